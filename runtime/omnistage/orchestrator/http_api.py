"""The orchestrator's HTTP front door: OpenAI-compatible routes plus operational ones.

Handlers stay thin: parse and validate a body (pure functions, so every rule is unit-testable),
submit one PipelineRequest, render its Outcome (pure functions again). The HTTP layer never
routes; the engine does. Every error leaves in OpenAI's JSON error shape, and a client that goes
away aborts its request through the pipeline so no stage keeps working for nobody.
See docs/http-api.md for the user-facing contract.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from omnistage.client import ControlError
from omnistage.metrics import CONTENT_TYPE, Family, render
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.images import ImageEncodeError, png_base64
from omnistage.orchestrator.openapi import (
    CHAT_ROLES,
    CONTROL_OPS,
    IMAGE_SIDE_MAX,
    IMAGE_SIDE_MIN,
    IMAGE_SIDE_MULTIPLE,
    MAX_GUIDANCE,
    MAX_MAX_TOKENS,
    MAX_N_CHAT,
    MAX_N_GENERIC,
    MAX_N_IMAGES,
    MAX_SEED,
    MAX_STEPS,
    MAX_TEMPERATURE,
    MAX_TIMEOUT_S,
    openapi_document,
)
from omnistage.spec import OmniPipeline

__all__ = [
    "API_KEY",
    "ApiError",
    "ChatCall",
    "ChatStream",
    "HttpApi",
    "ImagesCall",
    "build_app",
    "parse_chat",
    "parse_control",
    "parse_generic",
    "parse_images",
    "render_chat_completion",
    "render_chat_prompt",
    "render_generic",
    "render_images",
    "serve_http",
]

log = logging.getLogger("omnistage.http")

MAX_BODY_BYTES = 16 * 1024 * 1024
DISCONNECT_POLL_S = 0.25
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_MAX_JSON_DEPTH = 32
_IGNORED_HEADER = "X-Omnistage-Ignored-Fields"
_INLINE_RENDER_BYTES = 256 * 1024
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # keep reverse proxies from buffering the stream
}


# --------------------------------------------------------------------------- engine interface


class RequestHandleLike(Protocol):
    """What the HTTP layer needs from engine.RequestHandle."""

    id: str

    def events(self) -> AsyncIterator[rq.Delta | rq.Outcome]: ...

    def abort(self, child: int | None = None) -> None: ...

    async def outcome(self) -> rq.Outcome: ...


class OrchestratorLike(Protocol):
    """What the HTTP layer needs from engine.Orchestrator (a Protocol so tests can fake it)."""

    pipeline: OmniPipeline
    accepting: bool

    def submit(self, req: rq.PipelineRequest) -> RequestHandleLike: ...

    def readiness(self) -> tuple[bool, str]: ...

    def metrics_text(self) -> str: ...

    async def control(self, op: str, stages: list[str] | None = None) -> dict[str, dict]: ...


# --------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.extra = dict(extra or {})

    @property
    def type(self) -> str:
        if self.status in _ERROR_TYPES:
            return _ERROR_TYPES[self.status]
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param,
               "code": self.code, **self.extra}
        return {"error": err}

    def headers(self) -> dict[str, str]:
        """Retry-After is mandatory on 429 (default 1 s) and passed on for 503 when known."""
        after = self.retry_after
        if after is None and self.status == 429:
            after = 1.0
        if after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(after)))}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=_dumps(self.body()),
                            content_type="application/json", headers=self.headers())


def _bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


_PARAM_IN_MESSAGE = re.compile(r"\bparams\.([A-Za-z_]\w*)")
ParamMap = Callable[[str, str | None], str | None]


def _same_name(key: str, _stage: str | None) -> str | None:
    return key


def error_from_request_error(err: rq.RequestError, param_map: ParamMap = _same_name) -> ApiError:
    """Engine/worker error to HTTP. A worker names a bad field as `params.X`; param_map turns
    that into the field the client actually sent (for example height -> size)."""
    param = None
    match = _PARAM_IN_MESSAGE.search(err.message or "")
    if match and err.http_status == 400:
        param = param_map(match.group(1), err.stage)
    message = err.message or err.code
    if err.stage and err.http_status >= 500:
        message = f"{message} (stage {err.stage})"
    return ApiError(err.http_status, message, param=param, code=err.code,
                    retry_after=err.retry_after)


def outcome_error(outcome: rq.Outcome, param_map: ParamMap = _same_name) -> ApiError | None:
    """The error an OpenAI route answers with, or None when the outcome can be rendered.

    OpenAI responses have no room for partial failure, so a failed child fails the response.
    An abort keeps whatever the stages returned (an AR prefix); with nothing left it is a 503.
    """
    if outcome.error is not None:
        return error_from_request_error(outcome.error, param_map)
    for child in sorted(outcome.children, key=lambda c: c.index):
        if child.status in (rq.REQUEST_ERROR, rq.FATAL):
            if child.error is not None:
                return error_from_request_error(child.error, param_map)
            return ApiError(502, f"sample {child.index} failed", code="stage_failed")
    if outcome.status in (rq.REQUEST_ERROR, rq.FATAL):
        return ApiError(500, "request failed without an error report", code="internal")
    if outcome.status == rq.ABORT and not any(c.outputs for c in outcome.children):
        return ApiError(503, "the request was aborted before producing output", code="aborted")
    return None


# --------------------------------------------------------------------------- JSON helpers


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Strict JSON object: no NaN/Infinity, no overflowing floats, no absurd nesting."""
    if not raw.strip():
        raise _bad(None, "request body is empty; expected a JSON object", "invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_parse_float)
    except (ValueError, RecursionError) as exc:
        raise _bad(None, f"invalid JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(None, f"request body must be a JSON object, got {_json_type(body)}",
                   "invalid_type")
    return body


def _jsonable(value: Any) -> Any:
    """Stage outputs (msgpack-decoded) as JSON: bytes become base64, NaN/inf become null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float):
        return value
    return str(value)


def _dumps(obj: Any) -> bytes:
    # ensure_ascii keeps any odd code point escaped, so encoding can never fail here.
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii")


def _json_response(obj: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=_dumps(obj), content_type="application/json",
                        headers=dict(headers or {}))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True) if _json_type(value) != "object" else "{...}"
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- field validators


def _text(value: Any, param: str) -> str:
    """A string that can travel: msgpack needs valid UTF-8, so lone surrogates are refused."""
    if not isinstance(value, str):
        raise _bad(param, f"{param} must be a string, got {_json_type(value)}", "invalid_type")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"{param} is not valid Unicode text (lone surrogate at position "
                   f"{exc.start})") from None
    return value


def _opt_text(body: Mapping[str, Any], key: str, param: str | None = None) -> str | None:
    value = body.get(key)
    return None if value is None else _text(value, param or key)


def _opt_int(body: Mapping[str, Any], key: str, lo: int, hi: int,
             param: str | None = None) -> int | None:
    value = body.get(key)
    name = param or key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer, got {_json_type(value)} {_short(value)}",
                   "invalid_type")
    if not lo <= value <= hi:
        raise _bad(name, f"{name} must be between {lo} and {hi}, got {_short(value)}")
    return value


def _opt_number(body: Mapping[str, Any], key: str, lo: float, hi: float,
                param: str | None = None) -> float | None:
    value = body.get(key)
    name = param or key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"{name} must be a number, got {_json_type(value)} {_short(value)}",
                   "invalid_type")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise _bad(name, f"{name} must be between {lo:g} and {hi:g}, got {_short(value)}")
    return float(value)


def _opt_bool(body: Mapping[str, Any], key: str, param: str | None = None) -> bool | None:
    value = body.get(key)
    name = param or key
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean, got {_json_type(value)}", "invalid_type")
    return value


def _check_model(body: Mapping[str, Any], served: str) -> str:
    """OpenAI semantics: an unknown model is a 404 model_not_found; omitting it is fine."""
    model = body.get("model")
    if model is None:
        return served
    model = _text(model, "model")
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{served}`.", param="model", code="model_not_found")
    return model


def _wire_value(value: Any, param: str, depth: int = 0) -> None:
    """Refuse what msgpack cannot carry before it reaches the engine's send loop."""
    if depth > _MAX_JSON_DEPTH:
        raise _bad(param, f"{param} is nested more than {_MAX_JSON_DEPTH} levels deep")
    if value is None or isinstance(value, bool | float):
        return
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise _bad(param, f"{param} does not fit in 64 bits: {_short(value)}")
    elif isinstance(value, str):
        _text(value, param)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _wire_value(item, f"{param}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key, param)
            _wire_value(item, f"{param}.{key}", depth + 1)
    else:  # pragma: no cover - json.loads produces nothing else
        raise _bad(param, f"{param} has an unsupported type {type(value).__name__}")


# --------------------------------------------------------------------------- chat

# Fields OpenAI defines that have no effect here; accepted and ignored.
_CHAT_IGNORED = frozenset({
    "top_p", "presence_penalty", "frequency_penalty", "metadata", "store", "service_tier",
    "parallel_tool_calls", "top_logprobs", "reasoning_effort", "verbosity", "prompt_cache_key",
    "safety_identifier", "web_search_options", "top_k", "repetition_penalty",
})
_CHAT_KNOWN = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "n",
    "stream", "stream_options", "user", "ignore_eos",
}) | _CHAT_IGNORED


