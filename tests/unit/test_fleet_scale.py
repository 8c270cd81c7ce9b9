"""The controller at fleet size: no reconcile scans every object of a kind (indexes kept by
`observe` instead), and the view keeps only the fields the controller reads. Each test counts
the objects a path visits or the calls it makes, so a scan or a whole-object cache that comes
back fails here (docs/benchmarks.md, "Operator at scale", says what each cost was)."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace
from typing import Any

import pytest

from omni_operator import builders
from omni_operator.controller import FINALIZER, Controller, owners, viewed
from omni_operator.models import API_VERSION
from omni_operator.readiness import gate_patch, is_ready
from omni_operator.status import model_failure, pool_status
from omnistage import kube
from omnistage.kubeapi import ApiError, Applied, project
from omnistage.spec import parse_pipeline

Obj = dict[str, Any]
NOW = "2026-01-01T00:00:00Z"


class CountingApi:
    """Records every call (verb, path); answers writes with the object written."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def delete(self, url: str, body: Any = None, **_: Any) -> Obj:
        self.calls.append(("delete", url))
        return {}

    async def patch(self, url: str, body: Any, kind: str = "merge", **_: Any) -> Obj:
        self.calls.append(("patch", url))
        return {"metadata": {"resourceVersion": "9"}}

    async def apply(self, url: str, body: Obj, **_: Any) -> Applied:
        self.calls.append(("apply", url))
        return Applied(body, True)

    async def create(self, url: str, body: Obj, **_: Any) -> Obj:
        self.calls.append(("create", url))
        return body

    async def close(self) -> None:
        pass


class Visits(dict):  # type: ignore[type-arg]
    """A view table that counts the entries a scan visits (iteration of any kind)."""

    visited = 0

    def __iter__(self) -> Any:
        Visits.visited += len(self)
        return super().__iter__()

    def items(self) -> Any:
        Visits.visited += len(self)
        return super().items()

    def values(self) -> Any:
        Visits.visited += len(self)
        return super().values()

    def keys(self) -> Any:
        Visits.visited += len(self)
        return super().keys()


def _pool(ns: str, pipeline: str, stage: str) -> Obj:
    return {"apiVersion": API_VERSION, "kind": "StagePool",
            "metadata": {"name": kube.pool_name(pipeline, stage), "namespace": ns,
                         "uid": f"{ns}/{pipeline}/{stage}", "resourceVersion": "1"},
            "spec": {"pipeline": pipeline, "replicas": 1, "stage": {"name": stage}}}


def _fleet(pipelines: int) -> Controller:
    """A controller whose view holds `pipelines` pipelines' pools (3 each) in two namespaces,
    fed through observe like the watches feed it."""
    c = Controller(api=CountingApi())  # type: ignore[arg-type]
    c.enqueue = lambda key: None  # type: ignore[method-assign]
    for ns in ("ns", "other"):
        for i in range(pipelines):
            for stage in "abc":
                c.view.observe("StagePool", "ADDED", _pool(ns, f"p{i}", stage))
    c.view.pools = Visits(c.view.pools)
    Visits.visited = 0
    return c


async def test_pruning_a_pipeline_s_pools_visits_none_of_the_fleet() -> None:
    """A pipeline reconcile deletes the pools of stages it no longer has. It scanned every
    pool of the fleet for its own (each pipeline's reconcile: the fleet squared per resync).
    Kills: the scan (visits), deleting another pipeline's or namespace's pool, keeping the
    removed stage's pool."""
    c = _fleet(300)
    pipeline = SimpleNamespace(metadata=SimpleNamespace(name="p7"),
                               spec=SimpleNamespace(stages=[SimpleNamespace(name="a"),
                                                            SimpleNamespace(name="b")]))
    await c.pipeline_reconciler.prune_pools(pipeline, "ns")  # type: ignore[arg-type]
    assert c.api.calls == [("delete", f"/apis/{API_VERSION}/namespaces/ns/stagepools/p7-c")]
    assert Visits.visited == 0


