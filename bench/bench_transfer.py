"""Tensor transfer between two processes over ZMQ, against an in-process memcpy.

A sender process sends a float32 tensor as a protocol `submit` (typed msgpack header + raw
frame, sent without copying) to a receiver process, which decodes it as a worker does (the
request union) into a numpy view and answers with a `final` reply. The
baseline is a single-process memcpy of the same size (numpy.copyto into a preallocated buffer).
Prints one line: GB/s per size and the ratio to memcpy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from omnistage import protocol as p
from omnistage.tuning import worker_env

SIZES_MB = (1, 16, 64)


def _receiver(endpoint: str, ready: mp.Event) -> None:  # type: ignore[valid-type]
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart(copy=False)
        msg = p.decode_request(frames[1:])
        if not isinstance(msg.header, p.Submit):
            break  # the stop message
        arr = msg.tensors["x"].numpy()  # zero-copy view over the received frame
        reply = p.Final(id=msg.header.id, seq=1, prompt_tokens=int(arr.size))
        sock.send_multipart([frames[0].bytes, *p.encode(reply)])
    sock.close(0)
    ctx.term()


def _memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _zmq_gbps(endpoint: str, nbytes: int, reps: int) -> float:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    x = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    best = float("inf")
    for i in range(reps + 1):
        t0 = time.perf_counter()
        sock.send_multipart(p.encode(p.Submit(id=f"r{i}"), {"x": x}), copy=False)
        p.decode_reply(sock.recv_multipart(copy=False))
        if i:  # the first round warms up connections and allocators
            best = min(best, time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    return nbytes / best / 1e9


def main() -> None:
    extra = worker_env()
    if extra and "--raw" not in sys.argv:
        # Measure what the workers get: they are launched with these glibc tunables.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **extra})
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--raw", action="store_true", help="without the workers' malloc tuning")
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    args = ap.parse_args()
    import zmq

    endpoint = (
        "tcp://127.0.0.1:0" if args.transport == "tcp" else f"ipc:///tmp/omnistage-bench-{id(ap)}"
    )
    if args.transport == "tcp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ready = mp.Event()
    proc = mp.Process(target=_receiver, args=(endpoint, ready), daemon=True)
    proc.start()
    ready.wait(10)
    parts = []
    for mb in SIZES_MB:
        nbytes = mb * 1024 * 1024
        z = _zmq_gbps(endpoint, nbytes, args.reps)
        m = _memcpy_gbps(nbytes, args.reps)
        parts.append(f"{mb}MB={z:.2f}GB/s ({z / m:.2f}x memcpy {m:.2f}GB/s)")
    ctx = zmq.Context()
    stop = ctx.socket(zmq.DEALER)
    stop.connect(endpoint)
    stop.send_multipart(p.encode(p.Control(cid="stop", op="drain")))
    proc.join(5)
    stop.close(0)
    tuned = "raw" if args.raw else "hugetlb"
    print(f"zmq_tensor_transfer[{args.transport},{tuned}]: " + " ".join(parts)
          + " (goal 64MB >=0.3x)")


if __name__ == "__main__":
    main()
