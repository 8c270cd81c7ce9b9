"""Releases across stages (omni_operator.release, PoolReconciler._converge_pods): the gate as a pure
function over fake pods, the release order as builders write it, and the controller's whole
rollout of a two-stage change against an in-memory API server and kubelet, checked after every
step: no changed stage below its routable count before the change, at most one extra replica
per changed stage, no old-revision replica retired before every changed stage has a Ready
new-revision one, a revert mid-rollout that deletes no serving replica before its replacement
is Ready, and no write once converged or after a restart."""

from __future__ import annotations

import copy
import datetime as dt
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omni_operator import builders, drain, release
from omni_operator.controller import Controller, merge_patch
from omni_operator.readiness import is_ready
from omnistage import kube
from omnistage.kubeapi import Applied
from omnistage.spec import parse_pipeline
from tests.harness.fakeload import FakeLoadServer

Obj = dict[str, Any]
NEW, OLD = "aaaaaaaaaa", "bbbbbbbbbb"


# ---- the gate, pure ------------------------------------------------------------------------------


def fake(revision: str | None, *, ready: bool = True, draining: bool = False) -> Obj:
    meta: Obj = {"labels": {}, "annotations": {}}
    if revision is not None:
        meta["labels"][kube.LABEL_REVISION] = revision
    if draining:
        meta["annotations"][kube.ANNOTATION_DRAINING] = "true"
    return {"metadata": meta,
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_the_gate_opens_only_when_every_changed_pool_serves_its_new_revision() -> None:
    waiting = release.PoolRelease(NEW, [fake(OLD), fake(OLD), fake(NEW, ready=False)])
    serving = release.PoolRelease(NEW, [fake(OLD), fake(OLD), fake(NEW)])
    untouched = release.PoolRelease(OLD, [fake(OLD)])
    assert waiting.changed and serving.changed and not untouched.changed
    assert (waiting.ready_new, serving.ready_new) == (0, 1)
    assert not release.gate_open([serving, waiting, untouched])
    assert release.gate_open([serving, untouched])
    assert release.gate_open([untouched])
    assert release.gate_open([])


def test_a_pool_is_changed_by_serving_replicas_of_another_revision_only() -> None:
    """A retiring old replica does not hold the release; nor does a pod without the label
    (an older operator's, which rolls the way every spec change does)."""
    assert not release.PoolRelease(NEW, [fake(NEW), fake(OLD, draining=True)]).changed
    assert not release.PoolRelease(NEW, [fake(NEW), fake(None)]).changed
    # Draining new replicas do not count as serving the new revision.
    assert release.PoolRelease(NEW, [fake(OLD), fake(NEW, draining=True)]).ready_new == 0


def test_routable_replicas_are_counted_per_revision() -> None:
    pods = [fake(OLD), fake(NEW), fake(NEW, ready=False), fake(NEW, draining=True), fake(None)]
    assert release.routable_by_revision(pods) == {NEW: 1, OLD: 1}


@pytest.mark.parametrize("text", [None, "", "abc", "abc=", "=3", "abc=x", "abc=-1"])
def test_an_unreadable_order_is_none(text: str | None) -> None:
    assert release.parse_order(text) is None


# ---- the release order, as the builders write it ---------------------------------------------


def pipeline_doc(generation: int, chars: int = 2, *, b_chars: int | None = None,
                 b_gpus: int = 0) -> Obj:
    """Two echo stages a -> b; engine.echoChunkChars is in the revision (tests/unit/
    test_revision.py), resources are not."""
    def stage(name: str, n: int, **extra: Any) -> Obj:
        return {"name": name, "kind": "echo", "replicas": 2, "drainTimeoutSeconds": 5,
                "engine": {"echoChunkChars": n}, **extra}
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": generation},
            "spec": {"stages": [stage("a", chars),
                                stage("b", chars if b_chars is None else b_chars,
                                      inputs=["a"], finalOutput=True,
                                      resources={"cpu": "100m", "memory": "64Mi",
                                                 "gpus": b_gpus})]}}


def pools_of(doc: Obj, current: dict[str, Obj | None] | None = None) -> dict[str, Obj]:
    children = builders.pipeline_children(doc, parse_pipeline(doc), current)
    return {c["spec"]["stage"]["name"]: c for c in children if c["kind"] == "StagePool"}


