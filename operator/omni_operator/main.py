"""`omnistage operator`: kopf watches, the controller reconciles, /metrics counts API writes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import kopf
from prometheus_client.core import CounterMetricFamily, Metric

from omni_operator import webhook
from omni_operator.controller import Controller
from omni_operator.handlers import register
from omnistage.kubeapi import KubeApi, KubeConfig
from omnistage.metrics import family, new_registry
from omnistage.sideport import start_side_port

log = logging.getLogger("omnistage.operator")


class OperatorCollector:
    """The operator's write and reconcile counters, read from the controller when scraped.

    Idle resyncs must write nothing; bench/bench_operator_scale.py and the cluster tests measure
    that through these names.
    """

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        api = self.controller.api
        yield family(CounterMetricFamily, "omnistage_operator_api_writes_total",
                     "Write calls (POST/PATCH/PUT/DELETE) the operator made to the API server",
                     {}, [((), api.writes)])
        yield family(CounterMetricFamily, "omnistage_operator_api_writes_by_verb_total",
                     "Write calls by HTTP verb", {},
                     [((verb,), n) for verb, n in sorted(api.writes_by_verb.items())], ["verb"])
        yield family(CounterMetricFamily, "omnistage_operator_reconciles_total",
                     "Reconcile passes", {}, [((), self.controller.reconciles)])


async def run(kubeconfig: str | None, metrics_host: str, metrics_port: int,
              resync_seconds: float, namespaces: list[str],
              admission: webhook.WebhookSettings | None = None) -> None:
    config = KubeConfig.load(kubeconfig)
    controller = Controller(KubeApi(config, user_agent="omnistage-operator"),
                            resync_seconds=resync_seconds)
    registry = kopf.OperatorRegistry()
    register(registry, controller)
    admission = admission or webhook.WebhookSettings(enabled=False)
    if admission.enabled:
        webhook.register(registry, admission)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own events only: kopf posting handler logs as events would be idle writes.
        settings.posting.enabled = False
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        if admission.enabled:
            webhook.configure(settings, admission)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return config.connection_info()

    await controller.prime(namespaces)
    controller.start()
    # Started once the caches are primed, so /readyz answering means the operator can reconcile.
    runner, url = await start_side_port(
        metrics_host, metrics_port, readiness=lambda: (True, "ready"),
        registry=new_registry(OperatorCollector(controller)))
    log.info("operator metrics on %s/metrics", url)
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
    admission = webhook.WebhookSettings(
        enabled=args.webhook, addr=args.webhook_addr, port=args.webhook_port,
        host=args.webhook_host, service=args.webhook_service, cert_dir=args.webhook_cert_dir,
        failure_policy=args.webhook_failure_policy,
    )
    asyncio.run(run(args.kubeconfig, args.metrics_host, args.metrics_port, args.resync_seconds,
                    list(args.namespace or []), admission))
    return 0
