"""The autoscaler on the REAL control plane: a fake orchestrator load drives a pool 1 -> 3 -> 1.

The operator runs as a real process with its load hook (omni_operator.autoscaler.LOAD_URL_ENV)
pointed at a tiny HTTP server on loopback that serves GET /v1/load with figures the test sets:
reaching a real orchestrator's load needs its pod, which the decision and the writes under test
do not. What is real: the API server, the CRDs (the spec's CEL rules), the scale subresource,
the pool's reconcile (pods created, and removed on scale-down), the status and the Events.
The last test drops the hook: the operator reads each orchestrator pod (a real Deployment's
pods on kwok nodes, at their loopback pod IPs) where a FakeLoadServer stands in for it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_operator.autoscaler import FIELD_MANAGER, LOAD_URL_ENV
from omnistage import kube as k
from omnistage.autoscaling import ANNOTATION_WAKE_REQUESTED
from omnistage.kubeapi import path, resource_path
from tests.cluster.test_operator import KWOK
from tests.cluster.test_operator_writes import _sa_kubeconfig
from tests.harness.cluster import Cluster, pods
from tests.harness.fakeload import FakeLoadServer, stage_load
from tests.harness.kubeclient import Kube
from tests.harness.local import free_port
from tests.harness.operator import Operator, apply, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(300)
NAME = "auto"


class FakeLoad(FakeLoadServer):
    """Serves /<namespace>/<pipeline>/v1/load: stage a at the figures `set` gives."""

    def __init__(self) -> None:
        super().__init__(document=lambda _path: self.document())

    def set(self, arrivals_per_s: float, service_s: float = 1.0) -> None:
        self.stages = {"a": stage_load(inflight=round(arrivals_per_s * service_s),
                                       arrivals_per_s=arrivals_per_s, service_s=service_s)}


@pytest.fixture(scope="module")
def load() -> Iterator[FakeLoad]:
    fake = FakeLoad()
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def operator(kube: Cluster, crds: None, load: FakeLoad,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """This module's own operator, its load read from the fake."""
    op = Operator(kube, tmp_path_factory.mktemp("operator") / "operator.log", webhook=False,
                  env={LOAD_URL_ENV: load.url})
    op.start()
    yield op
    op.stop()


def _pool(kube: Cluster, namespace: str) -> dict[str, Any]:
    """The pool as the API returns it (managedFields included)."""
    return kube.kube.get(resource_path(k.API_VERSION, "stagepools", namespace, f"{NAME}-a"),
                         ignore=(404,)) or {}


def _replicas(kube: Cluster, namespace: str) -> tuple[int | None, int]:
    """(spec.replicas, live pods) of the pool."""
    live = [p for p in pods(kube.kube, namespace, k.stage_selector(NAME))
            if not p["metadata"].get("deletionTimestamp")]
    return _pool(kube, namespace).get("spec", {}).get("replicas"), len(live)


def _decision(kube: Cluster, namespace: str) -> str | None:
    return ((_pool(kube, namespace).get("status") or {}).get("autoscaler") or {}).get("decision")