def order(pool: Obj) -> tuple[str, int] | None:
    return release.parse_order(pool["metadata"]["annotations"][kube.ANNOTATION_REVISION_ORDER])


def test_the_order_is_the_release_generation_and_a_revert_keeps_its_own() -> None:
    first = pools_of(pipeline_doc(1))
    rev1 = release.pool_revision(first["a"])
    assert order(first["a"]) == (rev1, 1)
    # A change outside the revision (and a resync, and a restarted operator) keeps the order.
    same = pools_of({**pipeline_doc(2)}, dict(first))
    assert order(same["a"]) == (rev1, 1)
    # Only stage a's revision changes: b keeps its order (its pods are not restarted).
    changed = pools_of(pipeline_doc(3, 3, b_chars=2), dict(first))
    rev2 = release.pool_revision(changed["a"])
    assert rev2 != rev1 and order(changed["a"]) == (rev2, 3)
    assert order(changed["b"]) == order(first["b"])
    assert changed["b"]["spec"] == first["b"]["spec"]
    # A revert to the first revision gets its order back: the replicas that kept running it
    # and the ones created for the revert carry one order, in every pool (the orchestrator's
    # pipeline revisions are releases by order). The pool remembers both.
    reverted = pools_of(pipeline_doc(4), dict(changed))
    assert order(reverted["a"]) == (rev1, 1)
    assert release.stored_orders(reverted["a"]) == [(rev1, 1), (rev2, 3)]
    again = pools_of(pipeline_doc(5, 3, b_chars=2), dict(reverted))  # forward again: 3
    assert release.stored_orders(again["a"]) == [(rev2, 3), (rev1, 1)]
    # A resync of the reverted pool writes the same annotation.
    assert pools_of(pipeline_doc(4), dict(reverted))["a"]["metadata"]["annotations"] == \
        reverted["a"]["metadata"]["annotations"]


def test_the_pool_remembers_a_few_revisions_and_reads_back_a_plain_annotation() -> None:
    history = [(f"r{i}", i) for i in range(10)]
    text = release.format_order("new", 42, history)
    assert release.parse_orders(text) == [("new", 42), *history[: release.HISTORY - 1]]
    assert release.parse_order("r1=7") == ("r1", 7)  # written before the history
    assert release.parse_orders("r1=7,bad,=3,r2=x,r3=9") == [("r1", 7), ("r3", 9)]


def test_pods_carry_their_revision_and_order_outside_the_spec_hash() -> None:
    pool = pools_of(pipeline_doc(5))["a"]
    pool["metadata"]["uid"] = "pool-a"
    pod = builders.pool_pod(pool, 0)
    surge = builders.pool_pod(pool, 2, surge=True)
    assert pod["metadata"]["labels"][kube.LABEL_REVISION] == release.pool_revision(pool)
    assert pod["metadata"]["annotations"][kube.ANNOTATION_REVISION_ORDER] == "5"
    assert release.is_surge(surge) and not release.is_surge(pod)
    assert (surge["metadata"]["annotations"][kube.ANNOTATION_SPEC_HASH]
            == pod["metadata"]["annotations"][kube.ANNOTATION_SPEC_HASH])


# ---- the controller's rollout, against an in-memory API server -------------------------------


