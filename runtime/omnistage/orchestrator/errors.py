"""HTTP errors in OpenAI's shape, and the mapping from engine outcomes to them (pure).

Every error the API sends, whatever the route, is {"error": {message, type, param, code}};
the engine's error codes map to statuses through requests.HTTP_STATUS and nothing else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.schemas import ERROR_TYPES, ErrorBody

__all__ = [
    "ERROR_TYPES",
    "INVALID_MEDIA",
    "MEDIA_TOO_LARGE",
    "ApiError",
    "ParamMap",
    "bad",
    "chat_param",
    "error_from_request_error",
    "generic_param",
    "images_param",
    "outcome_error",
    "speech_param",
]


# Error codes of media that do not decode (docs/http-api.md lists every code). Other audio
# and media errors use the schema's codes (invalid_value, unsupported_parameter).
INVALID_MEDIA = "invalid_media"  # base64 image or audio that does not decode
MEDIA_TOO_LARGE = "media_too_large"  # beyond omnistage.media's bounds


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
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.extra = dict(extra or {})
        self._headers = dict(headers or {})

    @property
    def type(self) -> str:
        if self.status in ERROR_TYPES:
            return ERROR_TYPES[self.status]
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> ErrorBody:
        err = {"message": self.message, "type": self.type, "param": self.param,
               "code": self.code, **self.extra}
        return {"error": err}  # type: ignore[typeddict-item]

    def headers(self) -> dict[str, str]:
        """The given headers (Allow on a 405); Retry-After is mandatory on 429 (default 1 s)
        and passed on for 503 when known."""
        out = dict(self._headers)
        after = self.retry_after
        if after is None and self.status == 429:
            after = 1.0
        if after is not None:
            out["Retry-After"] = str(max(1, math.ceil(after)))
        return out



def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


_PARAM_IN_MESSAGE = re.compile(r"\bparams\.([A-Za-z_]\w*)")
_INPUT_IN_MESSAGE = re.compile(r"\btensors\.(input_(?:image|audio)\.\d+)\b")
ParamMap = Callable[[str, str | None], str | None]


def _same_name(key: str, _stage: str | None) -> str | None:
    return key


def error_from_request_error(err: rq.RequestError, param_map: ParamMap = _same_name,
                             inputs: Mapping[str, str] | None = None) -> ApiError:
    """Engine/worker error to HTTP. A worker names a bad field as `params.X`; param_map turns
    that into the field the client actually sent (for example height -> size). A refusal of
    an input tensor (`tensors.input_audio.0`) names the part of the body it came from
    (`inputs`, PipelineRequest.inputs), in `param` and in place of the tensor and the stage
    in the message: the client never sees the internal names."""
    param = None
    message = err.message or err.code
    tensor = _INPUT_IN_MESSAGE.search(message)
    if tensor and err.http_status == 400 and tensor.group(1) in (inputs or {}):
        param = (inputs or {})[tensor.group(1)]
        return ApiError(400, param + message[tensor.end():], param=param, code=err.code)
    match = _PARAM_IN_MESSAGE.search(message)
    if match and err.http_status == 400:
        param = param_map(match.group(1), err.stage)
    if err.stage and err.http_status >= 500:
        message = f"{message} (stage {err.stage})"
    return ApiError(err.http_status, message, param=param, code=err.code,
                    retry_after=err.retry_after)


def outcome_error(outcome: rq.Outcome, param_map: ParamMap = _same_name,
                  inputs: Mapping[str, str] | None = None) -> ApiError | None:
    """The error an OpenAI route answers with, or None when the outcome can be rendered
    (param_map and inputs: as error_from_request_error).

    OpenAI responses have no room for partial failure, so a failed child fails the response.
    An abort keeps whatever the stages returned (an AR prefix); with nothing left it is a 503.
    """
    if outcome.error is not None:
        return error_from_request_error(outcome.error, param_map, inputs)
    for child in sorted(outcome.children, key=lambda c: c.index):
        if child.status in (rq.REQUEST_ERROR, rq.FATAL):
            if child.error is not None:
                return error_from_request_error(child.error, param_map, inputs)
            return ApiError(502, f"sample {child.index} failed", code="stage_failed")
    if outcome.status in (rq.REQUEST_ERROR, rq.FATAL):
        return ApiError(500, "request failed without an error report", code="internal")
    if outcome.status == rq.ABORT and not any(c.outputs for c in outcome.children):
        return ApiError(503, "the request was aborted before producing output", code="aborted")
    return None


# Which field the client sent, for a worker's refusal that names params.<key>.


def chat_param(key: str, _stage: str | None) -> str | None:
    return {"prompt": "messages", "token_ids": "messages"}.get(key, key)


_IMAGES_FIELD = {"height": "size", "width": "size", "num_inference_steps": "num_inference_steps",
                 "guidance_scale": "guidance_scale", "seed": "seed"}


def images_param(key: str, _stage: str | None) -> str | None:
    """The images API sets only these knobs; any other refusal (the encoder's, for a prompt
    longer than its context) is about the prompt, the one input the client gave it."""
    return _IMAGES_FIELD.get(key, "prompt")


def speech_param(key: str, _stage: str | None) -> str | None:
    """/v1/audio/speech sets the prompt (from `input`) and the voice."""
    return {"prompt": "input", "voice": "voice"}.get(key, key)


def generic_param(key: str, stage: str | None) -> str | None:
    if key == "prompt":
        return "prompt"
    return f"params.{stage}.{key}" if stage else f"params.{key}"
