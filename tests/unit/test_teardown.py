"""A deleting pipeline's ordered shutdown, call by call: the orchestrator drains, then the
pools' budgets go, then their stage pods in one delete-collection, then the pools once their
pods are gone, then the finalizer. Each step is reached through the events of the one before.

The shutdown once left the stage pods to the pools' foreground cascade: the garbage collector
read every pod and its pool back from the API server before deleting it (about five reads per
pod, counted in the API server's audit log of a 2,004-pod teardown), and the budgets, still
there, were counted again by the disruption controller at every event of their pods. A fake
API counts the calls here, so that cost coming back fails (docs/benchmarks.md, the teardown).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omni_operator import builders
from omni_operator.controller import FINALIZER, Controller, Key, removed
from omni_operator.models import API_VERSION
from omnistage import kube
from omnistage.kubeapi import Applied

Obj = dict[str, Any]
NOW = "2026-01-01T00:00:00Z"
NS = "ns"


class RecordingApi:
    """Every call with its path, body and query; writes answer with what they wrote."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any, dict[str, Any]]] = []

    async def delete(self, url: str, body: Any = None, **params: Any) -> Obj:
        """A collection's answer is a list; an object's, the object as it was (no finalizer:
        gone)."""
        self.calls.append(("delete", url, body, params))
        if params.get("labelSelector"):
            return {"kind": "List", "metadata": {}, "items": []}
        return {"metadata": {"name": url.rsplit("/", 1)[-1], "resourceVersion": "7"}}

    async def patch(self, url: str, body: Any, **params: Any) -> Obj:
        self.calls.append(("patch", url, body, params))
        return {"metadata": {"resourceVersion": "9"}}

    async def apply(self, url: str, body: Obj, **params: Any) -> Applied:
        self.calls.append(("apply", url, body, params))
        return Applied(body, False)

    async def create(self, url: str, body: Obj, **params: Any) -> Obj:
        self.calls.append(("create", url, body, params))
        return body

    async def close(self) -> None:
        pass


def _labels(pipeline: str, **more: str) -> dict[str, str]:
    return {kube.LABEL_MANAGED_BY: kube.MANAGED_BY, kube.LABEL_PIPELINE: pipeline, **more}


def _pipeline(name: str) -> Obj:
    return {"apiVersion": API_VERSION, "kind": "OmniPipeline",
            "metadata": {"name": name, "namespace": NS, "uid": f"u-{name}", "generation": 1,
                         "resourceVersion": "5", "finalizers": [FINALIZER],
                         "deletionTimestamp": NOW,
                         "managedFields": [{"manager": builders.FIELD_MANAGER,
                                            "operation": "Apply", "fieldsType": "FieldsV1",
                                            "fieldsV1": {"f:metadata": {"f:finalizers": {
                                                f"v:\"{FINALIZER}\"": {}}}}}]},
            "spec": {}, "status": {"phase": "Terminating"}}


def _pool(pipeline: str, stage: str) -> Obj:
    return {"apiVersion": API_VERSION, "kind": "StagePool",
            "metadata": {"name": kube.pool_name(pipeline, stage), "namespace": NS,
                         "uid": f"{pipeline}/{stage}", "resourceVersion": "1",
                         "labels": _labels(pipeline)},
            "spec": {"pipeline": pipeline, "replicas": 4, "stage": {"name": stage}}}


def _pdb(pipeline: str, stage: str) -> Obj:
    name = kube.pool_name(pipeline, stage)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": NS,
                         "labels": _labels(pipeline, **{kube.LABEL_POOL: name})}}


def _pod(pipeline: str, stage: str, ordinal: int) -> Obj:
    pool = kube.pool_name(pipeline, stage)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{pool}-{ordinal}", "namespace": NS,
                         "uid": f"{pool}-{ordinal}",
                         "labels": _labels(pipeline, **{kube.LABEL_POOL: pool,
                                                        kube.LABEL_COMPONENT: "stage",
                                                        kube.LABEL_ORDINAL: str(ordinal)})},
            "status": {"phase": "Running"}}


