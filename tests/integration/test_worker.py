"""Real `omnistage stage` processes over real ZMQ: every executor and every reply type."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest

from omnistage import protocol as p
from omnistage.client import ControlError, ReplicaChannel
from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.kube import work_left
from tests.harness.local import free_port
from tests.harness.metrics import sample
from tests.harness.waiting import until

pytestmark = pytest.mark.timeout(240)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _state(w) -> dict:
    return json.loads((await asyncio.to_thread(_get, w.http + "/state"))[1])


async def _wait_inflight(w, n: int, timeout: float = 60.0, key: str = "in_flight") -> None:
    for _ in range(int(timeout / 0.02)):
        if (await _state(w))[key] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never reached {key} {n}: {await _state(w)}")


# ---- AR ------------------------------------------------------------------------------------


async def test_ar_streams_token_deltas(start_worker, channels) -> None:
    w = start_worker("ar", model="tiny-llama")
    ch = channels(w)
    params = {"prompt": "Hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
    deltas, final = await ch.request("r1", params)
    assert isinstance(final.header, p.Final), final.header
    assert len([d for d in deltas if d.header.token_ids]) == 8
    assert [d.header.seq for d in deltas] == list(range(1, len(deltas) + 1))
    streamed_ids = [t for d in deltas for t in d.header.token_ids]
    assert streamed_ids == final.header.token_ids
    assert "".join(d.header.text for d in deltas) == final.header.text
    assert final.header.finish_reason == "length"
    assert final.header.completion_tokens == 8
    # Greedy decoding of a seeded model is deterministic across requests.
    _, again = await ch.request("r2", {**params, "stream": False})
    assert again.header.token_ids == final.header.token_ids


async def test_ar_abort_mid_stream_returns_prefix(start_worker, channels) -> None:
    w = start_worker("ar", model="tiny-llama")
    ch = channels(w)
    q = ch.submit("long", {"prompt": "x", "max_tokens": 1000, "stream": True,
                           "ignore_eos": True})
    seen: list[int] = []
    while len(seen) < 5:
        msg = await asyncio.wait_for(q.get(), 30)
        assert isinstance(msg.header, p.Delta), msg.header
        seen.extend(msg.header.token_ids)
    ch.abort("long")
    while True:
        msg = await asyncio.wait_for(q.get(), 30)
        if msg.type != "delta":
            break
        seen.extend(msg.header.token_ids)
    assert isinstance(msg.header, p.Aborted), msg.header
    assert msg.header.finish_reason == "abort"
    prefix = msg.header.token_ids
    assert 5 <= len(prefix) < 1000
    assert prefix == seen  # the prefix is exactly what was streamed
    assert msg.header.text


async def test_ar_hidden_states_condition_diffusion_image(start_worker, channels) -> None:
    ar = start_worker("ar", model="tiny-llama",
                      engine={"returnHiddenStates": True, "maxTokens": 2})
    dif = start_worker("diffusion", model="tiny-unet")
    ar_ch, dif_ch = channels(ar), channels(dif)
    _, enc = await ar_ch.request("enc", {"prompt": "a red square"})
    assert isinstance(enc.header, p.Final)
    hidden = enc.tensors["hidden_states"]
    assert hidden.dtype == "float32" and hidden.shape[1] == 64
    assert hidden.shape[0] == len("a red square") + 2  # prompt tokens + generated tokens
    params = {"height": 32, "width": 48, "num_inference_steps": 2}
    _, img = await dif_ch.request("img", params, {"encoder_hidden_states": hidden})
    assert isinstance(img.header, p.Final), img.header
    pixels = img.tensors["image"].numpy()
    assert pixels.shape == (32, 48, 3) and pixels.dtype == np.uint8
    # Conditioning matters: other hidden states give another image from the same seed.
    zeros = np.zeros(hidden.shape, dtype=np.float32)
    _, other = await dif_ch.request("img2", params, {"encoder_hidden_states": zeros})
    assert not np.array_equal(other.tensors["image"].numpy(), pixels)
    # A wrong conditioning width is a request-scoped error naming the tensor.
    _, bad = await dif_ch.request("bad", params, {"encoder_hidden_states":
                                                  np.zeros((3, 7), np.float32)})
    assert isinstance(bad.header, p.Error) and bad.header.code == "bad_request"
    assert "encoder_hidden_states" in bad.header.message


async def test_diffusion_abort_drops_sample(start_worker, channels) -> None:
    w = start_worker("diffusion", model="tiny-unet")
    ch = channels(w)
    # Many cheap steps rather than a few huge ones: the abort is seen at the next step even on a
    # loaded machine (a 256x256 step's self-attention alone took over a minute under load 15).
    q = ch.submit("big", {"height": 64, "width": 64, "num_inference_steps": 1000})
    await _wait_inflight(w, 1)
    ch.abort("big")
    msg = await asyncio.wait_for(q.get(), 60)
    assert isinstance(msg.header, p.Aborted)
    assert msg.tensors == {}  # the whole sample is dropped


async def test_model_loads_from_local_dir_via_from_pretrained(
    start_worker, channels, tmp_path: Path
) -> None:
    dest = tmp_path / "my-llama"
    subprocess.run([sys.executable, "-m", "omnistage.cli", "models", "save", "tiny-llama",
                    str(dest)], check=True, capture_output=True)
    assert (dest / "config.json").exists() and (dest / "tokenizer.json").exists()
    w = start_worker("ar", model=str(dest))
    _, final = await channels(w).request("r", {"prompt": "hi", "max_tokens": 3,
                                               "ignore_eos": True})
    assert isinstance(final.header, p.Final) and final.header.completion_tokens == 3


def test_missing_model_dir_fails_startup_with_reason(start_worker, tmp_path: Path) -> None:
    w = start_worker("ar", model=str(tmp_path / "nope"), ready=False)
    assert w.proc.wait(120) != 0
    assert "is not a directory" in w.log_tail()


# ---- admission, deadlines, cancellation ---------------------------------------------------


async def test_overload_reply_when_budget_full(start_worker, channels) -> None:
    w = start_worker("echo", admission={"maxRequests": 2})
    ch = channels(w)
    # Held until aborted: the budget is full for as long as the test needs, however slow.
    slow = {"prompt": "s", "delay_ms": 60000}
    q1, q2 = ch.submit("a", slow), ch.submit("b", slow)
    await _wait_inflight(w, 2)
    _, third = await ch.request("c", slow)
    assert isinstance(third.header, p.Overloaded) and third.header.retry_after > 0
    ch.abort("a")
    ch.abort("b")
    assert (await q1.get()).type == "aborted" and (await q2.get()).type == "aborted"
    _, text = await asyncio.to_thread(_get, w.http + "/metrics")
    assert sample(text, "omnistage_worker_rejected_total", stage="echo", replica="echo-0",
                  reason="budget") == 1


async def test_overload_reply_when_queue_full(start_worker, channels) -> None:
    w = start_worker("echo", admission={"maxQueue": 1})
    ch = channels(w)
    q = ch.submit("a", {"prompt": "s", "delay_ms": 60000})  # held until aborted
    await _wait_inflight(w, 1)
    _, second = await ch.request("b", {"prompt": "s"})
    assert isinstance(second.header, p.Overloaded)
    ch.abort("a")
    assert (await q.get()).type == "aborted"


async def test_deadline_reply_while_running_and_while_queued(start_worker, channels) -> None:
    w = start_worker("echo")
    ch = channels(w)
    running = ch.submit("run", {"prompt": "s", "delay_ms": 3000}, timeout_s=0.5)
    await _wait_inflight(w, 1)
    _, queued = await ch.request("queued", {"prompt": "q"}, timeout_s=0.2)
    assert isinstance(queued.header, p.Deadline)
    msg = await asyncio.wait_for(running.get(), 10)
    assert isinstance(msg.header, p.Deadline)


async def test_abort_while_queued_never_runs(start_worker, channels) -> None:
    w = start_worker("echo")
    ch = channels(w)
    first = ch.submit("first", {"prompt": "1", "delay_ms": 60000})  # held until aborted
    await _wait_inflight(w, 1)
    second = ch.submit("second", {"prompt": "2", "stream": True})
    await _wait_inflight(w, 2)
    ch.abort("second")
    msg = await asyncio.wait_for(second.get(), 60)
    assert isinstance(msg.header, p.Aborted)  # no delta came first: it never ran
    ch.abort("first")
    assert (await first.get()).type == "aborted"


async def test_distinct_reply_types(start_worker, channels) -> None:
    """Overload, deadline, cancel and drain are told apart by type, not by text."""
    assert len({p.tag(t) for t in p.TERMINAL_REPLIES}) == 6
    w = start_worker("echo")
    _, bad = await channels(w).request("x", {"prompt": 5})
    assert isinstance(bad.header, p.Error) and bad.header.code == "bad_request"
    assert "params.prompt" in bad.header.message


# ---- protocol robustness --------------------------------------------------------------------


async def test_malformed_frames_get_error_and_worker_keeps_serving(start_worker, channels) -> None:
    w = start_worker("echo")
    ch = channels(w)
    await ch.handshake(10)
    enc = msgspec.msgpack.encode
    # (frames, what the error names, the (id, cid) it answers)
    bad_messages = [
        ([b"\xc1not msgpack"], "not valid msgpack", (None, None)),
        ([enc([1, 2, 3])], "Expected `object`, got `array`", (None, None)),
        ([enc({"no_type": 1})], "missing required field `t`", (None, None)),
        ([enc({"t": "launch_missiles"})], "'launch_missiles' - at `$.t`; expected one of",
         (None, None)),
        ([enc({"t": "final", "id": "f"})], "'final' - at `$.t`", ("f", None)),  # a reply type
        ([enc({"t": "submit"})], "missing required field `id`", (None, None)),
        ([enc({"t": "submit", "id": "x", "tensors": [{"in": "frame", "name": "a",
                                                      "dtype": "float32", "shape": [4]}]}),
          b"123"], "declares 16 bytes", ("x", None)),
        ([enc({"t": "submit", "id": "y", "tensors": [{"in": "frame", "name": "a",
                                                      "dtype": "complex", "shape": [1]}]}),
          b"1234"], "`$.tensors[0].dtype`", ("y", None)),
        ([enc({"t": "submit", "id": "z", "tensors": [{}]})], "`$.tensors[0]`", ("z", None)),
        # A handle to shared memory from a client that offered none: this worker has no segment.
        ([enc({"t": "submit", "id": "s", "tensors": [{
            "in": "shm", "name": "a", "dtype": "uint8", "shape": [1], "offset": 4096, "lease": 1,
            "segment": "omnistage-shm.x.1.0123456789abcdef"}]})],
         "tensors[0] (a) is in shared memory, which this peer did not offer", ("s", None)),
        ([enc({"t": "ping", "cid": "p"}), b"extra"], "describes 0 tensors in frames but 1 data",
         (None, "p")),
        ([enc({"t": "control", "cid": "c", "op": "self_destruct"})], "`$.op`", (None, "c")),
    ]
    for frames, names, ids in bad_messages:
        ch.send_raw(frames)
        reply = await asyncio.wait_for(ch.unsolicited.get(), 5)
        assert isinstance(reply.header, p.Error) and reply.header.code == "malformed", reply.header
        assert names in reply.header.message, reply.header
        assert (reply.header.id, reply.header.cid) == ids, reply.header
    # A bad field of a request that has an id ends that request, so its caller is not left
    # waiting for a terminal reply.
    _, bad = await asyncio.wait_for(ch.request("neg", {"prompt": "x"}, timeout_s=-1), 5)
    assert isinstance(bad.header, p.Error) and bad.header.code == "malformed"
    assert "`$.timeout_s`" in bad.header.message
    with pytest.raises(ControlError, match="malformed"):  # a bad control RPC answers its caller
        await ch.control("self_destruct")  # type: ignore[arg-type]
    _, ok = await ch.request("fine", {"prompt": "still here"})
    assert isinstance(ok.header, p.Final) and ok.header.text == "still here"
    assert w.proc.poll() is None


async def test_handshake_names_the_replica_and_its_incarnation(start_worker, channels) -> None:
    w1, w2 = start_worker("echo", name="one"), start_worker("echo", name="two")
    hello = await channels(w1).handshake(10)
    assert (hello.version, hello.replica, hello.stage, hello.kind) == (
        p.PROTOCOL_VERSION, "one", "echo", "echo")
    state = await _state(w1)
    assert state["incarnation"] == hello.incarnation  # the side port shows the same process
    pong = await channels(w1).ping(5)  # so does every heartbeat, on any channel
    assert pong.state.incarnation == hello.incarnation and pong.state.replica_id == "one"
    other = await channels(w2).handshake(10)
    assert other.incarnation != hello.incarnation  # another process, another incarnation


async def test_a_restart_at_the_same_address_refuses_work_for_the_old_process(
        start_worker, channels, tmp_path: Path) -> None:
    port = free_port()
    w1 = start_worker("echo", name="same", port=port)
    ch = channels(w1)
    first = (await ch.handshake(10)).incarnation
    _, ok = await ch.request("before", {"prompt": "x"}, incarnation=first)
    assert ok.type == "final"
    w1.kill()
    await until(lambda: ch.disconnects, "the socket monitor reporting the closed connection")
    assert ch.disconnects == 1
    # Sent while nobody listens: ZMQ queues it and delivers it to the next process there.
    stale = ch.submit("stale", {"prompt": "x"}, incarnation=first)
    release = tmp_path / "release"
    w2 = await asyncio.to_thread(start_worker, "echo", name="same", port=port,
                                 env={HOLD_FILE_ENV: str(release)})
    reply = await asyncio.wait_for(stale.get(), 10)
    assert isinstance(reply.header, p.Error) and reply.header.code == "stale_incarnation"
    assert first in reply.header.message
    second = (await _state(w2))["incarnation"]
    await until(lambda: ch.peer is not None and ch.peer.incarnation == second,
                "the channel's handshake with the new process")
    assert second != first
    # An abort for the old process never reaches the request of the same id on the new one:
    # "live" is held (the hold file is missing) until the worker has counted the stale abort.
    live = ch.submit("live", {"prompt": "y"}, incarnation=second)
    await _wait_inflight(w2, 1)
    ch.abort("live", incarnation=first)
    labels = {"stage": "echo", "replica": "same"}
    await until(lambda: sample(_get(w2.http + "/metrics")[1],
                               "omnistage_worker_stale_messages_total", **labels) == 2,
                "the stale abort counted", interval=0.05)
    release.touch()
    assert (await asyncio.wait_for(live.get(), 10)).type == "final"
    _, text = await asyncio.to_thread(_get, w2.http + "/metrics")
    assert sample(text, "omnistage_worker_stale_messages_total", **labels) == 2
    assert sample(text, "omnistage_worker_admitted_total", **labels) == 1  # only "live" ran
    assert sample(text, "omnistage_worker_late_aborts_total", **labels) == 0  # stale, not late
    ch.abort("live", incarnation=second)  # finished: dropped, counted as late
    await until(lambda: sample(_get(w2.http + "/metrics")[1],
                               "omnistage_worker_late_aborts_total", **labels) == 1,
                "the late abort counted", interval=0.05)


async def test_handshake_of_another_version_is_refused(start_worker, channels,
                                                       monkeypatch) -> None:
    w = start_worker("echo")
    ch = channels(w)
    await ch.handshake(10)
    ch.send_raw([msgspec.msgpack.encode({"t": "hello", "version": 1})])
    reply = await asyncio.wait_for(ch.unsolicited.get(), 5)
    assert isinstance(reply.header, p.Error) and reply.header.code == "version_mismatch"
    assert reply.header.message == ("protocol version 1 is not supported: replica echo-0 speaks "
                                    f"version {p.PROTOCOL_VERSION}")
    # A client of a newer version learns it from the handshake, and sends nothing else.
    newer_version = p.PROTOCOL_VERSION + 1
    monkeypatch.setattr(p, "PROTOCOL_VERSION", newer_version)
    newer = channels(w)
    with pytest.raises(p.VersionMismatch, match="refused the handshake: version_mismatch: "
                                                f"protocol version {newer_version} is not "
                                                "supported"):
        await newer.handshake(10)
    with pytest.raises(p.VersionMismatch):
        await newer.request("r", {"prompt": "x"})
    assert "refusing client" in w.log_tail()


async def test_two_clients_share_one_worker(start_worker) -> None:
    w = start_worker("echo")
    a, b = ReplicaChannel(w.zmq, name="a"), ReplicaChannel(w.zmq, name="b")
    try:
        (_, ra), (_, rb) = await asyncio.gather(
            a.request("same-id", {"prompt": "from a", "delay_ms": 100}),
            b.request("same-id", {"prompt": "from b", "delay_ms": 100}),
        )
        assert ra.header.text == "from a" and rb.header.text == "from b"
    finally:
        await a.close()
        await b.close()



# ---- batches ------------------------------------------------------------------------------


async def _raw_client(endpoint: str, *, batches: bool):
    """A bare DEALER that handshakes as a client of this version, saying whether it reads
    batched replies: what a ReplicaChannel does, with every ZMQ message kept as it came."""
    import zmq.asyncio
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    await sock.send_multipart(p.encode(p.Hello(version=p.PROTOCOL_VERSION, batches=batches)))
    hello = p.decode_reply(await asyncio.wait_for(sock.recv_multipart(copy=False), 10))
    assert isinstance(hello.header, p.HelloReply) and hello.header.batches
    return ctx, sock


async def _replies(sock, ids: set[str]) -> tuple[dict[str, p.Message], list[int]]:
    """Every reply until each id has a terminal one; and how many each ZMQ message carried."""
    got: dict[str, p.Message] = {}
    sizes: list[int] = []
    while not ids <= got.keys():
        frames = await asyncio.wait_for(sock.recv_multipart(copy=False), 10)
        parts = p.unbatch(frames)
        sizes.append(len(parts))
        for part in parts:
            msg = p.decode_reply(part)
            if isinstance(msg.header, p.TERMINAL_REPLIES):
                got[msg.header.id] = msg
    return got, sizes


async def test_a_batch_is_served_message_by_message_and_a_bad_part_answers_only_itself(
        start_worker) -> None:
    """Submits in one batch all run; a malformed part is answered error/malformed with its id
    and the parts after it still run; a batch header that does not match its frames is
    answered as one malformed message, and the worker keeps serving."""
    w = start_worker("echo")
    ctx, sock = await _raw_client(w.zmq, batches=True)
    try:
        x = np.arange(4, dtype=np.float32)
        parts = [p.encode(p.Submit(id="one", params={"prompt": "first"})),
                 [msgspec.msgpack.encode({"t": "submit", "id": "bad", "timeout_s": -1})],
                 p.encode(p.Submit(id="two", params={"prompt": "second"}), {"x": x})]
        [batch] = p.batch(parts)
        await sock.send_multipart(batch)
        got, _ = await _replies(sock, {"one", "bad", "two"})
        assert got["one"].header.text == "first" and got["two"].header.text == "second"
        assert got["two"].tensors["x"].numpy().tolist() == x.tolist()
        bad = got["bad"].header
        assert isinstance(bad, p.Error) and bad.code == "malformed" and "`$.timeout_s`" in (
            bad.message)
        await sock.send_multipart([msgspec.msgpack.encode({"t": "batch", "frames": [1, 1]}),
                                   p.encode(p.Abort(id="x"))[0]])
        err = p.decode_reply(await asyncio.wait_for(sock.recv_multipart(copy=False), 10))
        assert isinstance(err.header, p.Error) and err.header.code == "malformed"
        assert "batch header counts 2 frames but 1 follow" in err.header.message
        await sock.send_multipart(p.encode(p.Submit(id="after", params={"prompt": "ok"})))
        got, _ = await _replies(sock, {"after"})
        assert got["after"].header.text == "ok" and w.proc.poll() is None
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("batches", [True, False])
async def test_replies_are_batched_only_to_a_client_that_reads_batches(
        start_worker, batches: bool) -> None:
    """Many submits at once: every one is answered, to a client that did not say it reads
    batches always one reply per ZMQ message (an older client could not read a batch)."""
    w = start_worker("echo", admission={"maxRequests": 256, "maxQueue": 256})
    ctx, sock = await _raw_client(w.zmq, batches=batches)
    try:
        ids = {f"r{i}" for i in range(200)}
        for frames in p.batch([p.encode(p.Submit(id=i, params={"prompt": i})) for i in ids]):
            await sock.send_multipart(frames)
        got, sizes = await _replies(sock, ids)
        assert {i: m.header.text for i, m in got.items()} == {i: i for i in ids}
        if not batches:
            assert set(sizes) == {1}
        else:
            assert sum(sizes) >= len(ids)
    finally:
        sock.close()
        ctx.term()

# ---- control RPCs -----------------------------------------------------------------------


async def test_control_rpcs_and_error_propagation(start_worker, channels) -> None:
    w = start_worker("echo")
    ch = channels(w)
    busy = ch.submit("busy", {"prompt": "b", "delay_ms": 60000})  # held until aborted
    await _wait_inflight(w, 1)
    with pytest.raises(ControlError) as err:
        await ch.control("sleep")
    assert err.value.type == "ControlConflict" and "in flight" in err.value.message
    ch.abort("busy")
    assert (await busy.get()).type == "aborted"

    assert (await ch.control("pause"))["paused"] is True
    held = ch.submit("held", {"prompt": "h"})
    await _wait_inflight(w, 1, key="queued")  # paused: admitted but not dispatched ...
    state = await _state(w)
    assert held.empty() and state["queued"] == 1  # ... and it stays queued
    # in_flight counts the queued request too: readers must not add `queued` again
    # (omnistage.kube.work_left, which `omnistage status` and the drain wait use).
    assert state["in_flight"] == 1 and work_left(state) == 1
    assert (await ch.control("resume"))["paused"] is False
    assert (await asyncio.wait_for(held.get(), 5)).type == "final"

    assert (await ch.control("sleep"))["asleep"] is True
    with pytest.raises(ControlError, match="asleep"):
        await ch.control("resume")
    woke = await ch.control("wake_up")
    assert woke["asleep"] is False and woke["paused"] is True  # wake_up does not resume
    after = ch.submit("after", {"prompt": "a"})
    await _wait_inflight(w, 1, key="queued")
    assert after.empty() and (await _state(w))["queued"] == 1
    await ch.control("resume")
    assert (await asyncio.wait_for(after.get(), 5)).type == "final"


# ---- HTTP side port -----------------------------------------------------------------------


async def test_http_side_port(start_worker, channels) -> None:
    w = start_worker("ar", model="tiny-llama", ready=False)
    # /livez answers while the model is still loading; /readyz only after load + warmup.
    saw_not_ready = False
    for _ in range(2000):
        if w.port_file.exists():
            info = json.loads(w.port_file.read_text())
            live = await asyncio.to_thread(_get, info["http"] + "/livez")
            ready = await asyncio.to_thread(_get, info["http"] + "/readyz")
            assert live[0] == 200
            if ready[0] == 503:
                saw_not_ready = True
                assert ready[1] == "loading"
            elif ready[0] == 200:
                break
        await asyncio.sleep(0.01)
    assert saw_not_ready
    w.wait_ready()
    await channels(w).request("m", {"prompt": "hi", "max_tokens": 2})
    status, text = await asyncio.to_thread(_get, w.http + "/metrics")
    assert status == 200
    labels = {"stage": "ar", "replica": "ar-0"}
    assert sample(text, "omnistage_worker_ready", **labels) == 1
    assert sample(text, "omnistage_worker_queue_depth", **labels) == 0
    assert sample(text, "omnistage_worker_inflight_requests", **labels) == 0
    assert sample(text, "omnistage_worker_admitted_total", **labels) == 1
    assert sample(text, "omnistage_worker_rejected_total", reason="budget", **labels) == 0
    assert sample(text, "omnistage_worker_replies_total", type="final", **labels) == 1
    assert sample(text, "omnistage_worker_execution_seconds_count", **labels) == 1
    assert sample(text, "omnistage_worker_execution_seconds_sum", **labels) > 0
    state = await _state(w)
    assert state["replica_id"] == "ar-0" and state["in_flight"] == 0
    assert state["draining"] is False and state["queued"] == 0


# ---- draining -----------------------------------------------------------------------------


async def test_sigterm_drains_inflight_then_exits_zero(start_worker, channels,
                                                      tmp_path: Path) -> None:
    release = tmp_path / "release"
    w = start_worker("echo", env={HOLD_FILE_ENV: str(release)})
    ch = channels(w)
    # Held until the test creates the hold file: the worker is still draining when `late`
    # arrives, however slow the machine (it exits once the five are done).
    queues = [ch.submit(f"r{i}", {"prompt": f"p{i}"}) for i in range(5)]
    await _wait_inflight(w, 5)
    w.proc.send_signal(signal.SIGTERM)
    for _ in range(100_000):  # until it says so; pytest's timeout bounds a hang
        if (await _state(w))["draining"]:
            break
        await asyncio.sleep(0.02)
    _, late = await ch.request("late", {"prompt": "late"})
    assert isinstance(late.header, p.Draining)
    w.proc.send_signal(signal.SIGTERM)  # a second SIGTERM is harmless
    assert w.proc.poll() is None  # the held five keep it alive
    release.touch()
    results = [await asyncio.wait_for(q.get(), 60) for q in queues]
    assert [r.type for r in results] == ["final"] * 5
    assert [r.header.text for r in results] == [f"p{i}" for i in range(5)]
    assert await asyncio.to_thread(w.proc.wait, 15) == 0


async def test_a_request_cut_by_the_drain_timeout_is_told_from_a_client_abort(
        start_worker, channels) -> None:
    """The replica cutting a request on its way out (drainTimeoutSeconds passed) answers
    `error/drain_timeout`, naming the timeout; the client's own abort still answers `aborted`.
    Kills: the cut answered as `aborted` (the HTTP API then said 200 `status: abort` with
    empty text, exactly as for a client's abort), and a client abort reported as a cut."""
    w = start_worker("echo", drainTimeoutSeconds=1)
    ch = channels(w)
    mine = ch.submit("mine", {"prompt": "m", "delay_ms": 60_000}, timeout_s=120)
    cut = ch.submit("cut", {"prompt": "c", "delay_ms": 60_000}, timeout_s=120)
    await _wait_inflight(w, 2)
    ch.abort("mine")
    assert (await asyncio.wait_for(mine.get(), 30)).type == "aborted"
    w.proc.send_signal(signal.SIGTERM)
    reply = await asyncio.wait_for(cut.get(), 30)  # far less than the request's 60 s
    assert isinstance(reply.header, p.Error), reply.header
    assert reply.header.code == "drain_timeout" and reply.header.id == "cut"
    assert "drain timeout (1s) passed" in reply.header.message, reply.header.message
    assert await asyncio.to_thread(w.proc.wait, 30) == 0


async def test_a_drain_while_asleep_cuts_the_queued_work_as_the_server_s(
        start_worker, channels) -> None:
    """Asleep, a replica has no model to finish queued work with: its drain cuts it at once,
    and says so the same way. Kills: that path still answering `aborted`."""
    w = start_worker("echo")
    ch = channels(w)
    assert (await ch.control("sleep"))["asleep"] is True  # sleeping pauses the queue
    queued = ch.submit("queued", {"prompt": "q"}, timeout_s=120)
    await _wait_inflight(w, 1, key="queued")
    await ch.control("drain")
    reply = await asyncio.wait_for(queued.get(), 30)
    assert isinstance(reply.header, p.Error) and reply.header.code == "drain_timeout", reply
    assert "asleep" in reply.header.message
    assert await asyncio.to_thread(w.proc.wait, 30) == 0


async def test_drain_rpc(start_worker, channels, tmp_path: Path) -> None:
    release = tmp_path / "release"
    w = start_worker("echo", env={HOLD_FILE_ENV: str(release)})
    ch = channels(w)
    q = ch.submit("r", {"prompt": "x"})  # held in flight until the checks are done
    await _wait_inflight(w, 1)
    assert (await ch.control("drain"))["draining"] is True
    assert (await ch.control("drain"))["draining"] is True  # repeated drain is harmless
    status, reason = await asyncio.to_thread(_get, w.http + "/readyz")
    assert status == 503 and reason == "draining"
    assert w.proc.poll() is None  # the held request keeps it alive
    release.touch()
    assert (await q.get()).type == "final"
    assert await asyncio.to_thread(w.proc.wait, 15) == 0
