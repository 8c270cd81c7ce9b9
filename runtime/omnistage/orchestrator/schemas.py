"""The HTTP API's types: request bodies as pydantic models, response bodies as TypedDicts.

Why: the body models validate requests (request_parsing.validate), name the field at fault (the
error's `param`) and are the schemas of the OpenAPI document (openapi.py), so what
/openapi.json says and what the server accepts cannot drift. The renderers are typed to return
the response TypedDicts the document shows. Engine knobs take their type and bounds from
EngineOptions (omnistage.params), the one bounds table. Prose is written only where a schema
cannot say it.

Union branches carry tags spelt `<name>` so a validation error names the field's request path
(`messages[0].content`), not pydantic's branch label; see params.error_path.
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Annotated, Any, Literal, NotRequired, Union

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    WithJsonSchema,
    create_model,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType, TypedDict  # pydantic wants this one before Python 3.12

from omnistage import media
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.load import PipelineLoad
from omnistage.params import engine_bounds, engine_type, per_request
from omnistage.protocol import PIPELINE_CONTROL_OPS as CONTROL_OPS
from omnistage.spec import STAGE_KINDS, VOICE_PATTERN

__all__ = [
    "ERROR_TYPES",
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ControlRequest",
    "ControlResponse",
    "ErrorBody",
    "GenericRequest",
    "GenericResponse",
    "ImagesRequest",
    "ImagesResponse",
    "Message",
    "ModelCard",
    "ModelList",
    "SpeechRequest",
    "SpeechStreamEvent",
    "image_size",
    "pipeline_bodies",
]

MAX_N_CHAT = 16
MAX_N_IMAGES = 10
MAX_N_GENERIC = 16
MAX_TIMEOUT_S = 86_400.0
MAX_WIRE_DEPTH = 32
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1

# --------------------------------------------------------------------------- field types


def _unicode(value: str) -> str:
    """msgpack needs valid UTF-8, so a lone surrogate (legal in JSON) is refused up front."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_value", "is not valid Unicode text (lone surrogate at position {pos})",
            {"pos": exc.start}) from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