def _unsupported_chat_fields(body: Mapping[str, Any]) -> list[str]:
    """OpenAI fields that would change the answer in ways the pipeline cannot honour."""
    bad = []
    for key in ("stop", "tools", "functions", "logit_bias", "audio", "prediction"):
        if body.get(key) not in (None, [], {}, ""):
            bad.append(key)
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none"):
            bad.append(key)
    if body.get("logprobs") not in (None, False):
        bad.append("logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        bad.append("response_format")
    if body.get("modalities") not in (None, ["text"]):
        bad.append("modalities")
    return bad


_CHAT_CONSUMED = _CHAT_KNOWN | {
    "stop", "tools", "functions", "logit_bias", "audio", "prediction", "tool_choice",
    "function_call", "logprobs", "response_format", "modalities",
}


def render_chat_prompt(messages: Iterable[tuple[str, str]]) -> str:
    """The chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`.

    Deliberately simple and model-agnostic (the orchestrator has no tokenizer); see
    docs/http-api.md. Pipelines that need a model's own template can send the rendered prompt
    through the generic route.
    """
    parts = [f"<|{role}|>\n{text}\n" for role, text in messages]
    return "".join(parts) + "<|assistant|>\n"


def _message_text(msg: Mapping[str, Any], i: int) -> str:
    param = f"messages[{i}].content"
    content = msg.get("content")
    if content is None:
        if msg.get("role") == "assistant":
            return ""
        raise _bad(param, f"{param} is required", "missing_required_parameter")
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list):
        raise _bad(param, f"{param} must be a string or a list of text parts, got "
                   f"{_json_type(content)}", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        pparam = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(pparam, f"{pparam} must be an object, got {_json_type(part)}",
                       "invalid_type")
        kind = part.get("type")
        if kind != "text":
            raise _bad(f"{pparam}.type", f"unsupported content part type {_short(kind)} in "
                       f"{pparam}; only 'text' parts are supported", "unsupported_parameter")
        texts.append(_text(part.get("text"), f"{pparam}.text"))
    return "\n".join(texts)


def _parse_messages(value: Any) -> list[tuple[str, str]]:
    if value is None:
        raise _bad("messages", "messages is required", "missing_required_parameter")
    if not isinstance(value, list):
        raise _bad("messages", f"messages must be an array, got {_json_type(value)}",
                   "invalid_type")
    if not value:
        raise _bad("messages", "messages must contain at least one message")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object, got "
                       f"{_json_type(msg)}", "invalid_type")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                       f"{', '.join(CHAT_ROLES)}, got {_short(role)}")
        out.append((role, _message_text(msg, i)))
    return out


