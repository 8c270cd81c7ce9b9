"""CurveZMQ between clients and real `omnistage stage` processes: only a peer holding the
pipeline's key is heard; everyone else is refused before a message is read, and counted; the
worker keeps serving through a fuzzing of its socket, authenticated or not, and holds no more
descriptors afterwards than it did before. While keys rotate (issue 43), a worker follows its
key directory (a generation added is admitted, one removed refused for new connections) and
the orchestrator names each replica's generation's key."""

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
    orch = Orchestrator(pipe, rt.membership, curve=curve.CurveKeyring.fixed(pair))
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


# ---- rotation (issue 43): a key directory that gains and loses generations ----------------


async def _refused_now(w: Any, pair: curve.CurveKeys, server_key: bytes) -> ReplicaChannel:
    """A new channel with `pair` that the worker refuses for its key; one admitted instead
    (the worker has not looked at its directory again yet: once a second) is closed and
    another tried. Waits on the worker's counter and the channel's handshake, nothing else."""
    while True:
        before = _refused(w, "key")
        ch = ReplicaChannel(w.zmq, name="probe", curve=pair, server_key=server_key)
        await until(lambda: _refused(w, "key") > before or ch.peer is not None,  # noqa: B023
                    what="the new channel refused or admitted", timeout=10)
        if ch.peer is None:
            return ch
        await ch.close()  # admitted under the directory's previous state: try again


async def test_a_worker_follows_its_key_directory_while_keys_rotate(start_worker,
                                                                    tmp_path: Path) -> None:
    """The operator's rotation as a running generation-0 worker sees it: the kubelet adds
    `public-1`/`secret-1` to the mounted Secret (a new timestamped folder, `..data` swapped),
    then removes generation 0's files. A client of pair 1 (naming the worker's own key, of
    generation 0, as the server's) is admitted within a second or so of the add, pair 0 still
    is; after the removal a NEW pair-0 connection is refused (reason "key").

    What libzmq does with a session already up: nothing. ZAP is asked once per connection, in
    its CURVE handshake; an established session is never authenticated again, so the pair-0
    channel opened before the removal keeps working, on the same connection (no disconnect).
    Only a reconnect (the connection lost) would be asked again, and refused."""
    from tests.unit.test_curve_keyring import kubelet_dir, pair_files

    zero, one = curve.generate(), curve.generate()
    d = kubelet_dir(tmp_path / "curve", pair_files(zero, 0), 0)
    w = start_worker("echo", env={curve.CURVE_KEYS_ENV: str(d)})
    old = ReplicaChannel(w.zmq, name="old", curve=zero)
    opened: list[ReplicaChannel] = [old]
    try:
        await old.handshake(30)
        # Before the add: pair 1 is another pipeline's key to this worker. libzmq gives a
        # refused connection up; the channel connects again itself (REFUSED_RETRY_S).
        early = await _refused_now(w, one, zero.public)
        assert old.disconnects == 0
        opened.append(early)
        kubelet_dir(d, {**pair_files(zero, 0), **pair_files(one, 1)}, 1)  # the operator's add
        # The refused channel retries every 100 ms; it is heard once the worker looked again.
        await early.handshake(10)  # a far guard: the reload comes within about a second
        _, final = await early.request("r1", {"prompt": "pair 1"})
        assert isinstance(final.header, p.Final) and final.header.text == "pair 1"
        fresh0 = ReplicaChannel(w.zmq, name="fresh0", curve=zero)  # pair 0: still admitted
        opened.append(fresh0)
        await fresh0.handshake(10)
        links = {ch.name: ch.disconnects for ch in (old, fresh0, early)}  # early's refusal: 1
        kubelet_dir(d, pair_files(one, 1), 2)  # the operator's drop of generation 0
        late0 = await _refused_now(w, zero, zero.public)
        opened.append(late0)
        before = _refused(w, "key")
        await until(lambda: _refused(w, "key") > before, what="pair 0 refused again on retry")
        assert late0.peer is None and late0.unsolicited.empty()
        # The sessions already up keep working on their connections: pair 0's and pair 1's.
        for ch in (old, fresh0, early):
            _, final = await ch.request(f"after-{ch.name}", {"prompt": ch.name})
            assert isinstance(final.header, p.Final) and final.header.text == ch.name
            assert ch.disconnects == links[ch.name], ch.name
        # And pair 1 is heard on a new connection after the drop too.
        new1 = ReplicaChannel(w.zmq, name="new1", curve=one, server_key=zero.public)
        opened.append(new1)
        await new1.handshake(10)
    finally:
        for ch in opened:
            await ch.close()
    assert w.proc.poll() is None


async def test_the_orchestrator_names_each_replicas_generation_as_server_key(
        start_worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mid-rotation, the Secret holds pairs 0 and 1: a worker started at generation 1
    ($OMNISTAGE_CURVE_GENERATION=1) is a CURVE server with pair 1, one started at 0 with pair
    0. The orchestrator (itself of generation 1) connects to each with the public key of the
    replica's generation (ReplicaInfo.curve_generation: `public-1`, `public`), and a request
    runs through both. Naming the other generation's key fails the handshake's cryptography."""
    from omnistage.orchestrator import engine
    from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
    from omnistage.orchestrator.requests import PipelineRequest
    from omnistage.spec import parse_pipeline

    zero, one = curve.generate(), curve.generate()
    d = curve.write(zero, tmp_path / "curve")
    curve.write(one, d, generation=1)
    w1 = start_worker("echo", name="a-0", env={curve.CURVE_KEYS_ENV: str(d),
                                               curve.CURVE_GENERATION_ENV: "1"})
    w0 = start_worker("echo", name="b-0", env={curve.CURVE_KEYS_ENV: str(d)})
    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "rotating"},
        "spec": {"stages": [{"name": "a", "kind": "echo"},
                            {"name": "b", "kind": "echo", "inputs": ["a"],
                             "finalOutput": True}]}})
    members = StaticMembership([ReplicaInfo("a", "a-0", w1.zmq, curve_generation=1),
                                ReplicaInfo("b", "b-0", w0.zmq, curve_generation=0)])
    server_keys: dict[str, bytes | None] = {}
    real = engine.ReplicaChannel

    def recording(endpoint: str, **kw: Any) -> ReplicaChannel:
        server_keys[kw["name"]] = kw.get("server_key")
        return real(endpoint, **kw)

    monkeypatch.setattr(engine, "ReplicaChannel", recording)
    orch = engine.Orchestrator(pipe, members, curve=curve.CurveKeyring(d, 1))
    wrong = ReplicaChannel(w1.zmq, name="wrong", curve=one, server_key=zero.public)
    try:
        await orch.start()
        assert server_keys == {"a-0": one.public, "b-0": zero.public}
        handle = orch.submit(PipelineRequest(prompt="both generations", finals=["b"]))
        out = await asyncio.wait_for(handle.outcome(), 60)
        assert out.status == "ok", out
        before = _refused(w1, "handshake")
        await until(lambda: _refused(w1, "handshake") > before,
                    what="a client naming generation 0's key refused by the generation-1 worker")
        assert wrong.peer is None
    finally:
        await wrong.close()
        await orch.stop(1)
