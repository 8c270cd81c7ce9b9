"""Level-triggered reconciliation of OmniPipelines and StagePools.

kopf event handlers feed the view (omni_operator.view), which keeps an in-memory copy of the
watched objects and tells the controller what each change calls a reconcile for; a coalescing
work queue (omni_operator.workqueue) reconciles each key, one at a time per key. Every
reconcile (omni_operator.pipeline_reconciler, omni_operator.pool_reconciler) compares desired
with observed state and writes only differences (omni_operator.writes), so a resync of an
unchanged world makes no write calls.

The Controller owns those pieces and wires them together: each keeps its own state, and what
one asks of another (an enqueue, a reconcile, an event) goes through the Controller's methods,
so there is one place that decides what it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from omni_operator.admin_credential import AdminCredential
from omni_operator.autoscaler import Autoscaler
from omni_operator.network_policy import NetworkPolicySettings
from omni_operator.pipeline_reconciler import FINALIZER, PipelineReconciler
from omni_operator.pool_reconciler import CREATE_EXPECTED_SECONDS, PoolReconciler
from omni_operator.view import LIST_PAGE, WATCHED, Key, Obj, ObjectView, meta_key, viewed
from omni_operator.workqueue import RETRY_CAP, WorkQueue
from omni_operator.writes import (
    ANNOTATION_APPLIED,
    STATUS_COALESCE_SECONDS,
    PermanentError,
    Writes,
    applied_intent,
    merge_patch,
    owners,
    owns,
    permanent,
    removed,
)
from omnistage.backoff import Backoff
from omnistage.kubeapi import ApiError, KubeApi, namespace_terminating

log = logging.getLogger("omnistage.operator")

# The names other modules and the tests import from here, wherever they live now.
__all__ = [
    "ANNOTATION_APPLIED",
    "CREATE_EXPECTED_SECONDS",
    "FINALIZER",
    "LIST_PAGE",
    "RETRY_CAP",
    "STATUS_COALESCE_SECONDS",
    "WATCHED",
    "Controller",
    "Key",
    "PermanentError",
    "applied_intent",
    "merge_patch",
    "namespace_terminating",
    "owners",
    "owns",
    "permanent",
    "removed",
    "viewed",
]


class Controller:
    """The operator's reconcile loop: the view, the work queue, the write layer and the two
    reconcilers, and the routing between them (ViewOwner and QueueOwner for the view and the
    queue; the Scheduler every piece enqueues through)."""

    def __init__(self, api: KubeApi, *, resync_seconds: float = 30.0, workers: int = 8,
                 autoscaler: bool = True, retry: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 network_policy: NetworkPolicySettings | None = None,
                 admin: AdminCredential | None = None) -> None:
        self.api = api
        self.resync_seconds = resync_seconds
        self.view = ObjectView(api, self)
        self.writes = Writes(api, self.view, self, clock=clock)
        self.queue = WorkQueue(self, self.view, self.writes, workers=workers, retry=retry,
                               clock=clock)
        # Off (--no-autoscaler): pools keep the size they have; HPA/KEDA may drive them.
        self.autoscaling = autoscaler
        # Each pipeline's NetworkPolicies: what `omnistage operator` was told (on by default,
        # command.py); None here, as in tests that build a Controller, makes none.
        # admin: the root of the orchestrators' admin keys (None: one made for this life).
        self.pipeline_reconciler = PipelineReconciler(self.view, self.writes, self,
                                                      network_policy, admin)
        self.pool_reconciler = PoolReconciler(self.view, self.writes, self, Autoscaler(self),
                                              clock=clock)
        self.reconciles = 0
        self._tasks: list[asyncio.Task[None]] = []  # the resync loop and the autoscaler

    @property
    def autoscaler(self) -> Autoscaler:
        """Sizes pools with spec.stage.autoscaling; the pool reconciler reports its decisions
        (one reference, there, so a replaced autoscaler is the one both use)."""
        return self.pool_reconciler.autoscaler

    @autoscaler.setter
    def autoscaler(self, scaler: Autoscaler) -> None:
        self.pool_reconciler.autoscaler = scaler

    # ---- the view, as the autoscaler and the handlers read it ------------------------------

    @property
    def pipelines(self) -> dict[tuple[str, str], Obj]:
        """The view's OmniPipelines by (namespace, name)."""
        return self.view.pipelines

    @property
    def pools(self) -> dict[tuple[str, str], Obj]:
        """The view's StagePools by (namespace, name)."""
        return self.view.pools

    @property
    def pods(self) -> dict[tuple[str, str], dict[str, Obj]]:
        """The view's pods by (namespace, pool or orchestrator), then by name."""
        return self.view.pods

    @property
    def children(self) -> dict[tuple[str, str, str], Obj]:
        """The view's other children by (kind, namespace, name)."""
        return self.view.children

    def watched(self, kind: str, event_type: str | None, obj: Obj) -> None:
        """One event of kopf's watch of `kind` (type None: an object of its listing)."""
        self.view.watched(kind, event_type, obj)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Drop an object the API server says is gone (a 404) from the view."""
        self.view.forget(kind, namespace, name)

    def seen(self, kind: str, obj: Obj, gone: bool) -> None:
        """ViewOwner: what the other pieces remember of an object follows it."""
        key = meta_key(obj)
        if gone:
            self.writes.forget((kind, *key))
        if kind == "OmniPipeline":
            if gone:
                self.pool_reconciler.pipeline_gone(key)
        elif kind == "StagePool":
            if gone:
                self.pool_reconciler.pool_gone(key)
            self.autoscaler.observe(obj, gone)
        elif kind == "Pod":
            self.pool_reconciler.pod_seen(obj, gone)

    def _event(self, obj: Obj, etype: str, reason: str, message: str) -> None:
        """An event on an object (the autoscaler's too), recorded in the background."""
        self.writes.event(obj, etype, reason, message)

    # ---- the queue ---------------------------------------------------------------------------

    def enqueue(self, key: Key) -> None:
        """Scheduler: reconcile `key` (once, however often it is asked before it runs)."""
        self.queue.enqueue(key)

    def enqueue_later(self, key: Key, delay: float) -> None:
        """Scheduler: reconcile `key` after `delay` seconds (the earliest pending one wins)."""
        self.queue.enqueue_later(key, delay)

    async def reconcile(self, key: Key) -> None:
        """QueueOwner: one reconcile of the object `key` names, if the view still has it."""
        self.reconciles += 1
        kind, ns, name = key
        if kind == "OmniPipeline":
            obj = self.view.pipelines.get((ns, name))
            if obj is not None:
                await self.pipeline_reconciler.reconcile(obj)
        else:
            obj = self.view.pools.get((ns, name))
            if obj is not None:
                await self.pool_reconciler.reconcile(obj)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def prime(self, namespaces: list[str] | None = None) -> None:
        """Fill the view with one list per kind before any reconcile runs (ObjectView.prime)."""
        await self.view.prime(namespaces)

    def start(self) -> None:
        """Workers, the resync loop and (unless off) the autoscaler, once the view is primed."""
        self.queue.start()
        self._tasks = [asyncio.create_task(self._resync())]
        if self.autoscaling:
            self._tasks.append(asyncio.create_task(self.autoscaler.run()))

    async def stop(self) -> None:
        """Cancel every task and timer (events in flight too), then close the clients."""
        tasks: list[asyncio.Future[Any]] = [*self.queue.cancel(), *self._tasks]
        for task in self._tasks:
            task.cancel()
        tasks += self.writes.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.autoscaler.close()
        await self.api.close()

    async def _resync(self) -> None:
        """Every resync period: check the view (ObjectView.confirm_primed), then reconcile every
        pipeline and pool that is not backing off."""
        while True:
            await asyncio.sleep(self.resync_seconds)
            try:
                await self.view.confirm_primed()
            except ApiError as exc:
                log.warning("checking primed objects failed: %s", exc)
            self.queue.resync([*(("OmniPipeline", ns, name) for ns, name in self.view.pipelines),
                               *(("StagePool", ns, name) for ns, name in self.view.pools)])
