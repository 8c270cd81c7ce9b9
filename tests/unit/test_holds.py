"""Held tasks (holds.py, routing.py): one bound per stage for every cause, refusals that name
their cause, counts by cause in GET /v1/load and /metrics, a wake that spreads its held tasks
over replicas as they arrive, and retirements counted apart from faults (replicas.py). Against
the in-process fake replicas of test_engine.py; the same with real worker processes:
tests/integration/test_holds.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import generate_latest

from omnistage import protocol as p
from omnistage.orchestrator.holds import DEFAULT_HOLD_QUEUE, HoldCause, Holds, hold_bounds
from omnistage.orchestrator.membership import ReplicaInfo
from omnistage.orchestrator.routing import wake_shares
from omnistage.spec import parse_pipeline
from tests.harness.metrics import sample
from tests.unit import test_engine
from tests.unit.test_engine import Make, Rig, Worker, echo, endpoint, outcome, until

pytestmark = pytest.mark.timeout(30)
make = test_engine.make  # the rig's fixture


def scaled(hold_queue: int, *, low: int = 1, **extra: Any) -> list[dict[str, Any]]:
    return [echo("a", final=True, replicas=low, **extra, autoscaling={
        "minReplicas": low, "maxReplicas": 4, "holdQueue": hold_queue})]


def finish(rig: Rig, rid: str) -> None:
    task = rig.orch.requests[rid].children[0].running[("a", False)]
    rig.net.link(task.replica.name).reply(p.Final(id=task.wire_id, text=rid))


def join(rig: Rig, name: str) -> None:
    """The placement's part: a new replica of stage a is up."""
    address = f"tcp://127.0.0.1:{21000 + len(rig.net.workers)}"
    rig.net.workers[address] = Worker(name, "a")
    rig.membership.publish(ReplicaInfo("a", name, address))


# ---- one bound, every cause ------------------------------------------------------------------


async def test_tasks_waiting_for_the_dispatch_window_count_against_hold_queue(make: Make) -> None:
    """holdQueue 2, a window of 1 on one replica: one task runs, two wait (window), the fourth
    is refused at once with no_replica and a message that names the window; the waiting ones
    are not hurt. Before: only a wake checked the bound, so the fourth waited too.

    Kills: the bound applied to WAKE only, a refusal without its cause, a refused task held."""
    rig = await make(scaled(2, dispatch={"perReplica": 1}), {"a": 1})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(4)]
    assert rig.orch.holds.by_cause("a") == {"wake": 0, "revision": 0, "window": 2}
    refused = outcome(hs[3])
    assert refused.error is not None and refused.error.code == "no_replica"
    assert "dispatch window" in refused.error.message
    assert "hold queue is full (2 requests wait)" in refused.error.message
    assert refused.error.retry_after is not None
    for i in range(3):
        await until(lambda i=i: f"r{i}" in {t.child.request.id for t in rig.orch.tasks.values()},
                    f"r{i} sent")
        finish(rig, f"r{i}")
    assert [outcome(h).status for h in hs[:3]] == ["ok"] * 3
    assert rig.orch.holds.refused == {("a", HoldCause.WINDOW): 1}
    rig.clean()


async def test_a_stage_without_autoscaling_is_bounded_at_the_default(make: Make) -> None:
    """No autoscaling, so no holdQueue of its own: its window holds stop at the default."""
    rig = await make([echo("a", final=True, dispatch={"perReplica": 1})], {"a": 1})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(DEFAULT_HOLD_QUEUE + 2)]
    assert rig.orch.load().stages["a"].held == DEFAULT_HOLD_QUEUE
    assert [h.id for h in hs if h.id not in rig.orch.requests] == [f"r{DEFAULT_HOLD_QUEUE + 1}"]
    assert outcome(hs[-1]).error.code == "no_replica"


