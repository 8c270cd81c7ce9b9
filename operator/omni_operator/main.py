"""`omnistage operator`: kopf watches, the controller reconciles, /metrics counts API writes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from aiohttp import web

from omni_operator.controller import Controller
from omni_operator.handlers import register
from omnistage.kubeapi import KubeApi, KubeConfig
from omnistage.metrics import CONTENT_TYPE, Family, render

log = logging.getLogger("omnistage.operator")


def operator_metrics(controller: Controller) -> str:
    writes = Family("omnistage_operator_api_writes_total", "counter",
                    "Write calls (POST/PATCH/PUT/DELETE) the operator made to the API server")
    writes.add(controller.api.writes)
    by_verb = Family("omnistage_operator_api_writes_by_verb_total", "counter",
                     "Write calls by HTTP verb")
    for verb, n in sorted(controller.api.writes_by_verb.items()):
        by_verb.add(n, verb=verb)
    return render([
        writes, by_verb,
        Family("omnistage_operator_reconciles_total", "counter", "Reconcile passes")
        .add(controller.reconciles),
    ])


async def _serve_metrics(controller: Controller, host: str, port: int) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=operator_metrics(controller).encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz)])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def run(kubeconfig: str | None, metrics_host: str, metrics_port: int,
              resync_seconds: float, namespaces: list[str]) -> None:
    config = KubeConfig.load(kubeconfig)
    controller = Controller(KubeApi(config, user_agent="omnistage-operator"),
                            resync_seconds=resync_seconds)
    registry = kopf.OperatorRegistry()
    register(registry, controller)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own events only: kopf posting handler logs as events would be idle writes.
        settings.posting.enabled = False
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return config.connection_info()

    await controller.prime(namespaces)
    controller.start()
    runner = await _serve_metrics(controller, metrics_host, metrics_port)
    log.info("operator metrics on http://%s:%d/metrics", metrics_host, metrics_port)
    try:
        await kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
        )
    finally:
        await controller.stop()
        await runner.cleanup()


def main(args: Any) -> int:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    asyncio.run(run(args.kubeconfig, args.metrics_host, args.metrics_port, args.resync_seconds,
                    list(args.namespace or [])))
    return 0
