"""`omnistage operator`: kopf watches, the controller reconciles, /metrics counts API writes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kopf
from prometheus_client.core import CounterMetricFamily, Metric

from omni_operator import admin_credential, webhook
from omni_operator.admin_credential import AdminCredential
from omni_operator.controller import Controller
from omni_operator.handlers import at_fleet_size, register
from omni_operator.leader import LeaderElector
from omni_operator.network_policy import MONITORING_NAMESPACE, NetworkPolicySettings, OperatorPeer
from omnistage.kubeapi import KubeApi, KubeConfig, WriteLimit, default_namespace
from omnistage.metrics import family, new_registry
from omnistage.sideport import start_side_port

log = logging.getLogger("omnistage.operator")


@dataclass(frozen=True)
class Limits:
    """What protects the API server: reconciles at once, and the writes' token bucket
    (write_qps 0: no limit). No defaults here: the flags' are the only ones (command.py)."""

    workers: int
    write_qps: float
    write_burst: int


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
        limit = getattr(api, "write_limit", None)  # a test's stand-in client may have none
        if limit is not None:
            yield family(CounterMetricFamily, "omnistage_operator_write_limit_wait_seconds_total",
                         "Seconds API writes waited for the write rate limit, summed", {},
                         [((), limit.waited)])


async def run(kubeconfig: str | None, metrics_host: str, metrics_port: int,
              resync_seconds: float, namespaces: list[str],
              lease: tuple[str, str, str] | None = None,
              admission: webhook.WebhookSettings | None = None,
              context: str | None = None, *, limits: Limits, autoscaler: bool = True,
              network_policy: NetworkPolicySettings | None = None,
              admin: AdminCredential | None = None,
              curve_propagation: float | None = None) -> int:
    """Run the operator; with ``lease`` (namespace, name, identity) only while holding it.
    admin: the root of the orchestrators' admin keys (admin_credential.load; None: one made
    for this run). curve_propagation: --curve-propagation (None: the default)."""
    admission = admission or webhook.WebhookSettings(enabled=False)
    config = KubeConfig.load(kubeconfig, context)
    write_limit = (WriteLimit(limits.write_qps, limits.write_burst)
                   if limits.write_qps > 0 else None)
    controller = Controller(
        KubeApi(config, user_agent="omnistage-operator", write_limit=write_limit,
                pool_size=max(64, limits.workers * 2)),  # connections for the waves in flight
        resync_seconds=resync_seconds, workers=limits.workers, autoscaler=autoscaler,
        network_policy=network_policy,
        # One credential for the controller: the pipeline reconciler hands each orchestrator
        # pod its digest, and the autoscaler (and the drain's pin wait) presents the key.
        admin=admin or admin_credential.load(None))
    if curve_propagation is not None:
        controller.pipeline_reconciler.curve_propagation_s = curve_propagation
    _say_network_policy(network_policy)
    if not autoscaler:
        log.info("the built-in autoscaler is off (--no-autoscaler): pools keep their size")
    log.info("reconciling %d at once; writes limited to %s", limits.workers,
             f"{limits.write_qps:g}/s, burst {limits.write_burst}" if write_limit else "nothing")
    if lease is None:
        return await _operate(config, controller, metrics_host, metrics_port, namespaces, None,
                              admission=admission)
    elector = LeaderElector(KubeApi(config, user_agent="omnistage-operator-leader"), *lease)
    primed = False
    # Only the leader's pod carries the label the chart's webhook Service selects (set with
    # either client config, so `kubectl get pods -L omnistage.io/webhook` shows who serves).
    own_pod = _own_pod() if admission.enabled else None
    serving = False

    def readiness() -> tuple[bool, str]:
        # A standby is ready: a rollout must be able to bring it up before the leader goes.
        if not elector.leading:
            return True, "standby"
        return (True, "leading") if primed else (False, "priming caches")

    # The side port comes first here, so a standby answers its probes.
    runner, url = await start_side_port(
        metrics_host, metrics_port, readiness=readiness,
        registry=new_registry(OperatorCollector(controller)))
    log.info("operator metrics on %s/metrics", url)
    try:
        await webhook.mark_serving(elector.api, own_pod, serving=False)
        await elector.acquire()
        await webhook.mark_serving(elector.api, own_pod, serving=True)
        serving = True
        hold = asyncio.create_task(elector.hold())
        stop = asyncio.Event()

        def on_primed() -> None:
            nonlocal primed
            primed = True

        work = asyncio.create_task(
            _operate(config, controller, None, None, namespaces, stop, on_primed,
                     admission=admission))
        done, _ = await asyncio.wait({hold, work}, return_when=asyncio.FIRST_COMPLETED)
        if hold in done:
            log.error("%s: stopping", hold.exception())
            stop.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(work, elector.lease_seconds - elector.renew_deadline)
            return 1
        hold.cancel()
        return work.result()
    finally:
        if serving:  # also after losing the lease: a standby-to-be must leave the Service
            await webhook.mark_serving(elector.api, own_pod, serving=False)
        await elector.release()
        await elector.api.close()
        await runner.cleanup()


