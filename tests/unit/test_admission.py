"""Worker admission contract: SerialScheduler, BoundedAdmission, ExecutionContext.

Every test observes behaviour (ordering, counters, which thread ran what) rather than trusting
internals, and blocks on threading.Event / asyncio futures instead of timed sleeps wherever an
event can say "this happened".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omnistage.admission import (
    AdmissionError,
    AdmissionReport,
    BoundedAdmission,
    CancellationToken,
    DeadlineExceeded,
    ExecutionCancelled,
    ExecutionContext,
    Overloaded,
    Permit,
    SerialScheduler,
)

pytestmark = pytest.mark.timeout(20)

WAIT = 5.0  # generous upper bound for "this will happen"; never a pass condition by itself


async def wait_event(event: threading.Event, limit: float = WAIT) -> None:
    """Wait for a worker-thread event without blocking the loop."""
    assert await asyncio.to_thread(event.wait, limit), "event was never set"


async def until(pred: Callable[[], bool], limit: float = WAIT) -> None:
    """Poll loop-side state (e.g. queue depth) that has no event of its own."""
    deadline = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.001)


class Blocker:
    """A job that occupies the permit until the test releases it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.finished = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.gate.wait(WAIT), "blocker was never released"
        self.finished.set()
        return "blocked"


@pytest.fixture
def sched() -> Iterator[SerialScheduler]:
    s = SerialScheduler()
    yield s
    s.close()


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    p = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    yield p
    p.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------
# SerialScheduler: basics


async def test_run_returns_result_and_runs_off_the_loop_thread(sched: SerialScheduler) -> None:
    loop_thread = threading.get_ident()
    result = await sched.run(lambda a, b: (a + b, threading.get_ident()), 2, 3)
    assert result[0] == 5
    assert result[1] != loop_thread
    assert sched.pending == 0
    assert not sched.running


async def test_private_executor_is_one_named_thread() -> None:
    s = SerialScheduler(name="omni-test-exec")
    try:
        names = {await s.run(lambda: threading.current_thread().name) for _ in range(5)}
        assert len(names) == 1
        assert names.pop().startswith("omni-test-exec")
    finally:
        s.close()


