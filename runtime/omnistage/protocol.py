"""Wire protocol between orchestrators and stage workers (see docs/protocol.md).

A message is a multipart ZMQ message: one msgpack header frame followed by zero or more raw
tensor frames. Tensors travel as bytes described by (name, dtype, shape) in the header, so
nothing on the wire is ever unpickled and large payloads are sent without copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

# Requests (client -> worker).
SUBMIT = "submit"
ABORT = "abort"
CONTROL = "control"
PING = "ping"
REQUEST_TYPES = frozenset({SUBMIT, ABORT, CONTROL, PING})

# Replies (worker -> client). Each terminal reply type is distinct so callers never parse text.
DELTA = "delta"  # streamed partial output, not terminal
FINAL = "final"  # success
ABORTED = "aborted"  # cancelled by an abort; AR carries the prefix, diffusion drops the sample
OVERLOADED = "overloaded"  # refused at admission: budget or queue full
DEADLINE = "deadline"  # the request's deadline passed before or while it ran
DRAINING = "draining"  # the replica is retiring and admits nothing new
ERROR = "error"  # request-scoped error (bad_request, not_ready) or internal failure
CONTROL_REPLY = "control_reply"
PONG = "pong"
TERMINAL_REPLIES = frozenset({FINAL, ABORTED, OVERLOADED, DEADLINE, DRAINING, ERROR})

CONTROL_OPS = frozenset({"sleep", "wake_up", "pause", "resume", "drain", "state"})

MAX_HEADER_BYTES = 1 << 20
MAX_ID_LEN = 256

# dtype name on the wire -> (numpy dtype used to view the bytes, itemsize)
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

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the worker answers it and keeps serving."""


@dataclass(slots=True)
class WireTensor:
    """A tensor as it travels: dtype name, shape and the frame buffer (never copied on decode)."""

    dtype: str
    shape: tuple[int, ...]
    buffer: Any  # bytes, memoryview or zmq.Frame

    @property
    def nbytes(self) -> int:
        return _WIRE_DTYPES[self.dtype].itemsize * math.prod(self.shape)

    def numpy(self) -> np.ndarray:
        """A read-only numpy view over the frame (bfloat16 comes back as uint16 words)."""
        buf = self.buffer.buffer if hasattr(self.buffer, "buffer") else self.buffer
        return np.frombuffer(buf, dtype=_WIRE_DTYPES[self.dtype]).reshape(self.shape)

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
            arr = np.ascontiguousarray(value)
            name = _numpy_name(arr.dtype)
            return cls(name, tuple(int(s) for s in arr.shape), memoryview(arr).cast("B"))
        mod = type(value).__module__
        if mod.startswith("torch"):
            import torch

            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            if t.dtype == torch.bfloat16:
                arr = t.view(torch.int16).numpy()
                return cls("bfloat16", tuple(t.shape), memoryview(arr).cast("B"))
            arr = t.numpy()
            return cls(_numpy_name(arr.dtype), tuple(t.shape), memoryview(arr).cast("B"))
        raise TypeError(f"cannot send value of type {type(value).__name__} as a tensor")


def _numpy_name(dt: np.dtype[Any]) -> str:
    for name, wire in _WIRE_DTYPES.items():
        if name != "bfloat16" and wire == dt.newbyteorder("<"):
            return name
    raise TypeError(f"unsupported tensor dtype {dt}; supported: {sorted(_WIRE_DTYPES)}")


@dataclass(slots=True)
class Message:
    header: dict[str, Any]
    tensors: dict[str, WireTensor] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return str(self.header.get("t", ""))


def encode(header: Mapping[str, Any], tensors: Mapping[str, Any] | None = None) -> list[Any]:
    """Frames for one message: header first, then one frame per tensor in header order."""
    frames: list[Any] = []
    hdr = dict(header)
    if tensors:
        descs = []
        for name, value in tensors.items():
            wt = WireTensor.from_any(value)
            descs.append({"name": name, "dtype": wt.dtype, "shape": list(wt.shape)})
            frames.append(wt.buffer)
        hdr["tensors"] = descs
    return [_encoder.encode(hdr), *frames]


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames into a Message; raises ProtocolError on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    raw = _frame_bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = _decoder.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    t = header.get("t")
    if not isinstance(t, str) or not t:
        raise ProtocolError("header field 't' (message type) is missing or not a string")
    descs = header.pop("tensors", None) or []
    if not isinstance(descs, list):
        raise ProtocolError("header field 'tensors' must be a list")
    if len(descs) != len(frames) - 1:
        raise ProtocolError(
            f"header describes {len(descs)} tensors but {len(frames) - 1} data frames arrived"
        )
    tensors: dict[str, WireTensor] = {}
    for i, (desc, frame) in enumerate(zip(descs, frames[1:], strict=True)):
        wt = _tensor_from(desc, frame, i)
        tensors[desc["name"]] = wt
    return Message(header, tensors)


def _tensor_from(desc: Any, frame: Any, i: int) -> WireTensor:
    where = f"tensors[{i}]"
    if not isinstance(desc, dict):
        raise ProtocolError(f"{where} must be a map")
    name, dtype, shape = desc.get("name"), desc.get("dtype"), desc.get("shape")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}.name must be a non-empty string")
    if dtype not in _WIRE_DTYPES:
        raise ProtocolError(f"{where}.dtype {dtype!r} is not one of {sorted(_WIRE_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise ProtocolError(f"{where}.shape must be a list of at most 8 non-negative ints")
    wt = WireTensor(dtype, tuple(shape), frame)
    size = len(frame.buffer) if hasattr(frame, "buffer") else len(memoryview(frame).cast("B"))
    if size != wt.nbytes:
        raise ProtocolError(
            f"{where} ({name}) declares {wt.nbytes} bytes ({dtype}{list(shape)}) "
            f"but its frame has {size}"
        )
    return wt


def _frame_bytes(frame: Any) -> bytes | memoryview:
    if hasattr(frame, "bytes"):
        return frame.bytes  # zmq.Frame
    return frame


def require_str(header: Mapping[str, Any], key: str, *, max_len: int = MAX_ID_LEN) -> str:
    value = header.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise ProtocolError(f"header field {key!r} must be a non-empty string of <= {max_len}")
    return value
