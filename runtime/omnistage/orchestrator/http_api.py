"""The orchestrator's HTTP front door: OpenAI-compatible routes plus operational ones.

Handlers stay thin: parse the body into a request (request_parsing.py, pure; it validates
against the models in schemas.py, from which openapi.py makes the OpenAPI document with the
same route table), submit one PipelineRequest, then render its Outcome (render.py, pure) or
pump its events to the client (http_streaming.py). The HTTP layer never routes; the engine
does. Every error leaves in OpenAI's JSON error shape, and a client that goes away aborts its
request through the pipeline so no stage keeps working for nobody. See docs/http-api.md for
the user-facing contract.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from omnistage import media
from omnistage.client import ControlError
from omnistage.kube import ADMIN_KEY_HEADER
from omnistage.metrics import HttpMetrics
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.auth import ApiKeys
from omnistage.orchestrator.errors import (
    ApiError,
    ParamMap,
    bad,
    chat_param,
    error_from_request_error,
    generic_param,
    images_param,
    outcome_error,
    speech_param,
)
from omnistage.orchestrator.http_streaming import (
    DISCONNECT_POLL_S,
    ChatSse,
    Flight,
    RequestHandleLike,
    SpeechFile,
    SpeechSse,
    StreamFormat,
    pump,
)
from omnistage.orchestrator.load import PipelineLoad
from omnistage.orchestrator.openapi import (
    LISTENERS,
    OPS_HANDLERS,
    ROUTES,
    Route,
    openapi_document,
    serves,
)
from omnistage.orchestrator.render import (
    dumps,
    jsonable,
    render_chat_completion,
    render_generic,
    render_images,
    render_speech,
    tensor_bytes,
)
from omnistage.orchestrator.request_parsing import (
    decode_media,
    ignored_header,
    parse_chat,
    parse_control,
    parse_generic,
    parse_images,
    parse_json_body,
    parse_speech,
    pipeline_body,
    speech_plan,
)
from omnistage.orchestrator.schemas import ModelCard
from omnistage.protocol import ControlConflict
from omnistage.sideport import add_ops_routes, serve_app
from omnistage.spec import OmniPipeline

__all__ = [
    "API_KEY",
    "DISCONNECT_POLL_S",
    "MAX_BODY_BYTES",
    "HttpApi",
    "OrchestratorLike",
    "build_app",
    "error_response",
    "serve_http",
]

log = logging.getLogger("omnistage.http")

MAX_BODY_BYTES = 16 * 1024 * 1024
_INLINE_RENDER_BYTES = 256 * 1024
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # keep reverse proxies from buffering the stream
}


# --------------------------------------------------------------------------- engine interface


class OrchestratorLike(Protocol):
    """What the HTTP layer needs from engine.Orchestrator (a Protocol so tests can fake it)."""

    pipeline: OmniPipeline
    accepting: bool

    def submit(self, req: rq.PipelineRequest) -> RequestHandleLike: ...

    def readiness(self) -> tuple[bool, str]: ...

    registry: CollectorRegistry

    async def control(self, op: str, stages: list[str] | None = None) -> dict[str, dict]: ...

    def load(self) -> PipelineLoad: ...


# --------------------------------------------------------------------------- responses


#: The pipeline revision a request ran on, on every response of a route that ran the pipeline
#: (docs/http-api.md): a client can see that its answers came from one release.
REVISION_HEADER = "X-Omnistage-Revision"


def request_headers(handle: RequestHandleLike) -> dict[str, str]:
    """X-Request-Id and, when its stages name revisions, X-Omnistage-Revision."""
    revision = getattr(handle, "revision", None)  # a test's fake handle may have none
    return {"X-Request-Id": handle.id, **({REVISION_HEADER: revision} if revision else {})}


def _json_response(obj: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), content_type="application/json",
                        headers=dict(headers or {}))


def error_response(err: ApiError) -> web.Response:
    return web.Response(status=err.status, body=dumps(err.body()),
                        content_type="application/json", headers=err.headers())


class _StreamWriter:
    """http_streaming.ResponseWriter over an aiohttp StreamResponse, prepared by the first write
    so that a stream failing before its first bytes still answers with a real status."""

    def __init__(self, request: web.Request, headers: Mapping[str, str]) -> None:
        self.request = request
        self.response = web.StreamResponse(headers=dict(headers))

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def write(self, data: bytes) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(data)

    async def end(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write_eof()

    def cut(self) -> None:
        if self.request.transport is not None:
            self.request.transport.close()


# --------------------------------------------------------------------------- the app


def _path_pattern(path: str) -> re.Pattern[str]:
    """An aiohttp route pattern as a regex, to tell a disabled API surface from a bad path."""
    return re.compile("^" + re.sub(r"\\\{.*?\\\}", "[^/]+", re.escape(path)) + "/?$")


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, HttpMetrics] = (
    weakref.WeakKeyDictionary())


def _http_metrics(registry: CollectorRegistry) -> HttpMetrics:
    """One set of HTTP metrics per registry: both listeners of an orchestrator count in it."""
    metrics = _METRICS.get(registry)
    if metrics is None:
        metrics = _METRICS[registry] = HttpMetrics(registry)
    return metrics


class HttpApi:
    """Handlers bound to one orchestrator and one listener; build_app wires them to the paths
    of the route table's routes that the listener serves.

    `routes` (default openapi.ROUTES) is one table for both: the handlers validate with each
    route's body model and /openapi.json is generated from the same table. `listener`:
    "public" (the API port) or "admin" (control, load, metrics: docs/security.md); `api_keys`
    are the keys its keyed routes need (API keys, or admin keys on the admin listener).
    """

    def __init__(self, orch: OrchestratorLike, *,
                 disconnect_poll_s: float | None = DISCONNECT_POLL_S,
                 routes: Iterable[Route] = ROUTES, api_keys: ApiKeys | None = None,
                 listener: str = "public") -> None:
        if listener not in LISTENERS:
            raise ValueError(f"listener {listener!r}: one of {', '.join(LISTENERS)}")
        self.orch = orch
        self.listener = listener
        self.api_keys = api_keys  # None: every route is open (orchestrator/auth.py)
        self.pipeline = orch.pipeline
        self.apis = list(self.pipeline.spec.orchestrator.api)
        self.model = self.pipeline.served_model_name()
        self.name = self.pipeline.metadata.name
        self.metrics = _http_metrics(orch.registry)
        self.disconnect_poll_s = disconnect_poll_s
        self.closing = False  # shutdown began: /readyz fails, every response says Connection: close
        self.started = int(time.time())
        table = [r for r in routes if serves(r, listener)]
        # The generic and control bodies name this pipeline's stages, in validator and document.
        self.served = [replace(r, body=pipeline_body(self.pipeline, r.body)) if r.body else r
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
        self.keyed = frozenset(r.handler for r in table if r.keyed)
        self.openapi = dumps(openapi_document(self.apis, routes=self.served,
                                               pipeline_name=self.name, model_name=self.model,
                                               api_keys=api_keys is not None,
                                               listener=listener))

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
            if self.api_keys is not None:
                self._check_key(request)
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

    def _check_key(self, request: web.Request) -> None:
        """A keyed route needs a key in force (a route nobody serves is a 404 as before)."""
        assert self.api_keys is not None
        name = getattr(request.match_info.handler, "__name__", None)
        if name not in self.keyed:
            return
        header = request.headers.get("Authorization")
        if self.listener == "admin":
            admin = request.headers.get(ADMIN_KEY_HEADER)
            if admin is not None:  # the operator's way: the API server's proxy drops the other
                header = f"Bearer {admin}"
        if self.api_keys.allows(header):
            return
        what = "an admin key" if self.listener == "admin" else "an API key"
        how = (f"{ADMIN_KEY_HEADER}: KEY or Authorization: Bearer KEY"
               if self.listener == "admin" else "Authorization: Bearer KEY")
        message = (f"invalid key: this route needs {what}" if header else
                   f"no key: this route needs {what}; send it as the header {how}")
        raise ApiError(401, message, code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})

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

    def _flight(self, request: web.Request, handle: RequestHandleLike) -> Flight:
        """The request tied to this connection: aborted if the client goes away first."""
        def gone() -> bool:
            transport = request.transport
            return transport is None or transport.is_closing()

        return Flight(handle, self.metrics, gone=gone, poll_s=self.disconnect_poll_s)

    async def _stream(self, request: web.Request, handle: RequestHandleLike, fmt: StreamFormat,
                      headers: Mapping[str, str], param: ParamMap) -> web.StreamResponse:
        """Every streamed answer: http_streaming.pump writes fmt's bytes of the request's events
        (and handles failure, disconnect and cancellation alike for every format)."""
        writer = _StreamWriter(request, headers)
        async with self._flight(request, handle) as flight:
            await pump(flight, fmt, writer, param)
        return writer.response

    # -- OpenAI routes ----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        call = parse_chat(await self._body(request), self.pipeline,
                          self.bodies["chat_completions"])
        if call.media:
            call.request.tensors = await asyncio.to_thread(decode_media, call.media)
        handle = self._submit(call.request)
        rid = f"chatcmpl-{handle.id}"
        created = int(time.time())
        headers = {**request_headers(handle), **ignored_header(call.ignored)}
        if call.request.stream:
            return await self._stream(request, handle, ChatSse(call, rid, created),
                                      {**_SSE_HEADERS, **headers}, chat_param)
        async with self._flight(request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, chat_param, call.request.inputs)
        if err is not None:
            raise err
        if call.speech is not None:  # audio encoding is CPU work: off the event loop
            payload = await asyncio.to_thread(render_chat_completion, outcome, call, rid, created)
        else:
            payload = render_chat_completion(outcome, call, rid, created)
        return _json_response(payload, headers)

    async def images_generations(self, request: web.Request) -> web.Response:
        call = parse_images(await self._body(request), self.pipeline,
                            self.bodies["images_generations"])
        handle = self._submit(call.request)
        created = int(time.time())
        async with self._flight(request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, images_param)
        if err is not None:
            raise err
        payload = await asyncio.to_thread(render_images, outcome, call, created)
        headers = {**request_headers(handle), **ignored_header(call.ignored)}
        return _json_response(payload, headers)

    async def audio_speech(self, request: web.Request) -> web.StreamResponse:
        """The file whole, or streamed as the stage makes it (call.request.stream), or SSE
        events (streamed as the stage makes pcm, else the whole file's at the end)."""
        call = parse_speech(await self._body(request), self.pipeline,
                            self.bodies["audio_speech"])
        handle = self._submit(call.request)
        headers = {**request_headers(handle), **ignored_header(call.ignored)}
        if call.sse:
            return await self._stream(request, handle, SpeechSse(call),
                                      {**_SSE_HEADERS, **headers}, speech_param)
        file_type = {"Content-Type": media.MEDIA_TYPES[call.response_format]}
        if call.request.stream:
            return await self._stream(request, handle, SpeechFile(call),
                                      {**headers, **file_type}, speech_param)
        async with self._flight(request, handle) as flight:
            outcome = await flight.outcome()
        err = outcome_error(outcome, speech_param)
        if err is not None:
            raise err
        data = await asyncio.to_thread(render_speech, outcome, call)
        return web.Response(body=data, headers={**headers, **file_type})

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
        async with self._flight(request, handle) as flight:
            outcome = await flight.outcome()
        if outcome.error is not None:
            raise error_from_request_error(outcome.error, generic_param)
        if tensor_bytes(outcome) > _INLINE_RENDER_BYTES:
            payload = await asyncio.to_thread(render_generic, outcome, handle.id)
        else:  # small answers: a thread hop would cost more than the encoding
            payload = render_generic(outcome, handle.id)
        return _json_response(payload, request_headers(handle))

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
              routes: Iterable[Route] = ROUTES,
              api_keys: ApiKeys | None = None,
              listener: str = "public") -> web.Application:
    """The aiohttp application of one of an orchestrator's listeners (only the enabled API
    surfaces): "public", the API; "admin", control, load and metrics.

    disconnect_poll_s: how often a waiting handler checks whether its client is still there.
    Needed when the app is served without handler_cancellation (aiohttp's default); None turns
    the check off for runners that cancel handlers on disconnect, as serve_http's does.
    """
    api = HttpApi(orch, disconnect_poll_s=disconnect_poll_s, routes=routes, api_keys=api_keys,
                  listener=listener)
    app = web.Application(middlewares=[api.middleware], client_max_size=MAX_BODY_BYTES)
    app[API_KEY] = api
    app.on_response_prepare.append(api._on_response_prepare)
    app.add_routes(api.routes())
    add_ops_routes(app, readiness=api.readiness, registry=orch.registry,
                   metrics=listener == "admin")
    return app


async def serve_http(orch: OrchestratorLike, host: str, port: int,
                     api_keys: ApiKeys | None = None, *,
                     listener: str = "public") -> tuple[web.AppRunner, str]:
    """Start one listener; returns the runner (await runner.cleanup() to stop) and its base URL.

    handler_cancellation makes a client disconnect cancel the handler at once, which aborts the
    request through the pipeline, so no per-request polling is needed.
    """
    return await serve_app(build_app(orch, disconnect_poll_s=None, api_keys=api_keys,
                                     listener=listener), host, port, handler_cancellation=True)

