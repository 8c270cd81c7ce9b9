"""Outcomes to response bodies: OpenAI chat completions and SSE chunks, images, generic JSON.

Pure functions (no I/O), typed to return the response TypedDicts that the OpenAPI document
shows (schemas.py). The handlers in http_api send what these return.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage import media
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.errors import ApiError, chat_param, outcome_error
from omnistage.orchestrator.images import ImageEncodeError, png_base64
from omnistage.orchestrator.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChildJson,
    GenericResponse,
    ImagesResponse,
    TensorJson,
    Usage,
)

__all__ = [
    "ChatCall",
    "ChatStream",
    "ImagesCall",
    "SpeechCall",
    "SpeechStream",
    "dumps",
    "jsonable",
    "render_chat_completion",
    "render_generic",
    "render_images",
    "render_speech",
    "speech_audio",
    "speech_sse",
    "speech_usage",
    "sse_event",
    "tensor_bytes",
]


def jsonable(value: Any) -> Any:
    """Stage outputs (msgpack-decoded) as JSON: bytes become base64, NaN/inf become null."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float):
        return value
    return str(value)


def dumps(obj: Any) -> bytes:
    # ensure_ascii keeps any odd code point escaped, so encoding can never fail here.
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii")


@dataclass(frozen=True)
class MediaPart:
    """An undecoded image_url or input_audio part: decoded off the event loop (media.py)."""

    kind: str  # "image" or "audio"
    param: str  # the field to name in an error, e.g. messages[0].content[1].image_url.url
    data: str
    format: str = ""


@dataclass
class ChatCall:
    """A validated chat request: what to submit and what the response needs to echo."""

    request: rq.PipelineRequest
    stage: str
    model: str
    include_usage: bool = False
    ignored: list[str] = field(default_factory=list)
    #: The stage whose audio answers (modalities with audio), and its encoding.
    speech: str | None = None
    audio_format: str = "wav"
    media: list[MediaPart] = field(default_factory=list)


@dataclass
class SpeechCall:
    request: rq.PipelineRequest
    stage: str
    response_format: str
    speed: float
    sse: bool
    ignored: list[str] = field(default_factory=list)


#: How long the API says audio lives (OpenAI's `expires_at`); nothing is kept server-side.
AUDIO_TTL_S = 3600
#: Bytes of pcm16 per streamed chunk (0.5 s at the pcm rate).
PCM_CHUNK_BYTES = media.PCM_SAMPLE_RATE
#: Bytes of an encoded file per speech.audio.delta event.
SSE_AUDIO_CHUNK_BYTES = 32 * 1024


@dataclass
class ImagesCall:
    request: rq.PipelineRequest
    stages: list[str]
    size: tuple[int, int] | None = None
    ignored: list[str] = field(default_factory=list)



# --------------------------------------------------------------------------- chat


