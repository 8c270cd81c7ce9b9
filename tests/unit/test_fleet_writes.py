"""What a fleet's ramp writes besides its pods: events and status patches (issue 24; every
write costs on a CPU-bound API server). A fake API counts the writes, so a per-pod event or an
uncoalesced status write that comes back fails here; docs/architecture.md ("Validation and
status") says what is written when."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omni_operator.controller import CREATE_EXPECTED_SECONDS, STATUS_COALESCE_SECONDS, Controller
from omni_operator.models import API_VERSION
from omni_operator.status import milestone
from omnistage.kubeapi import Applied
from tests.unit.test_controller_events import replica, stage_pool

Obj = dict[str, Any]
KEY = ("StagePool", "ns", "p-a")
NO_ROOM = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


class WriteApi:
    """Counts every write; a patch answers with a new resourceVersion, as the server does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.version = 100

    async def create(self, url: str, body: Obj, **_: Any) -> Obj:
        self.calls.append(("create", url, body))
        return body

    async def patch(self, url: str, body: Any, **_: Any) -> Obj:
        self.calls.append(("patch", url, body))
        self.version += 1
        return {**body, "metadata": {"resourceVersion": str(self.version)}}

    async def apply(self, url: str, body: Obj, **_: Any) -> Applied:
        self.calls.append(("apply", url, body))
        return Applied(body, True)

    async def delete(self, url: str, body: Any = None, **_: Any) -> Obj:
        self.calls.append(("delete", url, body))
        return {}

    async def get(self, url: str, **_: Any) -> None:
        return None

    async def close(self) -> None:
        pass

    def status_patches(self) -> list[Obj]:
        return [body["status"] for verb, url, body in self.calls
                if verb == "patch" and url.endswith("/stagepools/p-a/status")]

    def pod_creates(self) -> list[str]:
        return [body["metadata"]["name"] for verb, url, body in self.calls
                if verb == "create" and url.endswith("/pods")]


class Clock:
    """The controller's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _controller() -> tuple[Controller, WriteApi, Clock, list[tuple[str, ...]]]:
    api, clock = WriteApi(), Clock()
    controller = Controller(api=api, clock=clock, autoscaler=False)  # type: ignore[arg-type]
    events: list[tuple[str, ...]] = []
    controller.writes.event = lambda obj, *event: events.append(event)  # type: ignore[method-assign]
    return controller, api, clock, events


def _merged(old: Any, patch: Any) -> Any:
    """A JSON merge patch applied (RFC 7386), as the API server stores a status patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(old) if isinstance(old, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(out.get(k), v)
    return out


class Pool:
    """A StagePool in the controller's view; `echo` delivers our status writes back, as the
    watch does."""

    def __init__(self, controller: Controller, api: WriteApi, replicas: int) -> None:
        self.controller, self.api = controller, api
        self.obj = stage_pool(replicas)
        self.seen = 0
        controller.view.observe("StagePool", "ADDED", self.obj)

    def echo(self) -> None:
        for verb, url, body in self.api.calls[self.seen:]:
            if verb == "apply":  # the PodDisruptionBudget
                self.controller.view.observe(body["kind"], "ADDED", body)
            if verb == "patch" and url.endswith("/stagepools/p-a/status"):
                self.obj = {**self.obj, "status": _merged(self.obj.get("status"), body["status"]),
                            "metadata": {**self.obj["metadata"],
                                         "resourceVersion": str(self.api.version)}}
                self.controller.view.observe("StagePool", "MODIFIED", self.obj)
        self.seen = len(self.api.calls)

    async def reconcile(self) -> None:
        self.echo()
        await self.controller.pool_reconciler.reconcile(self.obj)
        self.echo()


def _due(controller: Controller) -> float:
    """Seconds until the pool's delayed reconcile."""
    return controller.queue._timers[KEY].when() - asyncio.get_running_loop().time()


def _fire(controller: Controller) -> None:
    """The pool's delayed reconcile is due: its timer goes (the test runs the reconcile)."""
    controller.queue._timers.pop(KEY).cancel()


def _cancel_timers(controller: Controller) -> None:
    for handle in controller.queue._timers.values():
        handle.cancel()
    controller.queue._timers.clear()


# ---- events ------------------------------------------------------------------------------


async def test_a_new_pipeline_says_created_once_naming_what_it_created() -> None:
    """One `Created` per pipeline reconcile: counts by kind and a few names. Kills: one event
    per created child (six here: a write each, a fleet's pipelines times its stages)."""
    controller, api, _, events = _controller()
    doc = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1,
                        "resourceVersion": "1"},
           "spec": {"stages": [{"name": s, "kind": "echo", "inputs": [prev] if prev else [],
                                "finalOutput": s == "e"}
                               for prev, s in zip(["", *"abcd"], "abcde", strict=True)]}}
    controller.view.observe("OmniPipeline", "ADDED", doc)
    await controller.pipeline_reconciler.reconcile(doc)
    created = [e for e in events if e[1] == "Created"]
    assert created == [("Normal", "Created", "created 1 Deployment (p-orchestrator), "
                                             "5 StagePools (p-a, p-b, p-c and 2 more)")]
    # The children in the view: nothing created, nothing said.
    for verb, url, body in list(api.calls):
        if verb == "apply" and body["kind"] in ("StagePool", "Deployment"):
            live = {**body, "metadata": {**body["metadata"], "uid": url}}
            controller.view.observe(body["kind"], "ADDED", live)
    events.clear()
    await controller.pipeline_reconciler.reconcile(doc)
    assert not [e for e in events if e[1] == "Created"]