async def test_fifo_order_and_one_concurrent_fn_under_contention(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    # An 8-thread pool would happily run these concurrently: only the permit serializes them.
    sched = SerialScheduler(executor=pool)
    lock = threading.Lock()
    active = 0
    max_active = 0
    order: list[int] = []

    def work(i: int) -> int:
        nonlocal active, max_active
        with lock:
            active += 1
            max_active = max(max_active, active)
        time.sleep(0.001)  # widen the window in which an overlap would be seen
        with lock:
            order.append(i)
            active -= 1
        return i

    blocker = Blocker()
    first = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    tasks = []
    for i in range(30):
        tasks.append(asyncio.create_task(sched.run(work, i)))
        await asyncio.sleep(0)  # each task enqueues before the next is created
    await until(lambda: sched.queued == 30)
    assert order == []
    blocker.gate.set()
    assert await asyncio.gather(*tasks) == list(range(30))
    assert await first == "blocked"
    assert order == list(range(30))
    assert max_active == 1
    assert sched.pending == 0 and not sched.running


async def test_cancel_while_queued_never_runs_fn(sched: SerialScheduler) -> None:
    calls = 0

    def counted() -> None:
        nonlocal calls
        calls += 1

    blocker = Blocker()
    first = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    queued = asyncio.create_task(sched.run(counted))
    await until(lambda: sched.queued == 1)
    assert sched.pending == 2
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert sched.queued == 0
    assert sched.pending == 1
    blocker.gate.set()
    await first
    await sched.wait_idle()
    assert await sched.run(lambda: "still works") == "still works"
    assert calls == 0
    assert sched.stats.dispatched == 2  # the blocker and the last call, never `counted`


class ManualExecutor(concurrent.futures.Executor):
    """Executor whose jobs the test completes by hand, on the loop thread, at a chosen moment."""

    def __init__(self) -> None:
        self.jobs: list[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self.jobs = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.jobs.append((fut, fn, args))
        return fut

    def finish(self, index: int) -> None:
        fut, fn, args = self.jobs[index]
        assert fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)


async def test_handoff_race_waiter_cancelled_as_it_is_granted_passes_permit_on() -> None:
    executor = ManualExecutor()
    sched = SerialScheduler(executor=executor)
    ran: list[str] = []
    holder = asyncio.create_task(sched.run(ran.append, "holder"))
    await until(lambda: len(executor.jobs) == 1)
    task_a = asyncio.create_task(sched.run(ran.append, "a"))
    task_b = asyncio.create_task(sched.run(ran.append, "b"))
    await until(lambda: sched.queued == 2)

    executor.finish(0)  # the holder's fn returns; the permit goes back via the loop
    for _ in range(10):  # step the loop, one callback batch at a time, until A is granted
        if sched.queued != 2:
            break
        await asyncio.sleep(0)
    # A holds the permit but has not resumed yet (it has not dispatched): the race window.
    assert sched.queued == 1 and len(executor.jobs) == 1 and not task_a.done()
    task_a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task_a

    await until(lambda: len(executor.jobs) == 2)  # B got the permit A could not use
    executor.finish(1)
    await task_b
    await holder
    assert ran == ["holder", "b"]
    assert sched.pending == 0 and not sched.running
    # No lost permit and no double grant: the next call dispatches straight away.
    last = asyncio.create_task(sched.run(ran.append, "c"))
    await until(lambda: len(executor.jobs) == 3)
    executor.finish(2)
    await last
    assert ran == ["holder", "b", "c"]


async def test_random_cancellations_never_deadlock_or_overlap(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    sched = SerialScheduler(executor=pool)
    lock = threading.Lock()
    active = 0
    max_active = 0
    ran: list[int] = []

    def work(i: int) -> int:
        nonlocal active, max_active
        with lock:
            active += 1
            max_active = max(max_active, active)
        with lock:
            active -= 1
            ran.append(i)
        return i

    rng = random.Random(1234)
    tasks = [asyncio.create_task(sched.run(work, i)) for i in range(300)]
    for _ in range(150):
        await asyncio.sleep(0)
        rng.choice(tasks).cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await sched.wait_idle()
    finished = [r for r in results if isinstance(r, int)]
    assert max_active == 1
    assert set(finished) <= set(ran)  # caller-cancelled work may still have run
    assert ran == sorted(ran)  # FIFO among the survivors
    assert sched.pending == 0 and sched.queued == 0 and not sched.running
    assert await sched.run(work, 999) == 999


async def test_cancel_after_dispatch_keeps_permit_until_fn_returns(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    sched = SerialScheduler(executor=pool)  # spare threads: only the permit can hold B back
    events: list[str] = []
    blocker = Blocker()

    def first() -> str:
        result = blocker()
        events.append("first-finished")
        return result

    second_started = threading.Event()

    def second() -> str:
        second_started.set()
        events.append("second-started")
        return "second"

    t1 = asyncio.create_task(sched.run(first))
    await wait_event(blocker.started)
    t1.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t1
    assert sched.running and sched.pending == 1  # the caller left, the work did not
    t2 = asyncio.create_task(sched.run(second))
    await until(lambda: sched.queued == 1)
    assert not await asyncio.to_thread(second_started.wait, 0.1)
    assert not blocker.finished.is_set()
    blocker.gate.set()
    assert await t2 == "second"
    assert events == ["first-finished", "second-started"]


async def test_caller_leaving_before_a_busy_shared_pool_starts_fn_withdraws_it() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    occupied = pool.submit(gate.wait, WAIT)
    sched = SerialScheduler(executor=pool)
    calls = 0

    def counted() -> None:
        nonlocal calls
        calls += 1

    try:
        task = asyncio.create_task(sched.run(counted))
        await until(lambda: sched.stats.dispatched == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(sched.wait_idle(), WAIT)  # permit back without waiting for pool
        assert not sched.running and not gate.is_set()
        gate.set()
        assert occupied.result(timeout=WAIT)
        assert await sched.run(lambda: "next") == "next"
        assert calls == 0
    finally:
        pool.shutdown(wait=False)


async def test_stop_iteration_from_fn_becomes_runtime_error(sched: SerialScheduler) -> None:
    """asyncio futures cannot carry StopIteration; the caller must get an error, not hang.

    Kills: the wrapping RuntimeError's text lost or naming `type(None)`.
    """
    def stop() -> None:
        raise StopIteration("done")

    with pytest.raises(RuntimeError) as info:
        await asyncio.wait_for(sched.run(stop), WAIT)
    assert isinstance(info.value.__cause__, StopIteration)
    assert str(info.value) == "StopIteration raised by scheduled work"
    assert not sched.running


def test_scheduler_outlives_a_closed_loop_with_abandoned_work() -> None:
    """Kills: the reset leaving `running` as None, or miscounting `completed` (-1, +2)."""
    sched = SerialScheduler()
    blocker = Blocker()

    async def leave_work_running() -> None:
        task = asyncio.create_task(sched.run(blocker))
        await asyncio.to_thread(blocker.started.wait, WAIT)
        task.cancel()

    try:
        asyncio.run(leave_work_running())  # the loop closes while fn still runs
        assert sched.running
        blocker.gate.set()
        deadline = time.monotonic() + WAIT
        while sched.running:  # the completion cannot reach the closed loop; it resets instead
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert sched.pending == 0 and sched.running is False
        assert sched.stats.completed == 1
        assert asyncio.run(sched.run(lambda: "new loop")) == "new loop"
    finally:
        sched.close()


async def test_exception_reaches_caller_unchanged_and_releases_permit(
    sched: SerialScheduler,
) -> None:
    boom = ValueError("boom")

    def fail() -> None:
        raise boom

    with pytest.raises(ValueError) as info:
        await sched.run(fail)
    assert info.value is boom
    assert not sched.running and sched.pending == 0
    assert sched.stats.completed == 1
    assert await sched.run(lambda: 7) == 7


async def test_max_pending_refuses_at_once_and_counts_abandoned_work() -> None:
    """Kills: `Overloaded(None)` (the refusal must say how many calls are pending)."""
    sched = SerialScheduler(max_pending=2)
    try:
        blocker = Blocker()
        t1 = asyncio.create_task(sched.run(blocker))
        await wait_event(blocker.started)
        t2 = asyncio.create_task(sched.run(lambda: "queued"))
        await until(lambda: sched.queued == 1)
        with pytest.raises(Overloaded) as full:
            await asyncio.wait_for(sched.run(lambda: None), WAIT)
        assert str(full.value) == "2 calls pending (max_pending=2)"
        assert full.value.code == "overloaded"
        # The blocker's caller leaves; its work still runs and still counts.
        t1.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t1
        assert sched.pending == 2
        with pytest.raises(Overloaded) as info:
            await asyncio.wait_for(sched.run(lambda: None), WAIT)
        assert isinstance(info.value, AdmissionError)
        blocker.gate.set()
        assert await t2 == "queued"
        await sched.wait_idle()
        assert await sched.run(lambda: "ok") == "ok"
    finally:
        sched.close()


async def test_max_pending_counts_work_abandoned_after_dispatch_alone() -> None:
    sched = SerialScheduler(max_pending=1)
    try:
        blocker = Blocker()
        t1 = asyncio.create_task(sched.run(blocker))
        await wait_event(blocker.started)
        t1.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t1
        with pytest.raises(Overloaded):
            await sched.run(lambda: None)
        blocker.gate.set()
        await sched.wait_idle()
        assert await sched.run(lambda: 1) == 1
    finally:
        sched.close()


async def test_separate_schedulers_do_not_serialize_each_other() -> None:
    a, b = SerialScheduler(), SerialScheduler()
    barrier = threading.Barrier(2, timeout=WAIT)  # breaks unless both fns run at once
    try:
        results = await asyncio.gather(a.run(barrier.wait), b.run(barrier.wait))
        assert sorted(results) == [0, 1]
    finally:
        a.close()
        b.close()


async def test_pause_keeps_fifo_and_lets_running_work_finish(sched: SerialScheduler) -> None:
    order: list[int] = []
    blocker = Blocker()
    running = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    sched.pause()
    assert sched.paused
    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(sched.run(order.append, i)))
        await asyncio.sleep(0)
    blocker.gate.set()
    assert await running == "blocked"  # running work continues while paused
    await until(lambda: not sched.running)
    assert sched.queued == 3 and order == []
    late = asyncio.create_task(sched.run(order.append, 3))  # paused: a free permit still queues
    await until(lambda: sched.queued == 4)
    assert order == []
    sched.resume()
    assert not sched.paused
    await asyncio.gather(*tasks, late)
    assert order == [0, 1, 2, 3]


async def test_wait_idle_waits_for_running_and_queued_work(sched: SerialScheduler) -> None:
    await asyncio.wait_for(sched.wait_idle(), WAIT)  # idle already
    blocker = Blocker()
    t1 = asyncio.create_task(sched.run(blocker))
    t2 = asyncio.create_task(sched.run(lambda: None))
    await wait_event(blocker.started)
    idle = asyncio.create_task(sched.wait_idle())
    await asyncio.sleep(0)
    assert not idle.done()
    blocker.gate.set()
    await asyncio.wait_for(idle, WAIT)
    assert t1.done() and t2.done()
    assert sched.pending == 0


async def test_close_shuts_private_executor_and_refuses_new_work() -> None:
    """Kills: the "SerialScheduler is closed" refusal text changed (None, XX, case)."""
    s = SerialScheduler()
    thread = await s.run(threading.current_thread)
    s.close(wait=True)
    assert s.closed is True
    assert not thread.is_alive()
    with pytest.raises(RuntimeError) as info:
        await s.run(lambda: None)
    assert str(info.value) == "SerialScheduler is closed"


async def test_close_keeps_a_caller_supplied_executor(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    s = SerialScheduler(executor=pool)
    await s.run(lambda: None)
    s.close()
    assert pool.submit(lambda: 5).result(timeout=WAIT) == 5


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_max_pending_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_pending"):
        SerialScheduler(max_pending=bad)


# --------------------------------------------------------------------------------------------
# SerialScheduler + ExecutionContext


async def test_context_checked_before_queueing(sched: SerialScheduler) -> None:
    cancelled = ExecutionContext()
    cancelled.cancel()
    with pytest.raises(ExecutionCancelled):
        await sched.run_with_context(cancelled, lambda: None)
    expired = ExecutionContext(deadline=time.monotonic() - 1)
    with pytest.raises(DeadlineExceeded):
        await sched.run_with_context(expired, lambda: None)
    assert sched.stats.dispatched == 0 and sched.pending == 0


async def test_context_cancelled_while_queued_from_another_thread(sched: SerialScheduler) -> None:
    """Kills: "cancelled while queued" text changed; a failed waiter treated as a handoff
    (`exception() is not None`), which would free the permit of the work still running."""
    calls = 0

    def counted() -> None:
        nonlocal calls
        calls += 1

    blocker = Blocker()
    first = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    ctx = ExecutionContext.with_timeout(60)
    queued = asyncio.create_task(sched.run_with_context(ctx, counted))
    await until(lambda: sched.queued == 1)
    canceller = threading.Thread(target=ctx.cancel)
    canceller.start()
    canceller.join()
    with pytest.raises(ExecutionCancelled) as info:
        await asyncio.wait_for(queued, WAIT)
    assert str(info.value) == "cancelled while queued"
    assert sched.running is True and not blocker.finished.is_set()  # woken while still busy
    assert sched.queued == 0 and sched.pending == 1
    blocker.gate.set()
    await first
    await sched.wait_idle()
    assert calls == 0
    assert sched.stats.dispatched == 1


async def test_no_check_after_fn_a_finished_result_is_returned(sched: SerialScheduler) -> None:
    ctx = ExecutionContext.with_timeout(60)

    def cancels_itself() -> str:
        ctx.cancel()  # e.g. the client hung up while the step ran
        return "done"

    assert await sched.run_with_context(ctx, cancels_itself) == "done"
    assert ctx.cancelled


async def test_context_token_wakes_and_exception_propagates(sched: SerialScheduler) -> None:
    err = KeyError("k")

    def fail() -> None:
        raise err

    with pytest.raises(KeyError) as info:
        await sched.run_with_context(ExecutionContext(), fail)
    assert info.value is err
    assert not sched.running


async def test_retained_permits_outlive_a_caller_that_left(sched: SerialScheduler) -> None:
    admission = BoundedAdmission(requests=4, units=100)
    permit = admission.try_admit(10)
    assert permit is not None
    ctx = ExecutionContext(permits=[permit])
    blocker = Blocker()
    task = asyncio.create_task(sched.run_with_context(ctx, blocker))
    await wait_event(blocker.started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not permit.released
    assert admission.report().units_in_use == 10
    blocker.gate.set()
    await sched.wait_idle()
    assert permit.released
    assert admission.report() == AdmissionReport(0, 4, 0, 100, 1, 0)


async def test_caller_hold_keeps_permits_after_fn(sched: SerialScheduler) -> None:
    admission = BoundedAdmission(requests=1)
    permit = admission.try_admit()
    assert permit is not None
    ctx = ExecutionContext(permits=[permit])
    with ctx.hold():
        await sched.run_with_context(ctx, lambda: None)
        await sched.run_with_context(ctx, lambda: None)
        assert not permit.released  # the caller still streams its result
    assert permit.released


async def test_a_dropped_caller_cancels_its_queued_work(
    sched: SerialScheduler,
) -> None:
    calls = 0

    def counted() -> None:
        nonlocal calls
        calls += 1

    ctx = ExecutionContext.with_timeout(60)

    async def handler() -> None:
        try:
            await sched.run_with_context(ctx, counted)
        except asyncio.CancelledError:  # the caller went away: its queued work must not run
            ctx.cancel()
            raise

    blocker = Blocker()
    first = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    task = asyncio.create_task(handler())
    await until(lambda: sched.queued == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctx.cancelled
    blocker.gate.set()
    await first
    await sched.wait_idle()
    assert calls == 0


# --------------------------------------------------------------------------------------------
# BoundedAdmission


def test_request_budget_refuses_without_reserving() -> None:
    adm = BoundedAdmission(requests=2)
    p1, p2 = adm.try_admit(), adm.try_admit()
    assert isinstance(p1, Permit) and isinstance(p2, Permit)
    assert adm.try_admit() is None
    assert adm.report() == AdmissionReport(
        depth=2, capacity=2, units_in_use=2, unit_capacity=None, admitted=2, rejected=1
    )
    p1.release()
    p3 = adm.try_admit()
    assert p3 is not None
    assert adm.report().depth == 2


def test_unit_budget_refuses_without_reserving() -> None:
    adm = BoundedAdmission(requests=10, units=10)
    big = adm.try_admit(6)
    assert big is not None and big.cost == 6
    assert adm.try_admit(5) is None
    report = adm.report()
    assert (report.depth, report.units_in_use, report.rejected) == (1, 6, 1)
    fits = adm.try_admit(4)
    assert fits is not None
    assert adm.report().units_in_use == 10
    assert adm.try_admit(1) is None
    assert adm.try_admit(0) is not None  # zero cost only needs a request slot


def test_cost_above_whole_budget_is_refused_not_clamped() -> None:
    adm = BoundedAdmission(requests=5, units=10)
    assert adm.try_admit(11) is None
    assert adm.report() == AdmissionReport(0, 5, 0, 10, 0, 1)
    whole = adm.try_admit(10)
    assert whole is not None and whole.cost == 10


def test_unbounded_units_only_limit_requests() -> None:
    adm = BoundedAdmission(requests=1)
    permit = adm.try_admit(10**9)
    assert permit is not None
    assert adm.report().unit_capacity is None
    with pytest.raises(ValueError, match="cost"):
        adm.try_admit(-1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, False, "2", None])
def test_bad_request_budget_names_requests(bad: Any) -> None:
    with pytest.raises(ValueError, match="requests"):
        BoundedAdmission(requests=bad)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "10"])
def test_bad_unit_budget_names_units(bad: Any) -> None:
    with pytest.raises(ValueError, match="units"):
        BoundedAdmission(requests=1, units=bad)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("1", TypeError), (None, TypeError)],
)
def test_bad_cost_names_cost_and_reserves_nothing(bad: Any, error: type[Exception]) -> None:
    adm = BoundedAdmission(requests=1, units=5)
    with pytest.raises(error, match="cost"):
        adm.try_admit(bad)
    assert adm.report() == AdmissionReport(0, 1, 0, 5, 0, 0)


def test_permit_release_is_idempotent_and_a_context_manager() -> None:
    adm = BoundedAdmission(requests=2, units=10)
    permit = adm.try_admit(3)
    other = adm.try_admit(2)
    assert permit is not None and other is not None
    permit.release()
    permit.release()
    assert permit.released
    report = adm.report()
    assert (report.depth, report.units_in_use) == (1, 2)  # not 0 / -1: released once
    with other:
        pass
    assert other.released
    assert (adm.report().depth, adm.report().units_in_use) == (0, 0)


def test_concurrent_double_release_counts_once() -> None:
    adm = BoundedAdmission(requests=2, units=10)
    permit = adm.try_admit(4)
    keep = adm.try_admit(1)
    assert permit is not None and keep is not None
    start = threading.Barrier(16)

    def release() -> None:
        start.wait()
        permit.release()

    threads = [threading.Thread(target=release) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (adm.report().depth, adm.report().units_in_use) == (1, 1)


def test_32_threads_by_1000_cycles_end_at_zero() -> None:
    adm = BoundedAdmission(requests=8, units=20)
    overshoot: list[AdmissionReport] = []
    start = threading.Barrier(32)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        for _ in range(1000):
            permit = adm.try_admit(rng.randint(0, 4))
            if permit is None:
                continue
            report = adm.report()
            if report.depth > 8 or report.units_in_use > 20:
                overshoot.append(report)
            permit.release()
            if rng.random() < 0.1:
                permit.release()  # a duplicate release must not free someone else's budget

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = adm.report()
    assert overshoot == []
    assert report.depth == 0 and report.units_in_use == 0
    assert report.admitted + report.rejected == 32_000
    assert report.admitted > 0


# --------------------------------------------------------------------------------------------
# ExecutionContext and CancellationToken


def test_check_cancellation_wins_over_deadline() -> None:
    ExecutionContext().check()
    ExecutionContext.with_timeout(60).check()
    expired = ExecutionContext(deadline=time.monotonic() - 1)
    with pytest.raises(DeadlineExceeded):
        expired.check()
    expired.cancel()
    with pytest.raises(ExecutionCancelled):
        expired.check()
    assert len({Overloaded.code, DeadlineExceeded.code, ExecutionCancelled.code}) == 3


def test_remaining_and_with_timeout() -> None:
    assert ExecutionContext().remaining() is None
    assert ExecutionContext.with_timeout(None).deadline is None
    remaining = ExecutionContext.with_timeout(10).remaining()
    assert remaining is not None and 0.0 < remaining <= 10.0  # exact values: the fake-clock tests
    assert ExecutionContext(deadline=time.monotonic() - 5).remaining() == 0.0
    with pytest.raises(ValueError, match="deadline"):
        ExecutionContext(deadline=float("nan"))
    shared = CancellationToken()
    assert ExecutionContext.with_timeout(1, token=shared).token is shared


def test_permits_released_after_last_holder() -> None:
    adm = BoundedAdmission(requests=3)
    p1, p2 = adm.try_admit(), adm.try_admit()
    assert p1 is not None and p2 is not None
    ctx = ExecutionContext(permits=[p1, p2])
    h1 = ctx.hold()
    h2 = ctx.hold()
    h1.release()
    h1.release()  # idempotent: must not count as h2 leaving
    assert not p1.released and not p2.released and adm.report().depth == 2
    h2.release()
    assert p1.released and p2.released
    assert adm.report().depth == 0


def test_last_holder_on_another_thread_releases_permits() -> None:
    adm = BoundedAdmission(requests=1)
    permit = adm.try_admit()
    assert permit is not None
    ctx = ExecutionContext(permits=[permit])
    holds = [ctx.hold() for _ in range(16)]
    start = threading.Barrier(16)

    def drop(h: Any) -> None:
        start.wait()
        h.release()

    threads = [threading.Thread(target=drop, args=(h,)) for h in holds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert permit.released and adm.report().depth == 0


def test_permit_release_is_idempotent_and_never_implicit() -> None:
    adm = BoundedAdmission(requests=2)
    permit = adm.try_admit()
    assert permit is not None
    ExecutionContext(permits=[permit])
    assert not permit.released  # never held: nothing releases it implicitly
    with permit:
        pass
    permit.release()
    assert permit.released and adm.report().depth == 0 and adm.report().admitted == 1


def test_token_callbacks_run_once_even_when_added_late_or_raced() -> None:
    token = CancellationToken()
    calls: list[str] = []
    token.add_callback(lambda: calls.append("early"))
    token.add_callback(lambda: 1 / 0)  # a broken callback must not stop the others
    token.add_callback(lambda: calls.append("second"))
    removed = lambda: calls.append("removed")  # noqa: E731
    token.add_callback(removed)
    token.remove_callback(removed)
    start = threading.Barrier(8)

    def cancel() -> None:
        start.wait()
        token.cancel()

    threads = [threading.Thread(target=cancel) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert token.cancelled
    assert calls == ["early", "second"]
    token.add_callback(lambda: calls.append("late"))
    assert calls == ["early", "second", "late"]
    assert token.wait(0)
