"""The operational HTTP routes every Omnistage process serves, and how it starts an aiohttp server.

`/livez`, `/readyz`, `/metrics` and `/state` are built from callbacks, so this module knows no
component: the stage worker, the orchestrator's API server and the operator all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from omnistage.metrics import exposition

log = logging.getLogger("omnistage.sideport")

# The listening sockets serve_app made for an app: owning them is how stop_listening can drain
# the accept queue without reaching into aiohttp's private state.
_LISTENERS = web.AppKey("omnistage_listeners", list[socket.socket])

Readiness = Callable[[], tuple[bool, str]]
"""Returns (ready, reason); the reason is the 503 body when not ready."""

StateView = Callable[[], Mapping[str, Any]]
"""Returns a JSON-serialisable snapshot for people (`/state`)."""


def add_ops_routes(app: web.Application, *, readiness: Readiness,
                   registry: CollectorRegistry, state: StateView | None = None,
                   metrics: bool = True) -> None:
    """Add GET /livez, /readyz, /metrics (not when `metrics` is False: the orchestrator's
    public listener) and /state (when `state` is given) to `app`.

    /livez answers 200 "ok" while the event loop serves HTTP. /readyz answers 200 or 503 with
    the reason from `readiness` ("ready", or "ready; ..." with what is degraded). /metrics
    scrapes `registry` on the event loop, so collectors read state that only the loop mutates.
    The callbacks run on every request.
    """

    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        ok, reason = readiness()
        if ok:
            return web.Response(text=reason or "ready")
        return web.Response(status=503, text=reason)

    async def metrics_route(request: web.Request) -> web.Response:
        body, content_type = exposition(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    routes = [web.get("/livez", livez), web.get("/readyz", readyz)]
    if metrics:
        routes.append(web.get("/metrics", metrics_route))
    if state is not None:
        view = state

        async def state_route(_: web.Request) -> web.Response:
            return web.json_response(dict(view()))

        routes.append(web.get("/state", state_route))
    app.add_routes(routes)


def ops_document(*, state: bool, title: str = "Omnistage side port",
                 version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes `add_ops_routes` adds (with /state when `state`),
    for clients and for the fuzz suite; the orchestrator documents the same three routes in
    its own /openapi.json (orchestrator/openapi.py)."""
    def text(description: str) -> dict[str, Any]:
        return {"description": description,
                "content": {"text/plain": {"schema": {"type": "string"}}}}

    paths: dict[str, Any] = {
        "/livez": {"get": {"operationId": "livez", "summary": "Liveness: the process serves "
                           "HTTP", "responses": {"200": text("ok")}}},
        "/readyz": {"get": {"operationId": "readyz", "summary": "Readiness",
                            "responses": {"200": text("ready, or ready; what is degraded"),
                                          "503": text("Why it is not ready.")}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                             "responses": {"200": {"description": "The exposition format the "
                                                   "Accept header asks for", "content": {
                                 "text/plain": {"schema": {"type": "string"}},
                                 "application/openmetrics-text": {
                                     "schema": {"type": "string"}}}}}}},
    }
    if state:
        paths["/state"] = {"get": {"operationId": "state", "summary": "A snapshot for people",
                                   "responses": {"200": {"description": "The state", "content": {
                                       "application/json": {"schema": {"type": "object"}}}}}}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths}


async def serve_app(app: web.Application, host: str, port: int,
                    **runner_options: Any) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0 = any free port); returns the runner (await
    `runner.cleanup()` to stop) and the base URL with the port actually bound.

    runner_options go to `web.AppRunner` (for example handler_cancellation=True).
    """
    listeners: list[socket.socket] = []
    app[_LISTENERS] = listeners  # before setup freezes the app
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **runner_options)
    await runner.setup()
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=128)
        listener.setblocking(False)
        listeners.append(listener)
        await web.SockSite(runner, listener).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}"


async def stop_listening(runner: web.AppRunner, settle: float = 2.0) -> None:
    """Close the runner's listening sockets without resetting a connection the kernel already
    accepted: closing a listening socket resets the connections still in its accept queue (and
    a busy event loop may leave some there), so those are taken in first and served like any
    other. It then waits up to `settle` seconds for them to close, which they do after their
    response when the app answers with `Connection: close` (the orchestrator's API does once
    shutdown began); closing one earlier would drop a request it already sent.

    What is left is a connection whose handshake completes between the last accept and the
    close, a window of one system call.
    """
    loop = asyncio.get_running_loop()
    accepted: list[socket.socket] = []
    listeners = runner.app.get(_LISTENERS, []) if runner.app is not None else []
    for listener in listeners:
        loop.remove_reader(listener.fileno())  # asyncio accepts nothing more from it
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.warning("accepting the last connections failed: %s", exc)
                break
            conn.setblocking(False)
            accepted.append(conn)
    listeners.clear()  # stop_listening may run twice; the sites close the sockets
    # No await between the last accept and the close: BaseSite.stop closes the listening socket
    # before it yields, so a handshake can only complete in that one-syscall gap.
    for site in list(runner.sites):
        await site.stop()
    taken: list[Any] = []
    for conn in accepted:
        with contextlib.suppress(OSError):
            transport, _ = await loop.connect_accepted_socket(runner.server, conn)
            taken.append(transport)
    deadline = loop.time() + settle
    # Every open connection, not only those just taken in: one accepted a moment before may
    # still carry a request on its way, and closing it with those bytes unread resets it. Each
    # closes after its response (`Connection: close`); an idle one is closed at the deadline.
    # A transport offers no event for its closing; aiohttp's handler no hook we may set.
    server = runner.server
    while loop.time() < deadline and (  # noqa: ASYNC110
            any(not t.is_closing() for t in taken)
            or (server is not None and server.connections)):
        await asyncio.sleep(0.01)


async def close_gracefully(runner: web.AppRunner) -> None:
    """Stop listening (see `stop_listening`), let the handlers in progress finish, then close
    every connection. Call it once the work the server waits for is done."""
    await stop_listening(runner)
    await runner.cleanup()


async def start_side_port(host: str, port: int, *, readiness: Readiness,
                          registry: CollectorRegistry,
                          state: StateView | None = None) -> tuple[web.AppRunner, str]:
    """An HTTP server with only the ops routes (see `add_ops_routes`); returns what `serve_app`
    returns."""
    app = web.Application()
    add_ops_routes(app, readiness=readiness, registry=registry, state=state)
    return await serve_app(app, host, port)
