"""The orchestrator's HTTP front door: OpenAI-compatible routes plus operational ones.

Handlers stay thin: validate the body against its model (schemas.py; openapi.py makes the
OpenAPI document from the same models and route table), submit one PipelineRequest, render its
Outcome (pure functions). The HTTP layer never routes; the engine does. Every error leaves in
OpenAI's JSON error shape, and a client that goes away aborts its request through the pipeline
so no stage keeps working for nobody. See docs/http-api.md for the user-facing contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import msgspec
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError

from omnistage import media
from omnistage.client import ControlError
from omnistage.kinds import Payload
from omnistage.kinds import get as get_kind
from omnistage.metrics import HttpMetrics
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.errors import (
    INVALID_MEDIA,
    MEDIA_TOO_LARGE,
    ApiError,
    bad,
    chat_param,
    error_from_request_error,
    generic_param,
    images_param,
    outcome_error,
    speech_param,
)
from omnistage.orchestrator.load import PipelineLoad
from omnistage.orchestrator.openapi import OPS_HANDLERS, ROUTES, Route, openapi_document
from omnistage.orchestrator.render import (
    ChatCall,
    ChatStream,
    ImagesCall,
    MediaPart,
    SpeechCall,
    SpeechStream,
    dumps,
    jsonable,
    render_chat_completion,
    render_generic,
    render_images,
    render_speech,
    speech_sse,
    sse_event,
    tensor_bytes,
)
from omnistage.orchestrator.schemas import (
    PART_TYPES,
    ChatCompletionRequest,
    ControlRequest,
    GenericRequest,
    ImagePart,
    ImagesRequest,
    ModelCard,
    SpeechRequest,
    TextPart,
    VoiceId,
    image_size,
    pipeline_bodies,
)
from omnistage.params import describe, json_type, max_tokens_bound
from omnistage.protocol import ControlConflict
from omnistage.sideport import add_ops_routes, serve_app
from omnistage.spec import OmniPipeline, PipelineSpec, stage_voices

__all__ = [
    "API_KEY",
    "HttpApi",
    "build_app",
    "error_response",
    "ignored_header",
    "parse_chat",
    "parse_control",
    "parse_generic",
    "parse_images",
    "parse_json_body",
    "parse_speech",
    "render_chat_prompt",
    "serve_http",
    "speech_plan",
    "validate",
]

log = logging.getLogger("omnistage.http")

MAX_BODY_BYTES = 16 * 1024 * 1024
DISCONNECT_POLL_S = 0.25
_IGNORED_HEADER = "X-Omnistage-Ignored-Fields"
_IGNORED_MAX_CHARS = 1024
_INLINE_RENDER_BYTES = 256 * 1024
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # keep reverse proxies from buffering the stream
}
M = TypeVar("M", bound=BaseModel)


# --------------------------------------------------------------------------- engine interface


class RequestHandleLike(Protocol):
    """What the HTTP layer needs from engine.RequestHandle."""

    id: str

    def events(self) -> AsyncIterator[rq.Event]: ...

    def abort(self, child: int | None = None) -> None: ...

    async def outcome(self) -> rq.Outcome: ...


class OrchestratorLike(Protocol):
    """What the HTTP layer needs from engine.Orchestrator (a Protocol so tests can fake it)."""

    pipeline: OmniPipeline
    accepting: bool

    def submit(self, req: rq.PipelineRequest) -> RequestHandleLike: ...

    def readiness(self) -> tuple[bool, str]: ...

    registry: CollectorRegistry

    async def control(self, op: str, stages: list[str] | None = None) -> dict[str, dict]: ...

    def load(self) -> PipelineLoad: ...


# --------------------------------------------------------------------------- JSON and validation


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float | int:
    """JSON has one number type: 4.0 and 1e20 are integers (JSON Schema's `integer` agrees),
    so an integral value parses as int and meets integer fields and their bounds."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return int(value) if value.is_integer() else value


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Strict JSON object: no NaN/Infinity, no overflowing floats, no absurd nesting."""
    if not raw.strip():
        raise bad(None, "request body is empty; expected a JSON object", "invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_parse_float)
    except (ValueError, RecursionError) as exc:
        raise bad(None, f"invalid JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, f"request body must be a JSON object, got {json_type(body)}",
                   "invalid_type")
    return body


def validate(model: type[M], body: Mapping[str, Any]) -> M:
    """The body as its model (schemas.py); the first problem is a 400 whose `param` is the
    field's request path, e.g. messages[0].content."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        problem = describe(err)
        message = problem.message
        if err["type"] == "extra_forbidden":
            message += f"; allowed: {', '.join(model.model_fields)}"
        raise ApiError(400, message, param=problem.path or None, code=problem.code) from None


def _json_response(obj: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), content_type="application/json",
                        headers=dict(headers or {}))


def error_response(err: ApiError) -> web.Response:
    return web.Response(status=err.status, body=dumps(err.body()),
                        content_type="application/json", headers=err.headers())


