"""The route table and the OpenAPI 3.1 document generated from it and the body models.

Why: http_api registers a handler for each route of this table, validating with the route's
body model, and the document is generated from the same table and models (schemas.py), so
/openapi.json describes exactly what the server serves and accepts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from omnistage.kube import ADMIN_KEY_HEADER, LOAD_PATH
from omnistage.media import MEDIA_TYPES
from omnistage.orchestrator.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ControlRequest,
    ControlResponse,
    ErrorBody,
    GenericRequest,
    GenericResponse,
    ImagesRequest,
    ImagesResponse,
    LoadResponse,
    ModelCard,
    ModelList,
    SpeechRequest,
    SpeechStreamEvent,
)
from omnistage.protocol import PIPELINE_CONTROL_OPS as CONTROL_OPS

__all__ = ["LISTENERS", "ROUTES", "Listener", "Route", "openapi_document", "serves"]

Listener = Literal["public", "admin", "both"]
LISTENERS: tuple[str, str] = ("public", "admin")


@dataclass(frozen=True)
class Route:
    """One route: http_api registers `handler` for it, openapi_document describes it."""

    method: str
    path: str  # aiohttp pattern
    handler: str  # HttpApi method name
    summary: str
    surface: str | None = None  # the spec.orchestrator.api surface that enables it; None: always
    body: type[BaseModel] | None = None
    response: Any = None  # a TypedDict; None: text/plain
    ok: str = "OK"
    errors: tuple[int, ...] = ()
    stream: Any = None  # the SSE event type, when the route can stream
    #: The 200 is a file in one of these media types (not JSON); `stream` may add SSE.
    binary: tuple[str, ...] = ()
    #: Served (and documented) only when the pipeline has a speech stage.
    needs_speech: bool = False
    #: The listener that serves it: "public" (the API port: the OpenAI and pipeline routes),
    #: "admin" (the admin port: control, the load signal, metrics; docs/security.md) or
    #: "both" (the probes and each listener's own document).
    listener: Listener = "public"
    #: Needs a key when the listener has keys: an API key on the public listener, an admin
    #: key on the admin one (orchestrator/auth.py). False for the probes, /metrics (the admin
    #: port is network-restricted, so scrapers need no credential) and the documents.
    keyed: bool = True


_COMMON_ERRORS = (400, 404, 413, 429, 500, 502, 503, 504)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", "chat_completions", "OpenAI chat completion, "
          "optionally streamed as server-sent events", "chat", ChatCompletionRequest,
          ChatCompletion, "A completion, or with stream: true an SSE stream of chunks.",
          _COMMON_ERRORS, ChatCompletionChunk),
    Route("POST", "/v1/images/generations", "images_generations", "OpenAI image generation "
          "(b64_json PNG only)", "images", ImagesRequest, ImagesResponse, "Base64 PNG images.",
          _COMMON_ERRORS),
    Route("POST", "/v1/audio/speech", "audio_speech", "OpenAI text to speech: the speech "
          "stage's audio as a file, or with stream_format sse as server-sent events", "speech",
          SpeechRequest, None, "The audio file (Content-Type by response_format), or SSE.",
          _COMMON_ERRORS, SpeechStreamEvent,
          binary=tuple(dict.fromkeys(MEDIA_TYPES.values())), needs_speech=True),
    Route("GET", "/v1/models", "list_models", "The served model", response=ModelList),
    Route("GET", "/v1/models/{model:.+}", "get_model", "Retrieve the served model",
          response=ModelCard, errors=(404,)),
    Route("POST", "/v1/pipelines/{name}/requests", "pipeline_request", "Run a request through "
          "an arbitrary stage graph", "generic", GenericRequest, GenericResponse,
          errors=_COMMON_ERRORS),
    Route("POST", "/v1/pipelines/{name}/control", "pipeline_control", "Fan a control RPC "
          f"({', '.join(CONTROL_OPS)}) out to stage replicas", None, ControlRequest,
          ControlResponse, errors=(400, 404, 409, 500, 503), listener="admin"),
    Route("GET", LOAD_PATH, "pipeline_load", "Per-stage load signal over a window (replicas, "
          "in flight, held, arrivals, service time, p95 queue wait and time to first output); "
          "the autoscaler reads it", response=LoadResponse, listener="admin"),
    Route("GET", "/livez", "livez", "Liveness: the process serves HTTP", keyed=False,
          listener="both"),
    Route("GET", "/readyz", "readyz", "Readiness: every stage has a routable replica and "
          "admission is open", errors=(503,), keyed=False, listener="both"),
    Route("GET", "/metrics", "metrics_route", "Prometheus metrics of the orchestrator and its "
          "HTTP layer", keyed=False, listener="admin"),
    Route("GET", "/openapi.json", "openapi_json", "This document", response=dict[str, Any],
          keyed=False, listener="both"),
)
#: Routes documented here but served by omnistage.sideport, like every process's ops routes.
OPS_HANDLERS = frozenset({"livez", "readyz", "metrics_route"})


def serves(route: Route, listener: str) -> bool:
    """Whether `listener` ("public" or "admin") serves the route."""
    return route.listener in (listener, "both")

# What a schema cannot say: when each error status happens.
_ERRORS: dict[int, str] = {
    400: "Bad input. `param` names the offending field (for example `messages[0].content`, "
         "`size`, `params.denoiser.height`).",
    401: "No key, or not one in force (`invalid_api_key`): send `Authorization: Bearer KEY` "
         "(an API key on the public listener; an admin key on the admin listener, which also "
         "takes it as `X-Omnistage-Admin-Key: KEY`).",
    404: "Unknown model (`model_not_found`), pipeline, route, or an API surface this pipeline "
         "does not enable (`api_not_enabled`).",
    409: "A replica's state forbids the control op now (`control_conflict`: resume while "
         "asleep, sleep with requests in flight); `replica` names it.",
    413: "Request body larger than the server accepts.",
    429: "A stage replica refused the request at admission (`overloaded`). Retry-After says "
         "when to retry.",
    500: "Internal error; for control, a worker-side exception (`exception_type`, `replica`).",
    502: "A stage failed or its replica was lost (`stage_failed`, `replica_lost`), or a "
         "worker refused a hop of another pipeline revision (`revision_mismatch`).",
    503: "No live replica for a stage (`no_replica`), not ready, draining, shutting down, "
         "the request was aborted (`aborted`), or a retiring replica cut it when its drain "
         "timeout passed (`drain_timeout`). Retry-After when the server suggests a delay.",
    504: "The request's deadline passed (`deadline`).",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "integer", "minimum": 1}}}


class _NoFieldTitles(GenerateJsonSchema):
    """Property titles only repeat the property names."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _schemas(types: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON Schemas of the given types (name -> type), as component refs plus the components."""
    inputs = [(name, "validation" if isinstance(t, type) and issubclass(t, BaseModel)
               else "serialization", TypeAdapter(t)) for name, t in types.items()]
    refs, defs = TypeAdapter.json_schemas(inputs, ref_template="#/components/schemas/{model}",
                                          schema_generator=_NoFieldTitles)
    return {name: schema for (name, _mode), schema in refs.items()}, defs.get("$defs", {})