class Fleet:
    """A controller whose view holds two deleting pipelines (p, q: 3 pools of 4 pods each,
    with their budgets, the orchestrators already gone), fed through `observe`. The keys it
    enqueues are recorded, not run: each step is driven by hand, as the events drive it."""

    def __init__(self) -> None:
        self.api = RecordingApi()
        self.ctl = Controller(api=self.api)  # type: ignore[arg-type]
        self.enqueued: list[Key] = []
        self.ctl.enqueue = self.enqueued.append  # type: ignore[method-assign]
        self.ctl.enqueue_later = lambda key, delay: None  # type: ignore[method-assign]
        self.pods: dict[str, Obj] = {}
        for name in ("p", "q"):
            self.ctl.view.observe("OmniPipeline", "ADDED", _pipeline(name))
            for stage in "abc":
                self.ctl.view.observe("StagePool", "ADDED", _pool(name, stage))
                self.ctl.view.observe("PodDisruptionBudget", "ADDED", _pdb(name, stage))
                for ordinal in range(4):
                    pod = _pod(name, stage, ordinal)
                    self.pods[pod["metadata"]["name"]] = pod
                    self.ctl.view.observe("Pod", "ADDED", pod)
        self.enqueued.clear()

    async def shutdown(self, name: str = "p") -> list[tuple[str, str, Any, dict[str, Any]]]:
        """One shutdown step of a pipeline; the calls it made."""
        before = len(self.api.calls)
        await self.ctl.pipeline_reconciler.shutdown(self.ctl.pipelines[(NS, name)])
        return self.api.calls[before:]

    def terminating(self, pipeline: str) -> None:
        """The delete-collection's answer, as the watch brings it: every stage pod of the
        pipeline has its deletionTimestamp."""
        for pod in self.pods.values():
            if pod["metadata"]["labels"][kube.LABEL_PIPELINE] == pipeline:
                pod["metadata"]["deletionTimestamp"] = NOW
                self.ctl.view.observe("Pod", "MODIFIED", copy.deepcopy(pod))


def _writes(calls: list[tuple[str, str, Any, dict[str, Any]]]) -> list[tuple[str, str]]:
    return [(verb, url) for verb, url, _, _ in calls if not url.endswith("/status")]


