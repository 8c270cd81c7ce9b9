"""The operational HTTP routes every Omnistage process serves, and how it starts an aiohttp server.

`/livez`, `/readyz`, `/metrics` and `/state` are built from callbacks, so this module knows no
component: the stage worker, the orchestrator's API server and the operator all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from omnistage.metrics import exposition

Readiness = Callable[[], tuple[bool, str]]
"""Returns (ready, reason); the reason is the 503 body when not ready."""

StateView = Callable[[], Mapping[str, Any]]
"""Returns a JSON-serialisable snapshot for people (`/state`)."""


def add_ops_routes(app: web.Application, *, readiness: Readiness,
                   registry: CollectorRegistry, state: StateView | None = None) -> None:
    """Add GET /livez, /readyz, /metrics (and /state when `state` is given) to `app`.

    /livez answers 200 "ok" while the event loop serves HTTP. /readyz answers 200 "ready", or 503
    with the reason from `readiness`. /metrics scrapes `registry` on the event loop, so
    collectors read state that only the loop mutates. The callbacks run on every request.
    """

    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        ok, reason = readiness()
        return web.Response(text="ready") if ok else web.Response(status=503, text=reason)

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = exposition(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    routes = [web.get("/livez", livez), web.get("/readyz", readyz),
              web.get("/metrics", metrics)]
    if state is not None:
        view = state

        async def state_route(_: web.Request) -> web.Response:
            return web.json_response(dict(view()))

        routes.append(web.get("/state", state_route))
    app.add_routes(routes)


async def serve_app(app: web.Application, host: str, port: int,
                    **runner_options: Any) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0 = any free port); returns the runner (await
    `runner.cleanup()` to stop) and the base URL with the port actually bound.

    runner_options go to `web.AppRunner` (for example handler_cancellation=True).
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound}"


async def start_side_port(host: str, port: int, *, readiness: Readiness,
                          registry: CollectorRegistry,
                          state: StateView | None = None) -> tuple[web.AppRunner, str]:
    """An HTTP server with only the ops routes (see `add_ops_routes`); returns what `serve_app`
    returns."""
    app = web.Application()
    add_ops_routes(app, readiness=readiness, registry=registry, state=state)
    return await serve_app(app, host, port)