def ignored_header(ignored: list[str]) -> dict[str, str]:
    """Unknown fields that were ignored, so a typo is visible. A JSON field name may hold any
    character and a header only visible ASCII, so names are percent-encoded (UTF-8; commas
    inside names too) and the list is cut at about 1 KiB, ending in `...` when cut."""
    if not ignored:
        return {}
    text = ",".join(quote(n.encode("utf-8", "surrogatepass"), safe="") for n in ignored)
    if len(text) > _IGNORED_MAX_CHARS:
        cut = text[:_IGNORED_MAX_CHARS]
        text = (cut.rsplit(",", 1)[0] + ",..." if "," in cut else "...")
    return {_IGNORED_HEADER: text}


def _check_model(model: str | None, served: str) -> str:
    """OpenAI semantics: an unknown model is a 404 model_not_found; omitting it is fine."""
    if model is None:
        return served
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{served}`.", param="model", code="model_not_found")
    return model


def _put(params: dict[str, Any], key: str, value: Any) -> None:
    """Set a stage parameter only when the client gave it: absent means the stage default."""
    if value is not None:
        params[key] = value


# --------------------------------------------------------------------------- chat


def render_chat_prompt(messages: Iterable[tuple[str, str]]) -> str:
    """The chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`.

    Deliberately simple and model-agnostic (the orchestrator has no tokenizer); see
    docs/http-api.md. Pipelines that need a model's own template can send the rendered prompt
    through the generic route.
    """
    parts = [f"<|{role}|>\n{text}\n" for role, text in messages]
    return "".join(parts) + "<|assistant|>\n"


def _message_text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if isinstance(part, TextPart))


# --------------------------------------------------------------------------- voices & media


def _needs(spec: PipelineSpec, finals: Iterable[str]) -> list[str]:
    """finals and every stage they need, in topological order."""
    needed: set[str] = set()
    stack = list(finals)
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(spec.stage(name).inputs)
    return [s for s in spec.topo_order() if s in needed]


@dataclass(frozen=True)
class SpeechPlan:
    """Where a pipeline's speech comes from: the stage whose kind emits audio, the stages
    that take a `voice` (their kind lists the engine option; else none is sent), the voices
    offered (by the first voice stage, else the audio stage) and the default."""

    stage: str
    voice_stages: tuple[str, ...]
    voices: tuple[str, ...]
    default: str

    def voice(self, value: str | VoiceId | None, param: str) -> str:
        name = value.id if isinstance(value, VoiceId) else value
        if name is None:
            return self.default
        if name not in self.voices:
            raise ApiError(400, f"{param} must be one of this pipeline's voices: "
                           f"{', '.join(self.voices)}; got {name!r}", param=param,
                           code="invalid_value")
        return name

    def params(self, voice: str) -> dict[str, dict[str, Any]]:
        return {s: {"voice": voice} for s in self.voice_stages}


def speech_plan(spec: PipelineSpec) -> SpeechPlan | None:
    """The speech stage (a final one whose kind emits AUDIO, else the last such stage in
    topological order), or None when no stage's kind emits audio."""
    def speaks(name: str) -> bool:
        return Payload.AUDIO in get_kind(spec.stage(name).kind).emits

    finals = [s for s in spec.final_stages() if speaks(s)]
    speaking = finals or [s for s in spec.topo_order() if speaks(s)][-1:]
    if not speaking:
        return None
    stage = speaking[0]
    voiced = tuple(s for s in _needs(spec, [stage])
                   if "voice" in get_kind(spec.stage(s).kind).engine_options)
    source = spec.stage(voiced[0] if voiced else stage)
    voices = tuple(stage_voices(source)) or ("default",)
    default = source.engine.voice if source.engine.voice in voices else voices[0]
    return SpeechPlan(stage, voiced, voices, default)


def _media_parts(req: ChatCompletionRequest) -> list[MediaPart]:
    """The image_url and input_audio parts in request order; remote URLs are refused."""
    parts: list[MediaPart] = []
    for m, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            at = f"messages[{m}].content[{p}]"
            if isinstance(part, ImagePart):  # a data URL: the schema refuses remote ones
                parts.append(MediaPart("image", f"{at}.image_url.url", part.image_url.url))
            elif not isinstance(part, TextPart):
                parts.append(MediaPart("audio", f"{at}.input_audio.data", part.input_audio.data,
                                       part.input_audio.format))
    if len(parts) > media.MAX_MEDIA_PARTS:
        raise ApiError(400, f"messages hold {len(parts)} image and audio parts; at most "
                       f"{media.MAX_MEDIA_PARTS} are accepted", param="messages",
                       code=MEDIA_TOO_LARGE)
    return parts


def _check_entry(spec: PipelineSpec, finals: list[str], parts: list[MediaPart]) -> None:
    """Input media go to the entry stages of the request; each must take that payload."""
    entries = [s for s in _needs(spec, finals) if not spec.stage(s).inputs]
    for part in parts:
        payload = Payload.IMAGE if part.kind == "image" else Payload.AUDIO
        if not any(payload in get_kind(spec.stage(s).kind).consumes for s in entries):
            field = part.param.rsplit(".", 2)[0]
            raise ApiError(400, f"{field} is not supported: this request's entry stage "
                           f"({', '.join(entries)}) does not take {part.kind} input",
                           param=field, code="unsupported_parameter")


