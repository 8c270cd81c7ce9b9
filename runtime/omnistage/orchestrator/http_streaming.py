"""Streamed answers: one pump from a request's events to the client, for every stream format.

Why one pump: chat SSE, speech SSE and the streamed speech file differ only in the bytes they
make of each event, so those bytes are a StreamFormat's business and everything else is here
once: when the response starts, when a chunk's credit goes back to the stage, and what a
failure, a client disconnect or a cancellation does to the request. Nothing here knows the
HTTP framework: http_api.py hands in a ResponseWriter over its response.

The rules (docs/http-api.md, "Streaming", "When audio streams", "Client disconnects"):

- The status line and headers go with the first bytes. Until then any failure (an outcome
  that is an error, a chunk that cannot be encoded, a bug) is raised as an ApiError, so the
  client gets a real HTTP status and the request is aborted if it is still running.
- A chunk's credit goes back once its bytes were written, so a slow client holds the stage
  back instead of the server buffering for it.
- After the first bytes a failure aborts the request (not counted as a disconnect), counts in
  stream_errors and ends the stream: with an error event where the format can carry one
  (SSE), else by cutting the connection before the body's end (an audio file has no room for
  an error, and a cut is what tells the client its file is short).
- A failed write is the client gone: the request is aborted and counted as a disconnect.
  Cancellation (aiohttp's handler_cancellation) propagates and the Flight aborts the request.
  A request is aborted at most once and never after its outcome, so it has one terminal
  outcome whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import numpy as np

from omnistage import media
from omnistage.metrics import HttpMetrics
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.errors import ApiError, ParamMap, outcome_error
from omnistage.orchestrator.render import (
    ChatCall,
    ChatStream,
    SpeechCall,
    SpeechStream,
    render_speech,
    sse_event,
)

__all__ = [
    "DISCONNECT_POLL_S",
    "ChatSse",
    "Flight",
    "RequestHandleLike",
    "ResponseWriter",
    "SpeechFile",
    "SpeechSse",
    "StreamFormat",
    "pump",
]

log = logging.getLogger("omnistage.http")

DISCONNECT_POLL_S = 0.25


class RequestHandleLike(Protocol):
    """What the HTTP layer needs from engine.RequestHandle."""

    id: str
    revision: str | None  # the pipeline revision it is pinned to (engine.RequestHandle)

    def events(self) -> AsyncIterator[rq.Event]: ...

    def abort(self, child: int | None = None) -> None: ...

    async def outcome(self) -> rq.Outcome: ...


class Flight:
    """Ties one pipeline request to its client: if the client goes away before the outcome
    (handler cancelled, write failed, or `gone()` seen true by the watcher), abort it.

    poll_s: how often to call `gone`; None when the server cancels handlers on disconnect
    (aiohttp only does when asked to, so without it the watcher looks)."""

    def __init__(self, handle: RequestHandleLike, metrics: HttpMetrics, *,
                 gone: Callable[[], bool], poll_s: float | None = DISCONNECT_POLL_S) -> None:
        self.handle = handle
        self.metrics = metrics
        self.finished = False
        self.aborted = False
        self._gone = gone
        self._poll_s = poll_s
        self._watch: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Flight:
        if self._poll_s is not None:
            self._watch = asyncio.create_task(self._watch_loop(self._poll_s or DISCONNECT_POLL_S))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if not self.finished:
            # Leaving without an outcome: cancelled (client gone) or a server-side failure.
            gone = exc_type is None or issubclass(exc_type,
                                                  asyncio.CancelledError | ConnectionError)
            self.client_gone(disconnected=gone)

    async def _watch_loop(self, interval: float) -> None:
        while not self.finished:
            await asyncio.sleep(interval)
            if self._gone():
                self.client_gone()
                return

    def client_gone(self, *, disconnected: bool = True) -> None:
        """Abort the request once; counted as a disconnect unless the server gave up."""
        if self.aborted or self.finished:
            return
        self.aborted = True
        if disconnected:
            self.metrics.disconnects.inc()
            log.info("client went away; aborting request %s", self.handle.id)
        try:
            self.handle.abort()
        except Exception:  # never let cleanup mask the real exit
            log.exception("abort of request %s failed", self.handle.id)

    async def outcome(self) -> rq.Outcome:
        result = await self.handle.outcome()
        self.finished = True
        return result


class ResponseWriter(Protocol):
    """Where a stream's bytes go. The first write sends the status line and headers."""

    @property
    def started(self) -> bool: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...

    def cut(self) -> None:
        """Close the connection before the body's end: the client sees a truncated body."""


class StreamFormat:
    """The bytes of one stream (pure; no I/O). `audio` and, when `heavy_finish`, `finish` are
    CPU work (encoding, resampling) that the pump runs off the event loop."""

    name = "stream"  # for logs
    heavy_finish = True
    #: The request's input tensor -> body field (PipelineRequest.inputs), for its errors.
    inputs: Mapping[str, str] = {}

    def start(self) -> list[bytes]:
        """Bytes that open the stream, sent with the first event that is not an error."""
        return []

    def delta(self, event: rq.Delta) -> list[bytes]:
        return []

    def audio(self, event: rq.AudioChunk) -> list[bytes]:
        return []

    def finish(self, outcome: rq.Outcome) -> list[bytes]:
        """The closing bytes of an outcome that is not an error."""
        return []

    def error(self, err: ApiError) -> bytes | None:
        """The error in the stream, or None when the format has no room for one."""
        return None


