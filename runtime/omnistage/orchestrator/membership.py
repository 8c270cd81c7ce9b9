"""Membership: which stage replicas exist, where they listen, and whether they may be routed to.

The orchestrator only consumes ReplicaInfo updates. Locally LocalStageRuntime publishes them
through a StaticMembership as it starts and stops processes; on Kubernetes a watch of the
pipeline's Pods does (KubernetesMembership in orchestrator/k8s_membership.py).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

ReplicaState = Literal["joining", "ready", "draining", "gone"]


@dataclass(frozen=True)
class ReplicaInfo:
    stage: str
    name: str  # stable replica identity (pod name locally and on Kubernetes)
    endpoint: str  # ZMQ endpoint, tcp://ip:port
    state: ReplicaState = "ready"
    # Its stage's payload revision and that revision's release order (docs/architecture.md,
    # "Revisions"): on Kubernetes the pod's label and annotation; None where the source does
    # not know it (the replica's hello then says). The highest order of a stage is its newest.
    revision: str | None = None
    order: int = 0
    # The generation of the pipeline's CurveZMQ pair the replica holds (on Kubernetes the pod's
    # annotation; omnistage.curve_keys): the server key to name is that generation's public
    # key. None: the orchestrator's own generation (a static replica, `omnistage serve`).
    curve_generation: int | None = None

    @property
    def routable(self) -> bool:
        """Only ready replicas take new requests; draining ones finish what they have."""
        return self.state == "ready"


OnChange = Callable[[ReplicaInfo], None]


class Membership(ABC):
    """Source of ReplicaInfo updates. `start` must report every replica known so far."""

    @abstractmethod
    async def start(self, on_change: OnChange) -> None: ...

    async def stop(self) -> None:  # noqa: B027 - static sources have nothing to stop
        """Stop watching."""


class StaticMembership(Membership):
    """A fixed or hand-driven set of replicas: the local backend and tests use it."""

    def __init__(self, replicas: Iterable[ReplicaInfo] = ()) -> None:
        self._replicas = {(r.stage, r.name): r for r in replicas}
        self._on_change: OnChange | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        self._loop = asyncio.get_running_loop()
        for info in list(self._replicas.values()):
            on_change(info)

    async def stop(self) -> None:
        """Forget the orchestrator: later publishes only update the recorded set."""
        self._on_change = None
        self._loop = None

    def publish(self, info: ReplicaInfo) -> None:
        """Record a change and tell the orchestrator (thread-safe)."""
        self._replicas[(info.stage, info.name)] = info
        if info.state == "gone":
            self._replicas.pop((info.stage, info.name), None)
        if self._on_change is None or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._on_change(info)
        else:
            self._loop.call_soon_threadsafe(self._on_change, info)

    @property
    def replicas(self) -> list[ReplicaInfo]:
        return list(self._replicas.values())