@dataclass(eq=False)
class _Child:
    running: dict[Any, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Task:
    stage: str = "a"
    companion: bool = False
    replica: Any = None
    tried: set[str] = field(default_factory=set)
    child: _Child = field(default_factory=_Child)


def test_every_cause_counts_against_the_one_bound_and_the_refusal_names_its_cause() -> None:
    """Whatever held the first, the second of any cause finds the bound (1) full; each
    refusal says what the task would have waited for. A task sent before (a retry) is held
    past the bound instead: the bound refuses new work, never work the pipeline took."""
    holds = Holds({"a": 1})
    assert holds.hold(_Task(), HoldCause.REVISION) is None  # type: ignore[arg-type]
    why = {}
    for cause in HoldCause:
        error = holds.hold(_Task(), cause)  # type: ignore[arg-type]
        assert error is not None and error.code == "no_replica", cause
        why[cause] = error.message
    assert "at zero replicas" in why[HoldCause.WAKE]
    assert "revision" in why[HoldCause.REVISION]
    assert "dispatch window" in why[HoldCause.WINDOW]
    assert all("hold queue is full (1 requests wait" in m for m in why.values())
    retry = _Task(tried={"a-0"})
    assert holds.hold(retry, HoldCause.WINDOW) is None  # type: ignore[arg-type]
    assert holds.by_cause("a") == {"wake": 0, "revision": 1, "window": 1}
    assert holds.held("a") == 2 and holds.held("a", HoldCause.WINDOW) == 1
    assert holds.take(retry) and holds.by_cause("a")["window"] == 0  # type: ignore[arg-type]


def test_the_bound_is_hold_queue_else_the_default() -> None:
    pipe = parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                           "metadata": {"name": "p"}, "spec": {"stages": [
                               *scaled(7), echo("b", ("a",), final=True)]}})
    assert hold_bounds(pipe.spec.stages) == {"a": 7, "b": DEFAULT_HOLD_QUEUE}


async def test_load_and_metrics_report_held_tasks_by_cause(make: Make) -> None:
    """GET /v1/load keeps `held` (the autoscaler reads it) and adds `held_by_cause`; the
    gauge omnistage_stage_held_requests has a `cause` label; refusals are counted by cause."""
    rig = await make(scaled(1, dispatch={"perReplica": 1}), {"a": 1})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(3)]
    load = rig.orch.load()
    assert load.stages["a"].held == 1
    assert load.held_by_cause == {"a": {"wake": 0, "revision": 0, "window": 1}}
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_stage_held_requests", pipeline="pl", stage="a",
                  cause="window") == 1
    assert sample(text, "omnistage_stage_held_requests", pipeline="pl", stage="a",
                  cause="wake") == 0
    assert sample(text, "omnistage_orchestrator_hold_refusals_total", pipeline="pl",
                  stage="a", cause="window") == 1
    assert outcome(hs[2]).error.code == "no_replica"


# ---- a wake spreads ----------------------------------------------------------------------------


def test_a_replica_s_share_at_a_wake_is_what_it_runs_at_once_plus_one() -> None:
    pipe = parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                           "metadata": {"name": "p"}, "spec": {"stages": [
                               *scaled(8, low=0),
                               {**echo("w", ("a",)), "dispatch": {"perReplica": 3},
                                "autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
                               {"name": "l", "kind": "ar", "model": "tiny-llama",
                                "inputs": ["a"], "finalOutput": True,
                                "engine": {"maxBatchSize": 4}, "autoscaling": {"maxReplicas": 2}},
                               echo("fixed", ("a",), final=True)]}})
    assert wake_shares(pipe.spec.stages) == {"a": 2, "w": 3, "l": 5}