def network_policy_settings(enabled: bool, pod_labels: dict[str, str],
                            namespace: str | None,
                            monitoring_namespace: str | None = MONITORING_NAMESPACE
                            ) -> NetworkPolicySettings:
    """The --network-policy flags as the builders take them: the operator's pods are a peer
    only when their labels are given (an operator outside a pod has none to give); their
    namespace defaults to the pod's own ($POD_NAMESPACE, the chart's downward-API env).
    monitoring_namespace: --monitoring-namespace ("" or None: none)."""
    namespace = namespace or os.environ.get("POD_NAMESPACE")
    monitoring = monitoring_namespace or None
    if not enabled or not pod_labels:
        return NetworkPolicySettings(enabled=enabled, monitoring_namespace=monitoring)
    if not namespace:
        raise ValueError("--operator-pod-labels needs --operator-namespace (or $POD_NAMESPACE)")
    return NetworkPolicySettings(enabled=True, operator=OperatorPeer(namespace, pod_labels),
                                 monitoring_namespace=monitoring)


def _say_network_policy(settings: NetworkPolicySettings | None) -> None:
    """One line at start: what the pipelines' NetworkPolicies admit, or that there are none."""
    if settings is None or not settings.enabled:
        log.info("network policies: off (--no-network-policy): the operator makes none")
        return
    monitoring = (f"pods in namespace {settings.monitoring_namespace}"
                  if settings.monitoring_namespace else "no monitoring namespace")
    if settings.operator is None:
        log.warning("network policies: the operator's own pods are not known "
                    "(--operator-pod-labels): no pod is admitted to the stage pods' side "
                    "port, nor for the operator to the orchestrators' admin port (%s are), so "
                    "where a CNI enforces the policies a drain cannot read /state and waits out "
                    "its timeout, and the autoscaler reads no load", monitoring)
    else:
        peer = settings.operator
        log.info("network policies: on; the stage pods' side port admits pods %s in %s; the "
                 "orchestrators' admin port admits them and %s",
                 ",".join(f"{k}={v}" for k, v in sorted(peer.pod_labels.items())),
                 peer.namespace, monitoring)


def _own_pod() -> tuple[str, str] | None:
    """(namespace, name) of the pod this operator runs in (the chart's downward-API env)."""
    name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
    return (namespace, name) if name and namespace else None


async def _operate(config: KubeConfig, controller: Controller, metrics_host: str | None,
                   metrics_port: int | None, namespaces: list[str],
                   stop: asyncio.Event | None, on_primed: Any = None,
                   admission: webhook.WebhookSettings | None = None) -> int:
    """Prime the caches, start the controller and run kopf until it stops (SIGTERM) or
    ``stop`` is set. Without a side port given, the caller serves it."""
    registry = kopf.OperatorRegistry()
    register(registry, controller)
    admission = admission or webhook.WebhookSettings(enabled=False)
    if admission.enabled:
        webhook.register(registry, admission)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own events only: kopf posting handler logs as events would be idle writes.
        settings.posting.enabled = False
        at_fleet_size(settings)
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        # Serving named namespaces only: no cluster-wide reads (kopf would otherwise watch
        # CRDs and namespaces), so the chart's namespaced RBAC needs nothing cluster-wide.
        settings.scanning.disabled = bool(namespaces)
        if admission.enabled:
            webhook.configure(settings, admission)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        # The controller's credentials: kopf logs in again when their expiration passes (an
        # exec plugin's token) or the server refuses them, and gets renewed ones. Sync on
        # purpose: kopf runs it in a thread, where a plugin may take its time.
        return config.connection_info()

    await controller.prime(namespaces)
    controller.start()
    if on_primed is not None:
        on_primed()
    runner = None
    if metrics_host is not None and metrics_port is not None:
        # Started once the caches are primed, so /readyz answering means it can reconcile.
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
            stop_flag=stop,
        )
    finally:
        await controller.stop()
        if runner is not None:
            await runner.cleanup()
    return 0


def main(args: Any) -> int:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    lease = None
    if args.leader_elect:
        # A renewal every retry period is not news: keep the write log to reconciles.
        logging.getLogger("omnistage.kubeapi.writes").addFilter(
            lambda record: "/leases/" not in record.getMessage())
        identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        lease = (args.leader_elect_namespace or default_namespace(), args.leader_elect_name,
                 identity)
    admission = webhook.WebhookSettings(
        enabled=args.webhook, addr=args.webhook_addr, port=args.webhook_port,
        host=args.webhook_host, service=args.webhook_service, cert_dir=args.webhook_cert_dir,
        failure_policy=args.webhook_failure_policy,
    )
    limits = Limits(workers=args.workers, write_qps=args.write_qps, write_burst=args.write_burst)
    try:
        policies = network_policy_settings(args.network_policy, args.operator_pod_labels,
                                           args.operator_namespace, args.monitoring_namespace)
        admin = admin_credential.load(args.admin_key_file)
    except ValueError as exc:  # admin_credential.AdminCredentialError too: it names the file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not admin.ephemeral:
        log.info("admin key: the root from %s (each pipeline's key derived from it)",
                 admin.source)
    return asyncio.run(run(args.kubeconfig, args.metrics_host, args.metrics_port,
                           args.resync_seconds, list(args.namespace or []), lease, admission,
                           args.context, limits=limits, autoscaler=args.autoscaler,
                           network_policy=policies, admin=admin,
                           curve_propagation=args.curve_propagation))
