"""Events the controller raises from its own decisions, against a recording stand-in API (the
same paths run against a real API server in tests/cluster/test_operator.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_operator import builders
from omni_operator.controller import FINALIZER, Controller
from omni_operator.models import API_VERSION
from omnistage import kube
from omnistage.kubeapi import Applied
from omnistage.spec import parse_pipeline

Obj = dict[str, Any]


class RecordingApi:
    """Answers every write with the object written; keeps the Events and Pods created."""

    def __init__(self) -> None:
        self.events: list[Obj] = []
        self.writes: list[tuple[str, str]] = []
        self.pods: list[str] = []

    async def create(self, url: str, body: Obj, **_: Any) -> Obj:
        if body.get("kind") == "Event":
            self.events.append(body)
        if body.get("kind") == "Pod":
            self.pods.append(body["metadata"]["name"])
        self.writes.append(("create", url))
        return body

    async def patch(self, url: str, body: Any, **_: Any) -> Obj:
        self.writes.append(("patch", url))
        return {"metadata": {}}

    async def delete(self, url: str, body: Any = None, **_: Any) -> Obj:
        self.writes.append(("delete", url))
        return {}

    async def apply(self, url: str, body: Obj, **_: Any) -> Applied:
        self.writes.append(("apply", url))
        return Applied(body, True)

    async def get(self, url: str, **_: Any) -> None:
        return None

    async def close(self) -> None:
        pass


def deleting_pipeline() -> Obj:
    return {"apiVersion": API_VERSION, "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1,
                         "resourceVersion": "5", "finalizers": [FINALIZER],
                         "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}}


async def _settle(controller: Controller) -> None:
    """Let the background event writes run."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_deletion_raises_one_normal_terminating_event() -> None:
    """The ordered shutdown takes many reconciles (one per second while the orchestrator
    drains); the deletion is announced once, as Normal. Kills: no event (docs/crds.md
    promises one), one per reconcile, a Warning, and a repeat after a restart once the status
    says Terminating."""
    api = RecordingApi()
    controller = Controller(api=api)  # type: ignore[arg-type]
    obj = deleting_pipeline()
    oname = builders.orchestrator_name("p")
    # An orchestrator pod still draining: each reconcile writes status and comes back later.
    controller.pods[("ns", oname)] = {f"{oname}-x": {"metadata": {"name": f"{oname}-x"}}}
    for _ in range(3):
        await controller.pipeline_reconciler.shutdown(obj)
    await _settle(controller)
    announced = [e for e in api.events if e["reason"] == "Terminating"]
    assert len(announced) == 1, api.events
    [event] = announced
    assert event["type"] == "Normal"
    assert event["involvedObject"]["kind"] == "OmniPipeline"
    assert "orchestrator drains first" in event["message"]

    # A restarted operator (no memory) finds the status already Terminating: no repeat.
    restarted_api = RecordingApi()
    restarted = Controller(api=restarted_api)  # type: ignore[arg-type]
    restarted.view.pods = controller.view.pods
    await restarted.pipeline_reconciler.shutdown({**obj, "status": {"phase": "Terminating"}})
    await _settle(restarted)
    assert not [e for e in restarted_api.events if e["reason"] == "Terminating"]
    for c in (controller, restarted):  # the 1 s re-checks were scheduled on this loop
        for handle in c.queue._timers.values():
            handle.cancel()


# ---- replicas that go away ------------------------------------------------------------------


def stage_pool(replicas: int) -> Obj:
    doc = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
           "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                "replicas": replicas}]}}
    [pool] = [c for c in builders.pipeline_children(doc, parse_pipeline(doc))
              if c["kind"] == "StagePool"]
    pool["metadata"].update(uid="u2", generation=1, resourceVersion="1")
    return pool


def replica(pool: Obj, ordinal: int, *, ready: bool = True, spec_hash: str | None = None) -> Obj:
    pod = builders.pool_pod(pool, ordinal)
    pod["metadata"]["uid"] = f"pod-{ordinal}"
    if spec_hash is not None:
        pod["metadata"]["annotations"][kube.ANNOTATION_SPEC_HASH] = spec_hash
    flag = "True" if ready else "False"
    pod["status"] = ({"phase": "Running", "podIP": "127.0.0.1", "conditions": [
        {"type": t, "status": flag} for t in ("Ready", "ContainersReady", kube.READINESS_GATE)]}
        if ready else {"phase": "Pending"})
    return pod