class ChatSse(StreamFormat):
    """chat.completion.chunk events (render.ChatStream), then [DONE]."""

    name = "chat"

    def __init__(self, call: ChatCall, rid: str, created: int) -> None:
        self.stream = ChatStream(call, rid, created)
        self.heavy_finish = call.speech is not None  # text only: cheaper than a thread hop
        self.inputs = call.request.inputs

    def start(self) -> list[bytes]:
        return [sse_event(c) for c in self.stream.start()]

    def delta(self, event: rq.Delta) -> list[bytes]:
        return [sse_event(c) for c in self.stream.delta(event)]

    def audio(self, event: rq.AudioChunk) -> list[bytes]:
        return [sse_event(c) for c in self.stream.audio(event)]

    def finish(self, outcome: rq.Outcome) -> list[bytes]:
        return [*(sse_event(c) for c in self.stream.finish(outcome)), sse_event("[DONE]")]

    def error(self, err: ApiError) -> bytes:
        """OpenAI clients raise on an error event; no [DONE] follows it."""
        return sse_event(err.body())


class SpeechSse(StreamFormat):
    """/v1/audio/speech with stream_format sse (render.SpeechStream): speech.audio.delta
    events, as the stage streams pcm or whole at the end, then speech.audio.done."""

    name = "speech"

    def __init__(self, call: SpeechCall) -> None:
        self.stream = SpeechStream(call)

    def audio(self, event: rq.AudioChunk) -> list[bytes]:
        return self.stream.audio(event)

    def finish(self, outcome: rq.Outcome) -> list[bytes]:
        return self.stream.finish(outcome)

    def error(self, err: ApiError) -> bytes:
        return sse_event(err.body())


class SpeechFile(StreamFormat):
    """/v1/audio/speech with stream_format audio: the file of the speech stage's chunks (child
    0), through one media.AudioFileStream; a chunk that breaks the contract (tensor `audio`, a
    `sample_rate`, the same on every chunk) is a 502, as for pcm. No room for an error."""

    name = "speech file"

    def __init__(self, call: SpeechCall) -> None:
        self.call = call
        self.encoder: media.AudioFileStream | None = None

    def audio(self, event: rq.AudioChunk) -> list[bytes]:
        """The file's bytes this chunk makes ready."""
        if event.stage != self.call.stage or event.child != 0:
            return []
        try:
            if event.sample_rate is None:
                raise media.MediaError("the chunk has no sample_rate")
            if self.encoder is None:
                self.encoder = media.AudioFileStream(self.call.response_format,
                                                     event.sample_rate)
            elif self.encoder.rate != event.sample_rate:
                raise media.MediaError(f"sample_rate changed from {self.encoder.rate} to "
                                       f"{event.sample_rate}")
            audio = event.audio
            return [self.encoder.feed(audio.numpy() if hasattr(audio, "numpy")
                                      else np.asarray(audio))]
        except media.MediaError as exc:
            raise ApiError(502, f"stage {event.stage} streamed audio that cannot be encoded "
                           f"(chunk {event.seq}): {exc}", code="stage_failed") from None

    def finish(self, outcome: rq.Outcome) -> list[bytes]:
        """The file's end, or the whole file when the stage made no chunks."""
        if self.encoder is None:
            return [render_speech(outcome, self.call)]
        return [self.encoder.close()]


async def _write(writer: ResponseWriter, pieces: list[bytes]) -> None:
    for data in pieces:
        if data:  # an empty write would start the response with nothing to say
            await writer.write(data)


async def pump(flight: Flight, fmt: StreamFormat, writer: ResponseWriter,
               param: ParamMap) -> None:
    """Drive the flight's request events into the writer in fmt's bytes until its outcome,
    handling every failure as the module docstring says. Raises ApiError only while nothing
    has been written (the caller answers it with its status); a cancellation propagates (the
    Flight then aborts the request)."""
    handle = flight.handle
    try:
        begun = False
        async for event in handle.events():
            if isinstance(event, rq.Outcome):
                flight.finished = True
                err = outcome_error(event, param, fmt.inputs)
                if err is not None:
                    raise err
            if not begun:
                begun = True
                await _write(writer, fmt.start())
            if isinstance(event, rq.Outcome):
                await _write(writer, await asyncio.to_thread(fmt.finish, event)
                             if fmt.heavy_finish else fmt.finish(event))
                await writer.end()
                return
            if isinstance(event, rq.AudioChunk):
                await _write(writer, await asyncio.to_thread(fmt.audio, event))
                event.credit()  # written: the stage may make the next one
            else:
                await _write(writer, fmt.delta(event))
        raise RuntimeError("event stream ended without an outcome")
    except ConnectionError:
        flight.client_gone()  # a failed write: the client went away
    except Exception as exc:
        if isinstance(exc, ApiError):
            err = exc
        else:
            log.exception("%s stream %s failed", fmt.name, handle.id)
            err = ApiError(500, "internal server error", code="internal")
        flight.client_gone(disconnected=False)  # the server gave up: stop the stages
        if not writer.started:
            raise err from None
        await _fail(flight, fmt, writer, err)


async def _fail(flight: Flight, fmt: StreamFormat, writer: ResponseWriter,
                err: ApiError) -> None:
    """The status line is gone already: report the error in the stream and end it, or cut
    the connection when the format has no room for it (a client that left is not written to)."""
    log.warning("%s stream %s failed after its first bytes: %s", fmt.name, flight.handle.id,
                err.body()["error"])
    flight.metrics.stream_errors.inc()
    data = fmt.error(err)
    if data is None:
        writer.cut()
        return
    with contextlib.suppress(ConnectionError):
        await writer.write(data)
        await writer.end()
