"""Drain-style retirement by the operator on the real control plane with the local pod runner,
when the operator's environment names an HTTP proxy (a cluster behind one) that refuses.

The operator reads each retiring worker's /state straight from its pod IP. Read through the
environment's proxy, the proxy's refusal looked like "nothing listens there" (0 in flight), and a
replica was deleted about a second after its drain mark, with its request still running.

The scenario and its checks are the scale-down e2e test's (tests/e2e/test_drain_e2e.py, one
source), run here with a shorter hold, in whichever pod mode the session uses.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from omnistage import kube as k
from tests.e2e.test_drain_e2e import (
    ECHO,
    _deleted_only_after_its_request,
    _held_pipeline,
    _hold_one_on_each,
    _live,
)
from tests.harness.cluster import Cluster, PodRunner
from tests.harness.operator import Operator

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def operator(
    kube: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`omnistage operator` (this module's only one) whose environment names an HTTP proxy that
    refuses every connection (a port bound and never listening) and exempts no host from it.
    Its API calls are HTTPS and never use the environment's proxy, so only plain-HTTP reads
    could go through it."""
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
        env = {"http_proxy": proxy, "HTTP_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""}
        op = Operator(kube, tmp_path_factory.mktemp("operator") / "operator.log",
                      webhook=False, env=env)
        op.start()
        try:
            yield op
        finally:
            op.stop()


def test_scale_down_behind_a_refusing_proxy_waits_for_the_request_in_flight(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    """Scale 2 -> 1 while a request is held on replica 1: it is marked draining, gets no new
    work, and is deleted only once that request has completed.

    Kills: reading /state through the environment's proxy (the victim deleted about a second
    after its mark, its 30 s request still running), and what the e2e test kills (deleting at
    once, a mark that does not stop routing, a wait that ignores the in-flight work)."""
    if not podrunner.local:
        pytest.skip("reads worker /state on loopback pod IPs: needs the local pod runner")
    delay_ms = 30_000
    url, keep, victim = _held_pipeline(kube, namespace, operator, drain_timeout=600)
    held = _hold_one_on_each(podrunner, url, [keep, victim], delay_ms)
    kube.kubectl("scale", "-n", namespace, f"sp/{ECHO}-a", "--replicas=1")
    _deleted_only_after_its_request(kube, podrunner, namespace, operator, url, victim, keep,
                                    held, held[1], delay_ms)
    assert [p["metadata"]["name"] for p in _live(kube, namespace, k.stage_selector(ECHO))] \
        == [f"{ECHO}-a-0"]