def _events(kube: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    items = kube.kube.get(resource_path("v1", "events", namespace))["items"]
    return [e for e in items if e.get("reason") == reason]


def test_a_pool_follows_its_load_1_3_1(kube: Cluster, namespace: str, operator: Operator,
                                       load: FakeLoad) -> None:
    load.set(arrivals_per_s=0.5)
    # On the kwok nodes: a pool does not grow while a replica cannot be placed, and a fresh
    # cluster may have no other node that takes pods.
    stage = {"name": "a", "kind": "echo", "finalOutput": True, "placement": KWOK,
             "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "periodSeconds": 1,
                             "coolDownSeconds": 0}}
    apply(kube, namespace, pipeline_doc(NAME, [stage], orchestrator=dict(KWOK)))
    wait_for(lambda: _pool(kube, namespace).get("status", {}).get("autoscaler"), 60,
             "the autoscaler's first decision", operator.log_tail)
    assert _replicas(kube, namespace)[0] == 1
    wait_for(lambda: [p for p in pods(kube.kube, namespace, k.stage_selector(NAME))
                      if k.condition_status(p, "PodScheduled") == "True"], 180,
             "the first replica scheduled", operator.log_tail)

    load.set(arrivals_per_s=3.0)  # Little's law: 3/s x 1 s / 1 per replica = 3
    wait_for(lambda: _replicas(kube, namespace) == (3, 3), 60, "3 replicas", operator.log_tail)
    # The status follows in the pool's reconcile (after its pods).
    wait_for(lambda: _decision(kube, namespace) == "scale up 1 -> 3", 30, "the decision shown",
             operator.log_tail)
    pool = _pool(kube, namespace)
    scaler = pool["status"]["autoscaler"]
    assert scaler["lastDirection"] == "Up"
    assert scaler["inputs"]["arrivalsPerSecond"] == 3.0
    assert any(m["manager"] == FIELD_MANAGER and m.get("subresource") == "scale"
               for m in pool["metadata"]["managedFields"])
    cond = next(c for c in pool["status"]["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("True", "Active")

    # Steady: periods pass, the load is read, nothing is written.
    start, reads = operator.log_offset(), load.reads
    wait_for(lambda: load.reads >= reads + 3, 30, "3 more periods")
    assert [w for w in operator.write_lines(start) if "/scale" in w] == []
    [up] = _events(kube, namespace, "Autoscaled")
    assert up["message"].startswith("scale up 1 -> 3") and up.get("count", 1) == 1

    columns = kube.kubectl("get", "-n", namespace, "sp", f"{NAME}-a").stdout.splitlines()
    assert columns[0].split()[:8] == ["NAME", "PIPELINE", "STAGE", "DESIRED", "CURRENT",
                                      "READY", "DRAINING", "AUTOSCALER"]
    assert "scale up 1 -> 3" in columns[1]

    load.set(arrivals_per_s=0.5)
    wait_for(lambda: _replicas(kube, namespace) == (1, 1), 90, "back to 1 replica",
             operator.log_tail)
    wait_for(lambda: sorted(e["message"].split(":")[0]
                            for e in _events(kube, namespace, "Autoscaled"))
             == ["scale down 3 -> 1", "scale up 1 -> 3"], 30, "one event per change")
    wait_for(lambda: _decision(kube, namespace) == "scale down 3 -> 1", 30,
             "the decision shown", operator.log_tail)
    assert _pool(kube, namespace)["status"]["autoscaler"]["lastDirection"] == "Down"


def test_the_crd_refuses_what_the_validator_refuses(kube: Cluster, namespace: str,
                                                    operator: Operator) -> None:
    """The CEL rules (the webhook is off here) carry the cross-field checks, at the same paths."""
    stage = {"name": "a", "kind": "echo", "finalOutput": True, "replicas": 5,
             "autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": {}}}
    doc = pipeline_doc("bad", [stage])
    proc = kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0
    for where, text in (("spec.stages[0].autoscaling.minReplicas",
                         "minReplicas must be at most maxReplicas (got 3 > 2)"),
                        ("spec.stages[0].autoscaling.target", "set exactly one of"),
                        ("spec.stages[0].replicas",
                         "must be within [minReplicas, maxReplicas] (got 5, bounds [3, 2])")):
        assert where in proc.stderr and text in proc.stderr, proc.stderr


def test_a_wake_scales_a_pool_at_zero_and_only_the_orchestrator_s_own_pools_may_be_woken(
        kube: Cluster, namespace: str, operator: Operator, load: FakeLoad,
        tmp_path: Path) -> None:
    """A sleeping pool (minReplicas 0, idle) is Ready at zero; the wake annotation, written
    with the orchestrator's own ServiceAccount, brings it to 1 at once (its period is long)."""
    load.set(arrivals_per_s=0.0)
    stage = {"name": "a", "kind": "echo", "finalOutput": True,
             "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "periodSeconds": 1,
                             "idleSeconds": 1, "coolDownSeconds": 0}}
    apply(kube, namespace, pipeline_doc(NAME, [stage]))
    wait_for(lambda: _replicas(kube, namespace) == (0, 0), 60, "idle to zero", operator.log_tail)
    ready = next(c for c in _pool(kube, namespace)["status"]["conditions"]
                 if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "IdleAtZero")

    # The period is now an hour: only the wake can bring it up within the wait below. Nothing
    # is held either (a held request at zero would wake the pool on its next period).
    stage["autoscaling"]["periodSeconds"] = 3600
    reads = load.reads
    apply(kube, namespace, pipeline_doc(NAME, [stage]))
    wait_for(lambda: (_pool(kube, namespace)["spec"]["stage"]["autoscaling"]["periodSeconds"]
                      == 3600), 30, "the pool's new period")
    wait_for(lambda: load.reads >= reads + 1, 30, "a period under the new spec")
    account = f"system:serviceaccount:{namespace}:{NAME}-orchestrator"
    wait_for(lambda: kube.kubectl("auth", "can-i", "patch", f"stagepools/{NAME}-a", "-n",
                                  namespace, f"--as={account}", check=False).stdout.strip()
             == "yes", 30, "the orchestrator's Role")
    assert kube.kubectl("auth", "can-i", "patch", "stagepools/other-a", "-n", namespace,
                        f"--as={account}", check=False).stdout.strip() == "no"
    stamp = "2099-01-01T00:00:00Z"  # newer than any scale-down
    # What the orchestrator sends, with its own token: a merge patch of the annotation (it may
    # not even read the pool).
    as_orchestrator = Kube.from_kubeconfig(_sa_kubeconfig(
        kube, namespace, f"{NAME}-orchestrator", tmp_path / "orchestrator.kubeconfig"))
    as_orchestrator.patch(path("StagePool", namespace, f"{NAME}-a"),
                          {"metadata": {"annotations": {ANNOTATION_WAKE_REQUESTED: stamp}}})
    wait_for(lambda: _replicas(kube, namespace) == (1, 1), 30, "woken to 1", operator.log_tail)
    [woken] = wait_for(lambda: _events(kube, namespace, "Woken"), 30, "the Woken event")
    assert "woken" in woken["message"]


