"""Waking a stage at zero replicas: the orchestrator holds a request for it and asks a Waker.

Why a Protocol: the orchestrator does not place replicas. On Kubernetes it asks the operator
(StagePoolWaker patches the pool's wake annotation; the operator scales the pool up on the watch
event); under `omnistage serve` the local autoscaler starts a process (CallbackWaker). The
engine calls a waker at most once per WAKE_INTERVAL_S per stage, and a failed wake only logs:
the held requests still end by their deadline.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from omnistage import kube

if TYPE_CHECKING:
    from omnistage.kubeapi import KubeApi

__all__ = ["WAKE_INTERVAL_S", "CallbackWaker", "StagePoolWaker", "Waker", "waker_for"]

WAKE_INTERVAL_S = 1.0
"""The engine asks to wake one stage at most this often (the contract's once per second)."""


class Waker(Protocol):
    async def wake(self, stage: str) -> None:
        """Ask for the stage to get a replica; returns once asked (not once it is up)."""
        ...


class CallbackWaker:
    """In process: calls fn(stage) (a plain or async function)."""

    def __init__(self, fn: Callable[[str], Awaitable[None] | None]) -> None:
        self.fn = fn

    async def wake(self, stage: str) -> None:
        result = self.fn(stage)
        if inspect.isawaitable(result):
            await result


class StagePoolWaker:
    """On Kubernetes: a merge patch of the StagePool's wake annotation (its Role grants patch on
    the pipeline's own pools only). api() gives the client (the membership's, once started)."""

    def __init__(self, api: Callable[[], KubeApi | None], namespace: str, pipeline: str,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.api = api
        self.namespace = namespace
        self.pipeline = pipeline
        self.now = now

    async def wake(self, stage: str) -> None:
        from omnistage.kubeapi import path

        client = self.api()
        if client is None:
            raise RuntimeError("no Kubernetes client yet (the membership has not started)")
        stamp = self.now().astimezone(UTC).isoformat(timespec="milliseconds")
        url = path("StagePool", self.namespace, kube.pool_name(self.pipeline, stage))
        await client.patch(url, {"metadata": {"annotations": {
            kube.ANNOTATION_WAKE_REQUESTED: stamp.replace("+00:00", "Z")}}})


def waker_for(membership: object) -> Waker | None:
    """The waker that goes with a membership: on Kubernetes the StagePool annotation (with the
    membership's client); a static membership has nobody to ask."""
    from omnistage.orchestrator.k8s_membership import KubernetesMembership

    if isinstance(membership, KubernetesMembership):
        return StagePoolWaker(lambda: membership.api, membership.namespace, membership.pipeline)
    return None