def evicted(pod: Obj) -> Obj:
    """The pod as the Eviction API leaves it: DisruptionTarget, then the deletion mark."""
    conditions = [*pod["status"].get("conditions", []),
                  {"type": "DisruptionTarget", "status": "True",
                   "reason": "EvictionByEvictionAPI"}]
    return {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {**pod["status"], "conditions": conditions}}


def controller_with(pool: Obj, pods: list[Obj]) -> tuple[Controller, RecordingApi]:
    api = RecordingApi()
    controller = Controller(api=api)  # type: ignore[arg-type]
    controller.view.observe("StagePool", None, pool)
    for pod in pods:
        controller.view.observe("Pod", "ADDED", pod)
    return controller, api


def reasons(api: RecordingApi) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in api.events]


async def test_an_evicted_replica_comes_back_under_its_own_name() -> None:
    """A pool whose ordinals have a gap (0 and 2: ordinal 1 was retired, then freed by a
    scale-up) loses replica 2 to `kubectl drain`. It comes back as p-a-2, not in the gap as
    p-a-1, and the eviction is reported once, naming it. Kills: the terminating replica's
    ordinal handed to a new pod at once (p-a-1 created, no event: the issue's node drain),
    and the ordinal forgotten once the pod is gone."""
    pool = stage_pool(2)
    pods = [replica(pool, 0), replica(pool, 2)]
    controller, api = controller_with(pool, pods)
    await controller.pool_reconciler.reconcile(pool)
    assert api.pods == []  # converged: two replicas, nothing to create

    controller.view.observe("Pod", "MODIFIED", evicted(pods[1]))
    await controller.pool_reconciler.reconcile(pool)
    assert api.pods == []  # p-a-2 still terminates: its name is not free yet, and 1 is not it
    controller.view.observe("Pod", "DELETED", evicted(pods[1]))
    await controller.pool_reconciler.reconcile(pool)
    await _settle(controller)
    assert api.pods == ["p-a-2"]
    evictions = [e for e in api.events if e["reason"] == "ReplicaEvicted"]
    assert [(e["type"], e["message"]) for e in evictions] == [
        ("Normal", "replica p-a-2 was evicted; replacing it under the same name")]
    assert ("Warning", "ReplicaLost") not in reasons(api)

    # Once it is back, the gap is not remembered for anyone else: a scale-down retires the
    # highest ordinal, and the one after that brings nobody back.
    controller.view.observe("Pod", "ADDED", replica(pool, 2))
    await controller.pool_reconciler.reconcile(pool)
    assert api.pods == ["p-a-2"] and not controller.pool_reconciler._returning.get(("ns", "p-a"))


async def test_a_stale_pending_replica_the_operator_replaces_is_not_reported_evicted() -> None:
    """An out-of-date replica that serves nothing (Pending) is deleted by the operator and
    recreated with the new spec: announced as RollingUpdate when deleted, and nothing more
    when it goes. Kills: reporting the operator's own deletion as ReplicaEvicted (or, for
    that matter, as a lost replica)."""
    pool = stage_pool(1)
    stale = replica(pool, 0, ready=False, spec_hash="0ld")
    controller, api = controller_with(pool, [stale])
    await controller.pool_reconciler.reconcile(pool)
    assert ("delete", "/api/v1/namespaces/ns/pods/p-a-0") in api.writes
    terminating = {**stale, "metadata": {**stale["metadata"],
                                         "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    controller.view.observe("Pod", "MODIFIED", terminating)
    controller.view.observe("Pod", "DELETED", terminating)
    await controller.pool_reconciler.reconcile(pool)
    await _settle(controller)
    assert api.pods == ["p-a-0"]  # back under its name, with the new spec
    assert reasons(api).count(("Normal", "RollingUpdate")) == 1, api.events
    assert not [r for r in reasons(api) if r[1] in ("ReplicaEvicted", "ReplicaLost")], api.events


async def test_a_replica_that_vanishes_unasked_is_a_warning() -> None:
    """The other side: no eviction, no retirement, no operator delete. Kills: the silence
    above extended to every gone replica."""
    pool = stage_pool(2)
    pods = [replica(pool, 0), replica(pool, 1)]
    controller, api = controller_with(pool, pods)
    controller.view.observe("Pod", "DELETED", pods[1])
    await controller.pool_reconciler.reconcile(pool)
    await _settle(controller)
    assert api.pods == ["p-a-1"]
    assert ("Warning", "ReplicaLost") in reasons(api)
