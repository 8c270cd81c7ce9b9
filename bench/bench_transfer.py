"""Tensor transfer between two processes, against an in-process memcpy, in one run.

A sender process sends a float32 tensor as a protocol `submit` to a receiver process, which
decodes it as a worker does (the request union) into a numpy view and answers with a `final`
reply that carries the moment it had that view. A transfer is timed from "the sender has the
tensor" to "the receiver has a view of it" (one way: both processes read the same
CLOCK_MONOTONIC); the round trip, which adds the reply's way back, is printed too. Paths:

- shm: the sender copies the tensor into a block of its shared-memory segment
  (omnistage.shm.SegmentManager.try_place) and sends only the handle over ZMQ ipc://; the
  receiver maps the block read-only; the sender frees the block when the reply arrives.
- ipc: the bytes go as a frame over ZMQ on a unix socket (zero-copy send, numpy view on
  receive), as `omnistage serve` does for tensors below the shared-memory threshold.
- tcp: the same over loopback TCP, as between pods.
- tcp-raw: no ZMQ and no protocol: plain socket sendall into recv_into a preallocated buffer.
  It has no goal; it shows what the kernel's loopback TCP allows on this machine.

The baseline is numpy.copyto of the same size into a preallocated buffer in this process. Each
repetition times one memcpy and then one transfer, so both see the same machine load; the best
of each is kept (1 MB runs four times the repetitions: a single wake-up of a busy machine is
the size of the whole transfer). Prints one line per path and one summary line with the goals
(one way):

    shm at 64 MB >= 0.6x memcpy; shm at 1 MB >= 0.3x; tcp at 64 MB >= 0.3x

--check exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from omnistage import protocol as p
from omnistage.shm import SegmentManager, ShmConfig
from omnistage.tuning import worker_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import Goal, add_check_flag, exit_status, verdicts

SIZES_MB = (1, 16, 64)
GOALS = (("shm", 64, 0.6), ("shm", 1, 0.3), ("tcp", 64, 0.3))


def _receiver(endpoint: str, shm_dir: str | None, ready: mp.Event) -> None:  # type: ignore[valid-type]
    """A worker's receive path: decode the request union, view the tensor, answer."""
    import zmq

    shm = SegmentManager(ShmConfig(Path(shm_dir), session="bench")) if shm_dir else None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    ready.set()
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            msg = p.decode_request(frames[1:], shm.resolve if shm else None)
            h = msg.header
            if isinstance(h, p.Hello):
                ok = shm is not None and shm.verify(h.shm)
                reply = p.HelloReply(version=p.PROTOCOL_VERSION, replica="bench", stage="bench",
                                     kind="echo", incarnation="bench",
                                     shm=shm.probe() if ok and shm else None)
            elif isinstance(h, p.Submit):
                arr = msg.tensors["x"].numpy()  # a view: of the received frame, or of the block
                arrived = time.monotonic()
                reply = p.Final(id=h.id, seq=1, prompt_tokens=int(arr.size), text=repr(arrived))
            else:
                break  # the stop message
            sock.send_multipart([frames[0].bytes, *p.encode(reply)])
    finally:
        sock.close(0)
        ctx.term()
        if shm is not None:
            shm.close()


class _Path:
    """One receiver process and the sender's socket to it."""

    def __init__(self, endpoint: str, shm_dir: str | None) -> None:
        import zmq

        ready = mp.get_context("spawn").Event()
        self.proc = mp.get_context("spawn").Process(
            target=_receiver, args=(endpoint, shm_dir, ready), daemon=True)
        self.proc.start()
        if not ready.wait(60):
            raise RuntimeError(f"receiver at {endpoint} did not start")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)
        self.shm = SegmentManager(ShmConfig(Path(shm_dir), session="bench")) if shm_dir else None
        self.sock.send_multipart(p.encode(p.Hello(version=p.PROTOCOL_VERSION,
                                                  shm=self.shm.probe() if self.shm else None)))
        hello = p.decode_reply(self.sock.recv_multipart()).header
        assert isinstance(hello, p.HelloReply)
        if self.shm is not None and not self.shm.verify(hello.shm):
            raise RuntimeError("the receiver does not share the segment directory")
        self.n = 0

    def transfer(self, x: np.ndarray) -> tuple[float, float]:
        """(one way, round trip) in seconds."""
        self.n += 1
        rid = f"r{self.n}"
        t0 = time.monotonic()
        if self.shm is None:
            self.sock.send_multipart(p.encode(p.Submit(id=rid), {"x": x}), copy=False)
            reply = p.decode_reply(self.sock.recv_multipart(copy=False))
        else:
            placed = self.shm.try_place(x)
            assert placed is not None and placed.shm is not None
            self.sock.send_multipart(
                p.encode(p.Submit(id=rid, shm=self.shm.name), {"x": placed}, shm=True),
                copy=False)
            reply = p.decode_reply(self.sock.recv_multipart(copy=False), self.shm.resolve)
            self.shm.free([placed.shm.lease])  # the terminal reply: the receiver is done
        back = time.monotonic()
        assert isinstance(reply.header, p.Final) and reply.header.text is not None
        return float(reply.header.text) - t0, back - t0

    def close(self) -> None:
        self.sock.send_multipart(p.encode(p.Control(cid="stop", op="drain")))
        self.proc.join(10)
        self.sock.close(0)
        self.ctx.term()
        if self.shm is not None:
            self.shm.close()


