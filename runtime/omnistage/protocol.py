"""Wire protocol between orchestrators and stage workers (see docs/protocol.md).

A message is a multipart ZMQ message: one msgpack header frame followed by zero or more raw
tensor frames. Each header is one of the msgspec Structs below, tagged by its `t` field; the
worker decodes the request union and the client the reply union, so a header is validated by
its type and nothing is checked by hand. Tensors travel as bytes described by (name, dtype,
shape) in the header, so nothing on the wire is ever unpickled and large payloads are sent
without copies. A tensor descriptor is itself a tagged union: `frame` (the bytes follow as a
data frame) or `shm` (the bytes lie in a shared-memory segment on this machine, see
omnistage.shm; only the handle travels).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Literal, NamedTuple, TypeVar, get_args

import msgspec
import numpy as np

# Version 2: typed messages and the hello handshake. Version 3: tensor descriptors are a tagged
# union (frame | shm), the shared-memory handshake fields and the release message. Bump it on
# any change an older peer would misread; hello, hello_reply and error keep their fields so any
# two versions can tell each other apart. Version 4: streaming between stages (submit's
# chunk_window and fed, the feed and credit requests, the chunk and credit replies).
# Optional fields an older peer ignores (msgspec drops unknown keys) need no bump: queue_wait_s
# on a task's outputs came that way, and so did the revision fields (the revision of
# hello_reply and of the worker state; submit's revision, upstream_revisions and
# payload_revisions; the revision stamp on feed, chunk, final and aborted; docs/protocol.md,
# "Revisions").
PROTOCOL_VERSION = 4

MAX_HEADER_BYTES = 1 << 20
MAX_ID_LEN = 256
MAX_TENSOR_DIMS = 8
# The most chunks a stage may send ahead of its downstream's consumption (Submit.chunk_window);
# a worker also refuses more fed chunks than this waiting at once.
MAX_CHUNK_WINDOW = 1024
# The most messages in one batch (Batch): a sender splits a longer run into several.
MAX_BATCH = 1024

# ---- control operations --------------------------------------------------------------------

ControlOp = Literal["sleep", "wake_up", "pause", "resume", "drain", "state"]
CONTROL_OPS: tuple[ControlOp, ...] = get_args(ControlOp)


class ControlConflict(RuntimeError):
    """A control op the replica's state forbids now (resume while asleep, sleep while busy).
    Its name travels in ControlFailure.type, so callers tell it from a failure of the replica:
    the HTTP API answers it 409, not 500."""


# drain retires one replica and state reads one; neither is fanned out across a pipeline.
REPLICA_ONLY_OPS: frozenset[ControlOp] = frozenset({"drain", "state"})
# What Orchestrator.control fans out to every replica, and what the HTTP control route accepts.
PIPELINE_CONTROL_OPS: tuple[ControlOp, ...] = tuple(
    op for op in CONTROL_OPS if op not in REPLICA_ONLY_OPS
)

# ---- tensors -------------------------------------------------------------------------------

# dtype name on the wire -> numpy dtype used to view the bytes
_WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # numpy has no bfloat16: carried as raw 16-bit words
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
WireDType = Literal[tuple(_WIRE_DTYPES)]  # type: ignore[valid-type]

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]


# A shared-memory segment's file name (omnistage.shm makes them). A receiver checks it against
# shm.NAME_RE before it opens anything, so it never names a path; a regex here would cost every
# message about 2 us.
SegmentName = Annotated[str, msgspec.Meta(min_length=1, max_length=80)]

# A stage's payload revision (omnistage.revision.stage_revision): absent means "no check", so a
# peer older than revisions is served as before.
Revision = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
# Producer stage -> revision, as submit's upstream_revisions and payload_revisions carry them.
RevisionMap = Annotated[dict[Id, Revision], msgspec.Meta(max_length=256)]


class _TensorDesc(msgspec.Struct, frozen=True, gc=False, tag_field="in"):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
    dtype: WireDType
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                     msgspec.Meta(max_length=MAX_TENSOR_DIMS)]


class FrameTensor(_TensorDesc, tag="frame"):
    """The tensor's bytes are the next data frame (frames follow the descriptors' order)."""


class ShmTensor(_TensorDesc, tag="shm"):
    """The tensor's bytes lie in a shared-memory segment: `nbytes` from `offset` in `segment`.

    `lease` names the block in its owner's segment; the owner frees it when the borrower sends
    `release` (or dies). A receiver maps the segment read-only and never copies the bytes.
    """

    segment: SegmentName
    offset: Annotated[int, msgspec.Meta(ge=0)]
    lease: Annotated[int, msgspec.Meta(ge=0)]


TensorDesc = FrameTensor | ShmTensor


class ShmProbe(msgspec.Struct, frozen=True, gc=False):
    """A process's segment and the nonce written in its header: a peer that can read the same
    nonce from the same file shares this machine's shared-memory directory."""

    segment: SegmentName
    nonce: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]