def _unschedulable(pool: Obj, ordinal: int, message: str = NO_ROOM, uid: str = "") -> Obj:
    pod = replica(pool, ordinal, ready=False)
    pod["metadata"]["uid"] = uid or f"pod-{ordinal}"
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                    "reason": "Unschedulable", "message": message}]
    return pod


async def test_insufficient_capacity_is_said_once_per_message_per_pool() -> None:
    """A shape no node fits leaves every replica pending with the same scheduler message: one
    Warning for the pool naming a few of them, not one per pod (nor per replacement pod); a
    different message is one more; once no replica shows it, it is said again when it comes
    back. Kills: the event per pod (uid), an event per reconcile, a message never said again."""
    controller, api, _, events = _controller()
    pool = Pool(controller, api, 4)
    for o in range(4):
        controller.view.observe("Pod", "ADDED", _unschedulable(pool.obj, o))
    await pool.reconcile()
    said = [e for e in events if e[1] == "InsufficientCapacity"]
    assert said == [("Warning", "InsufficientCapacity",
                     f"p-a-0, p-a-1, p-a-2 and 1 more: {NO_ROOM}")]
    await pool.reconcile()
    controller.view.observe("Pod", "DELETED", _unschedulable(pool.obj, 3))  # replaced: a new pod
    controller.view.observe("Pod", "ADDED", _unschedulable(pool.obj, 3, uid="pod-3-again"))
    await pool.reconcile()
    controller.view.observe("Pod", "MODIFIED", _unschedulable(pool.obj, 0, "0/3 nodes: taint"))
    await pool.reconcile()
    said = [e for e in events if e[1] == "InsufficientCapacity"]
    assert said[1:] == [("Warning", "InsufficientCapacity", "p-a-0: 0/3 nodes: taint")]
    for o in range(4):  # room was made: every replica is placed
        controller.view.observe("Pod", "MODIFIED", replica(pool.obj, o, ready=False))
    await pool.reconcile()
    controller.view.observe("Pod", "MODIFIED", _unschedulable(pool.obj, 2))
    await pool.reconcile()
    said = [e for e in events if e[1] == "InsufficientCapacity"]
    assert said[2:] == [("Warning", "InsufficientCapacity", f"p-a-2: {NO_ROOM}")]
    _cancel_timers(controller)


# ---- status writes -----------------------------------------------------------------------