class _RawTcp:
    """The kernel's loopback TCP with nothing on top: the ceiling for the tcp path."""

    def __init__(self) -> None:
        port = _free_port()
        ready = mp.get_context("spawn").Event()
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, ready),
                                                    daemon=True)
        self.proc.start()
        if not ready.wait(60):
            raise RuntimeError("raw TCP receiver did not start")
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def transfer(self, x: np.ndarray) -> tuple[float, float]:
        t0 = time.monotonic()
        self.sock.sendall(x.nbytes.to_bytes(8, "little"))
        self.sock.sendall(x.data)
        arrived = b""
        while len(arrived) < 8:
            arrived += self.sock.recv(8 - len(arrived))
        back = time.monotonic()
        return np.frombuffer(arrived, np.float64)[0] - t0, back - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)


def _raw_receiver(port: int, ready: mp.Event) -> None:  # type: ignore[valid-type]
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        conn, _ = server.accept()
        buf = bytearray(64 << 20)
        view = memoryview(buf)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                n, got = int.from_bytes(head, "little"), 0
                while got < n:
                    got += conn.recv_into(view[got:n])
                conn.sendall(np.float64(time.monotonic()).tobytes())


def _measure(path: _Path | _RawTcp, nbytes: int, reps: int) -> tuple[float, float, float]:
    """Seconds for (one way, round trip, memcpy): the best of reps, each rep timing a memcpy
    and then a transfer."""
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    path.transfer(src)  # warms up connections, allocators and the segment's pages
    one = rtt = memcpy = float("inf")
    for _ in range(reps):
        t0 = time.monotonic()
        np.copyto(dst, src)
        memcpy = min(memcpy, time.monotonic() - t0)
        a, b = path.transfer(src)
        one, rtt = min(one, a), min(rtt, b)
    return one, rtt, memcpy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    extra = worker_env()
    if extra and "--raw" not in sys.argv:
        # Measure what the workers get: they are launched with these glibc tunables.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **extra})
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--raw", action="store_true", help="without the workers' malloc tuning")
    ap.add_argument("--shm-dir", default="/dev/shm", help="where the segments live")
    add_check_flag(ap)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="omnistage-bench-")
    paths: dict[str, _Path | _RawTcp] = {
        "shm": _Path(f"ipc://{tmp}/shm.sock", args.shm_dir),
        "ipc": _Path(f"ipc://{tmp}/ipc.sock", None),
        "tcp": _Path(f"tcp://127.0.0.1:{_free_port()}", None),
        "tcp-raw": _RawTcp(),
    }
    ratios: dict[tuple[str, int], float] = {}
    tuned = "raw" if args.raw else "hugetlb"
    try:
        for name, path in paths.items():
            parts = []
            for mb in SIZES_MB:
                nbytes = mb << 20
                one, rtt, memcpy = _measure(path, nbytes, args.reps * (4 if mb < 4 else 1))
                ratios[(name, mb)] = memcpy / one
                parts.append(f"{mb}MB={nbytes / one / 1e9:.2f}GB/s ({memcpy / one:.2f}x memcpy "
                             f"{nbytes / memcpy / 1e9:.2f}GB/s; round trip {memcpy / rtt:.2f}x)")
            print(f"tensor_transfer[{name},{tuned}]: " + " ".join(parts), flush=True)
    finally:
        for path in paths.values():
            path.close()
    goals = [Goal(f"{name}@{mb}MB", ratios.get((name, mb)), goal) for name, mb, goal in GOALS]
    print(f"summary[{tuned}]: " + verdicts(goals) + f"; ipc@64MB={ratios[('ipc', 64)]:.2f}x"
          f" tcp-raw@64MB={ratios[('tcp-raw', 64)]:.2f}x", flush=True)
    return exit_status(goals, args.check)


if __name__ == "__main__":
    sys.exit(main())
