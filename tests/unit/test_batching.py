"""BatchScheduler and select_joiners: joins and leaves, FIFO, abort, deadline, budgets.

The engine here is a fake whose steps the test releases one at a time (`engine.tick()`), so
which sequences share which step is exact, not a matter of timing. The same paths through the
real AR and diffusion executors, and through a real worker process, are in
tests/integration/test_batching.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import pytest

from omnistage.admission import (
    BoundedAdmission,
    DeadlineExceeded,
    ExecutionCancelled,
    ExecutionContext,
    Overloaded,
)
from omnistage.batching import BatchScheduler, run_alone, select_joiners
from tests.harness.waiting import HANG_GUARD, until

pytestmark = pytest.mark.timeout(120)  # a hang guard, above the waits' HANG_GUARD


@dataclass(eq=False)
class Job:
    name: str
    steps: int = 1
    key: Hashable = None
    tokens: int = 0


class FakeBatch:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.seqs: dict[int, list[Any]] = {}  # seq -> [job, steps done]

    def add(self, seq: int, job: Job, emit: Any) -> None:
        if job.name.startswith("bad"):
            raise ValueError(f"{job.name}: the batch refuses it")
        self.seqs[seq] = [job, 0]
        self.engine.joined.append(job.name)

    def step(self) -> dict[int, Any]:
        eng = self.engine
        eng.waiting = True  # who joins this step is settled: the scheduler already chose
        if not eng.ticks.acquire(timeout=10):
            raise AssertionError("the test never released this step")
        eng.waiting = False
        eng.steps.append([job.name for job, _ in self.seqs.values()])
        if eng.fail_next:
            eng.fail_next = False
            raise RuntimeError("the model fell over")
        done = {}
        for seq, state in list(self.seqs.items()):
            state[1] += 1
            if state[1] >= state[0].steps:
                done[seq] = ("done", state[0].name, state[1])
                del self.seqs[seq]
        eng.stepped.release()
        return done

    def abort(self, seq: int) -> Any:
        job, n = self.seqs.pop(seq)
        return ("aborted", job.name, n)

    def expire(self, seq: int) -> DeadlineExceeded:
        job, n = self.seqs.pop(seq)
        return DeadlineExceeded(f"{job.name}: deadline after {n} steps")


class FakeEngine:
    def __init__(self) -> None:
        self.ticks = threading.Semaphore(0)
        self.stepped = threading.Semaphore(0)
        self.steps: list[list[str]] = []  # the sequences of every step, in row order
        self.joined: list[str] = []  # join order
        self.fail_next = False
        self.waiting = False  # a step is waiting for its tick
        self.scheduler: BatchScheduler | None = None  # the scheduler that drives it

    def batch_key(self, job: Job) -> Hashable:
        return job.key

    def batch_tokens(self, job: Job) -> int:
        return job.tokens

    def new_batch(self) -> FakeBatch:
        return FakeBatch(self)

    async def tick(self, n: int = 1) -> None:
        """Release n steps, one at a time; after each, wait until the engine waits for the
        next one or has nothing left to run, so what joins next is settled."""
        for _ in range(n):
            self.ticks.release()
            assert await asyncio.to_thread(self.stepped.acquire, True, HANG_GUARD), \
                "step did not run"
            await until(lambda: self.waiting or not self.active())
        await asyncio.sleep(0.01)  # let the loop settle the sequences that left

    def active(self) -> bool:
        """The engine has sequences, or will take some at once."""
        s = self.scheduler
        return s is not None and (s.running or (s.queued > 0 and not s.paused))


def submit(sched: BatchScheduler, engine: FakeEngine, job: Job,
           ctx: ExecutionContext | None = None) -> asyncio.Task[Any]:
    ctx = ctx or ExecutionContext()
    engine.scheduler = sched
    return asyncio.ensure_future(sched.run_with_context(ctx, engine, job, lambda _d: None))


async def queued(sched: BatchScheduler, engine: FakeEngine, *jobs: Job) -> list[asyncio.Task[Any]]:
    """Submit jobs while paused, so they join together (in this order) on resume."""
    sched.pause()
    tasks = [submit(sched, engine, j) for j in jobs]
    await asyncio.sleep(0)
    assert sched.queued == len(jobs)
    return tasks


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def sched():
    s = BatchScheduler(max_size=8)
    yield s
    s.close()


# ---------------------------------------------------------------------------- select_joiners


def _select(queue: list[Job], *, running_key: Hashable = None, running: bool = False,
            size_left: int = 8,
            tokens_left: int | None = None) -> list[str]:
    taken = select_joiners(queue, lambda j: j.key, lambda j: j.tokens, running_key=running_key,
                           running=running, size_left=size_left,
                           tokens_left=tokens_left)
    return [j.name for j in taken]


def test_select_takes_in_queue_order_up_to_the_size() -> None:
    q = [Job(n) for n in "abcde"]
    assert _select(q, size_left=3) == ["a", "b", "c"]
    assert _select(q, size_left=0) == []
    assert _select([], size_left=3) == []


def test_select_never_lets_a_job_overtake_one_that_does_not_fit() -> None:
    q = [Job("a", tokens=6), Job("b", tokens=6), Job("c", tokens=2)]
    assert _select(q, tokens_left=10) == ["a"]  # c would fit, but b is older
    assert _select(q, tokens_left=12) == ["a", "b"]
    assert _select(q, running=True, tokens_left=5) == []


def test_select_takes_an_oversized_job_into_an_empty_batch_alone() -> None:
    q = [Job("big", tokens=50), Job("small", tokens=1)]
    assert _select(q, tokens_left=10) == ["big"]  # never stalls the queue
    assert _select(q, running=True, tokens_left=10) == []


def test_select_forms_a_batch_of_the_oldest_jobs_kind_skipping_others() -> None:
    q = [Job("a1", key="A"), Job("b1", key="B"), Job("a2", key="A"), Job("b2", key="B")]
    assert _select(q) == ["a1", "a2"]  # b1 keeps its place for the next batch
    assert _select(q[1:]) == ["b1", "b2"]


def test_select_an_incompatible_head_closes_a_running_batch() -> None:
    q = [Job("b1", key="B"), Job("a2", key="A")]
    assert _select(q, running=True, running_key="A") == []
    q = [Job("a2", key="A"), Job("b1", key="B"), Job("a3", key="A")]
    assert _select(q, running=True, running_key="A") == ["a2"]


# ---------------------------------------------------------------------------- the scheduler


async def test_concurrent_requests_share_every_step(sched, engine) -> None:
    tasks = await queued(sched, engine, Job("a", 3), Job("b", 3), Job("c", 3))
    sched.resume()
    await engine.tick(3)
    assert engine.steps == [["a", "b", "c"]] * 3
    assert [await t for t in tasks] == [("done", n, 3) for n in "abc"]
    assert sched.pending == 0 and not sched.running
    stats = sched.stats
    assert stats.dispatched == 3 and stats.completed == 3


async def test_sequences_join_and_leave_between_steps(sched, engine) -> None:
    a = submit(sched, engine, Job("a", 5))
    await until(lambda: engine.waiting)
    await engine.tick()
    b = submit(sched, engine, Job("b", 2))  # arrives while a's step 2 is under way:
    await asyncio.sleep(0)  # it joins at the boundary after it
    await engine.tick(3)
    assert (await b) == ("done", "b", 2)  # left after its 2 steps, a goes on without it
    await engine.tick()
    assert (await a) == ("done", "a", 5)
    assert engine.steps == [["a"], ["a"], ["a", "b"], ["a", "b"], ["a"]]


async def test_fifo_when_the_batch_is_full() -> None:
    engine = FakeEngine()
    sched = BatchScheduler(max_size=2)
    tasks = await queued(sched, engine, *(Job(n, 2) for n in "abcde"))
    sched.resume()
    await engine.tick(6)
    assert engine.joined == list("abcde")
    assert engine.steps == [["a", "b"]] * 2 + [["c", "d"]] * 2 + [["e"]] * 2
    assert all(t.done() for t in tasks)
    sched.close()


async def test_token_budget_holds_and_a_big_head_is_not_overtaken() -> None:
    engine = FakeEngine()
    sched = BatchScheduler(max_size=8, max_tokens=10)
    tasks = await queued(sched, engine, Job("a", 2, tokens=6), Job("b", 3, tokens=6),
                         Job("c", 1, tokens=2))
    sched.resume()
    await engine.tick(2)  # a alone: b does not fit beside it, and c may not overtake b
    assert engine.steps == [["a"], ["a"]]
    await engine.tick(3)
    assert engine.steps[2:] == [["b", "c"], ["b"], ["b"]]
    assert [(await t)[1] for t in tasks] == ["a", "b", "c"]
    sched.close()


async def test_abort_while_queued_never_runs(sched, engine) -> None:
    running = submit(sched, engine, Job("a", 2))
    await until(lambda: engine.waiting)
    permit = BoundedAdmission(requests=1).try_admit()
    assert permit is not None
    ctx = ExecutionContext(permits=[permit])
    mine = ctx.hold()  # as the worker holds it; the scheduler's hold must be gone too
    victim = submit(sched, engine, Job("victim", 2), ctx)
    await until(lambda: sched.queued == 1)
    ctx.cancel()
    with pytest.raises(ExecutionCancelled):
        await victim
    mine.release()
    assert sched.queued == 0 and permit.released
    await engine.tick(2)
    await running
    assert "victim" not in engine.joined


async def test_aborted_sequence_leaves_at_the_next_step_and_others_continue(sched,
                                                                           engine) -> None:
    ctx = ExecutionContext()
    sched.pause()
    victim = submit(sched, engine, Job("victim", 10), ctx)
    other = submit(sched, engine, Job("other", 3))
    await asyncio.sleep(0)
    sched.resume()
    await until(lambda: engine.waiting)
    await engine.tick(2)
    ctx.cancel()  # during step 3 (its members were settled before it)
    await engine.tick()
    assert (await victim) == ("aborted", "victim", 3)  # its prefix: the 3 steps it made
    assert (await other) == ("done", "other", 3)
    assert engine.steps == [["victim", "other"]] * 3


async def test_deadline_while_queued_and_in_the_batch(sched, engine) -> None:
    """Kills: a queued request that waits for a step boundary to see its deadline (no step
    comes: the hang guard fires), and a running one that ignores its deadline."""
    first_ctx = ExecutionContext.with_timeout(0.3)
    first = submit(sched, engine, Job("first", 100), first_ctx)
    await until(lambda: engine.waiting)
    queued_late = submit(sched, engine, Job("late", 1), ExecutionContext.with_timeout(0.05))
    await asyncio.sleep(0)
    with pytest.raises(DeadlineExceeded, match="while queued"):  # no step runs meanwhile
        await asyncio.wait_for(queued_late, HANG_GUARD)
    await engine.tick()
    await until(lambda: first_ctx.remaining() == 0, "first's deadline passed")
    await engine.tick()  # the step boundary after its deadline: first leaves
    with pytest.raises(DeadlineExceeded, match="first: deadline after"):
        await first
    assert "late" not in engine.joined
    assert sched.pending == 0


async def test_cancelled_in_the_queue_at_the_moment_it_would_join(sched, engine) -> None:
    """The engine thread may take a request whose token was just cancelled, before the loop
    removed it: the check right before joining still keeps it from running."""
    ctx = ExecutionContext()
    a = submit(sched, engine, Job("a", 2))
    await until(lambda: engine.waiting)
    b = submit(sched, engine, Job("b", 1), ctx)
    await asyncio.sleep(0)
    engine.ticks.release()
    ctx.token.cancel()  # races the step boundary on purpose
    await asyncio.to_thread(engine.stepped.acquire, True, 10)
    with pytest.raises(ExecutionCancelled):
        await b
    await engine.tick()
    await a
    assert engine.joined == ["a"]


async def test_admission_permits_are_held_until_the_sequence_leaves(sched, engine) -> None:
    admission = BoundedAdmission(2, 10)
    p1, p2 = admission.try_admit(4), admission.try_admit(6)
    assert p1 is not None and p2 is not None and admission.try_admit(1) is None
    c1, c2 = ExecutionContext(permits=[p1]), ExecutionContext(permits=[p2])
    sched.pause()
    t1 = submit(sched, engine, Job("short", 1), c1)
    t2 = submit(sched, engine, Job("long", 3), c2)
    await asyncio.sleep(0)
    sched.resume()
    await engine.tick()
    await t1
    assert p1.released and not p2.released  # the short one left; the long one still holds
    assert admission.report().units_in_use == 6
    await engine.tick(2)
    await t2
    assert p2.released and admission.report().depth == 0


async def test_a_caller_that_leaves_does_not_stop_its_running_sequence(sched, engine) -> None:
    admission = BoundedAdmission(1)
    permit = admission.try_admit()
    ctx = ExecutionContext(permits=[permit])
    task = submit(sched, engine, Job("orphan", 3), ctx)
    await until(lambda: engine.waiting)
    task.cancel()
    await engine.tick()
    assert sched.running and not permit.released  # still running, still holding its budget
    await engine.tick(2)
    await until(lambda: permit.released)
    assert engine.steps == [["orphan"]] * 3 and sched.pending == 0


async def test_a_caller_that_leaves_while_queued_is_withdrawn(sched, engine) -> None:
    running = submit(sched, engine, Job("a", 1))
    await until(lambda: engine.waiting)
    gone = submit(sched, engine, Job("gone", 1))
    await asyncio.sleep(0)
    gone.cancel()
    await until(lambda: sched.queued == 0, "the cancelled caller withdrawn")
    await engine.tick()
    await running
    assert engine.joined == ["a"] and sched.pending == 0


async def test_pause_stops_joins_but_not_the_running_batch(sched, engine) -> None:
    a = submit(sched, engine, Job("a", 2))
    await until(lambda: engine.waiting)
    sched.pause()
    b = submit(sched, engine, Job("b", 1))
    await asyncio.sleep(0)
    await engine.tick(2)
    await a
    # Each tick returns once the step boundary's joins are settled: b would have joined by now.
    assert not b.done() and sched.queued == 1 and "b" not in engine.joined
    sched.resume()
    await engine.tick()
    await b
    assert engine.steps == [["a"], ["a"], ["b"]]


async def test_max_pending_counts_queued_and_running(engine) -> None:
    sched = BatchScheduler(max_size=4, max_pending=2)
    a = submit(sched, engine, Job("a", 1))
    await until(lambda: engine.waiting)
    b = submit(sched, engine, Job("b", 1))
    await asyncio.sleep(0)
    assert sched.pending == 2 and sched.queued == 1  # one running, one queued
    with pytest.raises(Overloaded, match="max_pending=2"):
        await sched.run_with_context(ExecutionContext(), engine, Job("c"), lambda _d: None)
    await engine.tick(2)
    await asyncio.gather(a, b)
    await sched.wait_idle()
    sched.close()


async def test_incompatible_jobs_wait_their_turn_without_starvation(sched, engine) -> None:
    """A stream of arrivals compatible with the running batch cannot keep an older incompatible
    job waiting: it closes the batch to newcomers, and starts the next one."""
    first = await queued(sched, engine, Job("a1", 2, "A"), Job("b1", 2, "B"),
                         Job("a2", 2, "A"))
    sched.resume()
    await until(lambda: engine.waiting)
    await engine.tick()
    late = [submit(sched, engine, Job(f"a{i}", 2, "A")) for i in (3, 4)]  # compatible with
    await asyncio.sleep(0)  # the running batch, but b1 is older
    await engine.tick(5)
    assert engine.steps == [["a1", "a2"]] * 2 + [["b1"]] * 2 + [["a3", "a4"]] * 2
    await asyncio.gather(*first, *late)


async def test_an_incompatible_head_closes_a_running_batch_to_newcomers(sched, engine) -> None:
    a1 = submit(sched, engine, Job("a1", 3, "A"))
    await until(lambda: engine.waiting)
    b1 = submit(sched, engine, Job("b1", 1, "B"))
    a2 = submit(sched, engine, Job("a2", 1, "A"))  # would fit the running batch, but b1 is older
    await asyncio.sleep(0)
    await engine.tick(5)
    assert engine.steps == [["a1"]] * 3 + [["b1"]] + [["a2"]]
    await asyncio.gather(a1, b1, a2)


async def test_a_failing_step_fails_its_batch_and_the_scheduler_goes_on(sched, engine) -> None:
    tasks = await queued(sched, engine, Job("a", 3), Job("b", 3))
    engine.fail_next = True
    sched.resume()
    engine.ticks.release()
    for t in tasks:
        with pytest.raises(RuntimeError, match="fell over"):
            await t
    after = submit(sched, engine, Job("after", 1))
    await asyncio.sleep(0)
    await engine.tick()
    assert (await after) == ("done", "after", 1)


async def test_a_job_the_batch_refuses_fails_alone(sched, engine) -> None:
    tasks = await queued(sched, engine, Job("a", 1), Job("bad", 1), Job("c", 1))
    sched.resume()
    await until(lambda: engine.waiting)
    await engine.tick()
    assert (await tasks[0]) == ("done", "a", 1) and (await tasks[2]) == ("done", "c", 1)
    with pytest.raises(ValueError, match="bad: the batch refuses it"):
        await tasks[1]
    assert engine.steps == [["a", "c"]] and sched.pending == 0


async def test_close_fails_what_is_still_queued(engine) -> None:
    sched = BatchScheduler(max_size=1)
    a = submit(sched, engine, Job("a", 1))
    await until(lambda: engine.waiting)
    b = submit(sched, engine, Job("b", 1))
    await asyncio.sleep(0)
    sched.close()
    await engine.tick()
    assert (await a) == ("done", "a", 1)  # the running batch finishes
    with pytest.raises(RuntimeError, match="closed"):
        await b
    with pytest.raises(RuntimeError, match="closed"):
        await sched.run_with_context(ExecutionContext(), engine, Job("c"), lambda _d: None)


async def test_a_dead_request_is_refused_before_queueing(sched, engine) -> None:
    ctx = ExecutionContext()
    ctx.cancel()
    with pytest.raises(ExecutionCancelled):
        await sched.run_with_context(ctx, engine, Job("x"), lambda _d: None)
    with pytest.raises(DeadlineExceeded):
        await sched.run_with_context(ExecutionContext(time.monotonic() - 1), engine, Job("y"),
                                     lambda _d: None)
    assert sched.pending == 0 and engine.joined == []


def test_run_alone_honours_cancel_and_deadline(engine) -> None:
    engine.ticks.release(100)
    assert run_alone(engine.new_batch(), Job("a", 3), ExecutionContext(), None) == \
        ("done", "a", 3)
    ctx = ExecutionContext()
    ctx.cancel()
    assert run_alone(engine.new_batch(), Job("b", 3), ctx, None) == ("aborted", "b", 0)
    with pytest.raises(DeadlineExceeded):
        run_alone(engine.new_batch(), Job("c", 3), ExecutionContext(time.monotonic() - 1), None)