async def test_ordered_shutdown_finds_its_pools_without_a_scan() -> None:
    """Each step of a pipeline's shutdown (every second while it lasts, for every deleting
    pipeline) looked for its pools by scanning all of them. Kills: the scan, a pool of a
    pipeline with the same name in another namespace deleted, a pool left running."""
    c = _fleet(300)
    obj = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p7", "namespace": "ns", "uid": "u", "generation": 1,
                        "resourceVersion": "5", "finalizers": [FINALIZER],
                        "deletionTimestamp": NOW},
           "status": {"phase": "Terminating"}}
    await c.pipeline_reconciler.shutdown(obj)
    deletes = sorted(url for verb, url in c.api.calls if verb == "delete")
    assert deletes == [f"/apis/{API_VERSION}/namespaces/ns/stagepools/p7-{s}" for s in "abc"]
    assert Visits.visited == 0
    for handle in c.queue._timers.values():  # the 1 s re-check was scheduled on this loop
        handle.cancel()


def test_the_pool_index_follows_every_event_and_leaves_nothing_behind() -> None:
    """Kills: an index that misses a pool's move to another pipeline, keeps a deleted pool,
    or keeps empty entries (memory that grows with every pipeline ever seen)."""
    c = Controller(api=CountingApi())  # type: ignore[arg-type]
    c.enqueue = lambda key: None  # type: ignore[method-assign]
    a, b = _pool("ns", "p", "a"), _pool("ns", "p", "b")
    c.view.observe("StagePool", "ADDED", a)
    c.view.observe("StagePool", "ADDED", b)
    c.view.observe("StagePool", "MODIFIED", a)
    assert c.view.pools_of("ns", "p") == ["p-a", "p-b"] and c.view.pools_of("other", "p") == []
    moved = copy.deepcopy(b)
    moved["spec"]["pipeline"] = "q"
    c.view.observe("StagePool", "MODIFIED", moved)
    assert c.view.pools_of("ns", "p") == ["p-a"] and c.view.pools_of("ns", "q") == ["p-b"]
    c.view.observe("StagePool", "DELETED", a)
    c.forget("StagePool", "ns", "p-b")  # a 404 drops it as its DELETED event would
    assert c.view.pools_of("ns", "p") == [] and c.view.pools_of("ns", "q") == []
    assert c.view._pools_of == {} and c.pools == {}


def _pod(ns: str, pool: str, ordinal: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{pool}-{ordinal}", "namespace": ns, "uid": f"{pool}{ordinal}",
                         "labels": {kube.LABEL_POOL: pool, kube.LABEL_ORDINAL: str(ordinal),
                                    kube.LABEL_COMPONENT: "stage"}},
            "status": {"phase": "Running"}}


def test_a_pod_is_found_by_name_without_visiting_the_fleet() -> None:
    """`view("Pod", ...)` (a 404 on a pod write drops it through it) visited every pool's pods.
    Kills: that scan, a pod of the same name in another namespace returned, and empty pod
    tables left behind by pools that are gone."""
    c = Controller(api=CountingApi())  # type: ignore[arg-type]
    c.enqueue = lambda key: None  # type: ignore[method-assign]
    for ns in ("ns", "other"):
        for p in range(200):
            for o in range(4):
                c.view.observe("Pod", "ADDED", _pod(ns, f"p{p}-a", o))
    c.view.pods = Visits(c.view.pods)
    Visits.visited = 0
    pod = c.view.get("Pod", "other", "p7-a-2")
    assert pod is not None and pod["metadata"]["namespace"] == "other"
    assert c.view.get("Pod", "ns", "nope-0") is None
    assert Visits.visited == 0
    for o in range(4):
        c.view.observe("Pod", "DELETED", _pod("ns", "p7-a", o))
    assert ("ns", "p7-a") not in c.pods and ("other", "p7-a") in c.pods
    assert c.view.get("Pod", "ns", "p7-a-0") is None and ("ns", "p7-a-0") not in c.view._pod_group


async def test_events_in_flight_are_tracked_until_done_and_cancelled_on_stop() -> None:
    """Events are recorded in the background, hundreds at once in a ramp. Kills: finished
    ones kept (memory), and stop() leaving one running."""
    c = Controller(api=CountingApi())  # type: ignore[arg-type]
    release = asyncio.Event()

    async def slow() -> None:
        await release.wait()

    async def quick() -> None:
        pass

    for _ in range(500):
        c.writes._spawn(quick())
    c.writes._spawn(slow())
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(c.writes._spawned) == 1
    [pending] = c.writes._spawned
    await c.stop()
    assert pending.cancelled()


# ---- the view keeps what the controller reads ------------------------------------------------


