"""Failover on the cluster (issue 22): `kill -9` of a stage replica's worker under load costs no
request when failover is on, and costs the requests bound to it when it is off.

The real control plane, the operator as a process and the local pod runner (run with
OMNISTAGE_POD_MODE=process): a two-stage echo pipeline, two replicas per stage, closed-loop
clients on the orchestrator pod. In each stage the worker of a replica that holds a request is
killed by pid (its /state says the pid); the pod runner restarts it in place, as a kubelet does.
The second test is the first one's control: with spec.orchestrator.failover.maxRetries: 0 the same
kills must fail requests with `replica_lost`, which shows that the kills hit requests in flight
(so the first test's "0 failed" is failover's doing and not a missed kill).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.load import Load, Result, summary
from tests.harness.metrics import sample
from tests.harness.operator import Operator, apply, get, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(600)

NAME = "fokill"
ROUTE = f"/v1/pipelines/{NAME}/requests"
ORCH_PORT = 8000
ADMIN_PORT = 8001  # the admin listener (adminPort's default): /metrics, open there
STAGES = ("a", "b")


def _live(kube: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube.kube, ns, selector)
            if not p["metadata"].get("deletionTimestamp")]


def _kill_one_replica_per_stage(kube: Cluster, podrunner: PodRunner, namespace: str,
                                operator: Operator, max_retries: int | None
                                ) -> tuple[list[Result], dict[str, float]]:
    """Run the pipeline under load, SIGKILL one busy replica of each stage, wait until both are
    back and serving; (every request's result, the orchestrator's retries per stage)."""
    # Not about keys (test_curve_cluster checks keys on by default): the API serves without.
    orchestrator: dict[str, Any] = {"api": ["generic"], "auth": {"disabled": True}}
    if max_retries is not None:
        orchestrator["failover"] = {"maxRetries": max_retries}
    echo = {"kind": "echo", "replicas": 2, "engine": {"echoDelayMs": 300},
            "drainTimeoutSeconds": 20}
    apply(kube, namespace, pipeline_doc(NAME, [
        {"name": "a", **echo}, {"name": "b", "inputs": ["a"], "finalOutput": True, **echo},
    ], orchestrator=orchestrator))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", NAME), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, f"{NAME} Ready", operator.log_tail, interval=1)
    [orch] = _live(kube, namespace, f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator")
    url = f"http://{orch['status']['podIP']}:{ORCH_PORT}"

    def state(pod: dict[str, Any]) -> dict[str, Any]:
        return json.loads(podrunner.http_get(pod, k.WORKER_HTTP_PORT, "/state")[1])

    with Load(lambda: url, ROUTE, {"prompt": "x"}, clients=6) as load:
        load.wait_for(10)
        victims = []
        for stage in STAGES:
            replicas = _live(kube, namespace, f"{k.stage_selector(NAME)},{k.LABEL_STAGE}={stage}")
            assert len(replicas) == 2, [p["metadata"]["name"] for p in replicas]

            def busy(replicas: list[dict[str, Any]] = replicas) -> tuple[Any, ...] | None:
                for pod in replicas:
                    if (s := state(pod))["in_flight"] >= 1:
                        return pod, s
                return None

            pod, before = wait_for(busy, 30, f"a request in flight on a replica of {stage}")
            os.kill(before["pid"], signal.SIGKILL)
            victims.append((pod, before))

        for pod, before in victims:
            name = pod["metadata"]["name"]

            def back(name: str = name, before: dict[str, Any] = before) -> bool:
                now = get(kube, namespace, "pod", name) or {}
                if k.condition_status(now, "Ready") != "True":
                    return False
                try:
                    return state(now)["incarnation"] != before["incarnation"]
                except OSError:
                    return False

            wait_for(back, 180, f"{name} restarted in place and Ready",
                     lambda name=name: podrunner.log_tail(namespace, name),  # type: ignore[misc]
                     interval=0.5)
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    metrics = podrunner.http_get(orch, ADMIN_PORT, "/metrics")[1]
    retries = {s: sample(metrics, "omnistage_orchestrator_retries_total", stage=s) or 0.0
               for s in STAGES}
    print(f"\n[kill -9, maxRetries {max_retries}] {summary(results)} retries {retries}")
    return results, retries


def test_kill_9_of_a_replica_of_each_stage_under_load_fails_no_request(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    """Failover on (the default maxRetries): every request answers 200, and the orchestrator
    counted a retry at each stage (the requests on each killed replica ran again elsewhere)."""
    if not podrunner.local:
        pytest.skip("kills a pod's process by pid: needs the local pod runner")
    results, retries = _kill_one_replica_per_stage(kube, podrunner, namespace, operator, None)
    bad = [r for r in results if r.kind != "ok"]
    assert not bad, bad[:3]
    assert all(retries[s] >= 1 for s in STAGES), retries


def test_without_failover_the_same_kills_fail_requests(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    """maxRetries: 0, the same scenario: the requests on the killed replicas fail with 502
    replica_lost and nothing is retried. This is the test above with failover off: it shows the
    kills hit requests in flight."""
    if not podrunner.local:
        pytest.skip("kills a pod's process by pid: needs the local pod runner")
    results, retries = _kill_one_replica_per_stage(kube, podrunner, namespace, operator, 0)
    lost = [r for r in results if r.kind == "failed" and r.code == "replica_lost"]
    assert len(lost) >= 2, summary(results)  # at least the one held at each stage
    assert retries == {s: 0.0 for s in STAGES}, retries