def test_milestones_are_first_statuses_phases_generations_and_condition_flips() -> None:
    base = {"phase": "Pending", "observedGeneration": 1, "replicas": 1,
            "conditions": [{"type": "Ready", "status": "False", "reason": "A", "message": "1"}]}
    assert milestone({}, base)
    assert not milestone(base, {**base, "replicas": 2, "conditions": [
        {"type": "Ready", "status": "False", "reason": "B", "message": "2"}]})
    assert milestone(base, {**base, "phase": "Ready"})
    assert milestone(base, {**base, "observedGeneration": 2})
    assert milestone(base, {**base, "conditions": [{"type": "Ready", "status": "True"}]})
    assert milestone(base, {**base, "conditions": [*base["conditions"],
                                                   {"type": "Progressing", "status": "True"}]})


async def test_a_ramp_writes_pool_status_at_milestones_and_the_last_counts_late() -> None:
    """Four replicas appear and become ready, each a reconcile 0.1 s after the last. Written
    at once: the first status, Ready flipping True, Progressing flipping False. Counts in
    between are held while a write is younger than STATUS_COALESCE_SECONDS, and the latest is
    written by the delayed reconcile. Then idle: no write, no timer.
    Kills: a write per count change (the 4.4 status patches per pool of issue 24), a held
    value never written (no delayed reconcile), a flip held back, an idle write."""
    controller, api, clock, _ = _controller()
    start = clock.now
    pool = Pool(controller, api, 4)
    await pool.reconcile()
    assert [s["replicas"] for s in api.status_patches()] == [0]  # the first: at once
    for o in range(4):  # the pods' events arrive
        clock.now += 0.1
        controller.view.observe("Pod", "ADDED", replica(pool.obj, o, ready=False))
        await pool.reconcile()
    assert len(api.status_patches()) == 1  # held
    assert _due(controller) == pytest.approx(STATUS_COALESCE_SECONDS - 0.4, abs=0.1)
    _fire(controller)
    clock.now = start + STATUS_COALESCE_SECONDS
    await pool.reconcile()
    assert [s["replicas"] for s in api.status_patches()] == [0, 4]  # the latest counts
    assert KEY not in controller.queue._timers

    for o in range(4):  # they become ready, one by one
        clock.now += 0.1
        controller.view.observe("Pod", "MODIFIED", replica(pool.obj, o))
        await pool.reconcile()
    written = api.status_patches()
    flips = [{c["type"]: c["status"] for c in s.get("conditions") or []} for s in written[2:]]
    assert flips == [{"Ready": "True", "Progressing": "True"},  # 2 of 4 changes, at once
                     {"Ready": "True", "Progressing": "False"}]
    assert _merged(written[0], written[-1])["readyReplicas"] == 4
    assert pool.obj["status"]["readyReplicas"] == 4

    _fire(controller)  # the held counts' delayed reconcile: the flip wrote them already
    clock.now += 60  # then idle resyncs: nothing to write, nothing to come back for
    for _ in range(3):
        await pool.reconcile()
    assert len(api.status_patches()) == 4 and not controller.queue._timers


async def test_a_restarted_operator_writes_nothing_for_a_converged_pool() -> None:
    """A restarted operator has no memory of its writes: a pool whose stored status is what it
    computes gets no write and no timer. Kills: coalescing that writes (or re-arms) on a
    status that did not change."""
    controller, api, clock, _ = _controller()
    pool = Pool(controller, api, 2)
    for o in range(2):
        controller.view.observe("Pod", "ADDED", replica(pool.obj, o))
    await pool.reconcile()
    clock.now += STATUS_COALESCE_SECONDS
    await pool.reconcile()
    converged = pool.obj
    restarted, api2, _, _ = _controller()
    restarted.view.observe("StagePool", "ADDED", converged)
    restarted.view.children = controller.view.children  # the PodDisruptionBudget
    for o in range(2):
        restarted.view.observe("Pod", "ADDED", replica(converged, o))
    await restarted.pool_reconciler.reconcile(converged)
    assert api2.calls == [] and not restarted.queue._timers
    _cancel_timers(controller)


