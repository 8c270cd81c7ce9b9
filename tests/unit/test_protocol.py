"""The wire protocol's types and framing, and the client channel against in-process peers.

Real worker processes are exercised in tests/integration/test_worker.py; here the peers a real
worker cannot imitate (another protocol version, unreadable replies) stand in over real ZMQ.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
import pytest

from omnistage import protocol as p
from omnistage.client import ReplicaChannel
from tests.harness.fake_worker import FakeWorker

enc = msgspec.msgpack.encode


def roundtrip_request(header: msgspec.Struct, tensors: dict[str, Any] | None = None) -> Any:
    return p.decode_request([bytes(f) for f in p.encode(header, tensors)])


def test_every_request_type_roundtrips() -> None:
    for header in (p.Hello(version=2), p.Submit(id="r", params={"prompt": "x"}, timeout_s=1.5),
                   p.Submit(id="r", chunk_window=4, fed=True),
                   p.Feed(id="r", seq=1, text="x"), p.Feed(id="r", seq=2, last=True,
                                                           incarnation="i"),
                   p.Credit(id="r", seq=3, incarnation="i"),
                   p.Abort(id="r"), p.Control(cid="c", op="pause"), p.Ping(cid="c")):
        assert roundtrip_request(header).header == header


def test_chunks_and_feeds_carry_tensors_and_credit_goes_both_ways() -> None:
    """Streaming between stages: a chunk reply and a feed request carry text and tensors;
    credit is both a reply (from the consumer) and a request (to the producer)."""
    x = np.arange(6, dtype=np.int64)
    chunk = p.decode_reply(p.encode(p.Chunk(id="r", seq=1, text="ab"), {"chunk": x}))
    assert (chunk.header.id, chunk.header.seq, chunk.header.text) == ("r", 1, "ab")
    np.testing.assert_array_equal(chunk.tensors["chunk"].numpy(), x)
    feed = roundtrip_request(p.Feed(id="d", seq=1, text="ab"), {"chunk": x})
    assert not feed.header.last
    np.testing.assert_array_equal(feed.tensors["chunk"].numpy(), x)
    assert p.decode_reply(p.encode(p.Credit(id="d", seq=1))).header == p.Credit(id="d", seq=1)
    assert roundtrip_request(p.Credit(id="r", seq=1)).header == p.Credit(id="r", seq=1)
    assert "credit" in p.REQUEST_TYPES and "credit" in p.REPLY_TYPES
    assert p.Chunk not in p.TERMINAL_REPLIES and p.Credit not in p.TERMINAL_REPLIES
    with pytest.raises(TypeError, match="a credit message carries no tensors"):
        p.encode(p.Credit(id="r", seq=1), {"x": x})
    with pytest.raises(p.ProtocolError, match=r"'chunk' - at `\$.t`"):
        p.decode_request(p.encode(p.Chunk(id="r", seq=1)))  # a reply type, sent to a worker
    with pytest.raises(p.ProtocolError, match=r"'feed' - at `\$.t`"):
        p.decode_reply(p.encode(p.Feed(id="r", seq=1)))  # a request type, sent to a client


@pytest.mark.parametrize(("header", "error"), [
    ({"t": "chunk", "id": "r", "seq": 0}, ">= 1 - at `$.seq`"),
    ({"t": "chunk", "seq": 1}, "missing required field `id`"),
    ({"t": "chunk", "id": "r", "seq": 1, "text": 5}, "`$.text`"),
    ({"t": "credit", "id": "r", "seq": -1}, ">= 0 - at `$.seq`"),
])
def test_malformed_streaming_replies_name_what_is_wrong(header: dict[str, Any],
                                                        error: str) -> None:
    with pytest.raises(p.ProtocolError) as exc:
        p.decode_reply([enc(header)])
    assert error in str(exc.value)


def test_every_reply_type_roundtrips() -> None:
    state = p.WorkerState(replica_id="w", stage="a", kind="echo", incarnation="i", ready=True,
                          loaded=True, draining=False, paused=False, asleep=False, in_flight=0,
                          queued=0, pid=1)
    for header in (
        p.HelloReply(version=2, replica="w", stage="a", kind="echo", incarnation="i"),
        p.Delta(id="r", seq=1, text="t", token_ids=[1]),
        p.Final(id="r", replica="w", seq=2, text="t", token_ids=[1], finish_reason="stop",
                prompt_tokens=1, completion_tokens=1),
        p.Aborted(id="r", replica="w", seq=2, finish_reason="abort"),
        p.Overloaded(id="r", retry_after=1.0, message="full"),
        p.Deadline(id="r", message="late"),
        p.Draining(id="r", message="retiring"),
        p.Error(code="malformed", message="m", cid="c"),
        p.ControlReply(cid="c", op="sleep", ok=False, error=p.ControlFailure("E", "m")),
        p.Pong(cid="c", state=state),
    ):
        assert p.decode_reply(p.encode(header)).header == header


def test_request_and_reply_unions_are_separate() -> None:
    """A worker refuses a reply type, and a client a request type, naming the known ones."""
    with pytest.raises(p.ProtocolError, match=r"Invalid value 'final' - at `\$.t`; expected one "
                                              r"of \['hello', 'submit'"):
        p.decode_request(p.encode(p.Final(id="r")))
    with pytest.raises(p.ProtocolError, match=r"'submit' - at `\$.t`; expected one of"):
        p.decode_reply(p.encode(p.Submit(id="r")))


def test_defaults_are_not_sent() -> None:
    header = msgspec.msgpack.decode(p.encode(p.Final(id="r", seq=1, text="hi"))[0])
    assert header == {"t": "final", "id": "r", "seq": 1, "text": "hi"}


def test_tensors_travel_as_raw_frames_and_decode_as_views() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    mask = np.array([True, False])
    frames = p.encode(p.Submit(id="r"), {"x": x, "mask": mask})
    assert len(frames) == 3
    assert bytes(frames[1]) == x.tobytes()  # the array's own memory, not a serialised copy
    header = msgspec.msgpack.decode(frames[0])
    assert header["tensors"] == [{"in": "frame", "name": "x", "dtype": "float32", "shape": [3, 4]},
                                 {"in": "frame", "name": "mask", "dtype": "bool", "shape": [2]}]
    received = [frames[0], bytearray(frames[1]), bytearray(frames[2])]
    msg = p.decode_request(received)
    view = msg.tensors["x"].numpy()
    np.testing.assert_array_equal(view, x)
    received[1][:4] = np.float32(42).tobytes()
    assert view[0, 0] == 42  # a view over the received frame: no copy on decode
    np.testing.assert_array_equal(msg.tensors["mask"].numpy(), mask)


def test_tensors_only_on_messages_that_carry_them() -> None:
    with pytest.raises(TypeError, match="a ping message carries no tensors"):
        p.encode(p.Ping(cid="c"), {"x": np.zeros(1)})
    with pytest.raises(p.ProtocolError,
                       match="describes 0 tensors in frames but 1 data frames arrived"):
        p.decode_request([p.encode(p.Ping(cid="c"))[0], b"1234"])


@pytest.mark.parametrize(("frames", "error"), [
    ([], "empty message"),
    ([b"\xc1"], "not valid msgpack"),
    ([b"\x80" + b"\x00" * p.MAX_HEADER_BYTES], "exceeds"),
    ([enc([1, 2])], "Expected `object`, got `array`"),
    ([enc({"id": "r"})], "missing required field `t`"),
    ([enc({"t": "submit"})], "missing required field `id`"),
    ([enc({"t": "submit", "id": ""})], "`$.id`"),
    ([enc({"t": "submit", "id": "r" * 257})], "length <= 256 - at `$.id`"),
    ([enc({"t": "submit", "id": "r", "params": [1]})], "`$.params`"),
    ([enc({"t": "submit", "id": "r", "timeout_s": 0})], "> 0.0 - at `$.timeout_s`"),
    ([enc({"t": "submit", "id": "r", "timeout_s": True})], "`$.timeout_s`"),
    ([enc({"t": "control", "cid": "c", "op": "self_destruct"})], "`$.op`"),
    ([enc({"t": "hello"})], "missing required field `version`"),
    ([enc({"t": "submit", "id": "r", "chunk_window": 0})], ">= 1 - at `$.chunk_window`"),
    ([enc({"t": "submit", "id": "r", "chunk_window": p.MAX_CHUNK_WINDOW + 1})],
     "<= 1024 - at `$.chunk_window`"),
    ([enc({"t": "submit", "id": "r", "fed": "yes"})], "`$.fed`"),
    ([enc({"t": "feed", "id": "r"})], "missing required field `seq`"),
    ([enc({"t": "feed", "id": "r", "seq": 0})], ">= 1 - at `$.seq`"),
    ([enc({"t": "feed", "id": "r", "seq": 1, "last": 1})], "`$.last`"),
    ([enc({"t": "feed", "id": "r", "seq": 1, "tensors": [{"in": "frame", "name": "a",
                                                         "dtype": "uint8", "shape": [2]}]}),
      b"1"], "tensors[0] (a) declares 2 bytes (uint8[2]) but its frame has 1"),
    ([enc({"t": "credit", "id": "r", "seq": -1})], ">= 0 - at `$.seq`"),
    ([enc({"t": "credit", "seq": 1})], "missing required field `id`"),
    ([enc({"t": "submit", "id": "r", "tensors": [{"in": "frame", "name": "a", "dtype": "complex",
                                                  "shape": [1]}]}), b"1"],
     "'complex' - at `$.tensors[0].dtype`"),
    ([enc({"t": "submit", "id": "r", "tensors": [{"in": "frame", "name": "a", "dtype": "uint8",
                                                  "shape": [-1]}]}), b""],
     "`$.tensors[0].shape[0]`"),
    ([enc({"t": "submit", "id": "r", "tensors": [{"in": "frame", "name": "a", "dtype": "uint8",
                                                  "shape": [1] * 9}]}), b"1"],
     "length <= 8 - at `$.tensors[0].shape`"),
    ([enc({"t": "submit", "id": "r",
           "tensors": [{"in": "frame", "dtype": "uint8", "shape": [1]}]}), b"1"],
     "missing required field `name` - at `$.tensors[0]`"),
    ([enc({"t": "submit", "id": "r", "tensors": [{"in": "frame", "name": "a", "dtype": "float32",
                                                  "shape": [4]}]}), b"123"],
     "tensors[0] (a) declares 16 bytes (float32[4]) but its frame has 3"),
    ([enc({"t": "submit", "id": "r",
           "tensors": [{"in": "frame", "name": "a", "dtype": "uint8", "shape": [1]}] * 2}),
      b"1", b"2"], "tensors[1].name 'a' is repeated"),
    ([enc({"t": "submit", "id": "r", "tensors": [{"in": "frame", "name": "a", "dtype": "uint8",
                                                  "shape": [1]}]})],
     "describes 1 tensors in frames but 0 data frames arrived"),
])
def test_malformed_requests_name_what_is_wrong(frames: list[bytes], error: str) -> None:
    with pytest.raises(p.ProtocolError) as exc:
        p.decode_request(frames)
    assert error in str(exc.value)


def test_salvage_ids_from_undecodable_headers() -> None:
    bad_timeout = [enc({"t": "submit", "id": "r1", "timeout_s": -1})]
    assert p.salvage_ids(bad_timeout) == ("r1", None)
    assert p.salvage_ids([enc({"t": "control", "cid": "c1", "op": "x"})]) == (None, "c1")
    assert p.salvage_ids([enc({"t": "submit", "id": 5})]) == (None, None)
    assert p.salvage_ids([enc([1])]) == (None, None)
    assert p.salvage_ids([b"\xc1"]) == (None, None)
    assert p.salvage_ids([]) == (None, None)


def test_control_ops_are_defined_once() -> None:
    assert set(p.CONTROL_OPS) == {"sleep", "wake_up", "pause", "resume", "drain", "state"}
    assert p.PIPELINE_CONTROL_OPS == ("sleep", "wake_up", "pause", "resume")
    for op in p.CONTROL_OPS:  # the wire type accepts exactly these
        assert roundtrip_request(p.Control(cid="c", op=op)).header.op == op


def test_result_fields_are_the_executor_outcome_fields() -> None:
    assert p.RESULT_FIELDS == ("text", "token_ids", "finish_reason", "prompt_tokens",
                               "completion_tokens", "height", "width", "steps", "sample_rate")
    with pytest.raises(TypeError):
        p.Final(id="r", colour="red")  # an executor field the protocol does not know


def test_bad_reply_field_types_are_refused_by_the_client_decoder() -> None:
    frames = [enc({"t": "final", "id": "r", "prompt_tokens": "many"})]
    with pytest.raises(p.ProtocolError, match=r"`int \| null`, got `str` - at `\$.prompt_tokens`"):
        p.decode_reply(frames)


# ---- the client channel against in-process peers ----------------------------------------------


async def test_handshake_accepts_the_same_version_and_reports_the_incarnation() -> None:
    fake = FakeWorker()
    ch = ReplicaChannel(fake.endpoint, name="fake")
    try:
        hello = await ch.handshake(5)
        assert hello.version == p.PROTOCOL_VERSION and hello.incarnation == fake.incarnation
        assert ch.peer == hello
        assert fake.received[0] == {"t": "hello", "version": p.PROTOCOL_VERSION, "batches": True}
    finally:
        await ch.close()
        await fake.close()


@pytest.mark.parametrize(("version", "reason"), [
    (p.PROTOCOL_VERSION + 1, f"speaks protocol version {p.PROTOCOL_VERSION + 1}; this client "
                             f"speaks {p.PROTOCOL_VERSION}"),
    (None, f"may speak a protocol version older than {p.PROTOCOL_VERSION}): malformed: "
             "unknown message type"),
])
async def test_handshake_refuses_another_version(version: int | None, reason: str) -> None:
    fake = FakeWorker(version)
    ch = ReplicaChannel(fake.endpoint, name="fake")
    try:
        with pytest.raises(p.VersionMismatch) as exc:
            await ch.handshake(5)
        assert reason in str(exc.value)
        assert ch.peer is None
        with pytest.raises(p.VersionMismatch):
            ch.submit("r", {})  # nothing more is sent to it
        with pytest.raises(p.VersionMismatch):
            await ch.request("r2", {})
        # A marker on the same socket, after the refused calls: anything they had sent would
        # reach the peer before it (one connection keeps order), so once it is there, what
        # came before is all that ever will.
        ch.sock.send_multipart([msgspec.msgpack.encode({"t": "marker"})])
        for _ in range(1000):
            if fake.received and fake.received[-1]["t"] == "marker":
                break
            await asyncio.sleep(0.01)
        assert [m["t"] for m in fake.received] == ["hello", "marker"]
    finally:
        await ch.close()
        await fake.close()


async def test_unreadable_reply_still_ends_its_request() -> None:
    """A reply the client cannot decode is not dropped silently: its request gets an error."""
    fake = FakeWorker(on_submit=lambda m: [enc({"t": "final", "id": m["id"], "seq": "x"})])
    ch = ReplicaChannel(fake.endpoint, name="fake")
    try:
        _, reply = await asyncio.wait_for(ch.request("r1", {}), 5)
        assert isinstance(reply.header, p.Error) and reply.header.code == "malformed"
        assert reply.header.id == "r1" and "`$.seq`" in reply.header.message
    finally:
        await ch.close()
        await fake.close()


# ---- batches: several messages in one ZMQ message -------------------------------------------


def test_a_batch_carries_its_messages_in_order_with_their_tensor_frames() -> None:
    a = p.encode(p.Submit(id="a"))
    b = p.encode(p.Feed(id="a", seq=1, text="x"), {"chunk": np.arange(3, dtype=np.uint8)})
    c = p.encode(p.Feed(id="a", seq=2, last=True))
    [one] = p.batch([a, b, c])
    assert len(one) == 1 + 1 + 2 + 1  # the batch header, then each message's frames
    parts = p.unbatch(one)
    assert [p.decode_request(x).header for x in parts] == [
        p.decode_request(a).header, p.decode_request(b).header, p.decode_request(c).header]
    assert p.decode_request(parts[1]).tensors["chunk"].numpy().tolist() == [0, 1, 2]
    assert p.batch([a]) == [a] and p.unbatch(a) == [a]  # one message goes as it is


def test_a_long_run_is_split_into_batches_of_at_most_max_batch() -> None:
    msgs = [p.encode(p.Abort(id=f"r{i}")) for i in range(p.MAX_BATCH + 2)]
    out = p.batch(msgs)
    assert [len(p.unbatch(m)) for m in out] == [p.MAX_BATCH, 2]
    assert [bytes(x[0]) for m in out for x in p.unbatch(m)] == [m[0] for m in msgs]


@pytest.mark.parametrize("frames, names", [
    ([enc({"t": "batch", "frames": [1, 1]}), enc({"t": "abort", "id": "r"})],
     "counts 2 frames but 1 follow"),
    ([enc({"t": "batch", "frames": [1]}), enc({"t": "abort", "id": "r"})], "length >= 2"),
    ([enc({"t": "batch", "frames": [0, 1]}), b"x"], ">= 1"),
    ([enc({"t": "batch", "frames": "many"}), b"x"], "Expected `array`"),
])
def test_a_malformed_batch_header_is_refused_with_the_reason(frames: list[Any],
                                                             names: str) -> None:
    with pytest.raises(p.ProtocolError, match="batch header") as err:
        p.unbatch(frames)
    assert names in str(err.value)


async def _wait_received(fake: FakeWorker, n: int) -> None:
    for _ in range(500):
        if len(fake.received) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the fake worker got {len(fake.received)} messages, not {n}")


@pytest.mark.parametrize("batches", [True, False])
async def test_what_one_turn_sends_goes_as_one_batch_only_to_a_worker_that_reads_them(
        batches: bool) -> None:
    """A worker that says it reads batches gets one turn's messages as one ZMQ message; an
    older worker (no `batches` in its hello reply) gets them one by one, as before."""
    fake = FakeWorker(batches=batches)
    ch = ReplicaChannel(fake.endpoint, name="fake")
    try:
        await ch.handshake(5)
        for i in range(5):  # one turn of the loop: nothing awaited in between
            ch.abort(f"r{i}")
        await _wait_received(fake, 6)
        assert [m["id"] for m in fake.received[1:]] == [f"r{i}" for i in range(5)]
        assert fake.zmq_messages == ([1, 5] if batches else [1] * 6)
    finally:
        await ch.close()
        await fake.close()



async def test_a_reply_batch_that_cannot_be_split_still_ends_the_requests_it_names() -> None:
    """A batch header whose counts do not match: every frame that reads as a header still
    answers its request (a reply that decodes whole, or error/malformed naming its id)."""
    def reply(m: dict[str, Any]) -> list[Any] | None:
        if m["id"] != "whole":
            return None  # "torn" is answered only in whole's batch
        final = p.encode(p.Final(id="whole", text="whole"))
        torn = p.encode(p.Final(id="torn"), {"x": np.zeros(2, np.uint8)})[0]  # frame lost
        return [enc({"t": "batch", "frames": [1, 2]}), final[0], torn]

    fake = FakeWorker(on_submit=reply, batches=True)
    ch = ReplicaChannel(fake.endpoint, name="fake")
    try:
        await ch.handshake(5)
        torn = asyncio.ensure_future(ch.request("torn", {}))
        _, whole = await asyncio.wait_for(ch.request("whole", {}), 5)
        assert isinstance(whole.header, p.Final) and whole.header.text == "whole"
        _, bad = await asyncio.wait_for(torn, 5)
        assert isinstance(bad.header, p.Error) and bad.header.code == "malformed"
    finally:
        await ch.close()
        await fake.close()
