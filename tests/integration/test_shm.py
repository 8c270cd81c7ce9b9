"""Shared memory and ipc:// between real processes over real sockets: tensors cross as handles,
every block comes back, and nothing is left in /dev/shm when a process is killed with SIGKILL.

Each test keeps its segments in a private directory under /dev/shm, so what it counts there is
its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnistage import protocol as p
from omnistage.client import ReplicaChannel
from omnistage.local_runtime import LocalStageRuntime
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.requests import Outcome, PipelineRequest
from omnistage.shm import NAME_RE, SegmentManager, ShmConfig
from omnistage.spec import parse_pipeline
from tests.harness.local import alive, free_port

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
NEVER = 1 << 40  # a min_bytes no tensor reaches: that side sends frames, the other lends


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = Path("/dev/shm") / f"omnistage-it-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def segments(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if NAME_RE.match(n))


def worker_state(w: Any) -> dict[str, Any]:
    with urllib.request.urlopen(w.http + "/state", timeout=5) as resp:
        return json.loads(resp.read())


async def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def config(d: Path, **kw: Any) -> ShmConfig:
    return ShmConfig(d, session=kw.pop("session", "it"), **kw)


@pytest.fixture
def managers() -> Iterator[Callable[..., SegmentManager]]:
    made: list[SegmentManager] = []

    def make(d: Path, **kw: Any) -> SegmentManager:
        m = SegmentManager(config(d, **kw))
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


# ---- one worker, one client ----------------------------------------------------------------


async def test_ipc_endpoint_serves_the_same_worker(start_worker, tmp_path) -> None:
    sock = tmp_path / "echo.sock"
    w = start_worker("echo", ipc=sock)
    assert w.ipc == f"ipc://{sock}" and w.endpoint == w.ipc and w.zmq.startswith("tcp://")
    ch = ReplicaChannel(w.endpoint, name="ipc")
    try:
        x = np.arange(MiB, dtype=np.uint8)
        _, final = await ch.request("r", {"prompt": "hi"}, {"x": x})
        assert isinstance(final.header, p.Final) and final.header.text == "hi"
        np.testing.assert_array_equal(final.tensors["x"].numpy(), x)
    finally:
        await ch.close()
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0
    assert not sock.exists()  # the socket goes with the worker


async def test_tensors_cross_as_handles_both_ways(start_worker, shm_dir, managers) -> None:
    w = start_worker("echo", env=config(shm_dir).env())
    worker_segment = worker_state(w)["shm"]["segment"]
    assert segments(shm_dir) == [worker_segment]
    x = np.random.default_rng(0).random(MiB // 4, dtype=np.float32)

    # Client to worker: the client places, the echo hands the same block back (no copy at all).
    client = managers(shm_dir)
    ch = ReplicaChannel(w.endpoint, name="w", shm=client)
    try:
        await ch.handshake(10)
        assert ch.shm_peer == worker_segment
        _, final = await ch.request("a", {}, {"x": x})
        got = final.tensors["x"]
        assert got.shm is not None and got.shm.segment == client.name
        np.testing.assert_array_equal(got.numpy(), x)
        assert client.segment.live == 1  # the reply still views it
        ch.release(final)
        assert client.segment.live == 0
    finally:
        await ch.close()

    # Worker to client: a client that sends frames; the worker lends its output until released.
    frames_client = managers(shm_dir, min_bytes=NEVER)
    ch = ReplicaChannel(w.endpoint, name="w2", shm=frames_client)
    try:
        _, final = await ch.request("b", {}, {"x": x})
        got = final.tensors["x"]
        assert got.shm is not None and got.shm.segment == worker_segment
        assert final.lender == worker_segment
        np.testing.assert_array_equal(got.numpy(), x)
        assert worker_state(w)["shm"]["lent"] == 1
        ch.release(final)
        await until(lambda: worker_state(w)["shm"]["lent"] == 0, what="the release")
        # A channel without a segment of its own gets frames, and nothing is lent to it.
        plain = ReplicaChannel(w.endpoint, name="plain")
        try:
            _, final = await plain.request("c", {}, {"x": x})
            assert final.tensors["x"].shm is None
            np.testing.assert_array_equal(final.tensors["x"].numpy(), x)
            assert worker_state(w)["shm"]["lent"] == 0
        finally:
            await plain.close()
    finally:
        await ch.close()
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0
    assert worker_segment not in segments(shm_dir)  # a clean exit unlinks its segment


async def test_full_segment_makes_the_worker_wait_then_proceed(start_worker, shm_dir,
                                                               managers) -> None:
    """Back-pressure: a 2 MiB cap, two 1 MiB replies held by the client; the third waits (the
    worker stays up, below its cap) and leaves as soon as one is released."""
    w = start_worker("echo", env={**config(shm_dir, cap_bytes=2 * MiB).env()})
    client = managers(shm_dir, min_bytes=NEVER)
    ch = ReplicaChannel(w.endpoint, name="w", shm=client)
    x = np.ones(MiB, np.uint8)
    try:
        _, first = await ch.request("r1", {}, {"x": x})
        _, second = await ch.request("r2", {}, {"x": x})
        waiting = asyncio.ensure_future(ch.request("r3", {}, {"x": x * 3}))
        await until(lambda: worker_state(w)["shm"]["waits"] == 1, what="the worker waits")
        assert not waiting.done()  # the worker says it waits for room: its reply is not out
        st = worker_state(w)["shm"]
        assert st["used"] == 2 * MiB == st["capacity"] and st["lent"] == 2
        ch.release(first)
        _, third = await asyncio.wait_for(waiting, 10)
        assert isinstance(third.header, p.Final) and third.tensors["x"].numpy()[0] == 3
        # Larger than the whole cap: never waits, goes as frames.
        _, big = await asyncio.wait_for(ch.request("r4", {}, {"x": np.ones(3 * MiB, np.uint8)}), 10)
        assert big.tensors["x"].shm is None
        # Full again, and the request's deadline passes while it waits: a deadline reply.
        _, late = await ch.request("r5", {}, {"x": x}, timeout_s=1.0)
        assert isinstance(late.header, p.Deadline), late.header
        assert "no room in shared memory" in late.header.message
        for msg in (second, third):
            ch.release(msg)
        await until(lambda: worker_state(w)["shm"]["lent"] == 0, what="all released")
        assert worker_state(w)["ready"]
    finally:
        await ch.close()


# ---- SIGKILL: nothing left behind ----------------------------------------------------------

_BORROWER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    import numpy as np
    from omnistage.client import ReplicaChannel
    from omnistage.shm import SegmentManager, ShmConfig

    async def main():
        m = SegmentManager(ShmConfig(Path(sys.argv[1]), session="it", min_bytes=1 << 40))
        ch = ReplicaChannel(sys.argv[2], shm=m)
        _, final = await ch.request("held", {}, {"x": np.ones(1 << 20, np.uint8)})
        print(m.name, final.tensors["x"].shm.segment, flush=True)
        await asyncio.sleep(3600)  # holds the lent block until killed

    asyncio.run(main())
""")