def _real_pool_and_pod() -> tuple[Obj, Obj]:
    """A StagePool and one of its pods as the operator builds them, the pod with the status
    and managedFields the API server and the kubelet add."""
    doc = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
           "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                "replicas": 2}]}}
    [pool] = [c for c in builders.pipeline_children(doc, parse_pipeline(doc))
              if c["kind"] == "StagePool"]
    pool["metadata"].update(uid="u2", generation=1, resourceVersion="3")
    pod = builders.pool_pod(pool, 0)
    pod["metadata"].update(uid="u3", resourceVersion="4", managedFields=[
        {"manager": "kubelet", "operation": "Update", "subresource": "status",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:conditions": {}}}}])
    pod["spec"]["nodeName"] = "kwok-0"
    pod["status"] = {
        "phase": "Running", "podIP": "127.1.0.9", "hostIP": "127.0.0.1", "qosClass": "Burstable",
        "conditions": [{"type": "ContainersReady", "status": "True"},
                       {"type": "Ready", "status": "False"},
                       {"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [{
            "name": "worker", "ready": False, "restartCount": 1, "image": "img", "imageID": "x",
            "containerID": "c", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": kube.MODEL_FAILED_EXIT,
                                         "message": "no such model"}}}],
    }
    return pool, pod


def test_a_pod_s_view_drops_its_spec_and_answers_every_question_the_same() -> None:
    """Whole pods were most of the operator's memory at fleet size. Kills: storing the whole
    pod again (spec, managedFields), and a view that lacks a field the readiness gate, the
    model-failure report or the pool status read (their answers would change)."""
    pool, pod = _real_pool_and_pod()
    view = viewed("Pod", pod)
    assert "spec" not in view and "managedFields" not in view["metadata"]
    assert set(view["status"]) == {"phase", "podIP", "conditions", "containerStatuses"}
    assert pod["spec"] and pod["metadata"]["managedFields"]  # the input is left alone
    assert gate_patch(view, NOW) == gate_patch(pod, NOW) is not None
    assert is_ready(view) == is_ready(pod)
    assert model_failure(view) == model_failure(pod) is not None
    _, template_hash = builders.pod_template(pool)
    assert (pool_status(pool, [view], template_hash, NOW).wire()
            == pool_status(pool, [pod], template_hash, NOW).wire())

    c = Controller(api=CountingApi())  # type: ignore[arg-type]
    c.enqueue = lambda key: None  # type: ignore[method-assign]
    c.view.observe("Pod", "ADDED", pod)
    [stored] = c.pods[("ns", pool["metadata"]["name"])].values()
    assert stored == view


def test_managed_fields_are_kept_only_where_the_controller_asks_who_owns_them() -> None:
    """A StagePool's replicas and a pipeline's finalizers: `owners` must answer the same from
    the view; every other entry and every other kind's managedFields go. Kills: dropping an
    entry `owners` reads (a `kubectl scale` undone, a finalizer not released), and keeping
    the rest."""
    scale = {"manager": "kubectl", "operation": "Update", "subresource": "scale",
             "fieldsV1": {"f:spec": {"f:replicas": {}}}}
    ours = {"manager": builders.FIELD_MANAGER, "operation": "Apply",
            "fieldsV1": {"f:metadata": {"f:labels": {"f:x": {}}},
                         "f:spec": {"f:stage": {"f:name": {}}, "f:replicas": {}},
                         "f:status": {}}}
    other = {"manager": "someone", "operation": "Update", "fieldsV1": {"f:spec": {"f:x": {}}}}
    pool = _pool("ns", "p", "a")
    pool["metadata"]["managedFields"] = [scale, ours, other]
    view = viewed("StagePool", pool)
    assert owners(view, ("spec", "replicas")) == owners(pool, ("spec", "replicas"))
    assert [e["manager"] for e in view["metadata"]["managedFields"]] == ["kubectl",
                                                                        builders.FIELD_MANAGER]
    assert view["metadata"]["managedFields"][1]["fieldsV1"] == {"f:spec": {"f:replicas": {}}}
    assert view["spec"] == pool["spec"]

    item = f'v:"{FINALIZER}"'
    pipeline = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
                "metadata": {"name": "p", "namespace": "ns", "finalizers": [FINALIZER],
                             "managedFields": [
                                 {"manager": builders.FIELD_MANAGER, "operation": "Apply",
                                  "fieldsV1": {"f:metadata": {"f:finalizers": {item: {}}}}},
                                 {"manager": "kubectl", "operation": "Update",
                                  "fieldsV1": {"f:spec": {"f:stages": {}}}}]},
                "spec": {"stages": []}}
    path = ("metadata", "finalizers", item)
    assert owners(viewed("OmniPipeline", pipeline), path) == owners(pipeline, path) == {
        (builders.FIELD_MANAGER, "Apply", "")}
    assert len(viewed("OmniPipeline", pipeline)["metadata"]["managedFields"]) == 1

    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "s", "namespace": "ns", "managedFields": [ours]},
               "spec": {"ports": [{"port": 80}]}}
    assert viewed("Service", service) == {**service, "metadata": {"name": "s",
                                                                  "namespace": "ns"}}
    assert viewed("Service", viewed("Service", service)) == viewed("Service", service)