# ---- messages ------------------------------------------------------------------------------


class _Wire(msgspec.Struct, tag_field="t", omit_defaults=True, kw_only=True, gc=False):
    """Every header: a map tagged by `t`. Fields left at their default are not sent."""


# Requests (client -> worker).


class Hello(_Wire, tag="hello"):
    """The first message on every channel: the client's protocol version, and its shared-memory
    segment when it has one (the worker answers with its own if it can read the client's)."""

    version: int
    shm: ShmProbe | None = None
    batches: bool = False  # it reads batched replies (see Batch)


class Submit(_Wire, tag="submit"):
    id: Id
    params: dict[str, Any] = {}
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None  # the worker's default if unset
    tensors: list[TensorDesc] = []
    # The client's segment (as in its hello): the worker may put output tensors in its own
    # shared memory and lends them to this client, which releases them.
    shm: SegmentName | None = None
    # The process (hello_reply.incarnation) the request is for. Another process, a restart at
    # the same address, refuses it with error/stale_incarnation instead of running it.
    incarnation: str | None = None
    # Streaming between stages (docs/architecture.md). chunk_window: send the output in chunks
    # as it is made, at most this many ahead of the credits received. fed: the input arrives
    # in feed messages after this submit (the last one has last=true), not in this message.
    chunk_window: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_WINDOW)] | None = None
    fed: bool = False
    # Revisions (docs/architecture.md, "Revisions"): the revision this stage must be for the
    # request's pinned pipeline revision; the revision expected of each producer stage whose
    # payload the request brings (attached or fed); and the revision each attached payload
    # was stamped with by its producer (a negative-prompt companion's as "<stage>/neg"). A
    # worker of another revision, or a stamp other than expected, is refused with
    # error/revision_mismatch. Absent: no check.
    revision: Revision | None = None
    upstream_revisions: RevisionMap = {}
    payload_revisions: RevisionMap = {}


class Feed(_Wire, tag="feed"):
    """One chunk of a fed request's input (an upstream stage's chunk, routed by the
    orchestrator), in seq order; `last` marks the end of the input and may carry no data."""

    id: Id
    seq: Annotated[int, msgspec.Meta(ge=1)]
    text: str | None = None
    tensors: list[TensorDesc] = []
    last: bool = False
    incarnation: str | None = None  # as in submit: another process drops it
    revision: Revision | None = None  # the producer's stamp on the chunk (the chunk's revision)


class Credit(_Wire, tag="credit"):
    """Cumulative credit on one streamed edge: the consumer has taken every chunk up to `seq`.

    A worker whose executor took a fed chunk sends it (a reply naming its own request); the
    orchestrator passes it on to the upstream's request (a request), whose window it opens.
    Repeats and older values change nothing, so a resent stream may credit again.
    """

    id: Id
    seq: Annotated[int, msgspec.Meta(ge=0)]
    incarnation: str | None = None


class Abort(_Wire, tag="abort"):
    id: Id
    incarnation: str | None = None  # as in submit: another process drops the abort


class Control(_Wire, tag="control"):
    cid: Id
    op: ControlOp


class Ping(_Wire, tag="ping"):
    cid: Id


class Release(_Wire, tag="release"):
    """The client is done with these blocks the worker lent it (ShmTensor.lease); no reply."""

    leases: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=4096)]


Request = Hello | Submit | Feed | Credit | Abort | Control | Ping | Release

# Replies (worker -> client). Each terminal reply type is distinct so callers never parse text.


class WorkerState(msgspec.Struct, kw_only=True, gc=False):
    """A replica's state, as pong and control_reply carry it and /state shows it."""

    replica_id: str
    stage: str
    kind: str
    incarnation: str
    ready: bool
    loaded: bool
    draining: bool
    paused: bool
    asleep: bool
    in_flight: int  # admitted and not yet answered, queued ones included
    queued: int  # of those, not dispatched yet (so never more than in_flight)
    pid: int
    revision: str | None = None  # the stage's payload revision (absent from older workers)