async def test_held_tasks_spread_over_replicas_as_they_arrive(make: Make) -> None:
    """Six tasks held at zero; the first replica takes its share (2: echo runs one at a time,
    plus one queued), the others wait and go to the next two replicas as each arrives, and a
    freed slot takes the next. Before: all six went to the first replica.

    Kills: every held task released to the first routable replica, the spread never ending
    (a later task held though a replica has room), a waiting task stranded."""
    rig = await make(scaled(8, low=0), {"a": 0})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(6)]
    assert rig.orch.holds.by_cause("a")["wake"] == 6
    join(rig, "a-0")
    await until(lambda: rig.orch.pools["a"].has_routable() and not rig.orch.holds.held(
        "a", HoldCause.WAKE) and "a" not in rig.orch.router.pending, "the wake's release")
    assert rig.replica("a-0").inflight == 2
    assert rig.orch.holds.by_cause("a") == {"wake": 0, "revision": 0, "window": 4}
    join(rig, "a-1")
    await until(lambda: rig.orch.holds.held("a") == 2, "a-1 takes its share")
    join(rig, "a-2")
    await until(lambda: rig.orch.holds.held("a") == 0, "a-2 takes its share")
    assert [rig.replica(f"a-{i}").inflight for i in range(3)] == [2, 2, 2]
    for i in range(6):
        finish(rig, f"r{i}")
    assert [outcome(h).status for h in hs] == ["ok"] * 6
    assert rig.orch.router.waking == set()  # spread: the stage routes as before
    more = [rig.submit("y", request_id=f"s{i}") for i in range(9)]
    assert rig.orch.holds.held("a") == 0  # no window of its own: all go at once
    for h in more:
        rig.answer(h, "a")
        assert outcome(h).status == "ok"
    rig.clean()


async def test_with_one_replica_only_the_held_tasks_still_all_run(make: Make) -> None:
    """No second replica comes: each freed slot takes the next held task, in order."""
    rig = await make(scaled(8, low=0), {"a": 0})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(5)]
    join(rig, "a-0")
    for i in range(5):
        await until(lambda i=i: rig.orch.requests[f"r{i}"].children[0].running[
            ("a", False)].replica is not None, f"r{i} sent")
        assert rig.replica("a-0").inflight <= 2
        finish(rig, f"r{i}")
    assert [outcome(h).status for h in hs] == ["ok"] * 5
    rig.clean()


# ---- retirements are not faults ----------------------------------------------------------------


async def test_a_drained_replica_that_leaves_is_retired_not_lost(make: Make) -> None:
    """Draining, then its process closes the connection, then it leaves the membership:
    one retirement, no loss, no restart. A replica that goes without a drain is still lost.
    Before: the drained one counted one loss and one restart.

    Kills: retirements counted as faults, faults counted as retirements."""
    rig = await make(scaled(8), {"a": 2})
    e0, e1 = endpoint(rig, "a-0"), endpoint(rig, "a-1")
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "draining"))
    rig.net.link("a-0").on_disconnect()
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "gone"))
    counters = rig.orch.counters
    assert (counters["replicas_retired"], counters["replicas_lost"],
            counters["replica_restarts"]) == (1, 0, 0)
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_orchestrator_replicas_retired_total", pipeline="pl") == 1
    assert sample(text, "omnistage_orchestrator_replicas_lost_total", pipeline="pl") == 0
    rig.net.link("a-1").on_disconnect()  # a crash: no drain before it
    rig.membership.publish(ReplicaInfo("a", "a-1", e1, "gone"))
    assert (counters["replicas_retired"], counters["replicas_lost"],
            counters["replica_restarts"]) == (1, 1, 1)


async def test_a_process_that_says_it_drains_retires(make: Make) -> None:
    """The membership never said draining (SIGTERM reached the worker first), but its pong
    did: its end is a retirement too; a new process at the address starts afresh."""
    rig = await make(scaled(8), {"a": 1})
    e0 = endpoint(rig, "a-0")
    worker = rig.net.workers[e0]
    link = rig.net.link("a-0")
    pong = test_engine.state(worker)
    link.reply(p.Pong(cid="x", state=pong.__class__(**{
        **{f: getattr(pong, f) for f in pong.__struct_fields__}, "draining": True})))
    assert rig.replica("a-0").retiring
    link.on_disconnect()
    assert rig.orch.counters["replica_restarts"] == 0
    link.reply(link.hello_reply("inc-2"))
    assert not rig.replica("a-0").retiring  # a new process said nothing yet
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "gone"))
    assert (rig.orch.counters["replicas_lost"], rig.orch.counters["replicas_retired"]) == (1, 0)
