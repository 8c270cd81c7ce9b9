"""`kubectl drain` of a node running a stage replica loses no request.

The eviction honours the pool's PodDisruptionBudget; the evicted worker drains its in-flight work
on SIGTERM while the orchestrator stops routing to it (the Pod is terminating); the operator
brings the replica back under the same name on another node.
"""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest

from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.helm import Release
from tests.harness.operator import (
    apply,
    get,
    pipeline_doc,
    pod_url,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)


def _live(kube: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube.kube, ns, selector)
            if not p["metadata"].get("deletionTimestamp")]


def test_kubectl_drain_loses_no_request(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    doc = pipeline_doc("chat", [{
        "name": "llm", "kind": "ar", "model": "tiny-llama", "finalOutput": True, "replicas": 2,
        "engine": {"maxTokens": 8}, "drainTimeoutSeconds": 30,
    }], orchestrator={"api": ["chat"]})
    apply(kube, namespace, doc)

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", "chat"), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 600, "chat Ready", operator.log_tail, interval=1)
    [orch] = _live(kube, namespace, f"{k.LABEL_PIPELINE}=chat,{k.LABEL_COMPONENT}=orchestrator")
    replicas = _live(kube, namespace, k.stage_selector("chat"))
    victim = next(p for p in replicas if p["spec"]["nodeName"] != orch["spec"]["nodeName"])
    node = victim["spec"]["nodeName"]
    with pod_url(podrunner, orch, 8000) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        _drain_under_load(kube, namespace, operator, client, victim, node)


def _drain_under_load(kube: Cluster, namespace: str, operator: Release, client: openai.OpenAI,
                      victim: dict[str, Any], node: str) -> None:
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
                results.append("ok")
                stop.wait(0.05)  # steady traffic that leaves the two cores room for probes
            except Exception as exc:  # every failure is a lost request
                results.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(results) >= 8, 60, "load running")

        def budget() -> dict[str, Any]:
            return (get(kube, namespace, "pdb", "chat-llm") or {}).get("status") or {}

        def pod_states() -> str:
            return kube.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout

        wait_for(lambda: budget().get("disruptionsAllowed") == 1, 60,
                 "the disruption budget to allow one eviction",
                 lambda: f"{budget()}\n{pod_states()}")
        kube.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
                     "--pod-selector", f"{k.LABEL_PIPELINE}=chat", "--timeout=180s",
                     timeout=240)

        def replaced() -> dict[str, Any] | None:
            for p in _live(kube, namespace, k.stage_selector("chat")):
                if p["metadata"]["name"] == victim["metadata"]["name"] and \
                        p["metadata"]["uid"] != victim["metadata"]["uid"] and \
                        k.condition_status(p, "Ready") == "True":
                    return p
            return None

        back = wait_for(replaced, 300, "the replica back under its name", operator.log_tail,
                        interval=1)
        assert back["spec"]["nodeName"] != node  # the drained node is cordoned
        during = len(results)
        wait_for(lambda: len(results) >= during + 8, 60, "load after the drain")
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        kube.kubectl("uncordon", node, check=False)
    failures = [r for r in results if r != "ok"]
    assert not failures, failures[:5]
    assert len(results) >= 16