def test_an_hpa_on_an_autoscaled_pool_is_refused(kube: Cluster, namespace: str,
                                                operator: Operator, load: FakeLoad) -> None:
    load.set(arrivals_per_s=3.0)
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "external"},
           "spec": {"scaleTargetRef": {"apiVersion": k.API_VERSION, "kind": "StagePool",
                                       "name": f"{NAME}-a"},
                    "minReplicas": 1, "maxReplicas": 2,
                    "metrics": [{"type": "Resource", "resource": {
                        "name": "cpu", "target": {"type": "Utilization",
                                                  "averageUtilization": 50}}}]}}
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(hpa))
    stage = {"name": "a", "kind": "echo", "finalOutput": True,
             "autoscaling": {"maxReplicas": 3, "periodSeconds": 1}}
    apply(kube, namespace, pipeline_doc(NAME, [stage]))

    def refused() -> bool:
        conds = _pool(kube, namespace).get("status", {}).get("conditions") or []
        return any(c["type"] == "Autoscaling" and c["reason"] == "ExternalAutoscaler"
                   for c in conds)

    wait_for(refused, 90, "Autoscaling False ExternalAutoscaler", operator.log_tail)
    [event] = wait_for(lambda: _events(kube, namespace, "ExternalAutoscaler"), 30,
                       "the ExternalAutoscaler event")
    assert event["type"] == "Warning" and "external" in event["message"]
    assert _replicas(kube, namespace)[0] == 1  # the load asks 3: left to the HPA


# ---- several orchestrators (issue 37) --------------------------------------------------------


@contextlib.contextmanager
def _reading_pods(operator: Operator) -> Iterator[None]:
    """The operator without its load hook for a while: it reads the orchestrator pods."""
    env = dict(operator.env)
    operator.stop()
    operator.env = {k: v for k, v in env.items() if k != LOAD_URL_ENV}
    operator.start()
    try:
        yield
    finally:
        operator.stop()
        operator.env = env
        operator.start()


def _orchestrators(kube: Cluster, namespace: str, pipeline: str,
                   count: int) -> list[dict[str, Any]]:
    """The pipeline's `count` orchestrator pods once each is Ready with a pod IP."""
    selector = f"{k.LABEL_PIPELINE}={pipeline},{k.LABEL_COMPONENT}=orchestrator"

    def ready() -> list[dict[str, Any]] | None:
        found = [p for p in pods(kube.kube, namespace, selector)
                 if not p["metadata"].get("deletionTimestamp")
                 and (p.get("status") or {}).get("podIP")
                 and k.condition_status(p, "Ready") == "True"]
        return found if len(found) == count else None

    found = wait_for(ready, 120, f"{count} Ready orchestrator pods of {pipeline}")
    assert all(p["status"]["podIP"].startswith("127.") for p in found)  # loopback only
    return found


def _spec_replicas(kube: Cluster, namespace: str, pool: str) -> int | None:
    return (kube.kube.get(resource_path(k.API_VERSION, "stagepools", namespace, pool),
                          ignore=(404,)) or {}).get("spec", {}).get("replicas")


def _autoscaler_status(kube: Cluster, namespace: str, pool: str) -> dict[str, Any]:
    doc = kube.kube.get(resource_path(k.API_VERSION, "stagepools", namespace, pool),
                        ignore=(404,)) or {}
    return (doc.get("status") or {}).get("autoscaler") or {}