@dataclass
class ChatCall:
    """A validated chat request: what to submit and what the response needs to echo."""

    request: rq.PipelineRequest
    stage: str
    model: str
    include_usage: bool = False
    ignored: list[str] = field(default_factory=list)


def parse_chat(body: Mapping[str, Any], pipeline: OmniPipeline) -> ChatCall:
    """Validate an OpenAI chat body into a PipelineRequest for the chat stage only."""
    stage = pipeline.spec.chat_stage()
    if stage is None:
        raise ApiError(404, "this pipeline has no ar stage to answer chat completions",
                       code="api_not_enabled")
    model = _check_model(body, pipeline.served_model_name())
    unsupported = _unsupported_chat_fields(body)
    if unsupported:
        raise _bad(unsupported[0], f"unsupported field(s) {', '.join(unsupported)}: "
                   "Omnistage cannot honour them; remove them from the request",
                   "unsupported_parameter")
    messages = _parse_messages(body.get("messages"))
    params: dict[str, Any] = {}
    max_tokens = _opt_int(body, "max_tokens", 0, MAX_MAX_TOKENS)
    max_completion = _opt_int(body, "max_completion_tokens", 0, MAX_MAX_TOKENS)
    if max_completion is not None:
        max_tokens = max_completion
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    _put(params, "temperature", _opt_number(body, "temperature", 0.0, MAX_TEMPERATURE))
    _put(params, "seed", _opt_int(body, "seed", 0, MAX_SEED))
    if _opt_bool(body, "ignore_eos"):
        params["ignore_eos"] = True
    n = _opt_int(body, "n", 1, MAX_N_CHAT) or 1
    stream = bool(_opt_bool(body, "stream"))
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "stream_options must be an object", "invalid_type")
        include_usage = bool(_opt_bool(options, "include_usage", "stream_options.include_usage"))
    session = _opt_text(body, "user")
    ignored = sorted(k for k in body if k not in _CHAT_CONSUMED)
    request = rq.PipelineRequest(
        # Chat returns text only: don't compute or ship hidden states a stage may be set to emit.
        prompt=render_chat_prompt(messages),
        params={stage: {**params, "return_hidden_states": False}}, n=n, stream=stream,
        session=session or None, finals=[stage],
    )
    return ChatCall(request, stage, model, include_usage, ignored)