def test_project_keeps_the_named_fields_only() -> None:
    """Kills: a projection that keeps unnamed fields, drops named ones, adds absent ones, or
    changes its input."""
    obj = {"a": 1, "b": {"c": 2, "d": 3}, "l": [{"x": 1, "y": 2}, {"y": 3}], "n": None}
    before = copy.deepcopy(obj)
    assert project(obj, {"b": {"c": True}, "l": {"x": True}, "n": True, "z": True}) == {
        "b": {"c": 2}, "l": [{"x": 1}, {}], "n": None}
    assert obj == before


# ---- kopf's cost per event ---------------------------------------------------------------------


def test_kopf_builds_no_diff_base_for_the_operator_s_event_handlers(
        monkeypatch: Any) -> None:
    """kopf deep-copied every object on every event to build a diff base for change handlers;
    the operator has none, so `main` configures NoDiffBase. Kills: a change handler or daemon
    registered (the diff base would then be needed: NoDiffBase would break it), and a storage
    that copies the object again (counted through the copy kopf's diff base uses)."""
    import kopf
    from kopf._cogs.configs import diffbase
    from kopf._core.reactor import processing

    from omni_operator import controller as ctl
    from omni_operator.controller import WATCHED
    from omni_operator.handlers import NoDiffBase, at_fleet_size, register

    settings = kopf.OperatorSettings()
    at_fleet_size(settings)  # what `omnistage operator` configures
    assert isinstance(settings.persistence.diffbase_storage, NoDiffBase)
    assert settings.watching.chunk_size == ctl.LIST_PAGE  # kopf's first lists in pages too

    registry = kopf.OperatorRegistry()
    register(registry, Controller(api=CountingApi()))  # type: ignore[arg-type]
    for w in WATCHED:
        r = w.resource
        resource = kopf.Resource(r.group, r.version, r.plural, kind=w.kind)
        assert registry._watching.has_handlers(resource=resource)
        assert not registry._changing.has_handlers(resource=resource)
        assert not registry._spawning.has_handlers(resource=resource)

    if not hasattr(processing, "_detect_causes"):  # the lowest kopf (1.37) lacks this hook
        pytest.skip("this kopf has no processing._detect_causes to count the copies through")
    copies: list[int] = []  # sizes of the objects copied (kopf's modules share `copy`)
    real = diffbase.copy.deepcopy
    monkeypatch.setattr(diffbase.copy, "deepcopy",
                        lambda x, *a: copies.append(len(x) if isinstance(x, dict) else 0)
                        or real(x, *a))
    _, pod = _real_pool_and_pod()

    def detect(storage: kopf.DiffBaseStorage) -> int:
        copies.clear()
        settings = kopf.OperatorSettings()
        settings.persistence.diffbase_storage = storage
        processing._detect_causes(
            indexers=SimpleNamespace(indices={}), registry=registry, settings=settings,
            resource=kopf.Resource("", "v1", "pods", kind="Pod"),
            raw_event={"type": "MODIFIED", "object": pod}, body=kopf.Body(pod),
            patch=kopf.Patch(), memory=SimpleNamespace(memo=None), local_logger=None,
            event_logger=None)  # type: ignore[arg-type]
        return sum(1 for size in copies if size)

    assert detect(kopf.AnnotationsDiffBaseStorage()) > 0  # what kopf does by default
    assert detect(NoDiffBase()) == 0


# ---- a pipeline's first reconcile --------------------------------------------------------------