def test_two_orchestrators_size_pools_as_one_and_keep_a_stage_either_sends_to(
        kube: Cluster, namespace: str, operator: Operator) -> None:
    """Issue 37: the same total load through one orchestrator (pipeline solo) and through two
    (pipeline duo, half each) sizes stage a the same (within one replica); stage b of duo,
    which only one of its orchestrators sends to at a time (x, then y), is never scaled to zero,
    though the other reports it idle for far longer than its idleSeconds; each decision names
    both orchestrators. Each orchestrator pod's GET /v1/load is a FakeLoadServer at the pod's
    own loopback IP and the orchestrator's admin port, read by the operator straight, as it
    reads a real one (tests/cluster/test_admin_listener.py: a real one, with its key). Kills:
    an autoscaler that reads one orchestrator of two."""
    if not kube.is_local:
        pytest.skip("serves /v1/load at kwok's loopback pod IPs: local control plane only")
    port = free_port()
    admin_port = free_port()
    while admin_port == port:
        admin_port = free_port()
    a = {"name": "a", "kind": "echo", "placement": KWOK,
         "autoscaling": {"minReplicas": 1, "maxReplicas": 6, "periodSeconds": 1,
                         "coolDownSeconds": 0}}
    b = {"name": "b", "kind": "echo", "inputs": ["a"], "finalOutput": True, "placement": KWOK,
         "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "periodSeconds": 1,
                         "idleSeconds": 1, "coolDownSeconds": 0}}
    servers: list[FakeLoadServer] = []

    def serve(pod: dict[str, Any]) -> FakeLoadServer:
        server = FakeLoadServer(pod["status"]["podIP"], admin_port)
        server.clock = time.time
        servers.append(server)
        return server

    def busy(arrivals_per_s: float) -> Any:
        return stage_load(inflight=round(arrivals_per_s), arrivals_per_s=arrivals_per_s,
                          service_s=1.0, exec_s=1.0, last_request_unix=time.time())

    with _reading_pods(operator):
        try:
            for name, count in (("solo", 1), ("duo", 2)):
                apply(kube, namespace, pipeline_doc(name, [dict(a), dict(b)], orchestrator={
                    **KWOK, "replicas": count, "port": port, "adminPort": admin_port}))
            [solo] = [serve(p) for p in _orchestrators(kube, namespace, "solo", 1)]
            x, y = [serve(p) for p in sorted(_orchestrators(kube, namespace, "duo", 2),
                                             key=lambda p: p["metadata"]["name"])]
            solo.stages = {"a": busy(4.0), "b": busy(1.0)}
            x.stages = {"a": busy(2.0), "b": busy(1.0)}  # x sends to b, y does not
            y.stages = {"a": busy(2.0), "b": stage_load()}

            wait_for(lambda: _spec_replicas(kube, namespace, "solo-a") == 4, 90,
                     "solo-a sized 4 on its one orchestrator", operator.log_tail)
            wait_for(lambda: abs((_spec_replicas(kube, namespace, "duo-a") or 0) - 4) <= 1, 60,
                     "duo-a sized within one of solo-a on two orchestrators' load",
                     operator.log_tail)
            scaler = wait_for(lambda: (_autoscaler_status(kube, namespace, "duo-a")
                                       .get("inputs", {}).get("orchestratorsRead") == 2
                                       and _autoscaler_status(kube, namespace, "duo-a")), 30,
                              "duo-a's decision on both orchestrators", operator.log_tail)
            assert scaler["inputs"]["arrivalsPerSecond"] == 4.0
            assert "read 2 orchestrators (duo-orchestrator-" in scaler["reason"], scaler

            # b: x sends, y idle; then the other way round. Each phase lasts several periods
            # (reads counted at both fakes), each far past b's idleSeconds for the idle one.
            for sender, idle in ((x, y), (y, x)):
                sender.stages = {**sender.stages, "b": busy(1.0)}
                idle.stages = {**idle.stages, "b": stage_load(last_request_unix=time.time() - 60)}
                def periods(start: int = x.reads + y.reads) -> bool:
                    return x.reads + y.reads >= start + 10

                wait_for(periods, 60, "5 periods or more", operator.log_tail)
            downs = [e["message"] for e in _events(kube, namespace, "Autoscaled")
                     if e["involvedObject"]["name"] == "duo-b" and "-> 0" in e["message"]]
            assert downs == [], downs
            assert _spec_replicas(kube, namespace, "duo-b") == 1
            assert x.reads > 0 and y.reads > 0  # each orchestrator read, not one of them
            assert _spec_replicas(kube, namespace, "duo-a") == 4  # steady at solo's size
        finally:
            for server in servers:
                server.close()