async def test_the_stage_pods_go_in_one_collection_after_the_budgets_and_before_the_pools(
) -> None:
    """Kills: the pods left to the pools' cascade (a pool deleted, or deleted with
    Foreground, while its pods are there), a delete per pod, the budgets left to the cascade
    (or deleted after the pods), a selector that would take another pipeline's pods or the
    orchestrator's, a pool or the finalizer released while a pod is left, and a pool, budget
    or finalizer deleted or released again before its DELETED event came."""
    fleet = Fleet()
    calls = await fleet.shutdown("p")
    assert all(("PodDisruptionBudget", NS, f"p-{s}") not in fleet.ctl.children for s in "abc")
    pdbs = [("delete", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/p-{s}")
            for s in "abc"]
    assert _writes(calls) == [*pdbs, ("delete", f"/api/v1/namespaces/{NS}/pods")]
    [(_, _, body, params)] = [c for c in calls if c[1].endswith("/pods")]
    assert body is None  # each pod with its own grace period, as `kubectl delete` does
    assert params["labelSelector"] == kube.stage_selector("p")

    # The pods terminating: nothing more to delete yet (the budgets left the view with their
    # answers, so they are not deleted again before their DELETED events come).
    fleet.terminating("p")
    assert _writes(await fleet.shutdown("p")) == []

    # All but one pod gone: the pools stay, and no step is asked for before the last one.
    names = sorted(n for n in fleet.pods if n.startswith("p-"))
    fleet.enqueued.clear()
    for name in names[:-1]:
        fleet.ctl.view.observe("Pod", "DELETED", fleet.pods.pop(name))
    assert ("OmniPipeline", NS, "p") in fleet.enqueued  # pools a and b emptied
    assert _writes(await fleet.shutdown("p")) == []
    fleet.enqueued.clear()
    fleet.ctl.view.observe("Pod", "DELETED", fleet.pods.pop(names[-1]))
    assert ("OmniPipeline", NS, "p") in fleet.enqueued

    # No pod left: the pools go, plainly (nothing left for a cascade to wait on). Their
    # answers say they are gone, so the same step releases the finalizer, and the pipeline,
    # whose release answer shows no finalizer left, leaves the view before its DELETED event:
    # a step re-checked in between deleted every pool and released the finalizer again.
    calls = await fleet.shutdown("p")
    pools = [(v, u, b) for v, u, b, _ in calls if "stagepools" in u and not u.endswith("/status")]
    assert pools == [("delete", f"/apis/{API_VERSION}/namespaces/{NS}/stagepools/p-{s}", None)
                     for s in "abc"]
    assert _writes(calls)[-1] == ("apply", f"/apis/{API_VERSION}/namespaces/{NS}/omnipipelines/p")
    assert fleet.ctl.view.pools_of(NS, "p") == [] and (NS, "p") not in fleet.ctl.pipelines

    # The other pipeline was not touched: its pods, pools and budgets are all there.
    assert all(p["metadata"].get("deletionTimestamp") is None for n, p in fleet.pods.items()
               if n.startswith("q-"))
    assert len(fleet.ctl.view.pools_of(NS, "q")) == 3


async def test_a_collection_is_asked_again_only_for_a_pod_not_yet_terminating() -> None:
    """A step re-checked before the watch brought the pods' deletion asks again (a view a
    little behind), but one whose pods all terminate does not. Kills: a collection per
    re-check for the whole teardown, and a pod created late (a reconcile in flight when the
    deletion came) left running."""
    fleet = Fleet()
    await fleet.shutdown("p")
    fleet.terminating("p")
    late = _pod("p", "a", 7)
    fleet.ctl.view.observe("Pod", "ADDED", late)
    calls = await fleet.shutdown("p")
    assert _writes(calls) == [("delete", f"/api/v1/namespaces/{NS}/pods")]
    late["metadata"]["deletionTimestamp"] = NOW
    fleet.ctl.view.observe("Pod", "MODIFIED", late)
    assert _writes(await fleet.shutdown("p")) == []


async def test_a_deleting_pool_is_reconciled_without_building_anything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A teardown reconciles a pool at every event of its pods; each reconcile built the
    pool's pod template (and parsed its spec) for nothing. Kills: that work coming back, and
    any write for a pool whose pipeline is going."""
    built: list[str] = []
    real = builders.pod_template

    def counted(pool: Obj) -> Any:
        built.append(pool["metadata"]["name"])
        return real(pool)

    monkeypatch.setattr(builders, "pod_template", counted)
    fleet = Fleet()
    for stage in "abc":
        await fleet.ctl.pool_reconciler.reconcile(fleet.ctl.pools[(NS, kube.pool_name("p", stage))])
    assert built == [] and fleet.api.calls == []


@pytest.mark.parametrize(("answer", "gone"), [
    ({"kind": "Status", "status": "Success"}, True),
    ({"kind": "Status", "status": "Failure"}, False),
    # A budget or a pool without finalizers: removed at once, answered as it was.
    ({"metadata": {"name": "p-a", "resourceVersion": "7"}}, True),
    # A pipeline whose last finalizer was released: removed by the API server.
    ({"metadata": {"name": "p", "deletionTimestamp": NOW, "deletionGracePeriodSeconds": 0}},
     True),
    # ...but not while someone else's finalizer holds it.
    ({"metadata": {"name": "p", "deletionTimestamp": NOW, "deletionGracePeriodSeconds": 0,
                   "finalizers": ["example.com/keep"]}}, False),
    # A pod in its grace period is still there.
    ({"metadata": {"name": "p-a-0", "deletionTimestamp": NOW,
                   "deletionGracePeriodSeconds": 30}}, False),
    ({"kind": "PodList", "metadata": {}, "items": []}, False),
    (None, False),
])
def test_what_a_delete_answer_says_is_gone(answer: Any, gone: bool) -> None:
    """Kills: an object dropped from the view while it is still there (a pod terminating,
    another finalizer holding it: its later events would be read as news), and one kept
    after the answer said it went."""
    assert removed(answer) is gone