async def test_a_new_pipeline_s_children_are_applied_in_two_waves() -> None:
    """A first reconcile applied its nine children one after another, each waiting on the API
    server, and the pools (and so every stage pod) came last. Kills: applying one at a time
    again, and applying a workload (Deployment, StagePool) before what its pods reference
    (ConfigMap, ServiceAccount, Role, RoleBinding, Service) exists."""

    class SlowApi(CountingApi):
        def __init__(self) -> None:
            super().__init__()
            self.in_flight: list[str] = []
            self.waves: list[list[str]] = []
            self.done: set[str] = set()

        async def apply(self, url: str, body: Obj, **kw: Any) -> Applied:
            kind = body["kind"]
            if not self.in_flight:
                self.waves.append([])
            self.in_flight.append(kind)
            self.waves[-1].append(kind)
            if kind in ("Deployment", "StagePool"):
                assert {"ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                        "Service"} <= self.done, f"{kind} applied before {self.done}"
            await asyncio.sleep(0)  # the API server answers later: the others start meanwhile
            self.in_flight.remove(kind)
            self.done.add(kind)
            return await super().apply(url, body, **kw)

    api = SlowApi()
    c = Controller(api=api)  # type: ignore[arg-type]
    c.writes.event = lambda *a: None  # type: ignore[method-assign,assignment]
    obj = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1,
                        "resourceVersion": "2", "finalizers": [FINALIZER]},
           "spec": {"stages": [{"name": "a", "kind": "echo"},
                               {"name": "b", "kind": "echo", "inputs": ["a"]},
                               {"name": "c", "kind": "echo", "inputs": ["b"],
                                "finalOutput": True}]}}
    await c.pipeline_reconciler.reconcile(obj)
    assert [sorted(w) for w in api.waves] == [
        ["ConfigMap", "Role", "RoleBinding", "Service", "Service", "ServiceAccount"],
        ["Deployment", "StagePool", "StagePool", "StagePool"]]  # Services: API and admin


# ---- priming the view --------------------------------------------------------------------------


class PagingApi(CountingApi):
    """Serves `pods` for any pod list, LIST_PAGE at a time with continue tokens; other kinds
    list empty. The first continue token it is given has expired (410), once."""

    def __init__(self, pods: list[Obj]) -> None:
        super().__init__()
        self.pods = pods
        self.pages: list[int] = []
        self.expire_once = True

    async def get(self, url: str, **params: Any) -> Obj:
        if "/pods" not in url:
            return {"metadata": {}, "items": []}
        limit = int(params["limit"])
        start = int(params.get("continue") or 0)
        if start and self.expire_once:
            self.expire_once = False
            raise ApiError(410, {"reason": "Expired"}, "GET", url)
        items = copy.deepcopy(self.pods[start:start + limit])
        self.pages.append(len(items))
        more = start + limit < len(self.pods)
        return {"metadata": {"continue": str(start + limit) if more else ""}, "items": items}


async def test_priming_lists_in_pages_and_survives_an_expired_continue_token() -> None:
    """A restarted operator listed every kind in one answer: a fleet's pods decoded at once
    were its peak memory. Kills: a list without a limit (one answer with every pod), a page
    not followed, and a 410 on a continue token (a list that outlived the API server's
    window) ending the start instead of listing again."""
    from omni_operator import controller as ctl

    pods = [_pod("ns", f"p{p}-a", o) for p in range(300) for o in range(4)]
    api = PagingApi(pods)
    c = Controller(api=api)  # type: ignore[arg-type]
    c.enqueue = lambda key: None  # type: ignore[method-assign]
    await c.prime(["ns"])
    assert max(api.pages) == ctl.LIST_PAGE < len(pods)
    # 1200 pods: 500, then 410 (listed again from the start), then 500, 500, 200.
    assert api.pages == [500, 500, 500, 200]
    assert sum(len(group) for group in c.pods.values()) == len(pods)
    assert "spec" not in next(iter(c.pods[("ns", "p0-a")].values()))


def _paging_controller(pods: list[Obj]) -> tuple[PagingApi, Controller]:
    """A controller over an API that lists `pods` in pages (never expiring a continue
    token); its enqueues and replica-gone reports go nowhere."""
    api = PagingApi(pods)
    api.expire_once = False
    c = Controller(api=api)  # type: ignore[arg-type]
    c.enqueue = lambda key: None  # type: ignore[method-assign]
    c.pool_reconciler._replica_gone = lambda pod: None  # type: ignore[method-assign]
    return api, c


async def test_checking_primed_objects_lists_in_pages_too() -> None:
    """The first resync after a restart lists again what no watch event confirmed. Kills: that
    list unpaged, and a primed pod that a later page holds dropped as gone (or one that is
    gone kept)."""
    from omni_operator import controller as ctl

    pods = [_pod("ns", f"p{p}-a", o) for p in range(300) for o in range(4)]
    api, c = _paging_controller(pods)
    await c.prime(["ns"])
    gone = pods.pop()  # deleted after the list; no watch said so
    api.pages.clear()
    await c.view.confirm_primed()
    assert api.pages == [500, 500, 199] and max(api.pages) <= ctl.LIST_PAGE
    assert c.view.get("Pod", "ns", gone["metadata"]["name"]) is None
    assert c.view.get("Pod", "ns", pods[-1]["metadata"]["name"]) is not None
    assert c.view._unconfirmed == set()


