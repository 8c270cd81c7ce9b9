"""An autoscaled echo pool on the cluster in image mode scales 1 -> 3 -> 0 -> 1 under load
with no request lost (issue 21).

The operator is installed by the Helm chart (tests/e2e/conftest.py) and every pod runs in its
image under the pod runner. What is real: the orchestrator's load signal (GET /v1/load, read
by the operator's autoscaler), the decision, the scale subresource, the pool's reconcile (pods
created, drained and deleted), the hold of a request for a stage at zero and its wake (the
orchestrator's annotation on the pool, the operator's reaction on the pool's watch event).

The load is closed-loop (tests/harness/load.py): 4 clients on a 1 s echo. Little's law on what
the stage carries (arrivals/s x time in the stage, queue included) is about 4 requests at once,
so with inflightPerReplica 1 the pool goes to its maxReplicas 3. With the load gone, the pool
is idle and goes to zero after idleSeconds; one request then wakes it to 1.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from omnistage import kube as k
from omnistage.kubeapi import resource_path
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.helm import Release
from tests.harness.load import Load, summary
from tests.harness.operator import apply, get, pipeline_doc, pod_url, wait_for

pytestmark = pytest.mark.timeout(900)

NAME = "autoe2e"
ROUTE = f"/v1/pipelines/{NAME}/requests"
ORCH_PORT = 8000
IDLE_S = 30  # long enough that the pool seeded at 1 usually meets the load before it sleeps


def _pool(kube: Cluster, ns: str) -> dict[str, Any]:
    return kube.kube.get(resource_path(k.API_VERSION, "stagepools", ns, f"{NAME}-a"),
                         ignore=(404,)) or {}


def _ready_pods(kube: Cluster, ns: str) -> int:
    return sum(1 for p in pods(kube.kube, ns, k.stage_selector(NAME))
               if not p["metadata"].get("deletionTimestamp")
               and k.condition_status(p, "Ready") == "True")


def _diagnose(kube: Cluster, runner: PodRunner, ns: str, operator: Release) -> str:
    pool = _pool(kube, ns)
    out = [json.dumps({"spec.replicas": pool.get("spec", {}).get("replicas"),
                       "status": pool.get("status")}, indent=1)]
    for pod in pods(kube.kube, ns):
        name = pod["metadata"]["name"]
        out.append(f"--- {name} {pod.get('status', {}).get('phase')}\n"
                   f"{runner.log_tail(ns, name, lines=15)}")
    out.append(operator.log_tail(30))
    return "\n".join(out)


@contextmanager
def _recorded(kube: Cluster, ns: str) -> Iterator[list[int]]:
    """The pool's spec.replicas each time it changed (read every 0.25 s), as a list."""
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            n = _pool(kube, ns).get("spec", {}).get("replicas")
            if isinstance(n, int) and (not seen or seen[-1] != n):
                seen.append(n)
            stop.wait(0.25)

    thread = threading.Thread(target=poll, daemon=True, name="replicas")
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(30)


def _in_order(seen: list[int], wanted: list[int]) -> bool:
    """`wanted` occurs in `seen` in order (other sizes may come between)."""
    it = iter(seen)
    return all(any(n == w for n in it) for w in wanted)


def _post(base: str, prompt: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(base + ROUTE, data=json.dumps({"prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.status, json.loads(resp.read())


def test_an_autoscaled_pool_goes_1_3_0_1_under_load_without_losing_a_request(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    apply(kube, namespace, pipeline_doc(NAME, [{
        "name": "a", "kind": "echo", "finalOutput": True, "replicas": 1,
        "engine": {"echoDelayMs": 1000}, "drainTimeoutSeconds": 30,
        "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "periodSeconds": 2,
                        "windowSeconds": 6, "coolDownSeconds": 0, "idleSeconds": IDLE_S,
                        "target": {"inflightPerReplica": 1}},
    }], orchestrator={"auth": {"disabled": True}, "api": ["generic"]}))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", NAME), "Ready")
        return bool(cond and cond["status"] == "True")

    def why() -> str:
        return _diagnose(kube, podrunner, namespace, operator)

    wait_for(ready, 300, f"{NAME} Ready", why, interval=1)
    [orch] = [p for p in pods(kube.kube, namespace,
                              f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator")
              if not p["metadata"].get("deletionTimestamp")]
    with _recorded(kube, namespace) as seen, pod_url(podrunner, orch, ORCH_PORT) as base:
        # 1 -> 3 under load (from 1, or from 0 if the seeded replica slept before the load
        # came: then the first requests are held and wake it, which loses nothing either).
        with Load(lambda: base, ROUTE, {"prompt": "x"}, clients=4, pause=0.0,
                  timeout=300) as load:
            wait_for(lambda: _pool(kube, namespace).get("spec", {}).get("replicas") == 3,
                     300, "the pool scaled to 3 under load", why, interval=1)
            wait_for(lambda: _ready_pods(kube, namespace) == 3, 300, "3 ready replicas", why,
                     interval=1)
            served = load.count()
            load.wait_for(served + 8, timeout=120)  # the 3 replicas take the load
        results = load.snapshot()
        figures = summary(results)
        print(f"\n[autoscale e2e load] {figures}")
        assert figures["ok"] > 0 and all(figures[kind] == 0 for kind in (
            "aborted", "refused", "failed", "reset", "unreachable", "hung", "unavailable")), \
            [r for r in results if r.kind != "ok"][:5]

        # No load: idle for idleSeconds, the pool drains to zero (no stage pod left).
        wait_for(lambda: _pool(kube, namespace).get("spec", {}).get("replicas") == 0,
                 IDLE_S + 180, "the idle pool at zero", why, interval=1)
        wait_for(lambda: _ready_pods(kube, namespace) == 0 and not [
            p for p in pods(kube.kube, namespace, k.stage_selector(NAME))], 180,
            "no stage pod at zero", why, interval=1)
        # Asleep, the stage still serves (through the hold and the wake): Ready (IdleAtZero).
        wait_for(ready, 60, f"{NAME} Ready at zero", why, interval=1)

        # One request at zero is held and wakes the pool to 1; it succeeds.
        status, body = _post(base, "wake")
        assert status == 200 and body["children"][0]["outputs"]["a"]["fields"]["text"] == \
            "wake", body
        wait_for(lambda: _in_order(seen, [1, 3, 0, 1]), 30, "the sizes 1, 3, 0, 1 in order",
                 lambda: f"seen {seen}\n{why()}")
    assert max(seen) == 3, seen  # never past maxReplicas
    kube.kubectl("delete", "omnipipe", "-n", namespace, NAME, "--wait=false")
