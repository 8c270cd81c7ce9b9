"""The dispatch window (stage.dispatch.perReplica) against in-process fake replicas: the rig of
test_engine.py.

With a window, at most perReplica tasks sit on each replica (running and queued there); the rest
wait in the orchestrator in order, a freed slot takes the oldest, a retried task (after a lost
replica or a refusal) goes to the front, and a waiting task still ends by its abort or deadline,
once. Without one (the default) every task goes to a replica at once, as before. The same with
real worker processes and kill -9: tests/integration/test_failover.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from omnistage import protocol as p
from omnistage.spec import SpecError, parse_pipeline
from tests.unit import test_engine
from tests.unit.test_engine import HANG, ONE, Make, Rig, echo, events, outcome, until

pytestmark = pytest.mark.timeout(30)
make = test_engine.make  # the rig's fixture


def windowed(n: int) -> list[dict[str, Any]]:
    return [echo("a", final=True, dispatch={"perReplica": n})]


def submits(rig: Rig, replica: str) -> list[str]:
    return [s.id for s in rig.net.link(replica).of(p.Submit)]


def waiting(rig: Rig, stage: str = "a") -> list[str]:
    """The request ids of the stage's waiting tasks, in queue order."""
    return [t.child.request.id for t in rig.orch.holds.queue(stage)]


def finish(rig: Rig, rid: str) -> None:
    """The replica running request rid's task at a answers with its final."""
    task = rig.orch.requests[rid].children[0].running[("a", False)]
    rig.net.link(task.replica.name).reply(p.Final(id=task.wire_id, text=rid))


def where(rig: Rig, rid: str) -> str:
    return rig.orch.requests[rid].children[0].running[("a", False)].replica.name


async def test_without_a_window_every_task_goes_to_a_replica_at_once(make: Make) -> None:
    """The default (null): nothing waits in the orchestrator; five tasks queue on the one
    replica, as before the window existed."""
    rig = await make(ONE, {"a": 1})
    assert rig.orch.router.windows == {}
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(5)]
    assert submits(rig, "a-0") == [f"r{i}/0/a" for i in range(5)]
    assert rig.replica("a-0").inflight == 5
    assert waiting(rig) == [] and rig.orch.load().stages["a"].held == 0
    for i in range(5):
        finish(rig, f"r{i}")
    assert [outcome(h).status for h in hs] == ["ok"] * 5
    rig.clean()


async def test_at_most_n_per_replica_and_a_freed_slot_takes_the_oldest(make: Make) -> None:
    """perReplica 2 on two replicas: four tasks go, two wait in order (counted as held); a
    final frees a slot and the oldest waiting task takes it, on that replica."""
    rig = await make(windowed(2), {"a": 2})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(6)]
    assert sorted(len(submits(rig, n)) for n in ("a-0", "a-1")) == [2, 2]
    assert waiting(rig) == ["r4", "r5"]
    load = rig.orch.load().stages["a"]
    assert (load.inflight, load.held) == (4, 2)
    freed = where(rig, "r1")
    finish(rig, "r1")
    await until(lambda: waiting(rig) == ["r5"], "r4 sent")
    assert submits(rig, freed)[-1] == "r4/0/a"
    assert max(rig.replica(n).inflight for n in ("a-0", "a-1")) == 2
    for rid in ("r0", "r2", "r3", "r4"):
        finish(rig, rid)
    await until(lambda: waiting(rig) == [], "r5 sent")
    finish(rig, "r5")
    assert [outcome(h).status for h in hs] == ["ok"] * 6
    assert sum(len(submits(rig, n)) for n in ("a-0", "a-1")) == 6  # each sent once
    rig.clean()


async def test_a_waiting_task_goes_only_to_a_replica_with_room(make: Make) -> None:
    """perReplica 1 on three replicas, ten slots freed one by one: each time the oldest waiting
    task goes to the replica that freed (the only one with room), never above the window."""
    rig = await make(windowed(1), {"a": 3})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(13)]
    for i in range(10):
        freed = where(rig, f"r{i}")
        finish(rig, f"r{i}")
        await until(lambda i=i: f"r{i + 3}" not in waiting(rig), f"r{i + 3} sent")
        assert where(rig, f"r{i + 3}") == freed
        assert [rig.replica(f"a-{n}").inflight for n in range(3)] == [1, 1, 1]
    for i in range(10, 13):
        finish(rig, f"r{i}")
    assert [outcome(h).status for h in hs] == ["ok"] * 13
    rig.clean()


