"""CurveZMQ between clients and real `omnistage stage` processes: only a peer holding the
pipeline's key is heard; everyone else is refused before a message is read, and counted; the
worker keeps serving through a fuzzing of its socket, authenticated or not, and holds no more
descriptors afterwards than it did before."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from omnistage import curve
from omnistage import protocol as p
from omnistage.client import ReplicaChannel
from tests.harness.metrics import sample
from tests.harness.waiting import until
from tests.integration.test_worker import _get

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[curve.CurveKeys, dict[str, str]]:
    pair = curve.generate()
    return pair, {curve.CURVE_KEYS_ENV: str(curve.write(pair, tmp_path / "curve"))}


def _refused(w: Any, reason: str) -> float:
    text = _get(w.http + "/metrics")[1]
    value = sample(text, "omnistage_worker_refused_peers_total", reason=reason)
    assert value is not None, "the worker exports no refused-peers counter"
    return value


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_only_the_pipelines_key_is_heard(start_worker, keys) -> None:
    pair, env = keys
    w = start_worker("echo", env=env)
    good = ReplicaChannel(w.zmq, name="good", curve=pair)
    plain = ReplicaChannel(w.zmq, name="plain")
    # Claims the pipeline's public key without its secret: the handshake's cryptography fails.
    impostor = ReplicaChannel(w.zmq, name="impostor", curve=curve.CurveKeys(
        pair.public, curve.generate().secret))
    other = ReplicaChannel(w.zmq, name="other", curve=curve.generate())  # another pipeline's
    # A sound CURVE client of this worker (it knows the server key) with a key of its own:
    # the handshake succeeds, and the worker's ZAP handler refuses the key.
    zctx = zmq.Context()
    stranger = zctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    own = curve.generate()
    stranger.setsockopt(zmq.CURVE_SERVERKEY, pair.public)
    stranger.setsockopt(zmq.CURVE_PUBLICKEY, own.public)
    stranger.setsockopt(zmq.CURVE_SECRETKEY, own.secret)
    stranger.connect(w.zmq)
    stranger.send_multipart([msgspec.msgpack.encode({"t": "hello", "version": p.PROTOCOL_VERSION})])
    try:
        _, final = await good.request("r", {"prompt": "hi"})
        assert isinstance(final.header, p.Final) and final.header.text == "hi"
        # The two refusals happen in the handshake, so wait on the worker's counters...
        await until(lambda: _refused(w, "handshake") >= 1, what="the plain peer refused")
        await until(lambda: _refused(w, "key") >= 1, what="the wrong key refused")
        # ...and none of them ever got a hello reply, or anything else.
        plain_q = plain.submit("p", {"prompt": "never"})
        impostor_q = impostor.submit("s", {"prompt": "never"})
        before = _refused(w, "handshake")
        await until(lambda: _refused(w, "handshake") > before,
                    what="the refused peers retried and were refused again")
        for ch, q in ((plain, plain_q), (impostor, impostor_q), (other, None)):
            assert ch.peer is None, ch.name
            assert q is None or q.empty(), ch.name
            assert ch.unsolicited.empty(), ch.name
        assert stranger.poll(0) == 0  # its hello was never answered
        state = _get(w.http + "/state")[1]
        assert '"in_flight":0' in state.replace(" ", "")  # nothing of theirs was admitted
        _, again = await good.request("r2", {"prompt": "still"})
        assert isinstance(again.header, p.Final) and again.header.text == "still"
    finally:
        for ch in (good, plain, impostor, other):
            await ch.close()
        stranger.close()
        zctx.term()
    assert w.proc.poll() is None


async def test_a_worker_without_keys_does_not_answer_a_curve_client(start_worker, keys) -> None:
    """The other half of a mismatched deployment: the client insists on CURVE, the worker
    speaks plain ZMQ; the client hears nothing (so it cannot be fooled by an impostor)."""
    pair, _ = keys
    w = start_worker("echo")
    ch = ReplicaChannel(w.zmq, name="secure", curve=pair)
    plain = ReplicaChannel(w.zmq, name="plain")
    try:
        await plain.handshake(30)  # the worker is up and answering plain peers
        with pytest.raises(TimeoutError):
            await ch.handshake(1.0)  # a far guard: the handshake can never complete
        assert ch.peer is None
    finally:
        await ch.close()
        await plain.close()


def _garbage(rng: random.Random) -> list[bytes]:
    """Frames a confused or hostile peer might send: random bytes, msgpack of the wrong shape,
    headers with wrong tensor counts, oversized counts."""
    enc = msgspec.msgpack.encode
    choices = [
        lambda: [rng.randbytes(rng.randint(0, 64))],
        lambda: [enc({"t": rng.choice(["submit", "feed", "credit", "hello", "control", "x"]),
                      "id": rng.choice(["a", 1, None]), "seq": rng.randint(-5, 5)})],
        lambda: [enc({"t": "submit", "id": "t", "tensors": [
            {"in": "frame", "name": "a", "dtype": "float32", "shape": [rng.randint(-2, 1 << 40)]}
        ]}), rng.randbytes(8)],
        lambda: [enc({"t": "batch", "n": rng.randint(-1, 1000)}), rng.randbytes(4)],
        lambda: [b"", b"", b""],
        lambda: [enc({"t": "hello", "version": rng.randint(-1, 99)})],
    ]
    return rng.choice(choices)()


async def test_fuzzing_the_socket_authenticated_or_not(start_worker, keys) -> None:
    pair, env = keys
    w = start_worker("echo", env=env)
    rng = random.Random(43)
    good = ReplicaChannel(w.zmq, name="good", curve=pair)
    try:
        await good.handshake(30)
        baseline = _fds(w.proc.pid)
        host, port = w.zmq.removeprefix("tcp://").rsplit(":", 1)
        # Raw TCP: not even ZMTP. Each connection sends junk and goes away.
        for _ in range(20):
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(rng.randbytes(rng.randint(1, 512)))
        # ZMQ peers without the key: refused in the handshake, whatever they send after.
        zctx = zmq.Context()
        peers = []
        try:
            for i in range(10):
                s = zctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                if i % 2:  # a sound CURVE client with a key of its own
                    own = curve.generate()
                    s.setsockopt(zmq.CURVE_SERVERKEY, pair.public)
                    s.setsockopt(zmq.CURVE_PUBLICKEY, own.public)
                    s.setsockopt(zmq.CURVE_SECRETKEY, own.secret)
                s.connect(w.zmq)
                for _ in range(20):
                    s.send_multipart(_garbage(rng))  # queued: the pipe never opens
                peers.append(s)
            # The authenticated channel meanwhile: malformed messages are answered, never fatal.
            for _ in range(200):
                good.send_raw(_garbage(rng))
            _, final = await good.request("after", {"prompt": "alive"})
            assert isinstance(final.header, p.Final) and final.header.text == "alive"
            await until(lambda: _refused(w, "key") >= 5 and _refused(w, "handshake") >= 5,
                        what="the unauthenticated peers counted")
            assert not any(s.poll(0) for s in peers)  # none of them heard anything
        finally:
            for s in peers:
                s.close()
            zctx.term()
        # Every refused connection is closed again: the descriptor count comes back.
        await until(lambda: _fds(w.proc.pid) <= baseline + 2,
                    what=f"the worker's descriptors back near {baseline}")
    finally:
        await good.close()
    assert w.proc.poll() is None


async def test_only_a_peer_that_proved_shared_memory_may_send_handles(start_worker) -> None:
    """A peer that offered no segment in its hello may not name one, though the worker could
    map it (a peer that proved one may name another's: an orchestrator forwards lent blocks)."""
    from omnistage.shm import HEADER, SegmentManager, ShmConfig

    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = Path("/dev/shm") / f"omnistage-curve-{os.getpid()}"
    d.mkdir()
    owner = SegmentManager(ShmConfig(d, session="it"))
    other = SegmentManager(ShmConfig(d, session="it"))
    try:
        w = start_worker("echo", env=ShmConfig(d, session="it").env())
        victim = ReplicaChannel(w.endpoint, name="owner", shm=owner)
        thief = ReplicaChannel(w.endpoint, name="thief", shm=other)
        plain = ReplicaChannel(w.endpoint, name="plain")
        try:
            await victim.handshake(30)
            await thief.handshake(30)
            await plain.handshake(30)
            assert victim.shm_peer and thief.shm_peer
            header = msgspec.msgpack.encode({"t": "submit", "id": "steal", "tensors": [{
                "in": "shm", "name": "a", "dtype": "uint8", "shape": [16], "offset": HEADER,
                "lease": 1, "segment": owner.name}]})
            plain.send_raw([header])
            reply = await asyncio.wait_for(plain.unsolicited.get(), 10)
            assert isinstance(reply.header, p.Error), reply.header
            assert reply.header.code == "malformed" and reply.header.id == "steal"
            assert "this peer offered no shared memory in its hello" in reply.header.message
            # A peer that proved a segment may forward another's blocks: test_shm's pipeline
            # test (the orchestrator hands a worker's lent block on to the next) covers it.
        finally:
            for ch in (victim, thief, plain):
                await ch.close()
    finally:
        owner.close()
        other.close()
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


async def test_a_local_pipeline_with_curve_serves_and_refuses_others(tmp_path) -> None:
    """What `omnistage serve` does: the runtime hands its workers the pair, the orchestrator
    connects with it, a process without it is refused, and the key files go at shutdown."""
    from omnistage.local_runtime import LocalStageRuntime
    from omnistage.orchestrator.engine import Orchestrator
    from omnistage.orchestrator.requests import PipelineRequest
    from omnistage.spec import parse_pipeline

    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "curved"},
        "spec": {"stages": [{"name": "a", "kind": "echo"},
                            {"name": "b", "kind": "echo", "inputs": ["a"],
                             "finalOutput": True}]}})
    pair = curve.generate()
    rt = LocalStageRuntime(pipe, base_dir=tmp_path, log_dir=tmp_path / "logs", curve=pair)
    orch = Orchestrator(pipe, rt.membership, curve=pair)
    outsider: ReplicaChannel | None = None
    key_dir = None
    try:
        rt.start()
        key_dir = rt._curve_dir
        assert key_dir is not None and curve.load(key_dir) == pair
        assert oct(key_dir.stat().st_mode & 0o777) == "0o700"
        assert oct((key_dir / "secret").stat().st_mode & 0o777) == "0o600"
        await orch.start()
        handle = orch.submit(PipelineRequest(prompt="through", finals=["b"]))
        out = await asyncio.wait_for(handle.outcome(), 60)
        assert out.status == "ok", out
        worker = next(r.worker for r in rt.replicas.values() if r.plan.stage.name == "a")
        outsider = ReplicaChannel(worker.endpoint, name="outsider")  # ipc: still refused
        await until(lambda: _refused(worker, "handshake") >= 1, what="the outsider refused")
        assert outsider.peer is None
    finally:
        if outsider is not None:
            await outsider.close()
        await orch.stop(1)
        rt.shutdown(grace=10)
    assert key_dir is not None and not key_dir.exists()