async def test_kill_9_borrower_gives_its_blocks_back(start_worker, shm_dir) -> None:
    w = start_worker("echo", env=config(shm_dir).env())
    borrower = await asyncio.to_thread(
        subprocess.Popen, [sys.executable, "-c", _BORROWER, str(shm_dir), w.endpoint],
        stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(borrower.stdout.readline), 60)
        mine, lender = line.split()
        assert lender == worker_state(w)["shm"]["segment"]
        assert worker_state(w)["shm"]["lent"] == 1 and mine in segments(shm_dir)
        borrower.kill()
        borrower.wait(10)
        # The worker's upkeep sees the borrower's lock gone: block back, its segment unlinked.
        await until(lambda: worker_state(w)["shm"]["lent"] == 0, what="block reclaimed")
        await until(lambda: mine not in segments(shm_dir), what="borrower's segment swept")
        assert segments(shm_dir) == [lender]
    finally:
        if borrower.poll() is None:
            borrower.kill()


async def test_kill_9_lender_leaves_no_segment(start_worker, shm_dir, managers) -> None:
    w = start_worker("echo", env=config(shm_dir).env())
    client = managers(shm_dir, min_bytes=NEVER)
    client.start()  # upkeep: sweeps dead owners every couple of seconds
    ch = ReplicaChannel(w.endpoint, name="w", shm=client)
    x = np.arange(MiB, dtype=np.uint8)
    try:
        _, final = await ch.request("r", {}, {"x": x})
        lender = final.tensors["x"].shm.segment
        assert lender in segments(shm_dir)
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(10)
        await until(lambda: lender not in segments(shm_dir), what="dead lender swept")
        # What the client already mapped stays readable after the file is gone (no SIGBUS).
        np.testing.assert_array_equal(final.tensors["x"].numpy(), x)
        ch.release(final)  # to a dead lender: dropped, nothing pending forever
        client.upkeep()
        assert client.pending == 0
        assert segments(shm_dir) == [client.name]
    finally:
        await ch.close()