async def test_a_new_task_never_takes_a_slot_ahead_of_waiting_ones(make: Make) -> None:
    """A slot frees and a new request arrives before the waiting ones were sent (in the same
    loop turn): it queues behind them, and the slot goes to the oldest."""
    rig = await make(windowed(1), {"a": 1})
    [rig.submit("x", request_id=f"r{i}") for i in range(3)]
    assert waiting(rig) == ["r1", "r2"]
    finish(rig, "r0")
    rig.submit("x", request_id="r3")
    assert waiting(rig) == ["r1", "r2", "r3"]
    await until(lambda: waiting(rig) == ["r2", "r3"], "r1 sent")
    assert submits(rig, "a-0") == ["r0/0/a", "r1/0/a"]


async def test_a_failover_retry_goes_ahead_of_the_waiting_tasks(make: Make) -> None:
    """kill -9 of a replica holding two tasks: both are retried (nothing fails) and wait at the
    front of the queue, ahead of tasks admitted after them; the next freed slot takes one."""
    rig = await make(windowed(2), {"a": 2})
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(6)]
    victim = where(rig, "r0")
    survivor = "a-1" if victim == "a-0" else "a-0"
    lost = {t.child.request.id for t in rig.replica(victim).bound}
    rig.net.link(victim).on_disconnect()
    assert set(waiting(rig)[:2]) == lost and waiting(rig)[2:] == ["r4", "r5"]
    assert rig.orch.failovers["retries"] == {"a": 2}
    assert all(events(h) == [] for h in hs)  # nothing failed
    done = next(iter({f"r{i}" for i in range(4)} - lost))
    finish(rig, done)
    first = waiting(rig)[0]
    await until(lambda: len(waiting(rig)) == 3, "a retry sent")
    assert submits(rig, survivor)[-1] == f"{first}/0/a~1"
    assert waiting(rig)[1:] == ["r4", "r5"]


@pytest.mark.parametrize("refusal", [p.Draining, p.Error])
async def test_a_refused_task_goes_to_the_front(make: Make, refusal: type) -> None:
    """A replica refuses a task (draining, or not ready): the task waits at the front for a
    replica it has not tried, ahead of the tasks admitted after it."""
    rig = await make(windowed(1), {"a": 2})
    [rig.submit("x", request_id=f"r{i}") for i in range(4)]
    assert waiting(rig) == ["r2", "r3"]
    refusing = where(rig, "r0")
    other = "a-1" if refusing == "a-0" else "a-0"
    task = rig.orch.requests["r0"].children[0].running[("a", False)]
    fields = {"code": "not_ready"} if refusal is p.Error else {}
    rig.net.link(refusing).reply(refusal(id=task.wire_id, message="no", **fields))
    assert waiting(rig) == ["r0", "r2", "r3"]
    # The refusing replica's slot is free (the membership still says ready): r0 never goes
    # back there, r2 does.
    await until(lambda: waiting(rig) == ["r0", "r3"], "r2 sent")
    assert submits(rig, refusing) == ["r0/0/a", "r2/0/a"]
    finish(rig, "r1")
    await until(lambda: waiting(rig) == ["r3"], "r0 sent")
    assert submits(rig, other) == ["r1/0/a", "r0/0/a"]


async def test_abort_and_deadline_of_a_waiting_task_end_it_once(make: Make) -> None:
    """A waiting task is aborted (one `abort` outcome) or its request's deadline passes (one
    `deadline` outcome): it leaves the queue, nothing is ever sent for it, and the slot that
    frees later goes to the next one."""
    rig = await make(windowed(1), {"a": 1})
    h0 = rig.submit("x", request_id="r0")
    h1 = rig.submit("x", request_id="r1")
    h2 = rig.submit("x", request_id="r2", timeout_s=0.01)
    h3 = rig.submit("x", request_id="r3")
    assert waiting(rig) == ["r1", "r2", "r3"]
    h1.abort()
    assert outcome(h1).status == "abort"
    assert waiting(rig) == ["r2", "r3"]
    out = await asyncio.wait_for(h2.outcome(), HANG)
    assert (out.status, out.error.code) == ("request_error", "deadline")
    assert waiting(rig) == ["r3"]
    finish(rig, "r0")
    assert outcome(h0).status == "ok"
    await until(lambda: waiting(rig) == [], "r3 sent")
    assert submits(rig, "a-0") == ["r0/0/a", "r3/0/a"]
    finish(rig, "r3")
    assert outcome(h3).status == "ok"
    assert events(h1) == [] and events(h2) == []  # exactly one outcome each
    assert rig.orch.outcomes == {"ok": 2, "abort": 1, "request_error": 1}
    rig.clean()


async def test_a_session_s_task_goes_to_its_replica_past_the_window(make: Make) -> None:
    """Session affinity wins: a task of a session goes to the session's replica though its
    window is full (as without a window)."""
    rig = await make(windowed(1), {"a": 1})
    rig.submit("x", request_id="r0")
    rig.submit("x", request_id="s0", session="s")
    assert submits(rig, "a-0") == ["r0/0/a", "s0/0/a"]
    assert waiting(rig) == []