def _wire(value: Any, at: str = "", depth: int = 0) -> None:
    """What msgpack can carry: valid text, integers within 64 bits, bounded nesting."""
    def bad(message: str) -> PydanticCustomError:
        return PydanticCustomError("invalid_value", message, {"at": at})

    if depth > MAX_WIRE_DEPTH:
        raise bad(f"is nested more than {MAX_WIRE_DEPTH} levels deep")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad("is not valid Unicode text (lone surrogate)") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise bad("does not fit in 64 bits")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _wire(item, f"{at}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _wire(key, at, depth + 1)
            _wire(item, f"{at}.{key}", depth + 1)


def _wire_value(value: Any) -> Any:
    _wire(value)
    return value


# What _wire admits, as a schema: integers within 64 bits, other numbers only when fractional
# (the HTTP layer parses 4.0 as the integer 4, as JSON Schema reads it). Only the nesting limit
# is prose: a recursive schema cannot count.
_WireSchema = TypeAliasType("WireValue", Union[  # noqa: UP007 (a forward-referencing alias)
    bool, Annotated[int, Field(ge=_INT64_MIN, le=_UINT64_MAX)],
    Annotated[float, WithJsonSchema({"type": "number", "not": {"type": "integer"}})],
    str, list["WireValue"], dict[str, "WireValue"], None])
WireValue = Annotated[Any, PlainValidator(_wire_value, json_schema_input_type=_WireSchema),
                      Field(description="Any JSON value that can travel as msgpack: valid "
                            "Unicode strings, integers within 64 bits, at most "
                            f"{MAX_WIRE_DEPTH} levels of nesting.")]


def only(*allowed: Any, why: str) -> Any:
    """A field Omnistage cannot honour: the listed values are accepted (they change nothing),
    anything else is refused as unsupported_parameter. The same tuple makes the schema's enum."""
    def check(value: Any) -> Any:
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise PydanticCustomError("unsupported_parameter", "is not supported: {why}",
                                      {"why": why})
        return value

    return Annotated[Any, AfterValidator(check), WithJsonSchema(
        {"enum": list(allowed), "description": f"Not supported: {why}. Only the listed values "
         "are accepted; anything else is 400 unsupported_parameter."})]


Ignored = Annotated[Any, Field(description="Accepted for compatibility; it has no effect here.")]
MaxTokens = engine_type("max_tokens")
Temperature = engine_type("temperature")
Seed = engine_type("seed")
Steps = engine_type("num_inference_steps")
Guidance = engine_type("guidance_scale")


class _Body(BaseModel):
    """Strict: JSON has no implicit conversions, so "5" for an integer is the client's bug.
    Optional fields accept null as "not given", as OpenAI's API does."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


# --------------------------------------------------------------------------- chat

UserRole = Literal["system", "developer", "user", "tool", "function"]
ROLES: tuple[str, ...] = (*typing.get_args(UserRole), "assistant")


def _known_role(value: Any) -> Any:
    """Unknown roles reach Message (the non-assistant branch); name every role, not its four."""
    if not isinstance(value, str) or value not in ROLES:
        raise PydanticCustomError("invalid_value", "must be one of {roles}",
                                  {"roles": ", ".join(ROLES)})
    return value


class TextPart(_Body):
    """A text part; the text parts of a message are joined with newlines."""

    type: Literal["text"]
    text: Text


_MEDIA_NOTE = (f" At most {media.MAX_MEDIA_PARTS} image_url and input_audio parts per request; "
               "the pipeline's entry stage must take this input (400 otherwise).")


def _data_url(value: str) -> str:
    """Remote URLs are refused up front: this server does not fetch (docs/http-api.md)."""
    if not value.startswith("data:"):
        raise PydanticCustomError(
            "invalid_value", "must be a data URL (data:image/png;base64,...): this server "
            "does not fetch remote images, got {url}", {"url": repr(value[:60])})
    return value


class ImageUrl(_Body):
    url: Annotated[str, AfterValidator(_data_url), Field(
        json_schema_extra={"pattern": "^data:"}, description=(
            "A data URL, `data:image/png;base64,...` (png, jpeg, webp, gif or bmp), at most "
            f"{media.MAX_IMAGE_BYTES} bytes decoded and {media.MAX_IMAGE_PIXELS} pixels. "
            "Remote URLs are refused (400): this server does not fetch."))]
    detail: Literal["auto", "low", "high", "original"] | None = Field(
        None, description="Accepted; it has no effect here.")


class ImagePart(_Body):
    """An input image: decoded (Pillow) to RGB and sent to the entry stage as tensor
    `input_image.<i>` (uint8 [H, W, 3])."""

    type: Literal["image_url"]
    image_url: ImageUrl = Field(description=_MEDIA_NOTE.strip())


class InputAudio(_Body):
    data: Annotated[str, Field(description=(
        f"Base64 audio, at most {media.MAX_AUDIO_BYTES} bytes decoded and "
        f"{media.MAX_AUDIO_SECONDS:g} s; any sample rate in {media.MIN_SAMPLE_RATE}.."
        f"{media.MAX_SAMPLE_RATE} Hz (resampled to {media.INPUT_AUDIO_SAMPLE_RATE} Hz)."),
        json_schema_extra={"contentEncoding": "base64"})]
    format: Literal[media.AUDIO_INPUT_FORMATS]  # type: ignore[valid-type]


class AudioPart(_Body):
    """Input audio: decoded (PyAV) to mono float32 at the input rate and sent to the entry
    stage as tensor `input_audio.<i>`."""

    type: Literal["input_audio"]
    input_audio: InputAudio = Field(description=_MEDIA_NOTE.strip())


_PARTS: dict[str, type[_Body]] = {"text": TextPart, "image_url": ImagePart,
                                   "input_audio": AudioPart}
#: Every content part type; a pipeline's document lists those its entry stage takes.
PART_TYPES: tuple[str, ...] = tuple(_PARTS)


def _content(parts: tuple[str, ...]) -> Any:
    """The content field's type, admitting the given part types (text always)."""
    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else None
        return f"<{kind}>" if kind in parts else None

    refused = [p for p in PART_TYPES if p not in parts]
    why = f" ({', '.join(refused)}: this pipeline's entry stage does not take that input)" \
        if refused else ""
    part = Annotated[Union[tuple(Annotated[_PARTS[p], Tag(f"<{p}>")]  # noqa: UP007
                                 for p in parts)],
                     Discriminator(tag, custom_error_type="unsupported_parameter",
                                   custom_error_message="must be a content part of type "
                                   f"{' or '.join(parts)}{why}")]

    def content_tag(value: Any) -> str | None:
        return "<text>" if isinstance(value, str) else \
            "<parts>" if isinstance(value, list) else None

    media_note = _MEDIA_NOTE if len(parts) > 1 else ""
    return Annotated[
        Annotated[Text, Tag("<text>")] | Annotated[list[part], Tag("<parts>")],
        Discriminator(content_tag, custom_error_type="invalid_type",
                      custom_error_message="must be a string or an array of content parts"),
        Field(description="A string, or content parts: text parts joined with newlines"
              + (", images and audio sent to the entry stage as tensors." if media_note
                 else ".") + media_note),
    ]


Content = _content(PART_TYPES)


class Message(_Body):
    """A system, developer, user, tool or function message: content is required."""

    role: Annotated[UserRole, BeforeValidator(_known_role)]
    content: Content
    name: Text | None = None


class AssistantMessage(_Body):
    """An earlier assistant turn: content may be null or left out."""

    role: Literal["assistant"]
    content: Content | None = None
    name: Text | None = None


def _role_tag(value: Any) -> str:
    return "<assistant>" if isinstance(value, dict) and value.get("role") == "assistant" \
        else "<message>"


ChatMessage = Annotated[
    Annotated[Message, Tag("<message>")] | Annotated[AssistantMessage, Tag("<assistant>")],
    Discriminator(_role_tag),
]


def _messages(parts: tuple[str, ...]) -> Any:
    """The messages field's item type, with content admitting the given part types."""
    content = _content(parts)
    message = create_model("Message", __base__=Message, __module__=__name__,
                           __doc__=Message.__doc__, content=(content, ...))
    assistant = create_model("AssistantMessage", __base__=AssistantMessage,
                             __module__=__name__, __doc__=AssistantMessage.__doc__,
                             content=(content | None, None))
    return Annotated[Annotated[message, Tag("<message>")]
                     | Annotated[assistant, Tag("<assistant>")], Discriminator(_role_tag)]


VoiceName = Annotated[str, Field(pattern=VOICE_PATTERN)]


class VoiceId(_Body):
    id: VoiceName


def _voice_tag(value: Any) -> str | None:
    return "<name>" if isinstance(value, str) else "<id>" if isinstance(value, dict) else None


_VOICE_NOTE = ("A voice of the pipeline's speech stage (GET /v1/models lists them as `voices`), "
               "or {\"id\": name}. Omitted: the stage's engine.voice, else its first voice.")


def _voice(voices: tuple[str, ...] | None) -> Any:
    """The voice field's type: any well-formed name, or (per pipeline) one of `voices`."""
    name: Any = VoiceName if voices is None else Literal[voices]  # type: ignore[valid-type]
    ident = VoiceId if voices is None else create_model(
        "VoiceId", __base__=VoiceId, __module__=__name__, id=(name, ...))
    return Annotated[
        Annotated[name, Tag("<name>")] | Annotated[ident, Tag("<id>")],
        Discriminator(_voice_tag, custom_error_type="invalid_type",
                      custom_error_message="must be a voice name or {\"id\": name}"),
        Field(description=_VOICE_NOTE)]


Voice = _voice(None)


class AudioOutput(_Body):
    """What chat answers with when modalities include audio."""

    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = Field(description=(
        "The encoding of message.audio.data; pcm16 is raw 16-bit little-endian mono at "
        f"{media.PCM_SAMPLE_RATE} Hz. Streamed audio is pcm16 only. (aac is not produced.)"))
    voice: Voice | None = None


class StreamOptions(_Body):
    include_usage: bool | None = Field(None, description="Send a final chunk with usage.")


_EMPTY = (None, "", [], {})


class ChatCompletionRequest(_Body):
    """OpenAI's chat completion request. Unknown fields are ignored and listed in the
    X-Omnistage-Ignored-Fields response header (percent-encoded, comma-separated)."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = Field(None, description="Must equal the served model name.")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = Field(None, description="Default: the stage's maxTokens.")
    max_completion_tokens: MaxTokens | None = Field(
        None, description="Takes precedence over max_tokens.")
    temperature: Temperature | None = Field(
        None, description="0 is greedy. Default: the stage's temperature.")
    seed: Seed | None = Field(None, description="Sample i of a request with n > 1 uses seed + i.")
    n: Annotated[int, Field(ge=1, le=MAX_N_CHAT)] | None = Field(
        None, description="Samples, each its own child request. Default 1.")
    stream: bool | None = Field(None, description="Answer as server-sent events.")
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="Session key: pins the session to a replica "
                              "while that replica lives.")
    ignore_eos: bool | None = Field(None, description="Extension: generate max_tokens tokens.")
    stop: only(*_EMPTY, why="stop sequences") = None
    tools: only(*_EMPTY, why="tools") = None
    functions: only(*_EMPTY, why="functions") = None
    logit_bias: only(*_EMPTY, why="logit_bias") = None
    audio: AudioOutput | None = Field(None, description="Required when modalities include "
                                      "audio, and only then; with stream: true its format "
                                      "must be pcm16 (400 otherwise).")
    prediction: only(*_EMPTY, why="predicted outputs") = None
    tool_choice: only(None, "none", why="tools") = None
    function_call: only(None, "none", why="functions") = None
    logprobs: only(None, False, why="logprobs") = None
    response_format: only(None, {"type": "text"},
                          why="structured output; only text is produced") = None
    modalities: only(None, ["text"], ["text", "audio"], ["audio", "text"],
                     why="output other than text, or text and audio") = Field(
        None, description="With audio, `audio` is required (and needs it: 400 otherwise).")
    top_p: Ignored = None
    top_k: Ignored = None
    presence_penalty: Ignored = None
    frequency_penalty: Ignored = None
    repetition_penalty: Ignored = None
    metadata: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    parallel_tool_calls: Ignored = None
    top_logprobs: Ignored = None
    reasoning_effort: Ignored = None
    verbosity: Ignored = None
    prompt_cache_key: Ignored = None
    safety_identifier: Ignored = None
    web_search_options: Ignored = None


# --------------------------------------------------------------------------- images


_SIDE_MIN, _SIDE_MAX, _SIDE_MULTIPLE = engine_bounds("width")
# One regex says which sizes are valid, for the validator and the document alike: every side
# EngineOptions allows, spelt out, so a pattern-valid size is never refused for its numbers.
# Only constructs that read the same in Python and ECMA-262 ([0-9] and a space, not \d or \s).
_SIDES = "|".join(str(v) for v in range(_SIDE_MAX, _SIDE_MIN - 1, -1) if v % _SIDE_MULTIPLE == 0)
SIZE_PATTERN = f"^(?:auto|[ ]*({_SIDES})[ ]*[xX][ ]*({_SIDES})[ ]*)$"
_SIZE = re.compile(SIZE_PATTERN)
_SIZE_SHAPE = re.compile(r"[ ]*[0-9]+[ ]*[xX][ ]*[0-9]+[ ]*")


def _size(value: str) -> str:
    if _SIZE.fullmatch(value):
        return value
    if _SIZE_SHAPE.fullmatch(value):
        raise PydanticCustomError(
            "invalid_value", "{size}: each side must be {lo}..{hi} and a multiple of {m}",
            {"size": value.strip()[:40], "lo": _SIDE_MIN, "hi": _SIDE_MAX, "m": _SIDE_MULTIPLE})
    raise PydanticCustomError("invalid_value", "must look like WIDTHxHEIGHT (for example "
                              "'512x512'), got {value}", {"value": repr(value[:40])})


def image_size(value: str | None) -> tuple[int, int] | None:
    """A validated size as (width, height); None for auto or not given."""
    match = _SIZE.fullmatch(value or "")
    if not match or match.group(1) is None:
        return None
    return int(match.group(1)), int(match.group(2))


Size = Annotated[str, AfterValidator(_size), Field(
    json_schema_extra={"pattern": SIZE_PATTERN},  # the validator's own regex
    description=f"WIDTHxHEIGHT, each side {_SIDE_MIN}..{_SIDE_MAX} and a multiple of "
    f"{_SIDE_MULTIPLE} (the stage's width/height bounds); auto or omitted uses the stage's "
    "defaults. The model may need a larger multiple; the worker then answers 400 param size.")]


class ImagesRequest(_Body):
    """OpenAI's image generation request (base64 PNG only). Unknown fields are ignored and
    listed in the X-Omnistage-Ignored-Fields response header."""

    model_config = ConfigDict(extra="allow")

    prompt: Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
    model: Text | None = Field(None, description="Must equal the served model name.")
    negative_prompt: Text | None = Field(None, description="Extension: runs a companion "
                                         "request for classifier-free guidance.")
    n: Annotated[int, Field(ge=1, le=MAX_N_IMAGES)] | None = Field(
        None, description="Images, one per sample. Default 1.")
    size: Size | None = None
    response_format: only(None, "b64_json",
                          why="image URLs; Omnistage does not host images, use b64_json") = None
    output_format: only(None, "png", why="formats other than png") = None
    stream: only(None, False, why="streaming image generation") = None
    user: Text | None = Field(None, description="Session key.")
    seed: Seed | None = Field(None, description="Extension. Sample i uses seed + i.")
    num_inference_steps: Steps | None = Field(None, description="Extension.")
    guidance_scale: Guidance | None = Field(None, description="Extension.")
    quality: Ignored = None
    style: Ignored = None
    background: Ignored = None
    moderation: Ignored = None
    output_compression: Ignored = None
    partial_images: Ignored = None


# --------------------------------------------------------------------------- audio


class SpeechRequest(_Body):
    """OpenAI's text-to-speech request. Unknown fields are ignored and listed in the
    X-Omnistage-Ignored-Fields response header."""

    model_config = ConfigDict(extra="allow")

    input: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_unicode)]
    model: Text | None = Field(None, description="Must equal the served model name.")
    voice: Voice | None = None
    response_format: Literal[media.AUDIO_OUTPUT_FORMATS] | None = Field(  # type: ignore[valid-type]
        None, description="Default mp3. wav and flac are 16-bit at the stage's sample rate; "
        f"pcm is raw 16-bit little-endian mono at {media.PCM_SAMPLE_RATE} Hz. (aac is not "
        "produced.)")
    speed: Annotated[float, Field(ge=0.25, le=4.0)] | None = Field(
        None, description="Tempo, pitch kept (FFmpeg's atempo filter). Default 1.0.")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="audio (default): the file's bytes. sse: server-sent events "
        "speech.audio.delta (base64 chunks of the file) then speech.audio.done.")
    instructions: Ignored = None


class SpeechUsage(TypedDict):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class SpeechAudioDelta(TypedDict):
    type: Literal["speech.audio.delta"]
    audio: Annotated[str, WithJsonSchema({"type": "string", "contentEncoding": "base64"})]


class SpeechAudioDone(TypedDict):
    type: Literal["speech.audio.done"]
    usage: SpeechUsage


SpeechStreamEvent = Annotated[SpeechAudioDelta | SpeechAudioDone, Field(
    description="stream_format sse: base64 chunks of the encoded audio in order, then done.")]


# --------------------------------------------------------------------------- generic & control


def _knobs_text() -> str:
    kinds = [f"{kind}: {', '.join(per_request(kind))}" for kind in STAGE_KINDS]
    return ("Per-stage parameters, keyed by stage name; `*` applies to every stage, a stage's "
            "own entry wins. The engine knobs a stage kind takes (bounds as in EngineOptions): "
            f"{'; '.join(kinds)}; ar also takes ignore_eos. Other keys are ignored by stages.")


class GenericRequest(_Body):
    """Omnistage's own request: unknown fields are errors here (typos must not pass)."""

    model_config = ConfigDict(extra="forbid")

    prompt: Text | None = Field(None, description="Default: empty.")
    negative_prompt: Text | None = None
    params: dict[Text, dict[Text, WireValue]] | None = Field(None, description=_knobs_text())
    n: Annotated[int, Field(ge=1, le=MAX_N_GENERIC)] | None = Field(None, description="Default 1.")
    finals: list[str] | None = Field(
        None, min_length=1, description="Stages whose outputs to return; default: the "
        "pipeline's finalOutput stages. Only the stages they need run.")
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = None
    session: Text | None = Field(None, description="Session affinity key.")


class ControlRequest(_Body):
    """A control RPC for every live replica of the chosen stages."""

    model_config = ConfigDict(extra="forbid")

    op: Literal[CONTROL_OPS]
    stages: list[str] | None = Field(None, min_length=1, description="Default: every stage.")


def _unique(value: list[Any]) -> list[Any]:
    for i, item in enumerate(value):
        if item in value[:i]:
            raise PydanticCustomError("invalid_value", "repeats stage {name}",
                                      {"name": repr(item), "at": f"[{i}]"})
    return value


_MAX_TOKENS_NOTE = (" At most {most}, the chat stage's bound (the model's context when known "
                    "and engine.maxBatchTokens, less one prompt token); the worker also "
                    "refuses prompt + max_tokens beyond them (400 param max_tokens).")


_NO_SPEECH = "audio output: this pipeline has no speech stage (no stage's kind emits audio)"


@functools.lru_cache(maxsize=64)
def pipeline_bodies(stages: tuple[str, ...], chat_max_tokens: int | None = None,
                    voices: tuple[str, ...] | None = None,
                    parts: tuple[str, ...] = PART_TYPES,
                    ) -> dict[type[BaseModel], type[BaseModel]]:
    """The stock bodies narrowed to one pipeline, as {stock model: its narrowed copy}:
    GenericRequest and ControlRequest to its stage names, ChatCompletionRequest's max_tokens
    and max_completion_tokens to its chat stage's bound (params.max_tokens_bound). The HTTP API
    validates with the copies and documents them, so a value the document allows is one the
    server accepts, and the reverse."""
    stage = Literal[stages]  # type: ignore[valid-type]
    names = Annotated[list[stage], AfterValidator(_unique),  # type: ignore[valid-type]
                      Field(min_length=1, json_schema_extra={"uniqueItems": True})]
    knobs = dict[Literal[(*stages, "*")], dict[Text, WireValue]]  # type: ignore[misc]

    def field(model: type[BaseModel], name: str) -> Any:
        return Field(None, description=model.model_fields[name].description)

    generic = create_model("GenericRequest", __base__=GenericRequest, __module__=__name__,
                           __doc__=GenericRequest.__doc__,
                           finals=(names | None, field(GenericRequest, "finals")),
                           params=(knobs | None, field(GenericRequest, "params")))
    control = create_model("ControlRequest", __base__=ControlRequest, __module__=__name__,
                           __doc__=ControlRequest.__doc__,
                           stages=(names | None, field(ControlRequest, "stages")))
    out: dict[type[BaseModel], type[BaseModel]] = {GenericRequest: generic,
                                                   ControlRequest: control}
    chat: dict[str, Any] = {}
    if chat_max_tokens is not None:
        tokens = Annotated[int, Field(ge=0, le=chat_max_tokens)]
        note = _MAX_TOKENS_NOTE.format(most=chat_max_tokens)
        chat.update({key: (tokens | None, Field(None, description=str(
            ChatCompletionRequest.model_fields[key].description) + note))
            for key in ("max_tokens", "max_completion_tokens")})
    # Audio: the speech stage's voices, or no audio at all without one.
    if voices is None:
        chat["audio"] = (only(None, why=_NO_SPEECH), None)
        chat["modalities"] = (only(None, ["text"], why=_NO_SPEECH), None)
    else:
        audio = create_model("AudioOutput", __base__=AudioOutput, __module__=__name__,
                             __doc__=AudioOutput.__doc__, voice=(_voice(voices) | None, None))
        chat["audio"] = (audio | None, field(ChatCompletionRequest, "audio"))
        out[SpeechRequest] = create_model(
            "SpeechRequest", __base__=SpeechRequest, __module__=__name__,
            __doc__=SpeechRequest.__doc__, voice=(_voice(voices) | None, None))
    # Content parts: those the chat stage's entry stages take.
    if parts != PART_TYPES:
        chat["messages"] = (list[_messages(parts)],  # type: ignore[misc]
                            Field(min_length=1))
    out[ChatCompletionRequest] = create_model(
        "ChatCompletionRequest", __base__=ChatCompletionRequest, __module__=__name__,
        __doc__=ChatCompletionRequest.__doc__, **chat)
    return out


# --------------------------------------------------------------------------- responses

Status = Literal[rq.OK, rq.ABORT, rq.REQUEST_ERROR, rq.FATAL]
#: OpenAI's error `type` for each HTTP status Omnistage answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

ErrorType = Literal[tuple(sorted(set(ERROR_TYPES.values())))]


class ErrorDetail(TypedDict):
    message: str
    type: ErrorType
    param: Annotated[str | None, Field(description="The request field at fault, if any.")]
    code: Annotated[str | None, Field(description="Omnistage's machine-readable reason.")]
    replica: NotRequired[Annotated[str, Field(description="control errors only")]]
    exception_type: NotRequired[Annotated[str, Field(description="control errors only")]]


class ErrorBody(TypedDict):
    """OpenAI's error shape."""

    error: ErrorDetail


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: Annotated[int, Field(description="Summed over all choices.")]
    total_tokens: int


FinishReason = Annotated[str, Field(description="stop, length or abort (the request was "
                                    "aborted; the content is the prefix generated so far).")]


class AudioOut(TypedDict):
    """The spoken answer (modalities with audio): the speech stage's audio, encoded."""

    id: str
    data: Annotated[str, WithJsonSchema({"type": "string", "contentEncoding": "base64"})]
    expires_at: Annotated[int, Field(description="Unix time; this server keeps no audio, so "
                                     "it is only informative.")]
    transcript: Annotated[str, Field(description="The chat stage's text.")]


class AssistantOut(TypedDict):
    role: Literal["assistant"]
    content: Annotated[str | None, Field(description="null when the answer is audio (its "
                                         "text is audio.transcript), as OpenAI's.")]
    refusal: None
    audio: NotRequired[AudioOut]


class Choice(TypedDict):
    index: int
    message: AssistantOut
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(TypedDict):
    """One choice per sample, in sample order."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[Choice]
    usage: Usage


class ChunkAudio(TypedDict, total=False):
    """Streamed audio: the first carries id (and transcript text), transcript deltas follow,
    then base64 pcm16 data chunks, the last carries only id and expires_at."""

    id: str
    transcript: str
    data: Annotated[str, WithJsonSchema({"type": "string", "contentEncoding": "base64"})]
    expires_at: int


class ChunkDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None
    audio: ChunkAudio


class ChunkChoice(TypedDict):
    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: FinishReason | None


class ChatCompletionChunk(TypedDict):
    """One SSE `data:` event: a role delta per choice, content deltas, a final delta per choice
    with finish_reason, an optional usage chunk (empty choices), then `data: [DONE]`. An error
    after the stream started arrives as `data: {"error": {...}}` and ends the stream."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChunkChoice]
    usage: NotRequired[Usage | None]


class ImageData(TypedDict):
    b64_json: Annotated[str, WithJsonSchema({"type": "string", "contentEncoding": "base64",
                                             "contentMediaType": "image/png"})]


class ImagesResponse(TypedDict):
    """One PNG per sample and image stage, in sample order."""

    created: int
    data: list[ImageData]
    output_format: Literal["png"]


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    voices: NotRequired[Annotated[list[str], Field(
        description="Extension: the voices of the speech stage, when the pipeline has one; "
        "the first is the default.")]]


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TensorJson(TypedDict):
    dtype: str
    shape: list[int]
    data: Annotated[str, WithJsonSchema({
        "type": "string", "contentEncoding": "base64",
        "description": "Raw little-endian bytes, C order (bfloat16 as 16-bit words)."})]


class StageOutputJson(TypedDict):
    fields: dict[str, Any]
    tensors: dict[str, TensorJson]


class ChildErrorJson(TypedDict):
    code: str
    message: str
    stage: str | None


class ChildJson(TypedDict):
    index: int
    status: Status
    outputs: dict[str, StageOutputJson]
    error: NotRequired[ChildErrorJson]


class GenericResponse(TypedDict):
    """Every child's final-stage outputs; per-child failures are reported inline."""

    id: str
    status: Status
    children: list[ChildJson]


class ControlResponse(TypedDict):
    results: Annotated[dict[str, dict[str, Any]], Field(
        description="Replica name -> the state its worker reported.")]


def _struct_schema(struct: type) -> dict[str, Any]:
    """A msgspec Struct's JSON Schema with its nested Structs inlined, so the OpenAPI document
    describes the struct itself (its one definition) without components of its own."""
    (top,), defs = msgspec.json.schema_components([struct], ref_template="{name}")

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {"$ref"}:
                return inline(defs[node["$ref"]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return dict(inline(top))


LoadResponse = Annotated[dict[str, Any], WithJsonSchema(_struct_schema(PipelineLoad))]
"""GET /v1/load's body: orchestrator.load.PipelineLoad, encoded by msgspec."""
