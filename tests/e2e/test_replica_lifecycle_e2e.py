"""Replica and orchestrator lifecycle on the cluster (the real control plane, the local pod
runner), under bounded loopback load with every request counted (tests/harness/load.py):

- `kill -9` of the worker in a stage pod: the pod runner restarts the container at the same
  address, as a kubelet does with restartPolicy Always; each request in flight on it is failed
  over to the other replica (none fails, none hangs), and the restarted replica takes work again;
- a deleted orchestrator pod: nothing admitted is lost; the gap until the Deployment's
  replacement serves is measured and reported.

Requests go to orchestrator pod IPs; a Service is emulated by `Endpoints` over the orchestrator
pods that are Ready and not terminating.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.load import Endpoints, Load, longest_gap, summary
from tests.harness.metrics import sample
from tests.harness.operator import Operator, apply, get, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(600)

NAME = "life"
ROUTE = f"/v1/pipelines/{NAME}/requests"
ORCH_PORT = 8000
ORCH_ADMIN_PORT = 8001  # the admin listener (its default: port + 1): /metrics is there


def _live(kube: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube.kube, ns, selector)
            if not p["metadata"].get("deletionTimestamp")]


def _orchestrators(kube: Cluster, ns: str) -> list[dict[str, Any]]:
    return _live(kube, ns, f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator")


def _url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{ORCH_PORT}"


def _report(name: str, results: list[Any], **extra: Any) -> dict[str, Any]:
    figures = {**summary(results), "longest_gap_s": round(longest_gap(results), 3), **extra}
    print(f"\n[{name}] {figures}")
    return figures


def test_crashed_worker_and_deleted_orchestrator_under_load(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator) -> None:
    if not podrunner.local:
        pytest.skip("kills a pod's process by pid: needs the local pod runner")
    apply(kube, namespace, pipeline_doc(NAME, [{
        "name": "a", "kind": "echo", "replicas": 2, "finalOutput": True,
        "engine": {"echoDelayMs": 300}, "drainTimeoutSeconds": 20,
    }], orchestrator={"auth": {"disabled": True}, "api": ["generic"]}))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", NAME), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, f"{NAME} Ready", operator.log_tail, interval=1)
    _kill_9_of_a_worker(kube, podrunner, namespace)
    _deleted_orchestrator_pod(kube, podrunner, namespace, operator)


def _kill_9_of_a_worker(kube: Cluster, podrunner: PodRunner, namespace: str) -> None:
    [orch] = _orchestrators(kube, namespace)
    victim = next(p for p in _live(kube, namespace, k.stage_selector(NAME))
                  if p["metadata"]["name"] == f"{NAME}-a-1")

    def state() -> dict[str, Any]:
        return json.loads(podrunner.http_get(victim, k.WORKER_HTTP_PORT, "/state")[1])

    with Load(lambda: _url(orch), ROUTE, {"prompt": "x"}, clients=4) as load:
        load.wait_for(20)
        before = wait_for(lambda: (s := state())["in_flight"] >= 1 and s, 30,
                          "requests in flight on the victim")
        os.kill(before["pid"], signal.SIGKILL)
        killed = time.monotonic()

        def restarted() -> dict[str, Any] | None:
            pod = get(kube, namespace, "pod", f"{NAME}-a-1") or {}
            statuses = pod.get("status", {}).get("containerStatuses") or [{}]
            if statuses[0].get("restartCount", 0) >= 1 and \
                    k.condition_status(pod, "Ready") == "True":
                return pod
            return None

        pod = wait_for(restarted, 120, "the container restarted in place and Ready",
                       lambda: podrunner.log_tail(namespace, f"{NAME}-a-1"), interval=0.2)
        back = time.monotonic()
        assert pod["metadata"]["uid"] == victim["metadata"]["uid"]  # the same pod
        assert pod["status"]["podIP"] == victim["status"]["podIP"]  # at the same address
        after = state()
        assert after["incarnation"] != before["incarnation"] and after["pid"] != before["pid"]

        def admitted() -> float:
            text = podrunner.http_get(pod, k.WORKER_HTTP_PORT, "/metrics")[1]
            return sample(text, "omnistage_worker_admitted_total") or 0

        wait_for(lambda: admitted() > 0, 60, "the restarted replica to take work again")
        serving = time.monotonic()
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    figures = _report("kill -9 of a worker in a pod", results,
                      restarted_ready_s=round(back - killed, 3),
                      serving_again_s=round(serving - killed, 3))
    failed = [r for r in results if r.kind == "failed"]
    # The requests in flight on the killed process were failed over to the other replica
    # (docs/architecture.md, "Failover"): none failed, and the orchestrator counted the retries.
    assert not failed, failed[:3]
    retried = sample(podrunner.http_get(orch, ORCH_ADMIN_PORT, "/metrics")[1],
                     "omnistage_orchestrator_retries_total", stage="a") or 0
    assert retried >= 1, "no request was in flight on the killed worker"
    assert figures["hung"] == figures["reset"] == figures["refused"] == 0, figures
    assert figures["unreachable"] == figures["unavailable"] == 0, figures


def _deleted_orchestrator_pod(kube: Cluster, podrunner: PodRunner, namespace: str,
                              operator: Operator) -> None:
    [old] = _orchestrators(kube, namespace)

    def backends() -> list[str]:
        return [_url(p) for p in _orchestrators(kube, namespace)
                if k.condition_status(p, "Ready") == "True"]

    with Endpoints(backends, period=0.2) as endpoints, \
            Load(endpoints.pick, ROUTE, {"prompt": "x"}, clients=4) as load:
        load.wait_for(20)
        kube.kubectl("delete", "pod", "-n", namespace, old["metadata"]["name"], "--wait=false")
        deleted = time.monotonic()

        def replacement() -> dict[str, Any] | None:
            fresh = [p for p in _orchestrators(kube, namespace)
                     if p["metadata"]["uid"] != old["metadata"]["uid"]
                     and k.condition_status(p, "Ready") == "True"]
            return fresh[0] if fresh else None

        new = wait_for(replacement, 300, "a Ready replacement orchestrator", operator.log_tail,
                       interval=0.2)
        ready_at = time.monotonic()
        wait_for(lambda: _url(new) in endpoints.ready, 30, "the replacement in endpoints")
        load.wait_for(load.count() + 20, timeout=120)
        wait_for(lambda: not [p for p in pods(kube.kube, namespace)
                              if p["metadata"]["uid"] == old["metadata"]["uid"]], 120,
                 "the old orchestrator pod gone")
        gone_at = time.monotonic()
        results = load.snapshot()
    first_ok = min((r.sent + r.seconds for r in results
                    if r.kind == "ok" and r.target == _url(new)), default=float("nan"))
    figures = _report("deleted orchestrator pod", results,
                      replacement_ready_s=round(ready_at - deleted, 3),
                      first_ok_on_replacement_s=round(first_ok - deleted, 3),
                      old_pod_gone_s=round(gone_at - deleted, 3))
    # Nothing admitted is lost: every request either succeeded or was never sent (no ready
    # endpoint during the gap).
    assert figures["failed"] == figures["reset"] == figures["hung"] == 0, \
        [r for r in results if r.kind in ("failed", "reset", "hung")][:5]
    assert figures["refused"] == 0, [r for r in results if r.kind == "refused"][:5]
    ends = [e for e in podrunner.events() if e.get("pod") == old["metadata"]["name"]
            and e.get("namespace") == namespace]
    assert ends and all(e["exitCode"] == 0 and e.get("sentSignal") != "SIGKILL" for e in ends), \
        ends