async def test_a_waiting_task_whose_replicas_all_left_is_not_stranded(make: Make) -> None:
    """The only replica is lost while a task waits for it: the bound task fails with
    replica_lost (no other replica), and the waiting one ends too, with no_replica, instead of
    waiting forever."""
    rig = await make(windowed(1), {"a": 1})
    h0 = rig.submit("x", request_id="r0")
    h1 = rig.submit("x", request_id="r1")
    rig.net.link("a-0").on_disconnect()
    assert outcome(h0).error.code == "replica_lost"
    out = await asyncio.wait_for(h1.outcome(), HANG)
    assert (out.status, out.error.code) == ("fatal", "no_replica")
    assert waiting(rig) == []
    rig.clean()


async def test_a_waiting_task_keeps_its_revision_pin(make: Make) -> None:
    """a-0 runs revision A1, a-1 the newer A2; requests are pinned to one or the other. A task
    pinned to A2 waits while a-1 is full, though a-0 has room, and goes to a-1 once it frees;
    a task pinned to A1 meanwhile goes to a-0 at once (it waits behind nobody of its own)."""
    draws = [0.0, 0.0, 0.9]  # newest (A2), newest, previous (A1): a share of 1/2 each
    rig = await make(windowed(1), {"a": 2}, revision_rng=SimpleNamespace(random=draws.pop))
    draws.reverse()
    for name, rev, order in (("a-0", "A1", 1), ("a-1", "A2", 2)):
        r = rig.replica(name)
        r.info, r.said_revision = replace(r.info, revision=rev, order=order), rev
    hs = [rig.submit("x", request_id=f"r{i}") for i in range(3)]
    assert [h._request.pins["a"] for h in hs] == ["A2", "A2", "A1"]
    assert (submits(rig, "a-1"), submits(rig, "a-0")) == (["r0/0/a"], ["r2/0/a"])
    assert waiting(rig) == ["r1"]
    finish(rig, "r2")  # room on a-0, of the wrong revision for r1
    await until(lambda: not rig.orch.router.pending, "the queue drained")
    assert waiting(rig) == ["r1"] and submits(rig, "a-0") == ["r2/0/a"]
    finish(rig, "r0")
    await until(lambda: waiting(rig) == [], "r1 sent")
    assert submits(rig, "a-1") == ["r0/0/a", "r1/0/a"]
    finish(rig, "r1")
    assert [outcome(h).status for h in hs] == ["ok"] * 3
    rig.clean()


async def test_a_fed_task_sent_later_gets_every_chunk_so_far(make: Make) -> None:
    """a streams to b, whose window (1) is full: b's fed task waits while a's chunks and its end
    arrive; once the slot frees it is sent with every chunk kept, in order, then the end."""
    rig = await make([echo("a"), echo("b", ("a",), final=True, dispatch={"perReplica": 1})])
    h0 = rig.submit("x", request_id="r0")
    rig.answer(h0, "a", text="x")  # whole: r0's b takes b-0's one slot
    h1 = rig.submit("abcd", request_id="r1")
    a1 = rig.task(h1, "a")
    a_link = rig.net.link(a1.replica.name)
    a_link.reply(p.Chunk(id=a1.wire_id, seq=1, text="ab"))
    assert waiting(rig, "b") == ["r1"]
    a_link.reply(p.Chunk(id=a1.wire_id, seq=2, text="cd"))
    rig.answer(h1, "a", text="abcd")
    b_link = rig.net.link("b-0")
    assert submits(rig, "b-0") == ["r0/0/b"] and b_link.of(p.Feed) == []
    rig.answer(h0, "b", text="x")
    assert outcome(h0).status == "ok"
    await until(lambda: waiting(rig, "b") == [], "r1's b sent")
    [_, sub] = b_link.of(p.Submit)
    assert sub.id == "r1/0/b" and sub.fed
    assert [(f.seq, f.text, f.last) for f in b_link.of(p.Feed)] == [
        (1, "ab", False), (2, "cd", False), (3, None, True)]
    rig.answer(h1, "b", text="abcd")
    assert outcome(h1).status == "ok"
    rig.clean()


def test_per_replica_out_of_bounds_is_refused_by_name() -> None:
    for value in (0, -1, 4097, "two", 1.5):
        doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
               "metadata": {"name": "pl"},
               "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                    "dispatch": {"perReplica": value}}]}}
        with pytest.raises(SpecError, match=r"spec\.stages\[0\]\.dispatch\.perReplica"):
            parse_pipeline(doc)


def test_per_replica_bounds_and_null_are_accepted() -> None:
    for value, want in ((1, 1), (4096, 4096), (None, None)):
        doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
               "metadata": {"name": "pl"},
               "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                    "dispatch": {"perReplica": value}}]}}
        assert parse_pipeline(doc).spec.stages[0].dispatch.per_replica == want