def merged(old: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied, as the API server applies the status patches."""
    if not isinstance(patch, dict):
        return patch
    out = dict(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(out.get(key), value)
    return out


def test_a_status_patch_removes_what_the_status_no_longer_says() -> None:
    """A release over: the candidate revision and the old revision's count must go from the
    stored status (a merge patch of the new status alone keeps them, and the next reconcile
    writes again: a write on every resync)."""
    stored = {"revisions": {"stable": OLD, "candidate": NEW},
              "stages": {"a": {"routable": {OLD: 1, NEW: 2}, "ready": 2}}, "phase": "Ready"}
    now = {"revisions": {"stable": NEW}, "stages": {"a": {"routable": {NEW: 2}, "ready": 2}},
           "phase": "Ready"}
    patch = merge_patch(stored, now)
    assert patch["revisions"] == {"stable": NEW, "candidate": None}
    assert patch["stages"]["a"]["routable"] == {NEW: 2, OLD: None}
    assert merged(stored, patch) == now
    assert merge_patch({}, now) == now


class Cluster:
    """An API server and a kubelet in memory: writes land in the controller's view at once, as
    the watch would deliver them. Pods never get an IP, so a drain ends at once (nothing to
    ask) and the operator deletes the pod; `kubelet` makes the pods it is told Ready."""

    def __init__(self, *, running: bool = False) -> None:
        self.running = running  # kubelet: Running pods with a loopback IP (see pinned tests)
        self.pods: dict[str, Obj] = {}
        self.pools: dict[str, Obj] = {}
        self.applied: dict[str, Obj] = {}  # what else the controller applied (PDBs)
        self.specs: dict[str, Obj] = {}  # pod name -> the spec it was created with
        self.writes: list[tuple[str, str]] = []
        self.uids = 0
        # A slower world: deletes are graceful until gone(), creates reach the view at deliver().
        self.slow = False
        self.unseen: list[Obj] = []  # created pods whose ADDED event has not been delivered
        self.ctl = self.controller()
        self.violations: list[str] = []
        self.baseline: dict[str, int] = {}

    def controller(self) -> Controller:
        ctl = Controller(api=self, workers=1, resync_seconds=3600)  # type: ignore[arg-type]
        ctl.enqueue = lambda key: None  # type: ignore[method-assign]
        ctl.writes.event = lambda *a: None  # type: ignore[method-assign]
        return ctl

    # -- the API surface the controller calls
    async def create(self, url: str, body: Obj, **_: Any) -> Obj:
        self.writes.append(("create", body["metadata"]["name"]))
        pod = copy.deepcopy(body)
        self.specs[pod["metadata"]["name"]] = pod.pop("spec")  # the view keeps no spec
        self.uids += 1
        pod["metadata"]["uid"] = f"uid-{self.uids}"
        pod["status"] = {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}
        self.pods[pod["metadata"]["name"]] = pod
        if self.slow:
            self.unseen.append(pod)
        else:
            self.ctl.view.observe("Pod", "ADDED", pod)
        return pod

    async def patch(self, url: str, body: Obj, kind: str = "merge", **_: Any) -> Obj:
        parts = url.rstrip("/").split("/")
        sub = parts[-1] if parts[-1] == "status" else None
        name = parts[-2] if sub else parts[-1]
        self.writes.append(("patch" + (f"/{sub}" if sub else ""), name))
        if name in self.pools and sub:
            status = merged(self.pools[name].get("status") or {}, body["status"])
            pool = self.pools[name] = {**self.pools[name], "status": status}
            self.ctl.view.observe("StagePool", "MODIFIED", pool)
            return pool
        pod = self.pods[name]
        if not sub:
            pod["metadata"]["annotations"].update(body["metadata"]["annotations"])
            self.check_drain(pod)
        self.ctl.view.observe("Pod", "MODIFIED", copy.deepcopy(pod))
        return pod

    async def delete(self, url: str, body: Any = None, **_: Any) -> Obj:
        name = url.rstrip("/").split("/")[-1]
        self.writes.append(("delete", name))
        if is_ready(self.pods[name]):
            self.violations.append(f"deleted {name} while it was routable")
        if self.slow:  # terminating until gone() (a kubelet's grace period)
            self.pods[name]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            self.ctl.view.observe("Pod", "MODIFIED", copy.deepcopy(self.pods[name]))
        else:
            self.ctl.view.observe("Pod", "DELETED", self.pods.pop(name))
        return {}

    def gone(self) -> None:
        """The terminating pods leave (slow world)."""
        for name in [n for n, p in self.pods.items() if p["metadata"].get("deletionTimestamp")]:
            self.ctl.view.observe("Pod", "DELETED", self.pods.pop(name))

    def deliver(self) -> None:
        """The watch catches up with the creates (slow world)."""
        for pod in self.unseen:
            self.ctl.view.observe("Pod", "ADDED", copy.deepcopy(pod))
        self.unseen.clear()

    async def apply(self, url: str, body: Obj, **_: Any) -> Applied:
        kind = body["kind"]
        self.writes.append(("apply", body["metadata"]["name"]))
        self.applied[f"{kind}/{body['metadata']['name']}"] = body
        self.ctl.view.observe(kind, "ADDED", body)
        return Applied(body, True)

    # -- the world
    def set_pools(self, doc: Obj) -> None:
        current = {n: self.pools.get(kube.pool_name("p", n)) for n in ("a", "b")}
        for stage, pool in pools_of(doc, current).items():
            name = pool["metadata"]["name"]
            old = self.pools.get(name)
            pool["metadata"].update(uid=f"pool-{stage}", generation=doc["metadata"]["generation"],
                                    resourceVersion="1")
            pool["status"] = (old or {}).get("status", {})
            self.pools[name] = pool
            self.ctl.view.observe("StagePool", "MODIFIED", pool)

    def kubelet(self, ready: Callable[[Obj], bool]) -> None:
        for pod in self.pods.values():
            if ready(pod) and not is_ready(pod) and not kube.is_draining(pod):
                pod["status"] = {"phase": "Pending",
                                 "conditions": [{"type": "Ready", "status": "True"}]}
                if self.running:
                    pod["status"].update(phase="Running", podIP="127.0.0.1")
                self.ctl.view.observe("Pod", "MODIFIED", copy.deepcopy(pod))

    def schedulable(self, pod: Obj) -> bool:
        """A node fits it: it asks for no GPU (no node of this world has one)."""
        return not any(c["resources"].get("limits", {}).get("nvidia.com/gpu")
                       for c in self.specs[pod["metadata"]["name"]]["containers"])

    def of(self, stage: str) -> list[Obj]:
        return [p for p in self.pods.values()
                if p["metadata"]["labels"][kube.LABEL_STAGE] == stage]

    def targets(self) -> dict[str, str]:
        return {n: release.pool_revision(self.pools[kube.pool_name("p", n)]) for n in "ab"}

    def check_drain(self, pod: Obj) -> None:
        """An old-revision replica marked draining: every changed pool must have a Ready
        new-revision replica, and its own pool must keep its routable count."""
        stage = pod["metadata"]["labels"][kube.LABEL_STAGE]
        if release.pod_revision(pod) == self.targets()[stage]:
            return
        for name, target in self.targets().items():
            group = release.PoolRelease(target, self.of(name))
            if group.changed and group.ready_new < 1:
                self.violations.append(f"{pod['metadata']['name']} retired while stage {name} "
                                       "had no Ready new-revision replica")

    def check(self) -> None:
        for stage in "ab":
            pods = self.of(stage)
            routable = sum(1 for p in pods if is_ready(p))
            serving = sum(1 for p in pods if not kube.is_draining(p))
            if routable < self.baseline.get(stage, 0):
                self.violations.append(f"stage {stage}: {routable} routable")
            if serving > 2 + 1:
                self.violations.append(f"stage {stage}: {serving} replicas not retiring")

    async def step(self, ready: Callable[[Obj], bool]) -> None:
        for name in sorted(self.pools):
            await self.ctl.pool_reconciler.reconcile(self.pools[name])
            self.check()
        self.gone()
        self.deliver()
        self.kubelet(ready)
        self.check()

    async def run(self, ready: Callable[[Obj], bool], until: Callable[[], bool],
                  steps: int = 40) -> int:
        for n in range(steps):
            if until():
                return n
            await self.step(ready)
        raise AssertionError(f"not converged in {steps} steps: {self.describe()}")

    def converged(self) -> bool:
        targets = self.targets()
        return all(
            len(self.of(s)) == 2 and all(is_ready(p) and release.pod_revision(p) == targets[s]
                                         and not release.is_surge(p) for p in self.of(s))
            for s in "ab")

    def describe(self) -> str:
        return "; ".join(
            f"{p['metadata']['name']}:{release.pod_revision(p)}"
            f"{'+surge' if release.is_surge(p) else ''}{'+ready' if is_ready(p) else ''}"
            f"{'+draining' if kube.is_draining(p) else ''}" for p in self.pods.values())


def everyone(_: Obj) -> bool:
    return True


async def started(*, running: bool = False) -> Cluster:
    world = Cluster(running=running)
    world.set_pools(pipeline_doc(1))
    await world.run(everyone, world.converged)
    world.baseline = {"a": 2, "b": 2}
    return world


async def test_a_two_stage_release_retires_nothing_old_until_both_stages_serve_the_new() -> None:
    world = await started()
    first = world.targets()
    world.set_pools(pipeline_doc(2, 3))
    new = world.targets()
    assert all(new[s] != first[s] for s in "ab")

    # Stage b's new replica never becomes Ready: stage a surges and serves the new revision,
    # but neither stage retires an old replica.
    def not_b_new(pod: Obj) -> bool:
        return not (pod["metadata"]["labels"][kube.LABEL_STAGE] == "b"
                    and release.pod_revision(pod) == new["b"])

    for _ in range(10):
        await world.step(not_b_new)
    assert [release.is_surge(p) for p in world.of("a")].count(True) == 1
    assert [release.is_surge(p) for p in world.of("b")].count(True) == 1
    for stage in "ab":
        olds = [p for p in world.of(stage) if release.pod_revision(p) == first[stage]]
        assert len(olds) == 2 and all(is_ready(p) for p in olds), world.describe()
    assert not any(w[0] == "delete" for w in world.writes[-40:]), world.writes[-40:]

    # Once b's is Ready, both roll to the end: the surge leaves, the names are the old ones.
    await world.run(everyone, world.converged)
    assert world.violations == []
    assert sorted(world.pods) == ["p-a-0", "p-a-1", "p-b-0", "p-b-1"]
    orders = {p["metadata"]["annotations"][kube.ANNOTATION_REVISION_ORDER]
              for p in world.pods.values()}
    assert orders == {"2"}

    # Converged: a resync writes nothing, and neither does a restarted operator.
    world.writes.clear()
    await world.step(everyone)
    assert world.writes == []
    world.ctl = world.controller()
    for pool in world.pools.values():
        world.ctl.view.observe("StagePool", "ADDED", pool)
    for obj in world.applied.values():
        world.ctl.view.observe(obj["kind"], "ADDED", obj)
    for pod in world.pods.values():
        world.ctl.view.observe("Pod", "ADDED", copy.deepcopy(pod))
    await world.step(everyone)
    assert world.writes == []


async def test_an_old_replica_that_blinks_unready_while_the_release_is_held_is_kept() -> None:
    """Under load an old-revision replica can miss its readiness probes for a moment. While
    the release is held (b's new revision is not Ready) it is not replaced by a replica the
    pipeline cannot serve with; once the gate is open, an unready old replica goes at once."""
    world = await started()
    first = world.targets()
    world.set_pools(pipeline_doc(2, 3))
    new = world.targets()

    def not_b_new(pod: Obj) -> bool:
        return not (pod["metadata"]["labels"][kube.LABEL_STAGE] == "b"
                    and release.pod_revision(pod) == new["b"])

    def a_new_ready() -> bool:
        return any(is_ready(p) and release.pod_revision(p) == new["a"] for p in world.of("a"))

    await world.run(not_b_new, a_new_ready)
    blinked = world.pods["p-b-1"]
    assert release.pod_revision(blinked) == first["b"]
    blinked["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}
    world.ctl.view.observe("Pod", "MODIFIED", copy.deepcopy(blinked))
    world.baseline = {"a": 2, "b": 1}
    for _ in range(5):
        await world.step(not_b_new)
    assert world.pods["p-b-1"]["metadata"]["uid"] == blinked["metadata"]["uid"], world.describe()
    assert ("delete", "p-b-1") not in world.writes

    # b's new revision comes up: the gate opens and the unready old replica is replaced first.
    await world.run(everyone, world.converged)
    assert ("delete", "p-b-1") in world.writes
    assert world.violations == []


async def test_a_stage_whose_revision_did_not_change_is_not_restarted() -> None:
    world = await started()
    before = {p["metadata"]["uid"] for p in world.of("b")}
    world.set_pools(pipeline_doc(2, 3, b_chars=2))
    await world.run(everyone, world.converged)
    assert {p["metadata"]["uid"] for p in world.of("b")} == before
    assert world.violations == []


async def test_a_revert_mid_release_goes_back_without_dropping_capacity() -> None:
    world = await started()
    first = world.targets()
    world.set_pools(pipeline_doc(2, 3))
    new = world.targets()

    def replaced_one() -> bool:
        return any(release.pod_revision(p) == new["a"] and not release.is_surge(p)
                   and is_ready(p) for p in world.of("a"))

    await world.run(everyone, replaced_one)
    world.set_pools(pipeline_doc(3))
    assert world.targets() == first
    await world.run(everyone, world.converged)
    assert world.violations == []
    orders = {p["metadata"]["annotations"][kube.ANNOTATION_REVISION_ORDER]
              for p in world.pods.values()}
    assert orders <= {"1", "3"}  # untouched old replicas (1), replacements of the revert (3)
    assert sorted(world.pods) == ["p-a-0", "p-a-1", "p-b-0", "p-b-1"]


async def test_a_release_held_by_an_unschedulable_stage_goes_on_once_it_is_fixed() -> None:
    """Stage b's new template asks for GPUs no node has: its surge never becomes Ready, so no
    stage retires anything old; fixed (same revision), the surge is replaced at once (it
    serves nothing) and the release completes."""
    world = await started()
    first = world.targets()

    world.set_pools(pipeline_doc(2, 3, b_gpus=16))
    for _ in range(10):
        await world.step(world.schedulable)
    for stage in "ab":
        olds = [p for p in world.of(stage) if release.pod_revision(p) == first[stage]]
        assert len(olds) == 2 and all(is_ready(p) for p in olds), world.describe()
    world.set_pools(pipeline_doc(3, 3))
    await world.run(world.schedulable, world.converged)
    assert world.violations == []


async def test_a_surge_replaced_while_the_view_lags_is_created_once() -> None:
    """Seen on the real control plane under load: the unschedulable surge p-b-2, replaced
    once fixed, still terminated when the next reconcile created its replacement (p-b-3); it
    was gone before p-b-3's first watch event arrived, and a reconcile in between created a
    second surge at the lowest free ordinal (p-b-2 again): 4 replicas of a 2-replica stage
    serving at once. The pending surge keeps its place until the view shows it."""
    world = await started()

    world.set_pools(pipeline_doc(2, 3, b_gpus=16))
    for _ in range(5):
        await world.step(world.schedulable)
    assert [p["metadata"]["name"] for p in world.of("b") if release.is_surge(p)] == ["p-b-2"]
    world.set_pools(pipeline_doc(3, 3))
    world.slow = True
    pool_b = world.pools[kube.pool_name("p", "b")]
    await world.ctl.pool_reconciler.reconcile(pool_b)  # the stale surge p-b-2: deleted, terminating
    assert ("delete", "p-b-2") in world.writes
    # its replacement, above it: p-b-3, not yet seen
    await world.ctl.pool_reconciler.reconcile(pool_b)
    world.gone()  # p-b-2 leaves before p-b-3 reaches the view
    for _ in range(3):
        await world.ctl.pool_reconciler.reconcile(pool_b)
        world.check()
    surges = sorted(p["metadata"]["name"] for p in world.of("b") if release.is_surge(p))
    assert surges == ["p-b-3"], world.describe()
    world.deliver()
    await world.run(world.schedulable, world.converged)
    assert world.violations == []
    assert sorted(world.pods) == ["p-a-0", "p-a-1", "p-b-0", "p-b-1"]


# ---- the last replica of a leaving revision waits for the requests pinned to it ---------------


class FakeOrchestrator(FakeLoadServer):
    """One orchestrator pod's GET /v1/load on loopback, real HTTP: `pinned` per (stage,
    revision) as the orchestrator reports it (revisions[stage][revision].pinned), a document
    without the field (`without = ("pinned",)`: an older orchestrator), or HTTP 500
    (`broken`)."""

    @property
    def hits(self) -> int:
        return self.reads


@pytest.fixture
def orchestrators(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeOrchestrator]]:
    """Two orchestrator pods (an orchestrator rollout) on one port at two loopback IPs; the
    replicas' /state port refuses (nothing in flight in the replica itself), and the drain
    clock stands still unless a test moves it (the drain timeout never passes by itself)."""
    first = FakeOrchestrator("127.0.0.1")
    second = FakeOrchestrator("127.0.0.2", first.port)
    with socket.socket() as refused:  # bound, never listening: connections are refused
        refused.bind(("127.0.0.1", 0))
        monkeypatch.setattr(kube, "WORKER_HTTP_PORT", refused.getsockname()[1])
        clock = [dt.datetime(2027, 1, 1, tzinfo=dt.UTC)]
        monkeypatch.setattr(drain, "_now", lambda: clock[0])
        try:
            yield [first, second]
        finally:
            first.close()
            second.close()


def wire(world: Cluster, servers: list[FakeOrchestrator]) -> list[tuple[str, str, str]]:
    """Put the orchestrator's Service and pods in the controller's view (a third pod is not
    Running yet: it is not asked); record the events."""
    events: list[tuple[str, str, str]] = []
    world.ctl.writes.event = lambda obj, kind, reason, msg: events.append(  # type: ignore[method-assign]
        (kind, reason, msg))
    # The load is read on the admin listener, with the pipeline's admin key (its uid in it).
    world.ctl.children[("Service", "ns", "p-orchestrator-admin")] = {
        "spec": {"ports": [{"name": "admin", "port": servers[0].port}]}}
    world.ctl.view.pipelines[("ns", "p")] = pipeline_doc(1)
    pods = {f"p-orchestrator-{i}": {"metadata": {"name": f"p-orchestrator-{i}", "namespace": "ns"},
                                    "status": {"phase": "Running", "podIP": s.host}}
            for i, s in enumerate(servers)}
    pods["p-orchestrator-new"] = {"metadata": {"name": "p-orchestrator-new", "namespace": "ns"},
                                  "status": {"phase": "Pending", "podIP": "127.0.0.3"}}
    world.ctl.pods[("ns", "p-orchestrator")] = pods
    return events


def last_old(world: Cluster, first: dict[str, str], stage: str) -> Obj | None:
    """The stage's one replica left of its first revision, if it is draining."""
    olds = [p for p in world.of(stage) if release.pod_revision(p) == first[stage]]
    return olds[0] if len(olds) == 1 and kube.is_draining(olds[0]) else None


async def held_release(world: Cluster, first: dict[str, str]) -> dict[str, str]:
    """Release a change of both stages and run until each stage's last replica of its first
    revision is draining; the names of those replicas, by stage."""
    world.set_pools(pipeline_doc(2, 3))
    await world.run(everyone, lambda: all(last_old(world, first, s) for s in "ab"))
    return {s: last_old(world, first, s)["metadata"]["name"] for s in "ab"}  # type: ignore[index]


async def test_the_last_replica_of_a_leaving_revision_goes_once_nothing_is_pinned_to_it(
        orchestrators: list[FakeOrchestrator]) -> None:
    """Each orchestrator pod pins requests to one stage's leaving revision: neither stage's
    last old replica goes while its count is above 0 at ANY running orchestrator, though its
    own work is 0; the first old replica of each stage went without waiting (another one of
    its revision was left). A count gone (absent: 0) or 0 lets it go, with no DrainTimeout.
    Kills: not waiting (deleted with pinned 1), reading one orchestrator only (b went), and
    waiting on any old replica instead of the last (the release never gets this far)."""
    world = await started(running=True)
    first = world.targets()
    events = wire(world, orchestrators)
    orchestrators[0].pinned = {("a", first["a"]): 1}
    orchestrators[1].pinned = {("b", first["b"]): 2}
    names = await held_release(world, first)
    for _ in range(5):
        await world.step(everyone)
    assert {s: last_old(world, first, s) is not None for s in "ab"} == {"a": True, "b": True}
    assert not any(("delete", n) in world.writes for n in names.values()), world.describe()
    assert sum(1 for w in world.writes if w[0] == "delete") == 2  # the other old replica of each
    orchestrators[0].pinned = {}  # a's requests are done: the revision is no longer listed
    await world.step(everyone)
    assert ("delete", names["a"]) in world.writes and ("delete", names["b"]) not in world.writes
    orchestrators[1].pinned = {("b", first["b"]): 0}
    await world.run(everyone, world.converged)
    assert ("delete", names["b"]) in world.writes
    assert world.violations == []
    assert not [e for e in events if e[1] == "DrainTimeout"]
    assert all(o.hits for o in orchestrators)


async def test_an_orchestrator_without_the_field_counts_as_nothing_pinned(
        orchestrators: list[FakeOrchestrator]) -> None:
    """An orchestrator older than `pinned` lists the revision without it: read as 0, so the
    release goes on as before (kills: a missing field read as 'unknown', which would hold
    every release until its drain timeout)."""
    world = await started(running=True)
    first = world.targets()
    wire(world, orchestrators)
    for server in orchestrators:
        server.without = ("pinned",)
        server.pinned = {(s, first[s]): 7 for s in "ab"}
    world.set_pools(pipeline_doc(2, 3))
    await world.run(everyone, world.converged)
    assert world.violations == []


async def test_an_unreadable_orchestrator_holds_the_last_replica_until_the_drain_timeout(
        orchestrators: list[FakeOrchestrator], monkeypatch: pytest.MonkeyPatch) -> None:
    """An orchestrator that cannot be read may have requests pinned to the revision: wait.
    Past drainTimeoutSeconds (5 s here) the replica goes, and the DrainTimeout warning names
    the requests still pinned to its revision. Kills: an unreadable orchestrator read as 0,
    and a pin wait that the drain timeout does not bound."""
    world = await started(running=True)
    first = world.targets()
    events = wire(world, orchestrators)
    orchestrators[1].broken = True
    names = await held_release(world, first)
    for _ in range(3):
        await world.step(everyone)
    assert not any(("delete", n) in world.writes for n in names.values()), world.describe()
    # Readable again: a has nothing pinned and goes; b has 3 and waits, until the timeout.
    orchestrators[1].broken = False
    orchestrators[1].pinned = {("b", first["b"]): 3}
    await world.step(everyone)
    assert ("delete", names["a"]) in world.writes and ("delete", names["b"]) not in world.writes
    assert not [e for e in events if e[1] == "DrainTimeout"]
    later = drain._now() + dt.timedelta(seconds=5)
    monkeypatch.setattr(drain, "_now", lambda: later)
    await world.step(everyone)
    assert ("delete", names["b"]) in world.writes
    [(kind, _, message)] = [e for e in events if e[1] == "DrainTimeout"]
    assert kind == "Warning" and message.startswith(f"{names['b']}: drain timed out with 0 ")
    assert f"3 request(s) pinned to its revision {first['b']}" in message
    await world.run(everyone, world.converged)
    assert world.violations == []


async def test_a_replica_of_the_target_revision_never_waits_for_pins(
        orchestrators: list[FakeOrchestrator]) -> None:
    """A scale-down retires replicas of the pool's own revision, to zero: the last of them
    too, whatever is pinned to it (no release: pins were made for it). A pool being deleted
    holds nothing back and writes nothing: its pods go with it (the cascade, or its pipeline's
    shutdown). Kills: the rule applied to every last replica of a revision (a scale-down to
    zero held by pins), or a deleting pool that still converges (a replica made again)."""
    world = await started(running=True)
    first = world.targets()
    wire(world, orchestrators)
    for server in orchestrators:
        server.pinned = {(s, first[s]): 4 for s in "ab"}
    name = kube.pool_name("p", "b")
    world.pools[name] = {**world.pools[name], "spec": {**world.pools[name]["spec"], "replicas": 0}}
    world.ctl.view.observe("StagePool", "MODIFIED", world.pools[name])
    world.baseline = {"a": 2, "b": 0}
    await world.run(everyone, lambda: not world.of("b"))
    assert ("delete", "p-b-0") in world.writes and ("delete", "p-b-1") in world.writes

    # A release held by pins at stage a; the pool is deleted: its last old replica goes.
    world.set_pools(pipeline_doc(2, 3))
    await world.run(everyone, lambda: last_old(world, first, "a") is not None)
    for _ in range(3):
        await world.step(everyone)
    held = last_old(world, first, "a")
    assert held is not None
    pool = kube.pool_name("p", "a")
    world.pools[pool] = {**world.pools[pool], "metadata": {
        **world.pools[pool]["metadata"], "deletionTimestamp": "2027-01-01T00:00:00Z"}}
    world.ctl.view.observe("Pod", "DELETED", world.pods.pop(held["metadata"]["name"]))  # cascade
    before = len(world.writes)
    await world.ctl.pool_reconciler.reconcile(world.pools[pool])
    assert world.writes[before:] == []