class HelloReply(_Wire, tag="hello_reply"):
    """The worker accepted the handshake: who it is, and which process (incarnation) answers."""

    version: int
    replica: str
    stage: str
    kind: str
    incarnation: str  # a new random id at every process start
    shm: ShmProbe | None = None  # the worker's segment, when it could read the client's
    revision: Revision | None = None  # its stage's payload revision: what it stamps and checks
    # It copies a fed chunk's shared-memory tensors as the feed arrives, so a chunk's blocks
    # may go back to the upstream once it credits them; a worker without it (an older one in a
    # rollout) reads them in place, so they stay lent until the request ends.
    copies_fed: bool = False
    # It reads batched requests (see Batch), and batches its replies to a client whose hello
    # said it reads them. An older worker says nothing, so it is sent one message at a time.
    batches: bool = False


# A task's first output (delta seq 1, chunk seq 1) and its final or aborted reply carry how long
# the task waited in the worker's admission queue, admission to the executor taking it, in
# seconds; absent from workers older than this field and for work that never started. The
# orchestrator adds it to its own wait for the stage (GET /v1/load's queue_wait_p95_s).
QueueWait = Annotated[float, msgspec.Meta(ge=0)] | None


class Delta(_Wire, tag="delta"):
    """Streamed partial output; not terminal."""

    id: Id
    seq: int
    text: str = ""
    token_ids: list[int] = []
    queue_wait_s: QueueWait = None


class Chunk(_Wire, tag="chunk"):
    """One chunk of a streamed output (Submit.chunk_window), in seq order; not terminal. The
    final reply still follows and carries the whole result (what a final stage returns)."""

    id: Id
    seq: Annotated[int, msgspec.Meta(ge=1)]
    text: str | None = None
    tensors: list[TensorDesc] = []
    queue_wait_s: QueueWait = None
    revision: Revision | None = None  # the producer's revision stamp


FinishReason = Literal["stop", "length", "abort"]


class _Result(_Wire):
    """What an executor returns: one typed set of optional fields shared by every kind."""

    id: Id
    replica: str = ""
    seq: int = 0
    text: str | None = None  # ar, echo
    token_ids: list[int] | None = None  # ar
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None  # ar
    completion_tokens: int | None = None  # ar
    height: int | None = None  # diffusion
    width: int | None = None  # diffusion
    steps: int | None = None  # diffusion
    sample_rate: int | None = None  # vocoder: Hz of its "audio" tensor
    tensors: list[TensorDesc] = []
    queue_wait_s: QueueWait = None  # the worker's, not the executor's: not in RESULT_FIELDS
    revision: Revision | None = None  # the producer's revision stamp: not in RESULT_FIELDS


RESULT_FIELDS: tuple[str, ...] = tuple(
    f for f in _Result.__struct_fields__
    if f not in ("id", "replica", "seq", "tensors", "queue_wait_s", "revision")
)


class Final(_Result, tag="final"):
    """Success."""


class Aborted(_Result, tag="aborted"):
    """Cancelled by an abort: AR carries the generated prefix, diffusion drops the sample."""


class Overloaded(_Wire, tag="overloaded"):
    """Refused at admission: the budget or the execution queue is full."""

    id: Id
    retry_after: float
    message: str
    replica: str = ""


class Deadline(_Wire, tag="deadline"):
    """The request's deadline passed before or while it ran."""

    id: Id
    message: str
    replica: str = ""


class Draining(_Wire, tag="draining"):
    """The replica is retiring and admits nothing new."""

    id: Id
    message: str
    replica: str = ""


# revision_mismatch: the request was pinned to another revision of this stage, or brings a
# payload stamped with a revision other than the one it expects (a cross-revision hop). It is
# the request's terminal error, never a lost replica: the replica is fine, the routing was not.
ErrorCode = Literal["bad_request", "not_ready", "malformed", "internal", "version_mismatch",
                    "stale_incarnation", "drain_timeout", "revision_mismatch"]


class Error(_Wire, tag="error"):
    """A request-scoped error, a malformed message, or a refused handshake.

    `id` (or `cid`) names the request (or RPC) it answers when the worker could read one.
    """

    code: ErrorCode
    message: str
    id: str | None = None
    cid: str | None = None
    replica: str = ""


class ControlFailure(msgspec.Struct, gc=False):
    type: str  # the worker's exception type
    message: str


