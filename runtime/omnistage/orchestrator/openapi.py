"""The hand-written OpenAPI 3.1 document of the orchestrator's HTTP API.

Written by hand rather than generated so it documents the contract, not the implementation: every
bound below is also what http_api's validators enforce (they import these constants), and a unit
test checks that every route the app serves appears here with the same methods.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CHAT_ROLES",
    "CONTROL_OPS",
    "IMAGE_SIDE_MAX",
    "IMAGE_SIDE_MIN",
    "IMAGE_SIDE_MULTIPLE",
    "MAX_GUIDANCE",
    "MAX_MAX_TOKENS",
    "MAX_N_CHAT",
    "MAX_N_GENERIC",
    "MAX_N_IMAGES",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TEMPERATURE",
    "MAX_TIMEOUT_S",
    "openapi_document",
]

# Bounds shared by the document and the validators.
MAX_N_CHAT = 16
MAX_N_IMAGES = 10
MAX_N_GENERIC = 16
MAX_SEED = 2**63 - 1  # int64: what msgpack and torch generators accept
MAX_MAX_TOKENS = 2**31 - 1  # the worker narrows this to its model's context
MAX_TEMPERATURE = 2.0  # OpenAI's range
IMAGE_SIDE_MIN = 8
IMAGE_SIDE_MAX = 2048
IMAGE_SIDE_MULTIPLE = 8
MAX_STEPS = 1000
MAX_GUIDANCE = 100.0
MAX_TIMEOUT_S = 86_400.0
CONTROL_OPS = ("sleep", "wake_up", "pause", "resume")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"$ref": f"#/components/responses/E{s}"} for s in statuses}


_SEED = {"type": "integer", "minimum": 0, "maximum": MAX_SEED, "description": "Random seed; "
         "child i of a request with n > 1 uses seed + i."}

_ERROR_RESPONSES: dict[str, Any] = {
    "E400": _json(_ref("Error"), "Bad input. `param` names the offending field (for example "
                  "`messages[0].content`, `size`, `params.denoiser.height`)."),
    "E404": _json(_ref("Error"), "Unknown model (`code: model_not_found`), pipeline, route, or "
                  "an API surface this pipeline does not enable (`code: api_not_enabled`)."),
    "E413": _json(_ref("Error"), "Request body larger than the server accepts."),
    "E429": {
        **_json(_ref("Error"), "A stage replica refused the request at admission "
                "(`code: overloaded`). Retry after the given delay."),
        "headers": {"Retry-After": {"description": "Seconds to wait before retrying.",
                                    "schema": {"type": "integer", "minimum": 1}}},
    },
    "E500": _json(_ref("Error"), "Internal error; for control, a worker-side exception "
                  "(`exception_type`, `replica`)."),
    "E502": _json(_ref("Error"), "A stage failed or its replica was lost "
                  "(`code: stage_failed | replica_lost`)."),
    "E503": {
        **_json(_ref("Error"), "No live replica for a stage (`no_replica`), not ready, draining, "
                "shutting down, or the request was aborted (`aborted`)."),
        "headers": {"Retry-After": {"description": "Present when the server suggests a delay.",
                                    "schema": {"type": "integer", "minimum": 1}}},
    },
    "E504": _json(_ref("Error"), "The request's deadline passed (`code: deadline`)."),
}

_COMMON_ERRORS = (400, 404, 413, 429, 500, 502, 503, 504)

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "description": "OpenAI's error shape. `code` is Omnistage's machine-readable reason.",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": [
                    "invalid_request_error", "rate_limit_error", "server_error",
                    "upstream_error", "service_unavailable_error", "timeout_error"]},
                "param": {"type": ["string", "null"],
                          "description": "The request field at fault, when there is one."},
                "code": {"type": ["string", "null"], "examples": [
                    "invalid_value", "invalid_type", "missing_required_parameter",
                    "unsupported_parameter", "invalid_json", "model_not_found",
                    "api_not_enabled", "overloaded", "deadline", "no_replica",
                    "replica_lost", "stage_failed", "shutting_down", "aborted", "internal",
                    "control_failed"]},
                "replica": {"type": "string", "description": "control errors only"},
                "exception_type": {"type": "string", "description": "control errors only"},
            },
        }},
    },
    "ContentPart": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": list(CHAT_ROLES)},
            "content": {"oneOf": [
                {"type": "string"},
                {"type": "array", "items": _ref("ContentPart")},
                {"type": "null", "description": "assistant messages only"},
            ]},
            "name": {"type": "string"},
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "description": "Unknown fields are ignored and listed in the X-Omnistage-Ignored-Fields "
                       "response header. Sampling hints without an effect here (top_p, "
                       "presence_penalty, frequency_penalty, ...) are accepted and ignored. "
                       "Fields that would change the answer in ways Omnistage cannot honour "
                       "(stop, tools, tool_choice, functions, function_call, logit_bias, "
                       "logprobs: true, response_format other than text, audio, prediction, "
                       "modalities other than [text]) are rejected with 400.",
        "properties": {
            "model": {"type": "string", "description": "Must equal the served model name."},
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_MAX_TOKENS},
            "max_completion_tokens": {"type": "integer", "minimum": 0,
                                      "maximum": MAX_MAX_TOKENS,
                                      "description": "Takes precedence over max_tokens."},
            "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE},
            "seed": _SEED,
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_N_CHAT, "default": 1},
            "stream": {"type": "boolean", "default": False},
            "stream_options": {"type": ["object", "null"], "properties": {
                "include_usage": {"type": "boolean"}}},
            "user": {"type": "string", "description": "Session key: pins the session to a "
                     "replica while that replica lives."},
            "ignore_eos": {"type": "boolean", "description": "Extension: generate max_tokens."},
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "message": {"type": "object", "properties": {
                        "role": {"const": "assistant"}, "content": {"type": "string"}}},
                    "finish_reason": {"enum": ["stop", "length", "abort"]},
                },
            }},
            "usage": _ref("Usage"),
        },
    },
    "ChatCompletionChunk": {
        "type": "object",
        "description": "One SSE `data:` event. The stream sends a role delta per choice, content "
                       "deltas, a final delta per choice with finish_reason, an optional usage "
                       "chunk (empty choices) and `data: [DONE]`. An error after the stream "
                       "started arrives as `data: {\"error\": {...}}` and ends the stream.",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion.chunk"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"},
                "delta": {"type": "object", "properties": {
                    "role": {"const": "assistant"}, "content": {"type": "string"}}},
                "finish_reason": {"enum": ["stop", "length", "abort", None]},
            }}},
            "usage": {"oneOf": [_ref("Usage"), {"type": "null"}]},
        },
    },
    "Usage": {
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
        },
    },
    "ImagesRequest": {
        "type": "object",
        "required": ["prompt"],
        "description": "quality, style, background, moderation and output_compression are "
                       "accepted and ignored; unknown fields are ignored and listed in the "
                       "X-Omnistage-Ignored-Fields response header.",
        "properties": {
            "prompt": {"type": "string", "minLength": 1},
            "model": {"type": "string"},
            "negative_prompt": {"type": ["string", "null"], "description": "Extension: runs a "
                                "companion request for classifier-free guidance."},
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_N_IMAGES, "default": 1},
            "size": {"type": "string", "pattern": "^[0-9]+x[0-9]+$|^auto$",
                     "description": f"WIDTHxHEIGHT, each {IMAGE_SIDE_MIN}..{IMAGE_SIDE_MAX} and "
                                    f"a multiple of {IMAGE_SIDE_MULTIPLE}; auto or omitted "
                                    "uses the stage's defaults."},
            "response_format": {"enum": ["b64_json", None]},
            "output_format": {"enum": ["png", None]},
            "user": {"type": "string", "description": "Session key."},
            "seed": _SEED,
            "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": MAX_STEPS},
            "guidance_scale": {"type": "number", "minimum": 0, "maximum": MAX_GUIDANCE},
        },
    },
    "ImagesResponse": {
        "type": "object",
        "required": ["created", "data"],
        "properties": {
            "created": {"type": "integer"},
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "b64_json": {"type": "string", "contentEncoding": "base64",
                             "contentMediaType": "image/png"}}}},
            "output_format": {"const": "png"},
        },
    },
    "ModelList": {
        "type": "object",
        "properties": {"object": {"const": "list"}, "data": {"type": "array",
                                                             "items": _ref("Model")}},
    },
    "Model": {
        "type": "object",
        "properties": {
            "id": {"type": "string"}, "object": {"const": "model"},
            "created": {"type": "integer"}, "owned_by": {"type": "string"},
        },
    },
    "JsonValue": {"description": "Any JSON value; strings must be valid Unicode and integers "
                                 "fit in 64 bits (they travel as msgpack)."},
    "GenericRequest": {
        "type": "object",
        "additionalProperties": False,
        "description": "Unknown fields are errors on this route (it is Omnistage's own API).",
        "properties": {
            "prompt": {"type": "string", "default": ""},
            "negative_prompt": {"type": ["string", "null"]},
            "params": {"type": "object", "description": "Per-stage parameters, keyed by stage "
                       "name; `*` applies to every stage.",
                       "additionalProperties": {"type": "object",
                                                "additionalProperties": _ref("JsonValue")}},
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_N_GENERIC, "default": 1},
            "finals": {"type": ["array", "null"], "items": {"type": "string"}, "minItems": 1,
                       "description": "Stages whose outputs to return; default: the pipeline's "
                                      "finalOutput stages. Only the stages they need run."},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S},
            "session": {"type": ["string", "null"], "description": "Session affinity key."},
        },
    },
    "Tensor": {
        "type": "object",
        "properties": {
            "dtype": {"enum": ["float32", "float16", "bfloat16", "float64", "int64", "int32",
                               "uint8", "bool"]},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "data": {"type": "string", "contentEncoding": "base64",
                     "description": "Raw little-endian bytes, C order (bfloat16 as 16-bit "
                                    "words)."},
        },
    },
    "GenericResponse": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "status": {"enum": ["ok", "abort", "request_error", "fatal"]},
            "children": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"},
                "status": {"enum": ["ok", "abort", "request_error", "fatal"]},
                "outputs": {"type": "object", "additionalProperties": {
                    "type": "object", "properties": {
                        "fields": {"type": "object"},
                        "tensors": {"type": "object", "additionalProperties": _ref("Tensor")},
                    }}},
                "error": {"type": "object", "properties": {
                    "code": {"type": "string"}, "message": {"type": "string"},
                    "stage": {"type": ["string", "null"]}}},
            }}},
        },
    },
    "ControlRequest": {
        "type": "object",
        "required": ["op"],
        "additionalProperties": False,
        "properties": {
            "op": {"enum": list(CONTROL_OPS)},
            "stages": {"type": ["array", "null"], "items": {"type": "string"},
                       "description": "Default: every stage."},
        },
    },
    "ControlResponse": {
        "type": "object",
        "properties": {"results": {"type": "object", "description": "Replica name -> the "
                                   "state its worker reported.",
                                   "additionalProperties": {"type": "object"}}},
    },
}

_NAME_PARAM = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
               "description": "The pipeline's metadata.name."}
_TEXT = {"text/plain": {"schema": {"type": "string"}}}

# path -> (api surface or None for always-on, {method: operation})
_PATHS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "/v1/chat/completions": ("chat", {"post": {
        "summary": "OpenAI chat completion, optionally streamed as server-sent events",
        "requestBody": _body("ChatCompletionRequest"),
        "responses": {
            "200": {"description": "A completion, or with stream: true an SSE stream of chunks.",
                    "content": {"application/json": {"schema": _ref("ChatCompletion")},
                                "text/event-stream": {"schema": _ref("ChatCompletionChunk")}}},
            **_errors(*_COMMON_ERRORS),
        },
    }}),
    "/v1/images/generations": ("images", {"post": {
        "summary": "OpenAI image generation (b64_json PNG only)",
        "requestBody": _body("ImagesRequest"),
        "responses": {"200": _json(_ref("ImagesResponse"), "Base64 PNG images, one per "
                                   "sample."), **_errors(*_COMMON_ERRORS)},
    }}),
    "/v1/models": (None, {"get": {
        "summary": "The served model",
        "responses": {"200": _json(_ref("ModelList"), "One model: the served model name.")},
    }}),
    "/v1/models/{model}": (None, {"get": {
        "summary": "Retrieve the served model",
        "parameters": [{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "responses": {"200": _json(_ref("Model"), "The model."), **_errors(404)},
    }}),
    "/v1/pipelines/{name}/requests": ("generic", {"post": {
        "summary": "Run a request through an arbitrary stage graph",
        "parameters": [_NAME_PARAM],
        "requestBody": _body("GenericRequest"),
        "responses": {"200": _json(_ref("GenericResponse"), "Every child's final-stage "
                                   "outputs; per-child failures are reported inline."),
                      **_errors(*_COMMON_ERRORS)},
    }}),
    "/v1/pipelines/{name}/control": ("generic", {"post": {
        "summary": "Fan a control RPC (sleep, wake_up, pause, resume) out to stage replicas",
        "parameters": [_NAME_PARAM],
        "requestBody": _body("ControlRequest"),
        "responses": {"200": _json(_ref("ControlResponse"), "Each replica's reported state."),
                      **_errors(400, 404, 500, 503)},
    }}),
    "/livez": (None, {"get": {
        "summary": "Liveness: the process serves HTTP",
        "responses": {"200": {"description": "ok", "content": _TEXT}},
    }}),
    "/readyz": (None, {"get": {
        "summary": "Readiness: every stage has a routable replica and admission is open",
        "responses": {"200": {"description": "ready", "content": _TEXT},
                      "503": {"description": "The reason it is not ready.", "content": _TEXT}},
    }}),
    "/metrics": (None, {"get": {
        "summary": "Prometheus metrics of the orchestrator and its HTTP layer",
        "responses": {"200": {"description": "Prometheus text format 0.0.4.",
                              "content": _TEXT}},
    }}),
    "/openapi.json": (None, {"get": {
        "summary": "This document",
        "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1 document.")},
    }}),
}


def openapi_document(
    apis: Iterable[str] = ("chat", "images", "generic"),
    *,
    title: str = "Omnistage orchestrator",
    version: str = "0.1.0",
    pipeline_name: str | None = None,
    model_name: str | None = None,
) -> dict[str, Any]:
    """The document for the routes a pipeline enables (disabled API surfaces are left out)."""
    enabled = set(apis)
    paths = {
        path: copy.deepcopy(ops)
        for path, (surface, ops) in _PATHS.items()
        if surface is None or surface in enabled
    }
    description = ("OpenAI-compatible front door of an Omnistage pipeline. Errors use OpenAI's "
                   "JSON error shape; see docs/http-api.md.")
    if pipeline_name:
        description += f" Pipeline: `{pipeline_name}`."
    if model_name:
        description += f" Served model name: `{model_name}`."
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(_SCHEMAS),
            "responses": copy.deepcopy(_ERROR_RESPONSES),
        },
    }