async def test_the_look_again_for_an_awaited_pod_survives_a_coalesced_write() -> None:
    """A pool keeps one delayed reconcile, the earliest. The look-again armed for a created pod
    whose watch event has not come (~CREATE_EXPECTED_SECONDS) gave way to the sooner reconcile
    of a held status write, and nothing armed it again: the lost pod was never created again.
    Every reconcile that still awaits a pod arms it. Kills: arming it only on the create."""
    controller, api, clock, _ = _controller()
    start = clock.now
    pool = Pool(controller, api, 2)
    await pool.reconcile()
    assert api.pod_creates() == ["p-a-0", "p-a-1"]
    assert _due(controller) == pytest.approx(CREATE_EXPECTED_SECONDS + 1, abs=0.5)
    clock.now += 0.5
    # p-a-1's never comes
    controller.view.observe("Pod", "ADDED", replica(pool.obj, 0, ready=False))
    await pool.reconcile()
    assert len(api.status_patches()) == 1  # held: the coalescing reconcile took the slot
    assert _due(controller) == pytest.approx(STATUS_COALESCE_SECONDS - 0.5, abs=0.1)
    _fire(controller)
    clock.now = start + STATUS_COALESCE_SECONDS
    await pool.reconcile()
    assert len(api.status_patches()) == 2
    assert _due(controller) == pytest.approx(CREATE_EXPECTED_SECONDS + 1 - 2, abs=0.5)
    _fire(controller)
    clock.now = start + CREATE_EXPECTED_SECONDS + 1
    await pool.reconcile()
    assert api.pod_creates() == ["p-a-0", "p-a-1", "p-a-1"]  # looked again: created again
    _cancel_timers(controller)



# ---- the pool's PodDisruptionBudget ------------------------------------------------------


def _budgets(api: WriteApi) -> list[int]:
    """minAvailable of each PodDisruptionBudget the operator wrote, in order."""
    return [body["spec"]["minAvailable"] for verb, _, body in api.calls
            if verb == "apply" and body.get("kind") == "PodDisruptionBudget"]


async def test_a_pools_budget_is_written_once_its_minimum_is_ready_and_then_kept() -> None:
    """Four replicas, maxUnavailable 1: the budget (minAvailable 3) is written by the
    reconcile that sees the third replica ready, not before; later it is kept and follows the
    spec, whatever is ready. Kills: a budget written at the pool's first reconcile (through a
    fleet's ramp each pod event then has the disruption controller count every pod of the
    namespace: the controller-manager's time per pod grew with the fleet, 5.7 -> 13.6 ms from
    600 to 6,000 pods), a budget never written, one dropped or left unwritten when
    the pool falls below its minimum again."""
    controller, api, _, _ = _controller()
    pool = Pool(controller, api, 4)
    await pool.reconcile()
    for o in range(4):
        controller.view.observe("Pod", "ADDED", replica(pool.obj, o, ready=False))
        await pool.reconcile()
    assert _budgets(api) == []  # starting: nothing to protect, and a drain is not held up
    for o in range(3):
        assert _budgets(api) == []
        controller.view.observe("Pod", "MODIFIED", replica(pool.obj, o))
        await pool.reconcile()
    assert _budgets(api) == [3]
    assert ("PodDisruptionBudget", "ns", "p-a") in controller.children
    for o in range(3):  # below the minimum again: the budget stays, unwritten
        controller.view.observe("Pod", "MODIFIED", replica(pool.obj, o, ready=False))
        await pool.reconcile()
    assert _budgets(api) == [3]
    assert not [c for c in api.calls if c[0] == "delete"]
    # Scaled to 6 with none ready: the kept budget follows the spec at once.
    pool.obj = {**pool.obj, "spec": {**pool.obj["spec"], "replicas": 6},
                "metadata": {**pool.obj["metadata"], "generation": 2}}
    controller.view.observe("StagePool", "MODIFIED", pool.obj)
    await pool.reconcile()
    assert _budgets(api) == [3, 5]
    _cancel_timers(controller)


async def test_a_single_replica_pools_budget_is_written_at_once() -> None:
    """minAvailable 0 (one replica, maxUnavailable 1) is met by no replica: written at the
    first reconcile, as before."""
    controller, api, _, _ = _controller()
    pool = Pool(controller, api, 1)
    await pool.reconcile()
    assert _budgets(api) == [0]
    _cancel_timers(controller)