class ControlReply(_Wire, tag="control_reply"):
    cid: str
    op: ControlOp
    ok: bool
    result: WorkerState | None = None  # when ok
    error: ControlFailure | None = None  # when not ok: the worker's exception, never swallowed


class Pong(_Wire, tag="pong"):
    cid: str
    state: WorkerState


Reply = (
    HelloReply | Delta | Chunk | Credit | Final | Aborted | Overloaded | Deadline | Draining
    | Error | ControlReply | Pong
)
TERMINAL_REPLIES = (Final, Aborted, Overloaded, Deadline, Draining, Error)


class Batch(_Wire, tag="batch"):
    """Several messages in one ZMQ message: this header, then each message's frames in order,
    `frames` giving how many each has. A peer sends batches only to a peer that said it reads
    them (hello.batches, hello_reply.batches): what one turn of its event loop sent to that
    peer leaves as one message, so it costs one send and one wake-up on each side instead of
    one per message. An older peer would refuse the unknown tag as malformed."""

    frames: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]],
                      msgspec.Meta(min_length=2, max_length=MAX_BATCH)]


def tag(header: msgspec.Struct | type[msgspec.Struct]) -> str:
    """The `t` value of a header or header type (its message type)."""
    cls = header if isinstance(header, type) else type(header)
    return str(cls.__struct_config__.tag)


# ---- encoding ------------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the worker answers it and keeps serving."""


class VersionMismatch(ConnectionError):
    """The peer speaks another protocol version (or refused ours); nothing is routed to it."""


class ShmRef(NamedTuple):
    """Where a tensor lies in shared memory: a block of a segment, and its lease there."""

    segment: str
    offset: int
    lease: int


@dataclass(slots=True)
class WireTensor:
    """A tensor as it travels: dtype name, shape and the frame buffer (never copied on decode).

    A tensor received through (or placed in) shared memory also keeps its `shm` block, so it is
    passed on as the same handle, never copied, to a peer that shares the segment.
    """

    dtype: str
    shape: tuple[int, ...]
    buffer: Any  # bytes, memoryview or zmq.Frame; for shm, a read-only view of the block
    shm: ShmRef | None = None

    @property
    def nbytes(self) -> int:
        return _WIRE_DTYPES[self.dtype].itemsize * math.prod(self.shape)

    def numpy(self) -> np.ndarray:
        """A read-only numpy view over the frame (bfloat16 comes back as uint16 words)."""
        buf = self.buffer.buffer if hasattr(self.buffer, "buffer") else self.buffer
        return np.frombuffer(buf, dtype=_WIRE_DTYPES[self.dtype]).reshape(self.shape)

    def detached(self) -> WireTensor:
        """This tensor in memory of its own: a copy when it lies in shared memory (whose block
        goes back to its owner), else itself."""
        if self.shm is None:
            return self
        return WireTensor(self.dtype, self.shape, memoryview(bytes(_frame_buffer(self.buffer))))

    def torch(self, device: Any = None) -> Any:
        """A torch tensor owning its memory (one copy, so the model may write to it)."""
        import torch

        arr = self.numpy()
        if self.dtype == "bfloat16":
            t = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr.copy())
        return t if device is None else t.to(device)

    @classmethod
    def from_any(cls, value: Any) -> WireTensor:
        """Wrap a torch tensor, numpy array or WireTensor for sending."""
        if isinstance(value, WireTensor):
            return value
        if isinstance(value, np.ndarray):
            arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)
            name = _NUMPY_NAMES.get(arr.dtype) or _numpy_name(arr.dtype)
            return cls(name, arr.shape, _bytes_view(arr))
        mod = type(value).__module__
        if mod.startswith("torch"):
            import torch

            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            if t.dtype == torch.bfloat16:
                arr = t.view(torch.int16).numpy()
                return cls("bfloat16", tuple(t.shape), _bytes_view(arr))
            arr = t.numpy()
            return cls(_numpy_name(arr.dtype), tuple(t.shape), _bytes_view(arr))
        raise TypeError(f"cannot send value of type {type(value).__name__} as a tensor")


