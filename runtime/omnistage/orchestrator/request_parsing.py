"""Request bodies to pipeline requests: the HTTP API's pure half (no I/O, no aiohttp).

Why apart from the handlers (http_api.py): everything here is a function of a body and the
pipeline, so it is tested without a server and the routes stay thin. A body is validated
against its model (schemas.py; the same models generate /openapi.json), its first problem is a
400 naming the field, and the result is the PipelineRequest to submit plus what rendering the
answer needs (render.ChatCall, SpeechCall, ImagesCall).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from omnistage import media
from omnistage.kinds import Payload
from omnistage.kinds import get as get_kind
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.errors import INVALID_MEDIA, MEDIA_TOO_LARGE, ApiError, bad
from omnistage.orchestrator.render import ChatCall, ImagesCall, MediaPart, SpeechCall
from omnistage.orchestrator.schemas import (
    PART_TYPES,
    ChatCompletionRequest,
    ControlRequest,
    GenericRequest,
    ImagePart,
    ImagesRequest,
    SpeechRequest,
    TextPart,
    VoiceId,
    image_size,
    pipeline_bodies,
)
from omnistage.params import describe, json_type, max_tokens_bound
from omnistage.spec import OmniPipeline, PipelineSpec, stage_voices

__all__ = [
    "IGNORED_HEADER",
    "SpeechPlan",
    "decode_media",
    "ignored_header",
    "image_stages",
    "media_inputs",
    "media_tensors",
    "parse_chat",
    "parse_control",
    "parse_generic",
    "parse_images",
    "parse_json_body",
    "parse_speech",
    "pipeline_body",
    "render_chat_prompt",
    "speech_plan",
    "validate",
]

IGNORED_HEADER = "X-Omnistage-Ignored-Fields"
_IGNORED_MAX_CHARS = 1024
M = TypeVar("M", bound=BaseModel)


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
    return {IGNORED_HEADER: text}


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
    voiced = tuple(s for s in spec.needed_by([stage])
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
    entries = [s for s in spec.needed_by(finals) if not spec.stage(s).inputs]
    for part in parts:
        payload = Payload.IMAGE if part.kind == "image" else Payload.AUDIO
        if not any(payload in get_kind(spec.stage(s).kind).consumes for s in entries):
            field = part.param.rsplit(".", 2)[0]
            raise ApiError(400, f"{field} is not supported: this request's entry stage "
                           f"({', '.join(entries)}) does not take {part.kind} input",
                           param=field, code="unsupported_parameter")


def media_tensors(parts: list[MediaPart]) -> list[str]:
    """The tensor name of each part: `input_image.<i>` / `input_audio.<i>`, each kind counted
    from 0 in request order (the entry stage reads each kind as 0, 1, ... without gaps)."""
    counts = {"image": 0, "audio": 0}
    names = []
    for part in parts:
        names.append(f"input_{part.kind}.{counts[part.kind]}")
        counts[part.kind] += 1
    return names


def media_inputs(parts: list[MediaPart]) -> dict[str, str]:
    """Tensor name -> the request field of its part (messages[0].content[1].input_audio):
    what a stage's refusal of that tensor names (PipelineRequest.inputs)."""
    return {name: part.param.rsplit(".", 1)[0]
            for name, part in zip(media_tensors(parts), parts, strict=True)}


def decode_media(parts: list[MediaPart]) -> dict[str, Any]:
    """The parts as the entry stage's tensors (media_tensors names them). CPU-bound: the
    handler runs it off the loop; a part that does not decode is a 400 naming it."""
    tensors: dict[str, Any] = {}
    for name, part in zip(media_tensors(parts), parts, strict=True):
        try:
            if part.kind == "image":
                tensors[name] = media.decode_image_url(part.data)
            else:
                tensors[name] = media.decode_audio(part.data, part.format)
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
    req = validate(model or pipeline_body(pipeline, ChatCompletionRequest), body)
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
        inputs=media_inputs(parts),
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
    req = validate(model or pipeline_body(pipeline, SpeechRequest), body)
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
    entries = [get_kind(spec.stage(s).kind) for s in spec.needed_by([chat])
               if not spec.stage(s).inputs]
    takes = {p for row in entries for p in row.consumes}
    return ("text", *(part for part, payload in (("image_url", Payload.IMAGE),
                                                   ("input_audio", Payload.AUDIO))
                      if payload in takes))


def pipeline_body(pipeline: OmniPipeline, stock: type[M]) -> type[M]:
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
    req = validate(model or pipeline_body(pipeline, GenericRequest), body)
    params = {stage: dict(values) for stage, values in (req.params or {}).items()}
    return rq.PipelineRequest(
        prompt=req.prompt or "", negative_prompt=req.negative_prompt, params=params,
        n=req.n or 1, session=req.session or None, timeout_s=req.timeout_s,
        finals=list(req.finals) if req.finals is not None else None,
    )


def parse_control(body: Mapping[str, Any], pipeline: OmniPipeline,
                  model: type[ControlRequest] | None = None) -> tuple[str, list[str] | None]:
    """{op, stages?} -> (op, stages); unknown stages are refused before anything pauses."""
    req = validate(model or pipeline_body(pipeline, ControlRequest), body)
    return req.op, list(req.stages) if req.stages is not None else None