def _sse_event(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 reads an event stream's schema per event): `data` is
    a chunk or an error as JSON, or the literal `[DONE]` that ends the stream."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [chunk, error]}},
    ]}}}


def _doc_path(path: str) -> str:
    return re.sub(r"\{(\w+):[^}]+\}", r"{\1}", path)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(
    apis: Iterable[str] = ("chat", "images", "speech", "generic"),
    *,
    routes: Iterable[Route] = ROUTES,
    title: str = "Omnistage orchestrator",
    version: str = "0.1.0",
    pipeline_name: str | None = None,
    model_name: str | None = None,
    api_keys: bool = False,
    listener: str = "public",
) -> dict[str, Any]:
    """The document of one listener ("public" or "admin") for the routes a pipeline enables
    (disabled API surfaces are left out); api_keys: the listener has keys, so its keyed routes
    say so (their scheme, 401)."""
    enabled = set(apis)
    served = [r for r in routes if (r.surface is None or r.surface in enabled)
              and serves(r, listener)]
    types: dict[str, Any] = {"Error": ErrorBody}
    for r in served:
        for part, t in (("body", r.body), ("response", r.response), ("stream", r.stream)):
            if t is not None:
                types[f"{r.handler}.{part}"] = t
    refs, components = _schemas(types)
    paths: dict[str, dict[str, Any]] = {}
    for r in served:
        responses: dict[str, Any] = {}
        if r.binary:
            responses["200"] = {"description": r.ok, "content": {
                t: {"schema": {"type": "string", "contentMediaType": t}} for t in r.binary}}
            if r.stream is not None:
                responses["200"]["content"]["text/event-stream"] = {
                    "schema": _sse_event(refs[f"{r.handler}.stream"], refs["Error"])}
        elif r.response is None:
            responses["200"] = {"description": r.ok, "content": {"text/plain": {
                "schema": {"type": "string"}}}}
        else:
            responses["200"] = _json(refs[f"{r.handler}.response"], r.ok)
            if r.stream is not None:
                responses["200"]["content"]["text/event-stream"] = {
                    "schema": _sse_event(refs[f"{r.handler}.stream"], refs["Error"])}
        for status in (*r.errors, 401) if api_keys and r.keyed else r.errors:
            if r.response is None and not r.binary:
                responses[str(status)] = {"description": "The reason.", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}
                continue
            responses[str(status)] = _json(refs["Error"], _ERRORS[status])
            if status in (429, 503):
                responses[str(status)]["headers"] = _RETRY_AFTER
        op: dict[str, Any] = {"summary": r.summary, "operationId": r.handler,
                              "responses": responses}
        if api_keys and r.keyed:
            op["security"] = ([{"adminKey": []}, {"bearer": []}] if listener == "admin"
                              else [{"apiKey": []}])
        params = re.findall(r"\{(\w+)", r.path)
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "string"}} for p in params]
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[f"{r.handler}.body"]}}}
        paths.setdefault(_doc_path(r.path), {})[r.method.lower()] = op
    description = ("OpenAI-compatible front door of an Omnistage pipeline. Errors use OpenAI's "
                   "JSON error shape; see docs/http-api.md." if listener == "public" else
                   "Admin listener of an Omnistage orchestrator: control, the load signal and "
                   "metrics, apart from the public API; see docs/security.md.")
    if listener == "admin":
        title += " (admin)"
    schemes = ({"adminKey": {"type": "apiKey", "in": "header", "name": ADMIN_KEY_HEADER},
                "bearer": {"type": "http", "scheme": "bearer"}} if listener == "admin"
               else {"apiKey": {"type": "http", "scheme": "bearer"}})
    if pipeline_name:
        description += f" Pipeline: `{pipeline_name}`."
    if model_name:
        description += f" Served model name: `{model_name}`."
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": components, **(
            {"securitySchemes": schemes} if api_keys else {})},
    }