def _bytes_view(arr: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes without a copy. Flat first: memoryview cannot cast an
    empty array of two or more dimensions (a talker's [0, quantizers] codes)."""
    return memoryview(arr.reshape(-1)).cast("B")


_NUMPY_NAMES: dict[np.dtype[Any], str] = {
    dt: name for name, dt in _WIRE_DTYPES.items() if name != "bfloat16"}


def _numpy_name(dt: np.dtype[Any]) -> str:
    for name, wire in _WIRE_DTYPES.items():
        if name != "bfloat16" and wire == dt.newbyteorder("<"):
            return name
    raise TypeError(f"unsupported tensor dtype {dt}; supported: {sorted(_WIRE_DTYPES)}")


H = TypeVar("H", bound=msgspec.Struct)


@dataclass(slots=True)
class Message(Generic[H]):
    """A decoded message: its typed header and its tensors (views over the received frames)."""

    header: H
    tensors: dict[str, WireTensor] = field(default_factory=dict)
    # The segment of the worker that sent it (set by ReplicaChannel): its blocks in `tensors`
    # are lent to the reader, who gives them back with SegmentManager.release(msg).
    lender: str | None = None

    @property
    def type(self) -> str:
        return tag(self.header)


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
REQUEST_TYPES: tuple[str, ...] = tuple(tag(t) for t in get_args(Request))
REPLY_TYPES: tuple[str, ...] = tuple(tag(t) for t in get_args(Reply))


class _Ids(msgspec.Struct):
    id: Any = None
    cid: Any = None


_ids_decoder = msgspec.msgpack.Decoder(_Ids)


def encode(
    header: msgspec.Struct, tensors: Mapping[str, Any] | None = None, *, shm: bool = False
) -> list[Any]:
    """Frames for one message: header first, then one frame per `frame` tensor in header order.

    Tensors fill the header's `tensors` list (only submit, feed, chunk, final and aborted carry
    any). With
    `shm` (the peer shares this machine's segments) a tensor that lies in shared memory goes as
    its handle; otherwise its bytes go as a frame. A shared-memory block is copied into that
    frame: the frame may leave after the block went back to its owner.
    """
    frames: list[Any] = []
    if tensors:
        if not isinstance(header, Submit | Feed | Chunk | _Result):
            raise TypeError(f"a {tag(header)} message carries no tensors")
        descs: list[TensorDesc] = []
        for name, value in tensors.items():
            wt = WireTensor.from_any(value)
            ref = wt.shm
            if ref is not None and shm:
                descs.append(ShmTensor(name, wt.dtype, list(wt.shape), ref.segment, ref.offset,
                                       ref.lease))
                continue
            descs.append(FrameTensor(name, wt.dtype, list(wt.shape)))
            frames.append(wt.buffer if ref is None else bytes(_frame_buffer(wt.buffer)))
        header.tensors = descs
    return [_encoder.encode(header), *frames]


_batch_decoder = msgspec.msgpack.Decoder(Batch)
# How every batch header begins (a map whose first key is the tag): a message that does not
# is one message, told apart without decoding its header twice.
_BATCH_PREFIX = _encoder.encode(Batch(frames=[1, 1]))[:9]
assert _BATCH_PREFIX == b"\x82\xa1t\xa5batch", _BATCH_PREFIX


def batch(messages: Sequence[list[Any]]) -> list[list[Any]]:
    """ZMQ messages carrying these messages (each a list of frames) in order: one message
    stays as it is; more go as batches of at most MAX_BATCH."""
    if len(messages) == 1:
        return [messages[0]]
    out = []
    for i in range(0, len(messages), MAX_BATCH):
        part = messages[i:i + MAX_BATCH]
        if len(part) == 1:
            out.append(part[0])
            continue
        frames: list[Any] = [_encoder.encode(Batch(frames=[len(m) for m in part]))]
        for m in part:
            frames.extend(m)
        out.append(frames)
    return out


def unbatch(frames: Sequence[Any]) -> list[Sequence[Any]]:
    """The messages one ZMQ message carries: itself, or a batch's parts in order. Raises
    ProtocolError when a batch header is malformed or its counts do not match the frames."""
    if not frames:
        return [frames]
    raw = _frame_buffer(frames[0])
    if raw[:9] != _BATCH_PREFIX:
        return [frames]
    try:
        counts = _batch_decoder.decode(raw).frames
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"batch header: {exc}") from None
    if sum(counts) != len(frames) - 1:
        raise ProtocolError(f"batch header counts {sum(counts)} frames but "
                            f"{len(frames) - 1} follow it")
    parts, i = [], 1
    for n in counts:
        parts.append(frames[i:i + n])
        i += n
    return parts


# Maps a shared-memory descriptor to a read-only view of its bytes (omnistage.shm provides it);
# raises ShmUnavailable naming the segment when it cannot.
ShmResolver = Callable[[ShmTensor, int], memoryview]


class ShmUnavailable(ValueError):
    """A shared-memory tensor whose segment or block this process cannot map."""


def decode_request(frames: Sequence[Any], shm: ShmResolver | None = None) -> Message[Request]:
    """A worker's view of frames from a client; raises ProtocolError naming what is wrong."""
    return _decode(frames, _request_decoder, REQUEST_TYPES, shm)


def decode_reply(frames: Sequence[Any], shm: ShmResolver | None = None) -> Message[Reply]:
    """A client's view of frames from a worker; raises ProtocolError naming what is wrong."""
    return _decode(frames, _reply_decoder, REPLY_TYPES, shm)


def _decode(
    frames: Sequence[Any],
    decoder: msgspec.msgpack.Decoder[Any],
    types: tuple[str, ...],
    shm: ShmResolver | None,
) -> Message[Any]:
    if not frames:
        raise ProtocolError("empty message")
    raw = _frame_buffer(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        where = f"; expected one of {list(types)}" if str(exc).endswith("`$.t`") else ""
        raise ProtocolError(f"header: {exc}{where}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    descs: list[TensorDesc] = getattr(header, "tensors", ())
    if not descs and len(frames) == 1:
        return Message(header)
    in_frames = sum(1 for d in descs if isinstance(d, FrameTensor))
    if in_frames != len(frames) - 1:
        raise ProtocolError(
            f"header describes {in_frames} tensors in frames but {len(frames) - 1} data frames "
            "arrived"
        )
    tensors: dict[str, WireTensor] = {}
    data = iter(frames[1:])
    for i, desc in enumerate(descs):
        if desc.name in tensors:
            raise ProtocolError(f"tensors[{i}].name {desc.name!r} is repeated")
        nbytes = _WIRE_DTYPES[desc.dtype].itemsize * math.prod(desc.shape)
        if isinstance(desc, ShmTensor):
            if shm is None:
                raise ProtocolError(
                    f"tensors[{i}] ({desc.name}) is in shared memory, which this peer did not "
                    "offer")
            try:
                view = shm(desc, nbytes)
            except ShmUnavailable as exc:
                raise ProtocolError(f"tensors[{i}] ({desc.name}): {exc}") from None
            tensors[desc.name] = WireTensor(desc.dtype, tuple(desc.shape), view,
                                            ShmRef(desc.segment, desc.offset, desc.lease))
            continue
        frame = next(data)
        size = len(_frame_buffer(frame))
        if size != nbytes:
            raise ProtocolError(
                f"tensors[{i}] ({desc.name}) declares {nbytes} bytes "
                f"({desc.dtype}{desc.shape}) but its frame has {size}"
            )
        tensors[desc.name] = WireTensor(desc.dtype, tuple(desc.shape), frame)
    return Message(header, tensors)


def lent_leases(msg: Message[Any], segment: str | None) -> list[int]:
    """The blocks of `segment` (the replying worker's own) that this message lends its reader.

    A reply may also carry blocks of other segments (an echo stage returns its input's handle):
    those were lent by someone else and are released there.
    """
    if segment is None:
        return []
    return [wt.shm.lease for wt in msg.tensors.values()
            if wt.shm is not None and wt.shm.segment == segment]


def salvage_ids(frames: Sequence[Any]) -> tuple[str | None, str | None]:
    """The (id, cid) of a message that failed to decode, when they can still be read.

    An error reply can then name the request or RPC it ends, so no caller waits forever.
    """
    if not frames or len(_frame_buffer(frames[0])) > MAX_HEADER_BYTES:
        return None, None
    try:
        ids = _ids_decoder.decode(_frame_buffer(frames[0]))
    except msgspec.DecodeError:
        return None, None
    rid = ids.id if isinstance(ids.id, str) and 0 < len(ids.id) <= MAX_ID_LEN else None
    cid = ids.cid if isinstance(ids.cid, str) and 0 < len(ids.cid) <= MAX_ID_LEN else None
    return rid, cid


def _frame_buffer(frame: Any) -> memoryview | bytes:
    """The bytes of a frame without copying (zmq.Frame exposes a memoryview)."""
    if hasattr(frame, "buffer"):
        return frame.buffer
    if isinstance(frame, bytes):
        return frame
    return memoryview(frame).cast("B")
