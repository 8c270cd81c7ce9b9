"""The operator's leader election against the real API server's Leases.

Why against the API server: the election is only as good as the server's compare-and-swap
(resourceVersion) and its Lease semantics; a mock would agree with whatever we assumed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from omni_operator.leader import LeaderElector, LeadershipLost
from omnistage.kubeapi import KubeApi, KubeConfig
from tests.harness.cluster import Cluster
from tests.harness.waiting import HANG_GUARD, until

pytestmark = pytest.mark.timeout(120)


def _elector(kube: Cluster, ns: str, identity: str, **timing: float) -> LeaderElector:
    api = KubeApi(KubeConfig.from_kubeconfig(kube.kubeconfig), user_agent=identity)
    return LeaderElector(api, ns, "test-lease", identity,
                         **{"lease_seconds": 3.0, "renew_deadline": 2.0, "retry_seconds": 0.3,
                            **timing})


async def _close(*electors: LeaderElector) -> None:
    for e in electors:
        await e.api.close()


async def test_one_of_many_candidates_leads_and_a_release_hands_over_at_once(
    kube: Cluster, namespace: str
) -> None:
    # A minute's lease: a standby that took over by waiting it out (not by the release) would
    # miss the far guard below, and no load on the machine makes a held lease look free.
    timing = {"lease_seconds": 60.0, "renew_deadline": 30.0}
    electors = [_elector(kube, namespace, f"op-{i}", **timing) for i in range(3)]
    try:
        # Simultaneous attempts: the resourceVersion compare-and-swap lets exactly one win.
        wins = await asyncio.gather(*(e.try_acquire_or_renew() for e in electors))
        assert sum(wins) == 1, wins
        leader = electors[wins.index(True)]
        others = [e for e in electors if e is not leader]
        assert not any([await e.try_acquire_or_renew() for e in others])
        assert await leader.try_acquire_or_renew()  # the holder renews
        leader.leading = True
        refused = {e.identity: 0 for e in others}
        for e in others:
            e.try_acquire_or_renew = _counting(e, refused)  # type: ignore[method-assign]
        waiting = [asyncio.create_task(e.acquire()) for e in others]
        renewing = asyncio.create_task(leader.hold())
        await until(lambda: min(refused.values()) >= 3, "each standby refused three times")
        assert not any(t.done() for t in waiting)  # standbys wait while it renews
        renewing.cancel()
        started = time.monotonic()
        await leader.release()
        done, pending = await asyncio.wait(waiting, timeout=HANG_GUARD,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "exactly one standby takes over"
        # No lease period to wait out after a release (a far guard: half the lease).
        assert time.monotonic() - started < leader.lease_seconds / 2
        for t in pending:
            t.cancel()
        lease = await leader.api.get(leader.path)
        new = next(e for e, t in zip(others, waiting, strict=True) if t in done)
        assert lease["spec"]["holderIdentity"] == new.identity
        assert lease["spec"]["leaseTransitions"] == 1
    finally:
        await _close(*electors)


def _counting(e: LeaderElector, refused: dict[str, int]) -> Callable[[], Awaitable[bool]]:
    """e's attempts, counting the refused ones in refused[e.identity]."""
    attempt = e.try_acquire_or_renew

    async def counted() -> bool:
        won = await attempt()
        refused[e.identity] += not won
        return won

    return counted


async def test_a_silent_leader_is_replaced_after_the_lease_and_stops_leading(
    kube: Cluster, namespace: str
) -> None:
    old, new = _elector(kube, namespace, "old"), _elector(kube, namespace, "new")
    try:
        await old.acquire()
        started = time.monotonic()
        await new.acquire()  # old never renews: new waits out the lease, measured by its clock
        assert time.monotonic() - started >= old.lease_seconds
        # The old leader notices it can no longer renew and stops leading.
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(old.hold(), timeout=10)
        assert not old.leading
    finally:
        await _close(old, new)


def test_timing_must_leave_the_leader_time_to_stop(kube: Cluster) -> None:
    with pytest.raises(ValueError, match="retry_seconds < renew_deadline < lease_seconds"):
        _elector(kube, "default", "x", renew_deadline=5.0, lease_seconds=3.0)