async def test_a_kind_listed_again_forgets_what_was_deleted_while_its_watch_was_lost() -> None:
    """kopf lists a kind again when its watch gets 410 Gone, and a pod deleted in between gets
    no DELETED event. In a 6,000-pod teardown 151 pipelines waited for orchestrator pods that
    were long gone, for good. Kills: a listed event (type None) for a known object not taken
    as a new listing, the objects the listing does not repeat kept, and those it does (or that
    a later page of the check holds) dropped."""
    pods = [_pod("ns", f"p{p}-a", o) for p in range(150) for o in range(4)]
    api = PagingApi(pods)
    api.expire_once = False
    c = Controller(api=api)  # type: ignore[arg-type]
    enqueued: list[Any] = []
    c.enqueue = enqueued.append  # type: ignore[method-assign]
    c.pool_reconciler._replica_gone = lambda pod: None  # type: ignore[method-assign]
    for pod in pods:  # the watch's own events: nothing awaits confirmation
        c.watched("Pod", "ADDED", copy.deepcopy(pod))
    assert c.view._unconfirmed == set()
    await c.view.confirm_primed()
    assert api.pages == []  # nothing to check: no list

    gone = [pods.pop(0), pods.pop()]  # deleted while the watch was lost: no DELETED events
    listed, unlisted = pods[:300], pods[300:]
    for pod in listed:  # the new listing has come this far by the resync
        c.watched("Pod", None, copy.deepcopy(pod))
    assert {name for _, _, name in c.view._unconfirmed} == {
        p["metadata"]["name"] for p in gone + unlisted}
    enqueued.clear()
    await c.view.confirm_primed()
    assert api.pages == [500, 98]
    for pod in gone:
        assert c.view.get("Pod", "ns", pod["metadata"]["name"]) is None
    assert all(c.view.get("Pod", "ns", p["metadata"]["name"]) is not None for p in pods)
    assert ("StagePool", "ns", "p0-a") in enqueued  # its pool looks again
    assert c.view._unconfirmed == set()
    c.watched("Pod", None, copy.deepcopy(pods[-1]))  # the listing's rest: no new check
    assert c.view._unconfirmed == set()
    c.watched("Pod", "MODIFIED", copy.deepcopy(pods[-1]))  # watching again
    c.watched("Pod", None, copy.deepcopy(pods[-1]))  # and the next listing is one again
    assert len(c.view._unconfirmed) == len(pods) - 1


async def test_a_listing_that_follows_a_listing_with_no_event_between_is_one_again() -> None:
    """A quiet fleet: kopf's watch lost its place, it listed the pods, and its watch lost its
    place again before any event came, so it listed them once more. Pods deleted between the
    two listings are in neither and got no DELETED event: 51 pipelines of a 6,000-pod
    teardown waited for their orchestrator pods for good. Kills: the second listing not
    taken as one (only a watch event ended the first), the deleted pods kept."""
    pods = [_pod("ns", f"p{p}-a", o) for p in range(3) for o in range(4)]
    _, c = _paging_controller(pods)
    for pod in pods:
        c.watched("Pod", "ADDED", copy.deepcopy(pod))
    for pod in pods:  # the first listing: every pod, each confirmed
        c.watched("Pod", None, copy.deepcopy(pod))
    await c.view.confirm_primed()
    assert c.view._unconfirmed == set()
    gone = pods.pop(5)  # deleted; the watch lost its place again before it said so
    for pod in pods[:4]:  # the second listing has come this far by the resync
        c.watched("Pod", None, copy.deepcopy(pod))
    assert {name for _, _, name in c.view._unconfirmed} == {
        p["metadata"]["name"] for p in [gone, *pods[4:]]}
    await c.view.confirm_primed()
    assert c.view.get("Pod", "ns", gone["metadata"]["name"]) is None
    assert all(c.view.get("Pod", "ns", p["metadata"]["name"]) is not None for p in pods)
    for pod in pods[4:]:  # the second listing's rest: part of it, no new check
        c.watched("Pod", None, copy.deepcopy(pod))
    assert c.view._unconfirmed == set()