def decode_media(parts: list[MediaPart]) -> dict[str, Any]:
    """The parts as the entry stage's tensors `input_image.<i>` / `input_audio.<i>`, i
    counting every media part in request order. CPU-bound: the handler runs it off the loop;
    a part that does not decode is a 400 naming it."""
    tensors: dict[str, Any] = {}
    for i, part in enumerate(parts):
        try:
            if part.kind == "image":
                tensors[f"input_image.{i}"] = media.decode_image_url(part.data)
            else:
                tensors[f"input_audio.{i}"] = media.decode_audio(part.data, part.format)
        except media.MediaError as exc:
            code = MEDIA_TOO_LARGE if isinstance(exc, media.MediaTooLarge) else INVALID_MEDIA
            raise ApiError(400, f"{part.param} {exc}", param=part.param, code=code) from None
    return tensors


def parse_chat(body: Mapping[str, Any], pipeline: OmniPipeline,
               model: type[ChatCompletionRequest] | None = None) -> ChatCall:
    """Validate an OpenAI chat body into a PipelineRequest for the chat stage only. The model
    (default: ChatCompletionRequest for this pipeline) bounds max_tokens by the chat stage."""
    stage = pipeline.spec.chat_stage()
    if stage is None:
        raise ApiError(404, "this pipeline has no ar stage to answer chat completions",
                       code="api_not_enabled")
    req = validate(model or _pipeline_body(pipeline, ChatCompletionRequest), body)
    served = _check_model(req.model, pipeline.served_model_name())
    params: dict[str, Any] = {}
    _put(params, "max_tokens", req.max_completion_tokens if req.max_completion_tokens is not None
         else req.max_tokens)
    _put(params, "temperature", req.temperature)
    _put(params, "seed", req.seed)
    if req.ignore_eos:
        params["ignore_eos"] = True
    turns = [(m.role, _message_text(m.content)) for m in req.messages]
    # The worker renders the turns with the model's chat template when it has one; the prompt
    # (this module's model-agnostic rendering) is the fallback.
    params["messages"] = [{"role": role, "content": text} for role, text in turns]
    # Without audio, chat returns text only: don't compute or ship hidden states a stage may
    # be set to emit (the engine turns them on for a stage that feeds a requested one).
    by_stage: dict[str, dict[str, Any]] = {stage: {**params, "return_hidden_states": False}}
    finals = [stage]
    speaking = req.modalities is not None and "audio" in req.modalities
    plan = None
    if speaking and req.audio is None:
        raise bad("audio", "audio is required when modalities include audio, for example "
                  '{"voice": "default", "format": "wav"}', "missing_required_parameter")
    if req.audio is not None and not speaking:
        raise bad("modalities", 'modalities must be ["text", "audio"] when audio is given')
    if req.audio is not None:
        plan = speech_plan(pipeline.spec)
        if plan is None:
            raise bad("audio", "audio output is not supported: this pipeline has no speech "
                      "stage (no stage's kind emits audio)", "unsupported_parameter")
        if req.stream and req.audio.format != "pcm16":
            raise bad("audio.format", "streamed audio is pcm16 (OpenAI's streaming format); "
                      f"set audio.format to pcm16, got {req.audio.format}")
        voice = plan.voice(req.audio.voice, "audio.voice")
        for name, values in plan.params(voice).items():
            by_stage.setdefault(name, {}).update(values)
        if plan.stage != stage:
            finals.append(plan.stage)
    parts = _media_parts(req)
    _check_entry(pipeline.spec, finals, parts)
    request = rq.PipelineRequest(
        prompt=render_chat_prompt(turns), params=by_stage,
        n=req.n or 1, stream=bool(req.stream), session=req.user or None, finals=finals,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatCall(request, stage, served, include_usage, sorted(req.model_extra or {}),
                    speech=plan.stage if plan else None,
                    audio_format=req.audio.format if req.audio else "wav", media=parts)


# --------------------------------------------------------------------------- speech


def parse_speech(body: Mapping[str, Any], pipeline: OmniPipeline,
                 model: type[SpeechRequest] | None = None) -> SpeechCall:
    """Validate an OpenAI speech body into a PipelineRequest for the speech stage: `input`
    is the prompt of the stages it needs, `voice` goes to the stages that take one."""
    plan = speech_plan(pipeline.spec)
    if plan is None:
        raise ApiError(404, "this pipeline has no speech stage (no stage's kind emits audio)",
                       code="api_not_enabled")
    req = validate(model or _pipeline_body(pipeline, SpeechRequest), body)
    _check_model(req.model, pipeline.served_model_name())
    voice = plan.voice(req.voice, "voice")
    fmt = req.response_format or "mp3"
    speed = 1.0 if req.speed is None else float(req.speed)
    sse = req.stream_format == "sse"
    # At the normal speed the audio streams as the stage makes it: the file itself (stream_format
    # audio, every format of media.STREAMED_FORMATS), or pcm deltas (sse). SSE of a file format,
    # flac, and a changed speed (atempo over the whole) need the whole audio first.
    streams = fmt == "pcm" if sse else fmt in media.STREAMED_FORMATS
    request = rq.PipelineRequest(prompt=req.input, params=plan.params(voice), finals=[plan.stage],
                                 stream=streams and speed == 1.0)
    return SpeechCall(request, plan.stage, fmt, speed, sse, sorted(req.model_extra or {}))


class _SpeechFile:
    """/v1/audio/speech with stream_format audio: the file of the speech stage's chunks (child
    0), through one media.AudioFileStream; a chunk that breaks the contract (tensor `audio`, a
    `sample_rate`, the same on every chunk) is a 502, as for pcm."""

    def __init__(self, call: SpeechCall) -> None:
        self.call = call
        self.encoder: media.AudioFileStream | None = None

    def audio(self, event: rq.AudioChunk) -> bytes:
        """The file's bytes this chunk makes ready (CPU work: run off the loop)."""
        if event.stage != self.call.stage or event.child != 0:
            return b""
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
            return self.encoder.feed(audio.numpy() if hasattr(audio, "numpy")
                                     else np.asarray(audio))
        except media.MediaError as exc:
            raise ApiError(502, f"stage {event.stage} streamed audio that cannot be encoded "
                           f"(chunk {event.seq}): {exc}", code="stage_failed") from None

    def finish(self, outcome: rq.Outcome) -> bytes:
        """The file's end, or the whole file when the stage made no chunks."""
        if self.encoder is None:
            return render_speech(outcome, self.call)
        return self.encoder.close()


# --------------------------------------------------------------------------- images


def image_stages(pipeline: OmniPipeline) -> list[str]:
    """The stages whose images answer /v1/images/generations (their kind emits images, as
    diffusion does): the final ones, else the last one in topological order."""
    spec = pipeline.spec
    finals = [s for s in spec.final_stages() if get_kind(spec.stage(s).kind).serves_images]
    if finals:
        return finals
    imaging = [s for s in spec.topo_order() if get_kind(spec.stage(s).kind).serves_images]
    return imaging[-1:]


def parse_images(body: Mapping[str, Any], pipeline: OmniPipeline,
                 model: type[ImagesRequest] = ImagesRequest) -> ImagesCall:
    """Validate an OpenAI images body into a PipelineRequest for the diffusion final stages."""
    stages = image_stages(pipeline)
    if not stages:
        raise ApiError(404, "this pipeline has no diffusion stage to generate images",
                       code="api_not_enabled")
    req = validate(model, body)
    _check_model(req.model, pipeline.served_model_name())
    size = image_size(req.size)
    params: dict[str, Any] = {}
    if size is not None:
        params["width"], params["height"] = size
    _put(params, "num_inference_steps", req.num_inference_steps)
    _put(params, "guidance_scale", req.guidance_scale)
    _put(params, "seed", req.seed)
    request = rq.PipelineRequest(
        prompt=req.prompt, negative_prompt=req.negative_prompt,
        params={s: dict(params) for s in stages}, n=req.n or 1, session=req.user or None,
        finals=list(stages),
    )
    return ImagesCall(request, list(stages), size, sorted(req.model_extra or {}))


# --------------------------------------------------------------------------- generic & control


def _entry_parts(spec: PipelineSpec, chat: str | None) -> tuple[str, ...]:
    """The content part types the chat stage's entry stages take (text always)."""
    if chat is None:
        return PART_TYPES
    entries = [get_kind(spec.stage(s).kind) for s in _needs(spec, [chat])
               if not spec.stage(s).inputs]
    takes = {p for row in entries for p in row.consumes}
    return ("text", *(part for part, payload in (("image_url", Payload.IMAGE),
                                                   ("input_audio", Payload.AUDIO))
                      if payload in takes))


def _pipeline_body(pipeline: OmniPipeline, stock: type[M]) -> type[M]:
    """The stock body model narrowed to the pipeline: its stage names, its chat stage's
    max_tokens bound, its voices (no audio without a speech stage) and the content parts its
    entry stage takes (schemas.pipeline_bodies)."""
    spec = pipeline.spec
    chat = spec.chat_stage()
    most = None if chat is None else max_tokens_bound(spec.stage(chat))
    plan = speech_plan(spec)
    return pipeline_bodies(tuple(spec.stage_names()), most,  # type: ignore[return-value]
                           None if plan is None else plan.voices,
                           _entry_parts(spec, chat)).get(stock, stock)


def parse_generic(body: Mapping[str, Any], pipeline: OmniPipeline,
                  model: type[GenericRequest] | None = None) -> rq.PipelineRequest:
    """Validate the generic route's body; unknown fields are errors (typos must not pass).
    The model (default: GenericRequest for this pipeline's stages) names unknown stages."""
    req = validate(model or _pipeline_body(pipeline, GenericRequest), body)
    params = {stage: dict(values) for stage, values in (req.params or {}).items()}
    return rq.PipelineRequest(
        prompt=req.prompt or "", negative_prompt=req.negative_prompt, params=params,
        n=req.n or 1, session=req.session or None, timeout_s=req.timeout_s,
        finals=list(req.finals) if req.finals is not None else None,
    )


def parse_control(body: Mapping[str, Any], pipeline: OmniPipeline,
                  model: type[ControlRequest] | None = None) -> tuple[str, list[str] | None]:
    """{op, stages?} -> (op, stages); unknown stages are refused before anything pauses."""
    req = validate(model or _pipeline_body(pipeline, ControlRequest), body)
    return req.op, list(req.stages) if req.stages is not None else None




# --------------------------------------------------------------------------- the app


class _Flight:
    """Ties one pipeline request to its HTTP connection: if the client goes away before the
    outcome (handler cancelled, write failed, or the socket seen closed), abort it."""

    def __init__(self, api: HttpApi, request: web.Request, handle: RequestHandleLike) -> None:
        self.api = api
        self.request = request
        self.handle = handle
        self.finished = False
        self.aborted = False
        self._watch: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Flight:
        if self.api.disconnect_poll_s is not None:
            self._watch = asyncio.create_task(self._watch_loop())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if not self.finished:
            # Leaving without an outcome: cancelled (client gone) or a server-side failure.
            gone = exc_type is None or issubclass(exc_type,
                                                  asyncio.CancelledError | ConnectionError)
            self.client_gone(disconnected=gone)

    async def _watch_loop(self) -> None:
        """aiohttp only cancels handlers on disconnect when asked to, so also look."""
        interval = self.api.disconnect_poll_s or DISCONNECT_POLL_S
        while not self.finished:
            await asyncio.sleep(interval)
            transport = self.request.transport
            if transport is None or transport.is_closing():
                self.client_gone()
                return

    def client_gone(self, *, disconnected: bool = True) -> None:
        """Abort the request once; counted as a disconnect unless the server gave up."""
        if self.aborted or self.finished:
            return
        self.aborted = True
        if disconnected:
            self.api.metrics.disconnects.inc()
            log.info("client went away; aborting request %s", self.handle.id)
        try:
            self.handle.abort()
        except Exception:  # never let cleanup mask the real exit
            log.exception("abort of request %s failed", self.handle.id)

    async def outcome(self) -> rq.Outcome:
        result = await self.handle.outcome()
        self.finished = True
        return result


def _path_pattern(path: str) -> re.Pattern[str]:
    """An aiohttp route pattern as a regex, to tell a disabled API surface from a bad path."""
    return re.compile("^" + re.sub(r"\\\{.*?\\\}", "[^/]+", re.escape(path)) + "/?$")


class HttpApi:
    """Handlers bound to one orchestrator; build_app wires them to the route table's paths.

    `routes` (default openapi.ROUTES) is one table for both: the handlers validate with each
    route's body model and /openapi.json is generated from the same table.
    """

    def __init__(self, orch: OrchestratorLike, *,
                 disconnect_poll_s: float | None = DISCONNECT_POLL_S,
                 routes: Iterable[Route] = ROUTES) -> None:
        self.orch = orch
        self.pipeline = orch.pipeline
        self.apis = list(self.pipeline.spec.orchestrator.api)
        self.model = self.pipeline.served_model_name()
        self.name = self.pipeline.metadata.name
        self.metrics = HttpMetrics(orch.registry)
        self.disconnect_poll_s = disconnect_poll_s
        self.closing = False  # shutdown began: /readyz fails, every response says Connection: close
        self.started = int(time.time())
        table = list(routes)
        # The generic and control bodies name this pipeline's stages, in validator and document.
        self.served = [replace(r, body=_pipeline_body(self.pipeline, r.body)) if r.body else r
                       for r in table if r.surface is None or r.surface in self.apis]
        self.disabled = [(_path_pattern(r.path),
                          f"the {r.surface} API is not enabled for pipeline {self.name} "
                          f"(spec.orchestrator.api: {', '.join(self.apis)})") for r in table
                         if r.surface is not None and r.surface not in self.apis]
        self.speech = speech_plan(self.pipeline.spec)
        if self.speech is None:
            # Speech routes exist only where a stage's kind emits audio (the document too).
            speech = [r for r in self.served if r.needs_speech]
            self.served = [r for r in self.served if not r.needs_speech]
            self.disabled += [(_path_pattern(r.path), f"pipeline {self.name} has no speech "
                               "stage (no stage's kind emits audio)") for r in speech]
        self.bodies: dict[str, Any] = {r.handler: r.body for r in self.served}
        self.openapi = dumps(openapi_document(self.apis, routes=self.served,
                                               pipeline_name=self.name, model_name=self.model))

    # -- plumbing ---------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """Errors to OpenAI's shape, and per-route counters for /metrics."""
        started = time.perf_counter()
        status = 500
        self.metrics.inflight.inc()
        try:
            response = await handler(request)
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            return error_response(exc)
        except web.HTTPException as exc:
            err = self._http_exception(request, exc)
            status = err.status
            return error_response(err)
        except asyncio.CancelledError:
            status = 499  # nginx's "client closed request"; only ever seen in metrics
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(ApiError(500, "internal server error", code="internal"))
        finally:
            self.metrics.inflight.dec()
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            self.metrics.observe(route, request.method, status, time.perf_counter() - started)

    def _http_exception(self, request: web.Request, exc: web.HTTPException) -> ApiError:
        if exc.status == 404:
            for pattern, reason in self.disabled:
                if pattern.match(request.path):
                    return ApiError(404, reason, code="api_not_enabled")
            return ApiError(404, f"no route {request.method} {request.path}", code="not_found")
        if exc.status == 405:
            # RFC 9110: a 405 lists the methods the resource does serve.
            allow = exc.headers.get("Allow", "")
            return ApiError(405, f"method {request.method} is not allowed on {request.path} "
                            f"(allowed: {allow})", code="method_not_allowed",
                            headers={"Allow": allow})
        if exc.status == 413:
            return ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes",
                            code="request_too_large")
        return ApiError(exc.status, exc.reason or "HTTP error", code="http_error")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_json_body(await request.read())

    def _submit(self, req: rq.PipelineRequest) -> RequestHandleLike:
        if not self.orch.accepting:
            raise ApiError(503, "the orchestrator is shutting down", code="shutting_down",
                           retry_after=1)
        try:
            return self.orch.submit(req)
        except (UnicodeError, OverflowError) as exc:  # the engine promises not to; be safe
            raise bad(None, f"request cannot be encoded: {exc}") from None

    # -- OpenAI routes ----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        call = parse_chat(await self._body(request), self.pipeline,
                          self.bodies["chat_completions"])
        if call.media:
            call.request.tensors = await asyncio.to_thread(decode_media, call.media)
        handle = self._submit(call.request)
        rid = f"chatcmpl-{handle.id}"
        created = int(time.time())
        headers = {"X-Request-Id": handle.id, **ignored_header(call.ignored)}
        if call.request.stream:
            return await self._stream_chat(request, handle, call, rid, created, headers)
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, chat_param)
        if err is not None:
            raise err
        if call.speech is not None:  # audio encoding is CPU work: off the event loop
            payload = await asyncio.to_thread(render_chat_completion, outcome, call, rid, created)
        else:
            payload = render_chat_completion(outcome, call, rid, created)
        return _json_response(payload, headers)

    async def _stream_chat(self, request: web.Request, handle: RequestHandleLike,
                           call: ChatCall, rid: str, created: int,
                           headers: dict[str, str]) -> web.StreamResponse:
        """SSE. The response starts only once the first event is in, so a request that fails
        at once (overload, no replica) still gets a real HTTP status."""
        renderer = ChatStream(call, rid, created)
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        async with _Flight(self, request, handle) as flight:
            events, event = await self._first_event(handle, flight, chat_param)
            try:
                await response.prepare(request)
                for chunk in renderer.start():
                    await response.write(sse_event(chunk))
                while True:
                    if isinstance(event, rq.Outcome):
                        flight.finished = True
                        await self._finish_stream(response, renderer, event)
                        break
                    if isinstance(event, rq.AudioChunk):
                        chunks = await asyncio.to_thread(renderer.audio, event)
                    else:
                        chunks = renderer.delta(event)
                    for chunk in chunks:
                        await response.write(sse_event(chunk))
                    if isinstance(event, rq.AudioChunk):
                        event.credit()  # written: the stage may make the next one
                    event = await anext(events)
                await response.write_eof()
            except ConnectionError:
                flight.client_gone()
            except ApiError as err:  # a streamed chunk broke the contract: too late for a status
                await self._in_band_error(response, flight, err)
            except Exception:
                log.exception("chat stream %s failed", handle.id)
                await self._in_band_error(
                    response, flight, ApiError(500, "internal server error", code="internal"))
        return response

    async def _finish_stream(self, response: web.StreamResponse, renderer: ChatStream,
                             outcome: rq.Outcome) -> None:
        try:
            chunks = renderer.finish(outcome)
        except ApiError as err:
            # Too late for an HTTP status: OpenAI clients raise on an error event.
            self.metrics.stream_errors.inc()
            await response.write(sse_event(err.body()))
            return
        for chunk in chunks:
            await response.write(sse_event(chunk))
        await response.write(sse_event("[DONE]"))

    async def images_generations(self, request: web.Request) -> web.Response:
        call = parse_images(await self._body(request), self.pipeline,
                            self.bodies["images_generations"])
        handle = self._submit(call.request)
        created = int(time.time())
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, images_param)
        if err is not None:
            raise err
        payload = await asyncio.to_thread(render_images, outcome, call, created)
        headers = {"X-Request-Id": handle.id, **ignored_header(call.ignored)}
        return _json_response(payload, headers)

    async def audio_speech(self, request: web.Request) -> web.StreamResponse:
        call = parse_speech(await self._body(request), self.pipeline,
                            self.bodies["audio_speech"])
        handle = self._submit(call.request)
        headers = {"X-Request-Id": handle.id, **ignored_header(call.ignored)}
        if call.request.stream and not call.sse:
            return await self._stream_speech_file(request, handle, call, headers)
        if call.request.stream:
            return await self._stream_speech(request, handle, call, headers)
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, speech_param)
        if err is not None:
            raise err
        data = await asyncio.to_thread(render_speech, outcome, call)
        if not call.sse:
            return web.Response(body=data, headers={
                **headers, "Content-Type": media.MEDIA_TYPES[call.response_format]})
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        await response.prepare(request)
        for event in speech_sse(data, outcome):
            await response.write(event)
        await response.write_eof()
        return response

    async def _stream_speech(self, request: web.Request, handle: RequestHandleLike,
                             call: SpeechCall, headers: dict[str, str]) -> web.StreamResponse:
        """SSE of pcm as the speech stage streams it: each chunk is written, then credited, so
        a slow client holds the stage back. As chat, the response starts with the first
        event, so a request that fails at once still gets a real HTTP status."""
        renderer = SpeechStream(call)
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        async with _Flight(self, request, handle) as flight:
            events, event = await self._first_event(handle, flight, speech_param)
            try:
                await response.prepare(request)
                while not isinstance(event, rq.Outcome):
                    if isinstance(event, rq.AudioChunk):
                        for data in await asyncio.to_thread(renderer.audio, event):
                            await response.write(data)
                        event.credit()
                    event = await anext(events)
                flight.finished = True
                err = outcome_error(event, speech_param)
                if err is not None:
                    raise err
                for data in await asyncio.to_thread(renderer.finish, event):
                    await response.write(data)
                await response.write_eof()
            except ConnectionError:
                flight.client_gone()
            except ApiError as err:
                await self._in_band_error(response, flight, err)
            except Exception:
                log.exception("speech stream %s failed", handle.id)
                await self._in_band_error(
                    response, flight, ApiError(500, "internal server error", code="internal"))
        return response

    async def _stream_speech_file(self, request: web.Request, handle: RequestHandleLike,
                                  call: SpeechCall, headers: dict[str, str],
                                  ) -> web.StreamResponse:
        """stream_format audio: the audio file's bytes as the speech stage makes the audio
        (media.AudioFileStream), each chunk credited once written. The status line goes with
        the first event, so a request that fails at once gets a real HTTP status; one that fails
        later is aborted and its connection cut before the file's end (an audio body has no
        room for an error), so the client sees a truncated response, not a short file."""
        file = _SpeechFile(call)
        response = web.StreamResponse(headers={
            **headers, "Content-Type": media.MEDIA_TYPES[call.response_format]})
        async with _Flight(self, request, handle) as flight:
            events, event = await self._first_event(handle, flight, speech_param)
            try:
                await response.prepare(request)
                while not isinstance(event, rq.Outcome):
                    if isinstance(event, rq.AudioChunk):
                        data = await asyncio.to_thread(file.audio, event)
                        if data:
                            await response.write(data)
                        event.credit()
                    event = await anext(events)
                flight.finished = True
                err = outcome_error(event, speech_param)
                if err is not None:
                    raise err
                await response.write(await asyncio.to_thread(file.finish, event))
                await response.write_eof()
            except ConnectionError:
                flight.client_gone()
            except Exception as exc:
                if not isinstance(exc, ApiError):
                    log.exception("speech stream %s failed", handle.id)
                else:
                    log.warning("speech stream %s failed after its first bytes: %s", handle.id,
                                exc.body())
                flight.client_gone(disconnected=False)
                self.metrics.stream_errors.inc()
                if request.transport is not None:
                    request.transport.close()
        return response

    @staticmethod
    async def _first_event(handle: RequestHandleLike, flight: _Flight,
                           param: Callable[[str, str | None], str | None],
                           ) -> tuple[AsyncIterator[Any], Any]:
        """A stream's events and its first one; a request that ended at once with an error
        (overload, no replica) raises it here, before the response starts, so the client
        gets a real HTTP status."""
        events = handle.events().__aiter__()
        event = await anext(events)
        if isinstance(event, rq.Outcome):
            flight.finished = True
            err = outcome_error(event, param)
            if err is not None:
                raise err
        return events, event

    async def _in_band_error(self, response: web.StreamResponse, flight: _Flight,
                             err: ApiError) -> None:
        """The status line is gone already: abort the request, report the error in the
        stream, and end it (a client that left is not written to)."""
        flight.client_gone(disconnected=False)
        with contextlib.suppress(ConnectionError):
            self.metrics.stream_errors.inc()
            await response.write(sse_event(err.body()))
            await response.write_eof()

    async def list_models(self, _request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model:
            raise ApiError(404, f"The model `{request.match_info['model']}` does not exist",
                           param="model", code="model_not_found")
        return _json_response(self._model_card())

    def _model_card(self) -> ModelCard:
        card: ModelCard = {"id": self.model, "object": "model", "created": self.started,
                           "owned_by": "omnistage"}
        if self.speech is not None:
            card["voices"] = list(self.speech.voices)
        return card

    # -- pipeline routes --------------------------------------------------------------------

    def _check_pipeline(self, request: web.Request) -> None:
        name = request.match_info["name"]
        if name != self.name:
            raise ApiError(404, f"unknown pipeline {name!r}; this orchestrator serves "
                           f"{self.name!r}", param="name", code="pipeline_not_found")

    async def pipeline_request(self, request: web.Request) -> web.Response:
        self._check_pipeline(request)
        req = parse_generic(await self._body(request), self.pipeline,
                            self.bodies["pipeline_request"])
        handle = self._submit(req)
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        if outcome.error is not None:
            raise error_from_request_error(outcome.error, generic_param)
        if tensor_bytes(outcome) > _INLINE_RENDER_BYTES:
            payload = await asyncio.to_thread(render_generic, outcome, handle.id)
        else:  # small answers: a thread hop would cost more than the encoding
            payload = render_generic(outcome, handle.id)
        return _json_response(payload, {"X-Request-Id": handle.id})

    async def pipeline_control(self, request: web.Request) -> web.Response:
        self._check_pipeline(request)
        op, stages = parse_control(await self._body(request), self.pipeline,
                                   self.bodies["pipeline_control"])
        try:
            results = await self.orch.control(op, stages)
        except ControlError as exc:
            if exc.type == ControlConflict.__name__:  # the replica's state forbids it now
                raise ApiError(409, str(exc), code="control_conflict",
                               extra={"replica": exc.replica,
                                      "exception_type": exc.type}) from None
            raise ApiError(500, str(exc), code="control_failed",
                           extra={"replica": exc.replica, "exception_type": exc.type}) from None
        except ValueError as exc:
            # The engine prefixes the field at fault ("stages: unknown stage(s) ...").
            text = str(exc)
            param = "op" if text.startswith("op") else "stages" if "stage" in text else None
            raise bad(param, text) from None
        return _json_response({"results": jsonable(results)})

    async def pipeline_load(self, _request: web.Request) -> web.Response:
        """GET /v1/load: the engine's load signal, encoded once by msgspec (its one shape)."""
        return web.Response(body=msgspec.json.encode(self.orch.load()),
                            content_type="application/json")

    async def openapi_json(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.openapi, content_type="application/json")

    def readiness(self) -> tuple[bool, str]:
        """/readyz: fails first when shutdown begins, so endpoints stop sending traffic."""
        if self.closing or not self.orch.accepting:
            return False, "shutting down"
        return self.orch.readiness()

    def begin_shutdown(self) -> None:
        """From now on /readyz fails and every response carries `Connection: close`, so
        keep-alive clients open their next connection elsewhere; requests are still served
        until the orchestrator stops admitting."""
        self.closing = True

    async def _on_response_prepare(self, _request: web.Request,
                                   response: web.StreamResponse) -> None:
        if self.closing:
            response.force_close()  # close the connection after this response...
            response.headers["Connection"] = "close"  # ...and say so (the hook runs late)

    def routes(self) -> list[web.RouteDef]:
        """The table's routes, except the ops routes that omnistage.sideport serves."""
        return [web.route(r.method, r.path, getattr(self, r.handler)) for r in self.served
                if r.handler not in OPS_HANDLERS]


API_KEY = web.AppKey("omnistage_http_api", HttpApi)


def build_app(orch: OrchestratorLike, *,
              disconnect_poll_s: float | None = DISCONNECT_POLL_S,
              routes: Iterable[Route] = ROUTES) -> web.Application:
    """The aiohttp application for one orchestrator (only the enabled API surfaces).

    disconnect_poll_s: how often a waiting handler checks whether its client is still there.
    Needed when the app is served without handler_cancellation (aiohttp's default); None turns
    the check off for runners that cancel handlers on disconnect, as serve_http's does.
    """
    api = HttpApi(orch, disconnect_poll_s=disconnect_poll_s, routes=routes)
    app = web.Application(middlewares=[api.middleware], client_max_size=MAX_BODY_BYTES)
    app[API_KEY] = api
    app.on_response_prepare.append(api._on_response_prepare)
    app.add_routes(api.routes())
    add_ops_routes(app, readiness=api.readiness, registry=orch.registry)
    return app


async def serve_http(orch: OrchestratorLike, host: str, port: int
                     ) -> tuple[web.AppRunner, str]:
    """Start the API; returns the runner (await runner.cleanup() to stop) and its base URL.

    handler_cancellation makes a client disconnect cancel the handler at once, which aborts the
    request through the pipeline, so no per-request polling is needed.
    """
    return await serve_app(build_app(orch, disconnect_poll_s=None), host, port,
                           handler_cancellation=True)

