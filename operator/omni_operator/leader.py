"""Leader election on a coordination.k8s.io Lease: one operator replica reconciles at a time.

Why a Lease we manage, not kopf's peering: the operator is more than kopf's handlers. The
controller runs its own caches and resync loop, which kopf's peering would not pause, and
peering needs two more CRDs (KopfPeering, ClusterKopfPeering) and is a priority scheme rather
than a lock. A Lease gates the whole operator: a standby replica primes nothing and writes
nothing until it holds the Lease.

The rules are client-go's leaderelection: a Lease is free when it has no holder, or when its
record (holder, renewTime) has not changed for ``lease_seconds`` as measured by OUR clock since
we first saw it, so clock skew between replicas does not matter. Every write carries the
resourceVersion it read, so two candidates can never both win. The leader renews every
``retry_seconds``; if it cannot renew for ``renew_deadline`` (shorter than the lease) it stops
leading before anyone else may take over. On a graceful stop it releases the Lease (no holder),
so a rollout hands over at once instead of after a lease period.

The elector uses its own API client, so its renewals never count as the controller's writes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage import backoff
from omnistage.kubeapi import ApiError, KubeApi, resource_path

log = logging.getLogger("omnistage.operator.leader")
Obj = dict[str, Any]


class LeadershipLost(RuntimeError):
    """The Lease could not be renewed within the renew deadline."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElector:
    api: KubeApi
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_deadline: float = 10.0
    retry_seconds: float = 2.0
    leading: bool = False
    _observed: tuple[Any, ...] | None = field(default=None, repr=False)
    _observed_at: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not self.retry_seconds < self.renew_deadline < self.lease_seconds:
            raise ValueError("need retry_seconds < renew_deadline < lease_seconds")

    @property
    def path(self) -> str:
        return resource_path("coordination.k8s.io/v1", "leases", self.namespace, self.name)

    def _spec(self, acquire: bool, transitions: int) -> Obj:
        now = _now()
        spec: Obj = {"holderIdentity": self.identity,
                     "leaseDurationSeconds": int(self.lease_seconds), "renewTime": now,
                     "leaseTransitions": transitions}
        if acquire:
            spec["acquireTime"] = now
        return spec

    def _free(self, spec: Obj) -> bool:
        """No holder, or a record that has not moved for a whole lease duration (our clock)."""
        record = (spec.get("holderIdentity"), spec.get("renewTime"),
                  spec.get("leaseDurationSeconds"))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        if not spec.get("holderIdentity"):
            return True
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        return time.monotonic() - self._observed_at > duration

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True while we hold the Lease."""
        try:
            lease = await self.api.get(self.path, ignore=(404,))
            if lease is None:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace},
                        "spec": self._spec(acquire=True, transitions=0)}
                created = await self.api.create(
                    resource_path("coordination.k8s.io/v1", "leases", self.namespace), body,
                    ignore=(409,))
                return created is not None
            spec = lease.get("spec") or {}
            ours = spec.get("holderIdentity") == self.identity
            if not ours and not self._free(spec):
                return False
            transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
            lease["spec"] = {**spec, **self._spec(acquire=not ours, transitions=transitions)}
            # The resourceVersion we read makes this a compare-and-swap: 409 means we lost.
            return await self.api.replace(self.path, lease, ignore=(409,)) is not None
        except (TimeoutError, ApiError, OSError) as e:
            log.warning("lease %s/%s: %s", self.namespace, self.name, e)
            return False

    async def acquire(self) -> None:
        """Wait (as a standby) until we hold the Lease."""
        log.info("waiting for the lease %s/%s as %s", self.namespace, self.name, self.identity)
        while True:
            if await self.try_acquire_or_renew():
                break
            # A fixed period, as client-go's JitterUntil: retry_seconds stretched by up to 20%,
            # so standbys started together do not ask in lockstep.
            await asyncio.sleep(backoff.delay(0, self.retry_seconds, self.retry_seconds, 0.2))
        self.leading = True
        log.info("leading: holding the lease %s/%s as %s", self.namespace, self.name,
                 self.identity)

    async def hold(self) -> None:
        """Renew until a renewal fails for ``renew_deadline``; then raise LeadershipLost."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.retry_seconds)
            if await self.try_acquire_or_renew():
                last = time.monotonic()
            elif time.monotonic() - last > self.renew_deadline:
                self.leading = False
                raise LeadershipLost(
                    f"lease {self.namespace}/{self.name} not renewed for {self.renew_deadline}s")

    async def release(self) -> None:
        """Give the Lease up (no holder), so a standby takes over without waiting it out."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.api.get(self.path, ignore=(404,))
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**lease["spec"], "holderIdentity": None,
                             "leaseDurationSeconds": 1, "renewTime": _now()}
            await self.api.replace(self.path, lease, ignore=(409,))
            log.info("released the lease %s/%s", self.namespace, self.name)
        except (TimeoutError, ApiError, OSError) as e:
            log.warning("releasing the lease %s/%s: %s", self.namespace, self.name, e)