async def test_a_worker_restarted_at_the_same_address_is_met_with_its_new_segment(
        start_worker, shm_dir, managers, tmp_path) -> None:
    """kill -9 and a new process on the same unix socket (what the local runtime's supervisor
    does): the channel drops the dead segment at once, offers its own again in the new hello,
    and borrows from the new process's segment; the dead one is swept."""
    sock, env = tmp_path / "w.sock", config(shm_dir).env()
    w = start_worker("echo", name="w", ipc=sock, env=env)
    first = worker_state(w)["shm"]["segment"]
    client = managers(shm_dir, min_bytes=NEVER)
    ch = ReplicaChannel(w.endpoint, name="w", shm=client)
    x = np.arange(MiB, dtype=np.uint8)
    try:
        await ch.handshake(10)
        assert ch.shm_peer == first
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(10)
        await until(lambda: ch.disconnects == 1, what="the closed connection seen")
        assert ch.shm_peer is None  # nothing is sent as a handle to a dead segment
        w2 = start_worker("echo", name="w", ipc=sock, env=env)  # blocks the loop: fine here
        second = worker_state(w2)["shm"]["segment"]
        assert second != first and first not in segments(shm_dir)  # swept by the new worker
        await until(lambda: ch.shm_peer == second, what="the new handshake")
        _, final = await ch.request("after", {}, {"x": x})
        got = final.tensors["x"]
        assert got.shm is not None and got.shm.segment == second
        np.testing.assert_array_equal(got.numpy(), x)
        ch.release(final)
        await until(lambda: worker_state(w2)["shm"]["lent"] == 0, what="the release")
    finally:
        await ch.close()


# ---- a pipeline on the local runtime (what `omnistage serve` runs) -------------------------


def t2i(name: str) -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {"stages": [
            {"name": "enc", "kind": "ar", "model": "tiny-llama", "engine": {"maxTokens": 2}},
            {"name": "img", "kind": "diffusion", "model": "tiny-unet", "inputs": ["enc"],
             "finalOutput": True},
            {"name": "slow", "kind": "echo", "inputs": ["enc"], "finalOutput": True},
        ]},
    })


async def run(orch: Orchestrator, req: PipelineRequest) -> Outcome:
    return await asyncio.wait_for(orch.submit(req).outcome(), 120)