def _chat_param(key: str, _stage: str | None) -> str | None:
    return {"prompt": "messages", "token_ids": "messages"}.get(key, key)


def _usage(outcome: rq.Outcome, stage: str) -> dict[str, int]:
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


def render_chat_completion(outcome: rq.Outcome, call: ChatCall, rid: str,
                           created: int) -> dict[str, Any]:
    """A chat.completion object: one choice per child, in child order."""
    choices = []
    for child in sorted(outcome.children, key=lambda c: c.index):
        text, finish = _choice_result(child, call.stage)
        choices.append({"index": child.index,
                        "message": {"role": "assistant", "content": text, "refusal": None},
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

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        chunk = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.call.model, "system_fingerprint": None, "choices": choices}
        if self.call.include_usage:
            chunk["usage"] = usage
        return chunk

    @staticmethod
    def _choice(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self) -> list[dict[str, Any]]:
        n = self.call.request.n
        for i in range(n):
            self.sent[i] = ""
        return [self._chunk([self._choice(i, {"role": "assistant", "content": ""})])
                for i in range(n)]

    def delta(self, event: rq.Delta) -> list[dict[str, Any]]:
        if event.stage != self.call.stage or not event.text:
            return []
        self.sent[event.child] = self.sent.get(event.child, "") + event.text
        return [self._chunk([self._choice(event.child, {"content": event.text})])]

    def finish(self, outcome: rq.Outcome) -> list[dict[str, Any]]:
        """Closing chunks; raises ApiError when the outcome is an error (sent as an event)."""
        err = outcome_error(outcome, _chat_param)
        if err is not None:
            raise err
        chunks = []
        for child in sorted(outcome.children, key=lambda c: c.index):
            text, finish = _choice_result(child, self.call.stage)
            sent = self.sent.get(child.index, "")
            if len(text) > len(sent) and text.startswith(sent):
                # Whatever the stream did not carry (held-back bytes, a lost delta).
                chunks.append(self._chunk([self._choice(child.index,
                                                        {"content": text[len(sent):]})]))
            chunks.append(self._chunk([self._choice(child.index, {}, finish)]))
        if self.call.include_usage:
            chunks.append(self._chunk([], _usage(outcome, self.call.stage)))
        return chunks


def sse_event(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON object (or the literal [DONE])."""
    payload = data if isinstance(data, str) else _dumps(data).decode("ascii")
    return f"data: {payload}\n\n".encode()


# --------------------------------------------------------------------------- images

_IMAGES_IGNORED = frozenset({"quality", "style", "background", "moderation",
                             "output_compression", "partial_images"})
_IMAGES_CONSUMED = _IMAGES_IGNORED | {
    "prompt", "model", "negative_prompt", "n", "size", "response_format", "output_format",
    "user", "seed", "num_inference_steps", "guidance_scale", "stream",
}
_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


@dataclass
class ImagesCall:
    request: rq.PipelineRequest
    stages: list[str]
    size: tuple[int, int] | None = None
    ignored: list[str] = field(default_factory=list)


def image_stages(pipeline: OmniPipeline) -> list[str]:
    """The diffusion stages whose images answer /v1/images/generations: the diffusion final
    stages, else the last diffusion stage in topological order."""
    spec = pipeline.spec
    finals = [s for s in spec.final_stages() if spec.stage(s).kind == "diffusion"]
    if finals:
        return finals
    diffusion = [s for s in spec.topo_order() if spec.stage(s).kind == "diffusion"]
    return diffusion[-1:]


def _put(params: dict[str, Any], key: str, value: Any) -> None:
    """Set a stage parameter only when the client gave it: absent means the stage default."""
    if value is not None:
        params[key] = value


def parse_size(value: Any) -> tuple[int, int] | None:
    """'WxH' -> (width, height); 'auto' or null -> None (the stage's defaults)."""
    if value is None or value == "auto":
        return None
    if not isinstance(value, str):
        raise _bad("size", f"size must be a string like '512x512', got {_json_type(value)}",
                   "invalid_type")
    match = _SIZE.match(value)
    if not match:
        raise _bad("size", f"size must look like WIDTHxHEIGHT (for example '512x512'), got "
                   f"{_short(value)}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if not IMAGE_SIDE_MIN <= side <= IMAGE_SIDE_MAX or side % IMAGE_SIDE_MULTIPLE:
            raise _bad("size", f"size {width}x{height}: each side must be between "
                       f"{IMAGE_SIDE_MIN} and {IMAGE_SIDE_MAX} and a multiple of "
                       f"{IMAGE_SIDE_MULTIPLE}")
    return width, height


def parse_images(body: Mapping[str, Any], pipeline: OmniPipeline) -> ImagesCall:
    """Validate an OpenAI images body into a PipelineRequest for the diffusion final stages."""
    stages = image_stages(pipeline)
    if not stages:
        raise ApiError(404, "this pipeline has no diffusion stage to generate images",
                       code="api_not_enabled")
    _check_model(body, pipeline.served_model_name())
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "prompt is required", "missing_required_parameter")
    prompt = _text(prompt, "prompt")
    if not prompt:
        raise _bad("prompt", "prompt must not be empty")
    fmt = body.get("response_format")
    if fmt not in (None, "b64_json"):
        raise _bad("response_format", f"response_format {_short(fmt)} is not supported; only "
                   "b64_json is (Omnistage does not host image URLs)", "unsupported_parameter")
    out_fmt = body.get("output_format")
    if out_fmt not in (None, "png"):
        raise _bad("output_format", f"output_format {_short(out_fmt)} is not supported; only "
                   "png is", "unsupported_parameter")
    if body.get("stream"):
        raise _bad("stream", "streaming image generation is not supported",
                   "unsupported_parameter")
    negative = _opt_text(body, "negative_prompt")
    n = _opt_int(body, "n", 1, MAX_N_IMAGES) or 1
    size = parse_size(body.get("size"))
    params: dict[str, Any] = {}
    if size is not None:
        params["width"], params["height"] = size
    _put(params, "num_inference_steps", _opt_int(body, "num_inference_steps", 1, MAX_STEPS))
    _put(params, "guidance_scale", _opt_number(body, "guidance_scale", 0.0, MAX_GUIDANCE))
    _put(params, "seed", _opt_int(body, "seed", 0, MAX_SEED))
    session = _opt_text(body, "user")
    ignored = sorted(k for k in body if k not in _IMAGES_CONSUMED)
    request = rq.PipelineRequest(
        prompt=prompt, negative_prompt=negative, params={s: dict(params) for s in stages},
        n=n, session=session or None, finals=list(stages),
    )
    return ImagesCall(request, list(stages), size, ignored)


def _images_param(key: str, _stage: str | None) -> str | None:
    return {"height": "size", "width": "size", "token_ids": "prompt"}.get(key, key)


def render_images(outcome: rq.Outcome, call: ImagesCall, created: int) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- generic & control

_GENERIC_KEYS = ("prompt", "negative_prompt", "params", "n", "finals", "timeout_s", "session")


def _unknown_keys(body: Mapping[str, Any], allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    extra = [k for k in body if k not in allowed]
    if extra:
        raise _bad(extra[0], f"unknown field(s) {', '.join(map(repr, extra))}; allowed: "
                   f"{', '.join(allowed)}", "unsupported_parameter")


def _stage_list(value: Any, param: str, known: list[str]) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _bad(param, f"{param} must be a non-empty array of stage names",
                   "invalid_type" if not isinstance(value, list) else "invalid_value")
    out: list[str] = []
    for i, name in enumerate(value):
        if name not in known:
            raise _bad(f"{param}[{i}]", f"unknown stage {_short(name)} (stages: "
                       f"{', '.join(known)})")
        if name in out:
            raise _bad(f"{param}[{i}]", f"duplicate stage {name!r}")
        out.append(name)
    return out


def parse_generic(body: Mapping[str, Any], pipeline: OmniPipeline) -> rq.PipelineRequest:
    """Validate the generic route's body; unknown fields are errors (typos must not pass)."""
    _unknown_keys(body, _GENERIC_KEYS)
    known = pipeline.spec.stage_names()
    prompt = _opt_text(body, "prompt") or ""
    negative = _opt_text(body, "negative_prompt")
    params_in = body.get("params")
    params: dict[str, dict[str, Any]] = {}
    if params_in is not None:
        if not isinstance(params_in, dict):
            raise _bad("params", "params must be an object keyed by stage name",
                       "invalid_type")
        for stage, values in params_in.items():
            if stage != "*" and stage not in known:
                raise _bad(f"params.{stage}", f"unknown stage {_short(stage)} in params "
                           f"(stages: {', '.join(known)}, or * for all)")
            if not isinstance(values, dict):
                raise _bad(f"params.{stage}", f"params.{stage} must be an object, got "
                           f"{_json_type(values)}", "invalid_type")
            _wire_value(values, f"params.{stage}")
            params[stage] = dict(values)
    n = _opt_int(body, "n", 1, MAX_N_GENERIC) or 1
    finals = _stage_list(body.get("finals"), "finals", known)
    timeout = _opt_number(body, "timeout_s", 0.0, MAX_TIMEOUT_S)
    if timeout is not None and timeout <= 0:
        raise _bad("timeout_s", "timeout_s must be greater than 0")
    session = _opt_text(body, "session")
    return rq.PipelineRequest(prompt=prompt, negative_prompt=negative, params=params, n=n,
                              session=session or None, timeout_s=timeout, finals=finals)


def _generic_param(key: str, stage: str | None) -> str | None:
    if key == "prompt":
        return "prompt"
    return f"params.{stage}.{key}" if stage else f"params.{key}"


def _tensor_json(tensor: Any) -> dict[str, Any]:
    arr = tensor.numpy() if hasattr(tensor, "numpy") else tensor
    dtype = getattr(tensor, "dtype", None)
    return {"dtype": dtype if isinstance(dtype, str) else str(arr.dtype),
            "shape": [int(s) for s in arr.shape],
            "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def _tensor_bytes(outcome: rq.Outcome) -> int:
    return sum(getattr(t, "nbytes", 0) for c in outcome.children for o in c.outputs.values()
               for t in o.tensors.values())


def _error_json(err: rq.RequestError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, "stage": err.stage}


def render_generic(outcome: rq.Outcome, rid: str) -> dict[str, Any]:
    """Every child's final outputs with tensors as base64; failures stay per child."""
    children = []
    for child in sorted(outcome.children, key=lambda c: c.index):
        outputs = {
            stage: {"fields": _jsonable(out.fields),
                    "tensors": {name: _tensor_json(t) for name, t in out.tensors.items()}}
            for stage, out in child.outputs.items()
        }
        entry: dict[str, Any] = {"index": child.index, "status": child.status,
                                 "outputs": outputs}
        if child.error is not None:
            entry["error"] = _error_json(child.error)
        children.append(entry)
    return {"id": rid, "status": outcome.status, "children": children}


def parse_control(body: Mapping[str, Any], pipeline: OmniPipeline) -> tuple[str, list[str] | None]:
    """{op, stages?} -> (op, stages); unknown stages are refused before anything pauses."""
    _unknown_keys(body, ("op", "stages"))
    op = body.get("op")
    if op is None:
        raise _bad("op", "op is required", "missing_required_parameter")
    if op not in CONTROL_OPS:
        raise _bad("op", f"op must be one of {', '.join(CONTROL_OPS)}, got {_short(op)}")
    return op, _stage_list(body.get("stages"), "stages", pipeline.spec.stage_names())


# --------------------------------------------------------------------------- metrics


class HttpMetrics:
    """HTTP-level counters; route labels are route templates, so cardinality stays bounded."""

    WINDOW = 1024
    QUANTILES = (0.5, 0.9, 0.99)

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.latency: dict[str, tuple[list[float], collections.deque[float]]] = {}
        self.inflight = 0
        self.disconnects = 0
        self.stream_errors = 0

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests[(route, method, status)] += 1
        totals, window = self.latency.setdefault(
            route, ([0.0, 0.0], collections.deque(maxlen=self.WINDOW)))
        totals[0] += seconds
        totals[1] += 1
        window.append(seconds)

    def families(self) -> list[Family]:
        reqs = Family("omnistage_http_requests_total", "counter",
                      "HTTP requests, by route template, method and status")
        for (route, method, status), count in sorted(self.requests.items()):
            reqs.add(count, route=route, method=method, status=str(status))
        lat = Family("omnistage_http_request_duration_seconds", "summary",
                     f"HTTP request latency (quantiles over the last {self.WINDOW} requests "
                     "per route; streams count until their last byte)")
        for route, (totals, window) in sorted(self.latency.items()):
            ordered = sorted(window)
            for q in self.QUANTILES:
                value = ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0
                lat.add(value, route=route, quantile=f"{q:g}", _suffix="")
            lat.add(totals[0], route=route, _suffix="_sum")
            lat.add(totals[1], route=route, _suffix="_count")
        return [
            reqs,
            lat,
            Family("omnistage_http_inflight_requests", "gauge", "HTTP requests being served")
            .add(self.inflight),
            Family("omnistage_http_client_disconnects_total", "counter",
                   "Requests aborted because the client went away").add(self.disconnects),
            Family("omnistage_http_stream_errors_total", "counter",
                   "Streams that ended with an error event after they started")
            .add(self.stream_errors),
        ]

    def text(self) -> str:
        return render(self.families())


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
            self.api.metrics.disconnects += 1
            log.info("client went away; aborting request %s", self.handle.id)
        try:
            self.handle.abort()
        except Exception:  # never let cleanup mask the real exit
            log.exception("abort of request %s failed", self.handle.id)

    async def outcome(self) -> rq.Outcome:
        result = await self.handle.outcome()
        self.finished = True
        return result


_SURFACE_OF_PATH = (
    (re.compile(r"^/v1/chat/completions/?$"), "chat"),
    (re.compile(r"^/v1/images/generations/?$"), "images"),
    (re.compile(r"^/v1/pipelines/[^/]+/(requests|control)/?$"), "generic"),
)


class HttpApi:
    """Handlers bound to one orchestrator; build_app wires them to routes."""

    def __init__(self, orch: OrchestratorLike, *,
                 disconnect_poll_s: float | None = DISCONNECT_POLL_S) -> None:
        self.orch = orch
        self.pipeline = orch.pipeline
        self.apis = list(self.pipeline.spec.orchestrator.api)
        self.model = self.pipeline.served_model_name()
        self.name = self.pipeline.metadata.name
        self.metrics = HttpMetrics()
        self.disconnect_poll_s = disconnect_poll_s
        self.started = int(time.time())
        self.openapi = _dumps(openapi_document(self.apis, pipeline_name=self.name,
                                               model_name=self.model))

    # -- plumbing ---------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """Errors to OpenAI's shape, and per-route counters for /metrics."""
        started = time.perf_counter()
        status = 500
        self.metrics.inflight += 1
        try:
            response = await handler(request)
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            return exc.response()
        except web.HTTPException as exc:
            err = self._http_exception(request, exc)
            status = err.status
            return err.response()
        except asyncio.CancelledError:
            status = 499  # nginx's "client closed request"; only ever seen in metrics
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return ApiError(500, "internal server error", code="internal").response()
        finally:
            self.metrics.inflight -= 1
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            self.metrics.observe(route, request.method, status, time.perf_counter() - started)

    def _http_exception(self, request: web.Request, exc: web.HTTPException) -> ApiError:
        if exc.status == 404:
            for pattern, surface in _SURFACE_OF_PATH:
                if pattern.match(request.path) and surface not in self.apis:
                    return ApiError(404, f"the {surface} API is not enabled for pipeline "
                                    f"{self.name} (spec.orchestrator.api: "
                                    f"{', '.join(self.apis)})", code="api_not_enabled")
            return ApiError(404, f"no route {request.method} {request.path}", code="not_found")
        if exc.status == 405:
            return ApiError(405, f"method {request.method} is not allowed on {request.path}",
                            code="method_not_allowed")
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
            raise _bad(None, f"request cannot be encoded: {exc}") from None

    @staticmethod
    def _ignored_headers(ignored: list[str]) -> dict[str, str]:
        return {_IGNORED_HEADER: ",".join(ignored)} if ignored else {}

    # -- OpenAI routes ----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        call = parse_chat(await self._body(request), self.pipeline)
        handle = self._submit(call.request)
        rid = f"chatcmpl-{handle.id}"
        created = int(time.time())
        headers = {"X-Request-Id": handle.id, **self._ignored_headers(call.ignored)}
        if call.request.stream:
            return await self._stream_chat(request, handle, call, rid, created, headers)
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, _chat_param)
        if err is not None:
            raise err
        return _json_response(render_chat_completion(outcome, call, rid, created), headers)

    async def _stream_chat(self, request: web.Request, handle: RequestHandleLike,
                           call: ChatCall, rid: str, created: int,
                           headers: dict[str, str]) -> web.StreamResponse:
        """SSE. The response starts only once the first event is in, so a request that fails
        at once (overload, no replica) still gets a real HTTP status."""
        renderer = ChatStream(call, rid, created)
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        async with _Flight(self, request, handle) as flight:
            events = handle.events().__aiter__()
            event = await anext(events)
            if isinstance(event, rq.Outcome):
                flight.finished = True
                err = outcome_error(event, _chat_param)
                if err is not None:
                    raise err
            try:
                await response.prepare(request)
                for chunk in renderer.start():
                    await response.write(sse_event(chunk))
                while True:
                    if isinstance(event, rq.Outcome):
                        flight.finished = True
                        await self._finish_stream(response, renderer, event)
                        break
                    for chunk in renderer.delta(event):
                        await response.write(sse_event(chunk))
                    event = await anext(events)
                await response.write_eof()
            except ConnectionError:
                flight.client_gone()
            except Exception:
                # The status line is gone already: report in-band, abort, end the stream.
                log.exception("chat stream %s failed", handle.id)
                flight.client_gone(disconnected=False)
                err = ApiError(500, "internal server error", code="internal")
                with contextlib.suppress(ConnectionError):
                    self.metrics.stream_errors += 1
                    await response.write(sse_event(err.body()))
                    await response.write_eof()
        return response

    async def _finish_stream(self, response: web.StreamResponse, renderer: ChatStream,
                             outcome: rq.Outcome) -> None:
        try:
            chunks = renderer.finish(outcome)
        except ApiError as err:
            # Too late for an HTTP status: OpenAI clients raise on an error event.
            self.metrics.stream_errors += 1
            await response.write(sse_event(err.body()))
            return
        for chunk in chunks:
            await response.write(sse_event(chunk))
        await response.write(sse_event("[DONE]"))

    async def images_generations(self, request: web.Request) -> web.Response:
        call = parse_images(await self._body(request), self.pipeline)
        handle = self._submit(call.request)
        created = int(time.time())
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, _images_param)
        if err is not None:
            raise err
        payload = await asyncio.to_thread(render_images, outcome, call, created)
        headers = {"X-Request-Id": handle.id, **self._ignored_headers(call.ignored)}
        return _json_response(payload, headers)

    async def list_models(self, _request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model:
            raise ApiError(404, f"The model `{request.match_info['model']}` does not exist",
                           param="model", code="model_not_found")
        return _json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.started,
                "owned_by": "omnistage"}

    # -- pipeline routes --------------------------------------------------------------------

    def _check_pipeline(self, request: web.Request) -> None:
        name = request.match_info["name"]
        if name != self.name:
            raise ApiError(404, f"unknown pipeline {name!r}; this orchestrator serves "
                           f"{self.name!r}", param="name", code="pipeline_not_found")

    async def pipeline_request(self, request: web.Request) -> web.Response:
        self._check_pipeline(request)
        req = parse_generic(await self._body(request), self.pipeline)
        handle = self._submit(req)
        async with _Flight(self, request, handle) as flight:
            outcome = await flight.outcome()
        if outcome.error is not None:
            raise error_from_request_error(outcome.error, _generic_param)
        if _tensor_bytes(outcome) > _INLINE_RENDER_BYTES:
            payload = await asyncio.to_thread(render_generic, outcome, handle.id)
        else:  # small answers: a thread hop would cost more than the encoding
            payload = render_generic(outcome, handle.id)
        return _json_response(payload, {"X-Request-Id": handle.id})

    async def pipeline_control(self, request: web.Request) -> web.Response:
        self._check_pipeline(request)
        op, stages = parse_control(await self._body(request), self.pipeline)
        try:
            results = await self.orch.control(op, stages)
        except ControlError as exc:
            raise ApiError(500, str(exc), code="control_failed",
                           extra={"replica": exc.replica, "exception_type": exc.type}) from None
        except ValueError as exc:
            # The engine prefixes the field at fault ("stages: unknown stage(s) ...").
            text = str(exc)
            param = "op" if text.startswith("op") else "stages" if "stage" in text else None
            raise _bad(param, text) from None
        return _json_response({"results": _jsonable(results)})

    # -- operational routes -----------------------------------------------------------------

    async def livez(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, _request: web.Request) -> web.Response:
        if not self.orch.accepting:
            return web.Response(status=503, text="shutting down")
        ok, reason = self.orch.readiness()
        return web.Response(text="ready") if ok else web.Response(status=503, text=reason)

    async def metrics_route(self, _request: web.Request) -> web.Response:
        engine = self.orch.metrics_text()
        if engine and not engine.endswith("\n"):
            engine += "\n"
        return web.Response(body=(engine + self.metrics.text()).encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def openapi_json(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.openapi, content_type="application/json")

    def routes(self) -> list[web.RouteDef]:
        table = [
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{model:.+}", self.get_model),
            web.get("/livez", self.livez),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_route),
            web.get("/openapi.json", self.openapi_json),
        ]
        if "chat" in self.apis:
            table.append(web.post("/v1/chat/completions", self.chat_completions))
        if "images" in self.apis:
            table.append(web.post("/v1/images/generations", self.images_generations))
        if "generic" in self.apis:
            table.append(web.post("/v1/pipelines/{name}/requests", self.pipeline_request))
            table.append(web.post("/v1/pipelines/{name}/control", self.pipeline_control))
        return table


API_KEY = web.AppKey("omnistage_http_api", HttpApi)


def build_app(orch: OrchestratorLike, *,
              disconnect_poll_s: float | None = DISCONNECT_POLL_S) -> web.Application:
    """The aiohttp application for one orchestrator (only the enabled API surfaces).

    disconnect_poll_s: how often a waiting handler checks whether its client is still there.
    Needed when the app is served without handler_cancellation (aiohttp's default); None turns
    the check off for runners that cancel handlers on disconnect, as serve_http's does.
    """
    api = HttpApi(orch, disconnect_poll_s=disconnect_poll_s)
    app = web.Application(middlewares=[api.middleware], client_max_size=MAX_BODY_BYTES)
    app[API_KEY] = api
    app.add_routes(api.routes())
    return app


async def serve_http(orch: OrchestratorLike, host: str, port: int
                     ) -> tuple[web.AppRunner, str]:
    """Start the API; returns the runner (await runner.cleanup() to stop) and its base URL.

    handler_cancellation makes a client disconnect cancel the handler at once, which aborts the
    request through the pipeline, so no per-request polling is needed.
    """
    runner = web.AppRunner(build_app(orch, disconnect_poll_s=None), access_log=None,
                           handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}"