def _usage(outcome: rq.Outcome, stage: str) -> Usage:
    """OpenAI counts the prompt once and completion tokens over all choices."""
    prompt = completion = 0
    for child in outcome.children:
        out = child.outputs.get(stage)
        if out is None:
            continue
        prompt = max(prompt, _as_int(out.fields.get("prompt_tokens")))
        completion += _as_int(out.fields.get("completion_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _as_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _choice_result(child: rq.ChildOutcome, stage: str) -> tuple[str, str]:
    """(text, finish_reason) of one child; finish_reason keeps the stage's value ("abort"
    included: the openai client accepts unknown finish reasons)."""
    out = child.outputs.get(stage)
    fields = out.fields if out is not None else {}
    text = fields.get("text")
    finish = fields.get("finish_reason")
    default = "abort" if child.status == rq.ABORT else "stop"
    return (text if isinstance(text, str) else "",
            finish if isinstance(finish, str) and finish else default)


def speech_audio(child: rq.ChildOutcome, stage: str) -> tuple[np.ndarray, int]:
    """The speech stage's audio of one child: (float samples, sample rate); 502 when the
    stage broke the contract (tensor `audio`, field `sample_rate`)."""
    out = child.outputs.get(stage)
    if out is None:
        raise ApiError(502, f"stage {stage} returned no output", code="stage_failed")
    tensor = out.tensors.get("audio")
    rate = out.fields.get("sample_rate")
    if tensor is None or not isinstance(rate, int):
        raise ApiError(502, f"stage {stage} returned no audio (tensor audio and field "
                       f"sample_rate; got tensors {sorted(out.tensors)}, sample_rate {rate!r})",
                       code="stage_failed")
    arr = tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
    return arr, rate


def _encoded(child: rq.ChildOutcome, stage: str, fmt: str, speed: float = 1.0) -> bytes:
    samples, rate = speech_audio(child, stage)
    try:
        if speed != 1.0:
            samples = media.change_speed(samples, rate, speed)
        return media.encode_audio(samples, rate, "pcm" if fmt == "pcm16" else fmt)
    except media.MediaError as exc:
        raise ApiError(502, f"stage {stage} returned audio that cannot be encoded: {exc}",
                       code="stage_failed") from None


def _feed_pcm(encoders: dict[int, media.PcmStream], event: rq.AudioChunk) -> bytes:
    """A streamed chunk of the speech stage's audio as pcm16, through one encoder per child
    (so the joined bytes are the whole audio's pcm16); 502 when the chunk breaks the contract
    (tensor `audio`, a `sample_rate`, the same on every chunk)."""
    enc = encoders.get(event.child)
    try:
        if event.sample_rate is None:
            raise media.MediaError("the chunk has no sample_rate")
        if enc is None:
            enc = encoders[event.child] = media.PcmStream(event.sample_rate)
        elif enc.rate != event.sample_rate:
            raise media.MediaError(f"sample_rate changed from {enc.rate} to {event.sample_rate}")
        audio = event.audio
        return enc.feed(audio.numpy() if hasattr(audio, "numpy") else np.asarray(audio))
    except media.MediaError as exc:
        raise ApiError(502, f"stage {event.stage} streamed audio that cannot be encoded "
                       f"(chunk {event.seq}): {exc}", code="stage_failed") from None


def render_chat_completion(outcome: rq.Outcome, call: ChatCall, rid: str,
                           created: int) -> ChatCompletion:
    """A chat.completion object: one choice per child, in child order. With a speech stage,
    as OpenAI answers audio: content null, message.audio with the encoded audio and the chat
    stage's text as its transcript (CPU-bound then: the handler runs it off the loop)."""
    choices = []
    for child in sorted(outcome.children, key=lambda c: c.index):
        text, finish = _choice_result(child, call.stage)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if call.speech is not None:
            data = _encoded(child, call.speech, call.audio_format)
            message["content"] = None
            message["audio"] = {"id": f"audio_{rid}_{child.index}",
                                "data": base64.b64encode(data).decode("ascii"),
                                "expires_at": created + AUDIO_TTL_S, "transcript": text}
        choices.append({"index": child.index, "message": message,
                        "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": created, "model": call.model,
            "system_fingerprint": None, "choices": choices,
            "usage": _usage(outcome, call.stage)}


class ChatStream:
    """Turns engine events into chat.completion.chunk objects (pure: no I/O).

    Order: a role delta per choice, content deltas as they come, then a final delta per choice
    carrying finish_reason, then (with include_usage) a usage chunk with no choices.
    """

    def __init__(self, call: ChatCall, rid: str, created: int) -> None:
        self.call = call
        self.rid = rid
        self.created = created
        self.sent: dict[int, str] = {}
        #: Children whose speech streamed in chunks: their pcm16 encoders.
        self.encoders: dict[int, media.PcmStream] = {}

    def _chunk(self, choices: list[Any], usage: Usage | None = None) -> ChatCompletionChunk:
        chunk: ChatCompletionChunk = {
            "id": self.rid, "object": "chat.completion.chunk", "created": self.created,
            "model": self.call.model, "system_fingerprint": None, "choices": choices}
        if self.call.include_usage:
            chunk["usage"] = usage
        return chunk

    @staticmethod
    def _choice(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _audio_id(self, child: int) -> str:
        return f"audio_{self.rid}_{child}"

    def _text(self, child: int, text: str) -> dict[str, Any]:
        """A text delta: content, or with audio the transcript (OpenAI's delta.audio)."""
        if self.call.speech is None:
            return {"content": text}
        return {"audio": {"id": self._audio_id(child), "transcript": text}}

    def start(self) -> list[ChatCompletionChunk]:
        n = self.call.request.n
        for i in range(n):
            self.sent[i] = ""
        first: dict[str, Any] = {"role": "assistant", "content": ""}
        if self.call.speech is not None:
            first["content"] = None
        return [self._chunk([self._choice(i, dict(first))]) for i in range(n)]

    def delta(self, event: rq.Delta) -> list[ChatCompletionChunk]:
        if event.stage != self.call.stage or not event.text:
            return []
        self.sent[event.child] = self.sent.get(event.child, "") + event.text
        return [self._chunk([self._choice(event.child, self._text(event.child, event.text))])]

    def _data_chunks(self, child: int, pcm: bytes) -> list[ChatCompletionChunk]:
        aid = self._audio_id(child)
        return [self._chunk([self._choice(child, {"audio": {
            "id": aid, "data": base64.b64encode(pcm[i:i + PCM_CHUNK_BYTES]).decode("ascii")}})])
            for i in range(0, len(pcm), PCM_CHUNK_BYTES)]

    def audio(self, event: rq.AudioChunk) -> list[ChatCompletionChunk]:
        """A streamed chunk of the speech stage as pcm16 data deltas (CPU work when it
        resamples: the handler runs it off the loop)."""
        if event.stage != self.call.speech:
            return []
        return self._data_chunks(event.child, _feed_pcm(self.encoders, event))

    def _audio_chunks(self, child: rq.ChildOutcome) -> list[ChatCompletionChunk]:
        """The rest of the speech stage's audio as pcm16 data deltas, then the closing audio
        delta: the whole audio, or when it streamed in chunks only what the encoder held."""
        assert self.call.speech is not None
        aid = self._audio_id(child.index)
        enc = self.encoders.get(child.index)
        pcm = enc.close() if enc is not None else _encoded(child, self.call.speech, "pcm16")
        chunks = self._data_chunks(child.index, pcm)
        chunks.append(self._chunk([self._choice(child.index, {"audio": {
            "id": aid, "expires_at": self.created + AUDIO_TTL_S}})]))
        return chunks

    def finish(self, outcome: rq.Outcome) -> list[ChatCompletionChunk]:
        """Closing chunks; raises ApiError when the outcome is an error (sent as an event)."""
        err = outcome_error(outcome, chat_param, self.call.request.inputs)
        if err is not None:
            raise err
        chunks = []
        for child in sorted(outcome.children, key=lambda c: c.index):
            text, finish = _choice_result(child, self.call.stage)
            sent = self.sent.get(child.index, "")
            if len(text) > len(sent) and text.startswith(sent):
                # Whatever the stream did not carry (held-back bytes, a lost delta).
                chunks.append(self._chunk([self._choice(child.index,
                                                        self._text(child.index,
                                                                   text[len(sent):]))]))
            if self.call.speech is not None:
                chunks.extend(self._audio_chunks(child))
            chunks.append(self._chunk([self._choice(child.index, {}, finish)]))
        if self.call.include_usage:
            chunks.append(self._chunk([], _usage(outcome, self.call.stage)))
        return chunks


def sse_event(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON object (or the literal [DONE])."""
    payload = data if isinstance(data, str) else dumps(data).decode("ascii")
    return f"data: {payload}\n\n".encode()


def render_images(outcome: rq.Outcome, call: ImagesCall, created: int) -> ImagesResponse:
    """{created, data: [{b64_json}]}: one PNG per child and image stage, in child order.

    CPU-bound (PNG encoding); the handler runs it off the event loop.
    """
    data = []
    for child in sorted(outcome.children, key=lambda c: c.index):
        for stage in call.stages:
            out = child.outputs.get(stage)
            if out is None:
                continue
            tensor = out.tensors.get("image")
            if tensor is None and len(out.tensors) == 1:
                tensor = next(iter(out.tensors.values()))
            if tensor is None:
                raise ApiError(502, f"stage {stage} returned no image tensor "
                               f"(tensors: {sorted(out.tensors)})", code="stage_failed")
            try:
                data.append({"b64_json": png_base64(tensor)})
            except ImageEncodeError as exc:
                raise ApiError(502, f"stage {stage} returned an unencodable image: {exc}",
                               code="stage_failed") from None
    if not data:
        raise ApiError(502, "the pipeline returned no image", code="stage_failed")
    return {"created": created, "data": data, "output_format": "png"}


# --------------------------------------------------------------------------- speech


def render_speech(outcome: rq.Outcome, call: SpeechCall) -> bytes:
    """The encoded audio of /v1/audio/speech (one child). CPU-bound: run off the loop."""
    child = min(outcome.children, key=lambda c: c.index)
    return _encoded(child, call.stage, call.response_format, call.speed)


def speech_deltas(data: bytes) -> list[bytes]:
    """speech.audio.delta events: base64 pieces of the audio bytes."""
    return [sse_event({"type": "speech.audio.delta",
                       "audio": base64.b64encode(data[i:i + SSE_AUDIO_CHUNK_BYTES]).decode()})
            for i in range(0, len(data), SSE_AUDIO_CHUNK_BYTES)]


def speech_usage(outcome: rq.Outcome) -> dict[str, int]:
    """speech.audio.done's usage, from every stage the request ran (ChildOutcome.usage; the
    speech stage's own outputs rarely count tokens): input_tokens is the prompt as the stages
    read it, counted once (the largest prompt_tokens, the thinker's); output_tokens is every
    token they made, summed over stages (the thinker's text tokens, the talker's codec
    frames)."""
    tokens_in = tokens_out = 0
    for child in outcome.children:
        stages: dict[str, Mapping[str, Any]] = {s: out.fields for s, out in child.outputs.items()}
        stages.update(child.usage)
        for counts in stages.values():
            tokens_in = max(tokens_in, _as_int(counts.get("prompt_tokens")))
            tokens_out += _as_int(counts.get("completion_tokens"))
    return {"input_tokens": tokens_in, "output_tokens": tokens_out,
            "total_tokens": tokens_in + tokens_out}


def speech_sse(data: bytes, outcome: rq.Outcome) -> list[bytes]:
    """stream_format sse: speech.audio.delta events (base64 chunks of the file), then
    speech.audio.done with usage (speech_usage)."""
    events = speech_deltas(data)
    events.append(sse_event({"type": "speech.audio.done", "usage": speech_usage(outcome)}))
    return events


class SpeechStream:
    """/v1/audio/speech with stream_format sse and pcm, as the speech stage streams: a
    speech.audio.delta per chunk as it comes, then the rest and speech.audio.done."""

    def __init__(self, call: SpeechCall) -> None:
        self.call = call
        self.encoders: dict[int, media.PcmStream] = {}

    def audio(self, event: rq.AudioChunk) -> list[bytes]:
        """One chunk's events (CPU work when it resamples: run off the loop)."""
        if event.stage != self.call.stage or event.child != 0:
            return []
        return speech_deltas(_feed_pcm(self.encoders, event))

    def finish(self, outcome: rq.Outcome) -> list[bytes]:
        """The closing events: what the encoder held back, or the whole audio when nothing
        streamed (the stage made no chunks), then speech.audio.done."""
        enc = self.encoders.get(0)
        data = enc.close() if enc is not None else render_speech(outcome, self.call)
        return speech_sse(data, outcome)


# --------------------------------------------------------------------------- generic


def _tensor_json(tensor: Any) -> TensorJson:
    arr = tensor.numpy() if hasattr(tensor, "numpy") else tensor
    dtype = getattr(tensor, "dtype", None)
    return {"dtype": dtype if isinstance(dtype, str) else str(arr.dtype),
            "shape": [int(s) for s in arr.shape],
            "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def tensor_bytes(outcome: rq.Outcome) -> int:
    return sum(getattr(t, "nbytes", 0) for c in outcome.children for o in c.outputs.values()
               for t in o.tensors.values())


def _error_json(err: rq.RequestError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, "stage": err.stage}


def render_generic(outcome: rq.Outcome, rid: str) -> GenericResponse:
    """Every child's final outputs with tensors as base64; failures stay per child."""
    children = []
    for child in sorted(outcome.children, key=lambda c: c.index):
        outputs = {
            stage: {"fields": jsonable(out.fields),
                    "tensors": {name: _tensor_json(t) for name, t in out.tensors.items()}}
            for stage, out in child.outputs.items()
        }
        entry: ChildJson = {"index": child.index, "status": child.status,
                                 "outputs": outputs}
        if child.error is not None:
            entry["error"] = _error_json(child.error)
        children.append(entry)
    return {"id": rid, "status": outcome.status, "children": children}