async def test_pipeline_on_the_local_runtime_uses_shared_memory_end_to_end(shm_dir,
                                                                          tmp_path) -> None:
    """AR hidden states and the diffusion image travel as handles (every tensor, min_bytes 0),
    the orchestrator forwards them without copying, the image equals the frame path's, and no
    block outlives its request (aborted ones included)."""
    cfg = config(shm_dir, session="e2e", min_bytes=0)
    pipe = t2i(f"shm{uuid.uuid4().hex[:6]}")
    rt = LocalStageRuntime(pipe, base_dir=tmp_path, log_dir=tmp_path / "logs", shm=cfg)
    orch = Orchestrator(pipe, rt.membership, shm=cfg)
    plain = None
    try:
        rt.start()
        assert all(r.endpoint.startswith("ipc://") for r in rt.membership.replicas)
        await orch.start()
        workers = {r.plan.stage.name: r.worker for r in rt.replicas.values()}
        params = {"img": {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 7},
                  "*": {"seed": 7}}
        req = PipelineRequest(prompt="a cat", params=params, finals=["img"])
        out = await run(orch, req)
        assert out.status == "ok", out
        image = out.children[0].outputs["img"].tensors["image"]
        assert image.shm is None  # outputs are copied out before the blocks go back
        assert worker_state(workers["enc"])["shm"]["placed"] >= 1  # hidden states lent
        assert worker_state(workers["img"])["shm"]["placed"] >= 1  # and the image
        # The same request through an orchestrator without shared memory: the same image.
        plain = Orchestrator(pipe, rt.membership)
        await plain.start()
        framed = await run(plain, req)
        assert framed.status == "ok", framed
        np.testing.assert_array_equal(framed.children[0].outputs["img"].tensors["image"].numpy(),
                                      image.numpy())
        # Abort while the echo stage still holds the forwarded hidden states.
        handle = orch.submit(PipelineRequest(prompt="a dog", finals=["img", "slow"],
                                             params={**params, "slow": {"delay_ms": 3000}}))
        await until(lambda: worker_state(workers["slow"])["in_flight"] == 1, what="slow runs")
        handle.abort()
        aborted = await asyncio.wait_for(handle.outcome(), 30)
        assert aborted.status == "abort", aborted
        for stage in ("enc", "img", "slow"):
            await until(lambda s=stage: worker_state(workers[s])["shm"]["lent"] == 0,
                        what=f"{stage} got every block back")
        assert orch.shm is not None and orch.shm.segment.live == 0
        assert len(segments(shm_dir)) == 4  # three workers and the orchestrator, nothing else
    finally:
        if plain is not None:
            await plain.stop(1)
        await orch.stop(1)
        rt.shutdown(grace=10)
    assert segments(shm_dir) == []


_SERVE_YAML = """
apiVersion: omnistage.io/v1alpha1
kind: OmniPipeline
metadata: {name: NAME}
spec:
  stages:
    - {name: a, kind: echo}
    - {name: b, kind: echo, inputs: [a], finalOutput: true}
"""


def test_kill_9_serve_leaves_no_segment(shm_dir, tmp_path) -> None:
    """`omnistage serve` killed with SIGKILL: its workers die with it, and its reaper sweeps
    every segment of the session."""
    name = f"k{uuid.uuid4().hex[:6]}"
    spec = tmp_path / "p.yaml"
    spec.write_text(_SERVE_YAML.replace("NAME", name))
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage.cli", "serve", str(spec), "--port", str(free_port()),
         "--admin-port", str(free_port()),
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMNISTAGE_SHM_DIR": str(shm_dir)})
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if re.search(r"ready at http://", line):
                break
            assert time.monotonic() < deadline, "serve did not get ready"
        else:
            raise AssertionError(f"serve exited with {proc.wait()}")
        assert len(segments(shm_dir)) == 3  # the orchestrator and both workers
        reapers = [pid for pid in _pids_with("omnistage.shm") if _ppid(pid) == proc.pid]
        assert len(reapers) == 1
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 20
        while segments(shm_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert segments(shm_dir) == []
        while alive(reapers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(reapers[0])  # and the reaper is gone too
    finally:
        if proc.poll() is None:
            proc.kill()


def _pids_with(word: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if word.encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
