"""The worker admission contract as a caller sees it: refusal texts and codes, exact budget
boundaries and counters, release-once handles, logs, and the scheduler's states at each step.

Each test names in its docstring the mutations of runtime/omnistage/admission.py it kills
(`hack/mutation.sh admission`), written as the broken code. Time enters only through `clock`, a
fake that replaces the module's `time` and that only the test moves, or as a far hang guard.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import omnistage.admission as admission
from omnistage.admission import (
    AdmissionError,
    AdmissionReport,
    BoundedAdmission,
    CancellationToken,
    DeadlineExceeded,
    ExecutionCancelled,
    ExecutionContext,
    Overloaded,
    SchedulerStats,
    SerialScheduler,
)
from tests.unit.test_admission import WAIT, Blocker, ManualExecutor, until, wait_event

pytestmark = pytest.mark.timeout(20)

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")


class FakeClock:
    """Stands in for `time` inside omnistage.admission: both clocks read `now`, which only moves
    when the test (or the work it schedules) says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(admission, "time", fake)
    return fake


@pytest.fixture
def sched() -> Iterator[SerialScheduler]:
    s = SerialScheduler()
    yield s
    s.close()


def admission_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omnistage.admission"]


class Counter:
    """A job that counts its runs (work that must never run asserts `calls == 0`)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return "ran"


# --------------------------------------------------------------------------------------------
# Refusals a caller sees: type, code and text


def test_check_refusals_name_their_cause_and_the_deadline_is_inclusive(clock: FakeClock) -> None:
    """At exactly the deadline the work is refused; cancellation wins over the deadline.

    Kills: `time.monotonic() >= self.deadline` -> `>`; the texts "request deadline passed before
    execution" and "request was cancelled" changed (None, XX, upper case).
    """
    ctx = ExecutionContext(deadline=clock.now + 2.5)
    ctx.check()
    assert ctx.remaining() == 2.5 and ctx.expired is False
    clock.advance(2.5)
    assert ctx.remaining() == 0.0 and ctx.expired is True
    with pytest.raises(DeadlineExceeded) as late:
        ctx.check()
    assert str(late.value) == "request deadline passed before execution"
    ctx.cancel()
    with pytest.raises(ExecutionCancelled) as cancelled:
        ctx.check()
    assert str(cancelled.value) == "request was cancelled"
    codes = {
        AdmissionError.code: AdmissionError,
        Overloaded.code: Overloaded,
        DeadlineExceeded.code: DeadlineExceeded,
        ExecutionCancelled.code: ExecutionCancelled,
    }
    assert list(codes) == ["admission_error", "overloaded", "deadline_exceeded", "cancelled"]
    assert all(issubclass(cls, AdmissionError) for cls in codes.values())


def test_with_timeout_counts_from_now_and_keeps_token_and_permits(clock: FakeClock) -> None:
    """Kills: `with_timeout(None, ...)` dropping the token (`cls(None, None, permits)`), passing
    it as the deadline (`cls(token, permits)`, `cls(None, permits)`) or dropping the permits;
    `with_timeout(seconds, ...)` dropping the permits."""
    adm = BoundedAdmission(requests=2)
    timed_permit, untimed_permit = adm.try_admit(), adm.try_admit()
    assert timed_permit is not None and untimed_permit is not None
    token = CancellationToken()
    timed = ExecutionContext.with_timeout(2.5, token=token, permits=[timed_permit])
    untimed = ExecutionContext.with_timeout(None, token=token, permits=[untimed_permit])
    assert timed.deadline == 1002.5 and timed.remaining() == 2.5
    assert untimed.deadline is None and untimed.remaining() is None
    assert timed.token is token and untimed.token is token
    for ctx, permit in ((timed, timed_permit), (untimed, untimed_permit)):
        with ctx.hold():
            assert permit.released is False
        assert permit.released is True
    assert adm.report().depth == 0


@pytest.mark.parametrize("bad", ["10", True, math.nan])
def test_a_bad_timeout_is_refused_naming_seconds_and_the_value(bad: Any) -> None:
    """Kills: the `or` chain of the check turned into `and` (a string reaches `math.isnan` and
    raises TypeError, True is accepted, NaN reaches the deadline check with its text), and
    `ValueError(None)`."""
    with pytest.raises(ValueError) as info:
        ExecutionContext.with_timeout(bad)
    assert str(info.value) == f"seconds must be a number or None, got {bad!r}"


@pytest.mark.parametrize("bad", ["soon", True, math.nan])
def test_a_bad_deadline_is_refused_naming_the_value(bad: Any) -> None:
    """Kills: `isinstance(deadline, bool) and not isinstance(deadline, (int, float))` (a string
    reaches `math.isnan` and raises TypeError; True is accepted)."""
    with pytest.raises(ValueError) as info:
        ExecutionContext(deadline=bad)
    assert str(info.value) == f"deadline must be a time.monotonic() value or None, got {bad!r}"


def test_bad_budgets_are_refused_naming_the_parameter_and_value() -> None:
    """A substring match would still pass with "XXrequestsXX must ..."; the text is exact.

    Kills: the parameter names "requests", "units" and "max_pending" changed (XX, upper case).
    """
    with pytest.raises(ValueError) as requests:
        BoundedAdmission(requests=0)
    assert str(requests.value) == "requests must be a positive int, got 0"
    with pytest.raises(ValueError) as units:
        BoundedAdmission(requests=1, units=True)
    assert str(units.value) == "units must be a positive int, got True"
    with pytest.raises(ValueError) as pending:
        SerialScheduler(max_pending="3")  # type: ignore[arg-type]
    assert str(pending.value) == "max_pending must be a positive int, got '3'"


def test_bad_costs_are_refused_naming_the_type_and_value() -> None:
    """Kills: `type(None).__name__` in the TypeError's text; `ValueError(None)`."""
    adm = BoundedAdmission(requests=2, units=4)
    with pytest.raises(TypeError) as floating:
        adm.try_admit(1.5)  # type: ignore[arg-type]
    assert str(floating.value) == "cost must be an int, got float 1.5"
    with pytest.raises(TypeError) as boolean:
        adm.try_admit(True)
    assert str(boolean.value) == "cost must be an int, got bool True"
    with pytest.raises(ValueError) as negative:
        adm.try_admit(-1)
    assert str(negative.value) == "cost must be >= 0, got -1"
    assert adm.report() == AdmissionReport(0, 2, 0, 4, 0, 0)  # nothing reserved or counted


# --------------------------------------------------------------------------------------------
# BoundedAdmission: boundaries, counters, handles


def test_budgets_admit_exactly_up_to_their_limits_and_count_every_decision() -> None:
    """Kills: `self._depth >= self._requests` -> `>`; `cost > free` -> `>=`; `units - in_use`
    -> `+`; `_units_in_use += cost` -> `=`; the admitted and rejected counters set to 1,
    decremented or stepped by 2; the default cost 1 -> 2."""
    adm = BoundedAdmission(requests=3, units=10)
    assert adm.report() == AdmissionReport(0, 3, 0, 10, 0, 0)
    first = adm.try_admit(4)
    second = adm.try_admit(6)  # exactly the 6 units left
    assert first is not None and second is not None
    assert adm.try_admit(1) is None  # unit budget full
    zero = adm.try_admit(0)  # zero cost needs only a request slot
    assert zero is not None
    assert adm.try_admit(0) is None  # request budget full: depth == requests
    assert adm.report() == AdmissionReport(
        depth=3, capacity=3, units_in_use=10, unit_capacity=10, admitted=3, rejected=2
    )
    first.release()
    assert adm.try_admit(5) is None  # 4 units free
    again = adm.try_admit(4)
    assert again is not None
    assert adm.report() == AdmissionReport(3, 3, 10, 10, 4, 3)
    for permit in (second, zero, again):
        permit.release()
    default = adm.try_admit()
    assert default is not None and default.cost == 1
    assert adm.report() == AdmissionReport(1, 3, 1, 10, 5, 3)


def test_release_once_handles_report_released_as_a_bool() -> None:
    """Kills: `_ReleaseOnce.__init__` setting `_released = None` (a falsy non-bool)."""
    adm = BoundedAdmission(requests=1)
    permit = adm.try_admit()
    assert permit is not None
    assert permit.released is False
    hold = ExecutionContext(permits=[permit]).hold()
    assert hold.released is False
    hold.release()
    assert hold.released is True and permit.released is True


def test_admission_repr_shows_depth_and_units_against_capacity() -> None:
    """Kills: `r = None` in `BoundedAdmission.__repr__`."""
    adm = BoundedAdmission(requests=2, units=10)
    assert adm.try_admit(3) is not None
    assert repr(adm) == "BoundedAdmission(depth=1/2, units=3/10)"
    assert repr(BoundedAdmission(requests=1)) == "BoundedAdmission(depth=0/1, units=0/None)"


def test_a_permit_that_fails_to_release_is_logged_and_the_others_are_released(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kills: every change to `_log.exception("releasing retained permit %r failed", permit)`
    (text None/XX/upper case, argument None or missing, the permit as the message)."""

    class BrokenPermit:
        def release(self) -> None:
            raise RuntimeError("release failed")

        def __repr__(self) -> str:
            return "BrokenPermit()"

    caplog.set_level(logging.ERROR, logger="omnistage.admission")
    adm = BoundedAdmission(requests=1)
    good = adm.try_admit()
    assert good is not None
    ctx = ExecutionContext(permits=[BrokenPermit(), good])  # type: ignore[list-item]
    with ctx.hold():
        pass
    assert good.released is True and adm.report().depth == 0
    records = admission_records(caplog)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.ERROR, "releasing retained permit BrokenPermit() failed")
    ]
    assert records[0].exc_info is not None and str(records[0].exc_info[1]) == "release failed"


# --------------------------------------------------------------------------------------------
# CancellationToken


def test_a_failing_cancel_callback_is_logged_with_its_repr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kills: every change to `_log.exception("cancellation callback %r failed", cb)` (text
    XX, argument None or missing, the callback as the message)."""

    def broken() -> None:
        raise RuntimeError("callback failed")

    caplog.set_level(logging.ERROR, logger="omnistage.admission")
    ran: list[str] = []
    token = CancellationToken()
    token.add_callback(broken)
    token.add_callback(lambda: ran.append("after"))
    token.cancel()
    assert ran == ["after"]
    records = admission_records(caplog)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.ERROR, f"cancellation callback {broken!r} failed")
    ]
    assert records[0].exc_info is not None and str(records[0].exc_info[1]) == "callback failed"


def test_token_wait_returns_false_once_its_timeout_passes_uncancelled() -> None:
    """Kills: `self._event.wait(None)` (waiting forever instead of for `timeout`)."""
    token = CancellationToken()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(token.wait(0.01)), daemon=True)
    waiter.start()
    waiter.join(WAIT)  # hang guard far above the 10 ms wait
    token.cancel()  # frees a waiter that ignored its timeout
    assert results == [False]
    assert token.wait(0) is True


# --------------------------------------------------------------------------------------------
# SerialScheduler: states and configuration


def test_a_new_scheduler_reports_exact_idle_state() -> None:
    """Kills: `_busy`, `_paused` or `_closed` initialised to None, `resume()` setting
    `_paused = None`, `_exec_seconds_total` initialised to None."""
    s = SerialScheduler()
    assert s.running is False and s.paused is False and s.closed is False
    assert s.pending == 0 and s.queued == 0
    assert s.stats == SchedulerStats(dispatched=0, completed=0, exec_seconds_total=0.0)
    s.pause()
    assert s.paused is True
    s.resume()
    assert s.paused is False and s.running is False
    s.close()
    assert s.closed is True


async def test_private_executor_is_one_thread_named_after_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One thread runs every call of a scheduler (thread-bound model state stays valid).

    Kills: `max_workers=None` or no `max_workers` for the private pool; the default name
    "omnistage-serial" changed (XX, upper case).
    """
    created: list[tuple[int | None, str]] = []
    real_pool = concurrent.futures.ThreadPoolExecutor

    class RecordingPool(real_pool):  # type: ignore[valid-type, misc]
        def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "",
                     **kwargs: Any) -> None:
            created.append((max_workers, thread_name_prefix))
            super().__init__(max_workers, thread_name_prefix, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", RecordingPool)
    s = SerialScheduler()
    try:
        names = [await s.run(lambda: threading.current_thread().name) for _ in range(3)]
    finally:
        s.close()
    assert created == [(1, "omnistage-serial")]
    assert names == ["omnistage-serial_0"] * 3


async def test_fn_runs_in_a_copy_of_the_callers_context(sched: SerialScheduler) -> None:
    """Request-scoped context variables (request ids for logs) reach the work.

    Kills: `executor.submit(call, *args)` without `contextvars.copy_context().run`.
    """
    REQUEST_ID.set("req-7")
    assert await sched.run(REQUEST_ID.get) == "req-7"
    assert await sched.run_with_context(ExecutionContext(), REQUEST_ID.get) == "req-7"


async def test_exec_seconds_add_up_each_calls_own_time(
    sched: SerialScheduler, clock: FakeClock
) -> None:
    """`exec_seconds_total` sums the time each call's fn ran, failures included.

    Kills: `_exec_seconds_total += elapsed` -> `=` / `-=`; `now - start` -> `+`; the total
    starting at 1.0; `completed` counted as 1 instead of incremented.
    """

    def busy_for(seconds: float) -> float:
        clock.advance(seconds)
        return seconds

    def fail_after(seconds: float) -> None:
        clock.advance(seconds)
        raise RuntimeError("step failed")

    assert await sched.run(busy_for, 2.5) == 2.5
    with pytest.raises(RuntimeError, match="step failed"):
        await sched.run(fail_after, 0.25)
    assert sched.stats == SchedulerStats(dispatched=2, completed=2, exec_seconds_total=2.75)


# --------------------------------------------------------------------------------------------
# SerialScheduler: the permit


async def test_pause_on_an_idle_scheduler_queues_the_next_call_until_resume(
    sched: SerialScheduler,
) -> None:
    """With the permit free, a paused scheduler still queues (each entry point alone, since a
    waiter ahead would queue the call anyway).

    Kills: `self._busy or self._paused and self._waiters` in `run` and in `run_with_context`.
    """
    ran: list[str] = []

    async def queues_while_paused(call: Callable[[], Any]) -> None:
        before = sched.stats.dispatched
        sched.pause()
        task = asyncio.create_task(call())
        await until(lambda: sched.queued + sched.stats.dispatched - before == 1)
        assert sched.queued == 1 and sched.stats.dispatched == before
        assert sched.running is False
        sched.resume()
        await task

    await queues_while_paused(
        lambda: sched.run_with_context(ExecutionContext(), ran.append, "context")
    )
    await queues_while_paused(lambda: sched.run(ran.append, "plain"))
    assert ran == ["context", "plain"]


async def test_a_granted_waiter_keeps_the_permit_while_its_work_runs(
    sched: SerialScheduler,
) -> None:
    """A call arriving while a handed-over permit is in use queues behind it.

    Kills: `_release` marking the handed-over permit `_busy = None` (a newcomer takes the fast
    path and runs alongside) and marking a free permit `_busy = None`.
    """
    first, second = Blocker(), Blocker()
    t1 = asyncio.create_task(sched.run(first))
    await wait_event(first.started)
    t2 = asyncio.create_task(sched.run(second))
    await until(lambda: sched.queued == 1)
    first.gate.set()
    await wait_event(second.started)  # the permit went to the waiter
    assert sched.running is True
    t3 = asyncio.create_task(sched.run(lambda: "third"))
    await until(lambda: sched.queued == 1)
    assert sched.stats.dispatched == 2
    second.gate.set()
    assert await asyncio.gather(t1, t2, t3) == ["blocked", "blocked", "third"]
    assert sched.running is False and sched.pending == 0


async def test_a_waiter_cancelled_as_it_is_handed_the_permit_counts_itself_out_once() -> None:
    """The handoff race with two callers behind the one that leaves: `pending` drops by exactly
    one (the holder's completion and the leaver each count themselves out).

    Kills: the handoff path of `_wait_turn` setting `_pending = 1` instead of decrementing it.
    """
    executor = ManualExecutor()
    sched = SerialScheduler(executor=executor)
    ran: list[str] = []
    holder = asyncio.create_task(sched.run(ran.append, "holder"))
    await until(lambda: len(executor.jobs) == 1)
    leaver, second, third = (asyncio.create_task(sched.run(ran.append, n)) for n in "abc")
    await until(lambda: sched.queued == 3)
    assert sched.pending == 4
    executor.finish(0)  # the permit goes back via the loop, to the first waiter
    for _ in range(10):  # step the loop until the first waiter is granted
        if sched.queued != 3:
            break
        await asyncio.sleep(0)
    assert sched.queued == 2 and len(executor.jobs) == 1 and not leaver.done()
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert sched.pending == 2
    await until(lambda: len(executor.jobs) == 2)
    executor.finish(1)
    await until(lambda: len(executor.jobs) == 3)
    executor.finish(2)
    await asyncio.gather(holder, second, third)
    assert ran == ["holder", "b", "c"]
    assert sched.pending == 0 and sched.running is False


async def test_wait_idle_ignores_a_queued_caller_leaving_while_work_still_runs(
    sched: SerialScheduler,
) -> None:
    """Kills: `_maybe_idle` waking idle waiters when `pending == 0 or idle_waiters` or when
    `pending == 1`."""
    blocker = Blocker()
    running = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    queued = asyncio.create_task(sched.run(lambda: None))
    await until(lambda: sched.queued == 1)
    idle = asyncio.create_task(sched.wait_idle())
    await asyncio.sleep(0)  # idle registers its waiter
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    for _ in range(3):  # a wrong wake-up, already scheduled, is delivered within these steps
        await asyncio.sleep(0)
    assert not idle.done() and sched.pending == 1
    blocker.gate.set()
    await asyncio.wait_for(idle, WAIT)
    assert await running == "blocked"


async def test_a_deadline_that_passes_in_the_queue_is_refused_there(
    sched: SerialScheduler, clock: FakeClock
) -> None:
    """The loop timer refuses a queued request whose deadline passes while other work runs
    (the fake clock is frozen, so only that timer can refuse it: the worker-side check would
    pass).

    Kills: the queue timer not armed (`remaining = None`, `remaining is None`, `timer = None`,
    `call_later` without delay, callback, waiter or error); its text "deadline passed while
    queued" changed (None, XX, upper case); the expired waiter treated as a handoff.
    """
    counted = Counter()
    blocker = Blocker()
    first = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    ctx = ExecutionContext(deadline=clock.now + 0.01)  # 10 ms of loop time once queued
    task = asyncio.create_task(sched.run_with_context(ctx, counted))
    with pytest.raises(DeadlineExceeded) as info:
        await asyncio.wait_for(task, WAIT)
    assert str(info.value) == "deadline passed while queued"
    assert sched.running is True and not blocker.finished.is_set()
    assert sched.queued == 0 and sched.pending == 1
    blocker.gate.set()
    assert await first == "blocked"
    await sched.wait_idle()
    assert counted.calls == 0 and sched.stats.dispatched == 1 and sched.running is False


async def test_a_deadline_that_passes_while_the_pool_is_busy_is_refused_on_the_worker(
    clock: FakeClock,
) -> None:
    """Past the scheduler but stuck behind other work in a shared pool: the worker-side check
    refuses it at exactly the deadline, and the refusal frees the permit.

    Kills: `time.monotonic() >= self.deadline` -> `>` on the worker-side check.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    occupied = pool.submit(gate.wait, WAIT)  # something else holds the pool's only thread
    sched = SerialScheduler(executor=pool)
    counted = Counter()
    try:
        ctx = ExecutionContext(deadline=clock.now + 60)
        task = asyncio.create_task(sched.run_with_context(ctx, counted))
        await until(lambda: sched.stats.dispatched == 1)
        clock.advance(60)
        assert sched.running is True and not task.done()
        gate.set()
        with pytest.raises(DeadlineExceeded) as info:
            await asyncio.wait_for(task, WAIT)
        assert str(info.value) == "request deadline passed before execution"
        assert occupied.result(timeout=WAIT)
        assert counted.calls == 0
        assert sched.running is False and sched.pending == 0
        assert await sched.run(lambda: "next") == "next"
    finally:
        pool.shutdown(wait=False)


async def test_the_scheduler_removes_its_wake_up_from_a_shared_token(
    sched: SerialScheduler,
) -> None:
    """A long-lived token shared by many requests must not collect one callback per request.

    Kills: the `finally` of `_wait_turn` never removing the callback (`wake is None and ...`,
    `ctx is None`) or removing None instead of it.
    """

    class RecordingToken(CancellationToken):
        def __init__(self) -> None:
            super().__init__()
            self.added: list[Callable[[], None]] = []
            self.removed: list[Callable[[], None]] = []

        def add_callback(self, cb: Callable[[], None]) -> None:
            self.added.append(cb)
            super().add_callback(cb)

        def remove_callback(self, cb: Callable[[], None]) -> None:
            self.removed.append(cb)
            super().remove_callback(cb)

    token = RecordingToken()
    blocker = Blocker()
    first = asyncio.create_task(sched.run(blocker))
    await wait_event(blocker.started)
    tasks = [
        asyncio.create_task(sched.run_with_context(ExecutionContext(token=token), int, i))
        for i in range(3)
    ]
    await until(lambda: sched.queued == 3)
    blocker.gate.set()
    assert await asyncio.gather(*tasks) == [0, 1, 2]
    await first
    assert len(token.added) == 3
    assert {id(cb) for cb in token.removed} == {id(cb) for cb in token.added}
    assert len(token.removed) == 3


# --------------------------------------------------------------------------------------------
# SerialScheduler: submission failures, withdrawal, close, loops


async def test_context_work_withdrawn_before_it_started_releases_its_permits() -> None:
    """The caller leaves while its work still waits for a busy shared pool: the work is
    withdrawn, and the request's permits come back without the work ever running.

    Kills: `run_with_context` dispatching without its hold (`_dispatch(..., None)`), and
    `_dispatch` passing None instead of the hold to the completion callback.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    pool.submit(gate.wait, WAIT)
    sched = SerialScheduler(executor=pool)
    adm = BoundedAdmission(requests=1, units=5)
    permit = adm.try_admit(5)
    assert permit is not None
    counted = Counter()
    try:
        task = asyncio.create_task(
            sched.run_with_context(ExecutionContext(permits=[permit]), counted)
        )
        await until(lambda: sched.stats.dispatched == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(sched.wait_idle(), WAIT)
        assert permit.released is True
        assert adm.report() == AdmissionReport(0, 1, 0, 5, 1, 0)
        assert sched.running is False and counted.calls == 0
    finally:
        gate.set()
        pool.shutdown(wait=False)


async def test_a_refused_submission_reaches_the_caller_and_frees_everything() -> None:
    """A pool that refuses a job: the caller gets the pool's own error, the permit and the
    request's permits come back, and nothing counts as dispatched.

    Kills: `_dispatch`'s failure path releasing the hold when it is None (`hold is None`,
    AttributeError instead of the pool's error, permits kept) or miscounting `pending`.
    """

    class RefusingPool(concurrent.futures.ThreadPoolExecutor):
        refuse = 0

        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            if self.refuse:
                self.refuse -= 1
                raise RuntimeError("pool refused the job")
            return super().submit(fn, *args, **kwargs)

    pool = RefusingPool(max_workers=1)
    sched = SerialScheduler(executor=pool)
    adm = BoundedAdmission(requests=1)
    permit = adm.try_admit()
    assert permit is not None
    counted = Counter()
    try:
        pool.refuse = 2
        with pytest.raises(RuntimeError) as plain:
            await sched.run(counted)
        assert str(plain.value) == "pool refused the job"
        with pytest.raises(RuntimeError) as with_context:
            await sched.run_with_context(ExecutionContext(permits=[permit]), counted)
        assert str(with_context.value) == "pool refused the job"
        assert permit.released is True and adm.report().depth == 0
        assert sched.pending == 0 and sched.running is False and sched.stats.dispatched == 0
        assert await sched.run(lambda: "next") == "next"
        assert counted.calls == 0
    finally:
        pool.shutdown(wait=False)


async def test_calls_queued_when_the_scheduler_closes_before_its_first_dispatch_are_refused() -> (
    None
):
    """The private executor does not exist yet, and a closed scheduler does not create it: each
    queued caller gets "SerialScheduler is closed", and each one hands the permit on.

    Kills: the text of the refusal in `_private_executor` changed (None, XX, lower or upper
    case); `_dispatch`'s failure path miscounting `pending` (= 1, += 1, -= 2).
    """
    sched = SerialScheduler()
    adm = BoundedAdmission(requests=1)
    permit = adm.try_admit()
    assert permit is not None
    counted = Counter()
    sched.pause()
    plain = asyncio.create_task(sched.run(counted))
    with_context = asyncio.create_task(
        sched.run_with_context(ExecutionContext(permits=[permit]), counted)
    )
    await until(lambda: sched.queued == 2)
    sched.close()
    sched.resume()
    for task in (plain, with_context):
        with pytest.raises(RuntimeError) as info:
            await asyncio.wait_for(task, WAIT)
        assert str(info.value) == "SerialScheduler is closed"
    assert permit.released is True
    assert sched.pending == 0 and sched.running is False and sched.stats.dispatched == 0
    assert counted.calls == 0


async def test_close_keeps_running_queued_calls_on_a_caller_supplied_executor() -> None:
    """Closing refuses new calls; calls already admitted still run on the caller's pool.

    Kills: `_dispatch` ignoring the caller's executor (`executor = None`, which then asks the
    closed scheduler for a private one).
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    sched = SerialScheduler(executor=pool)
    try:
        blocker = Blocker()
        running = asyncio.create_task(sched.run(blocker))
        await wait_event(blocker.started)
        queued = asyncio.create_task(sched.run(lambda: "admitted before close"))
        await until(lambda: sched.queued == 1)
        sched.close()
        with pytest.raises(RuntimeError) as refused:
            await sched.run(lambda: None)
        assert str(refused.value) == "SerialScheduler is closed"
        blocker.gate.set()
        assert await asyncio.wait_for(queued, WAIT) == "admitted before close"
        assert await running == "blocked"
    finally:
        pool.shutdown(wait=False)


async def test_close_returns_without_waiting_for_running_work() -> None:
    """`close()` (any thread) does not block on the work in flight, which still completes.

    Kills: `close(wait=True)` as the default.
    """
    sched = SerialScheduler()
    started, gate = threading.Event(), threading.Event()

    def long_work() -> str:
        started.set()
        assert gate.wait(60), "never released"
        return "finished"

    task = asyncio.create_task(sched.run(long_work))
    await wait_event(started)
    closer = threading.Thread(target=sched.close)
    closer.start()
    try:
        await asyncio.to_thread(closer.join, WAIT)  # hang guard; close returns at once
        assert not closer.is_alive()
        assert sched.closed is True and sched.running is True
    finally:
        gate.set()
    assert await asyncio.wait_for(task, WAIT) == "finished"
    assert sched.running is False


async def test_two_event_loops_at_once_are_refused_and_an_idle_scheduler_moves_loops() -> None:
    """Kills: the loop check inverted (`loop is self._loop`), `or` for `and` or `is None` in the
    busy-elsewhere test, the loop never recorded (`self._loop = None`), and the refusal's text
    changed (None, XX, lower or upper case)."""
    sched = SerialScheduler()
    blocker = Blocker()
    other = threading.Thread(target=lambda: asyncio.run(sched.run(blocker)))
    other.start()
    try:
        await wait_event(blocker.started)
        with pytest.raises(RuntimeError) as info:
            await sched.run(lambda: None)
        assert str(info.value) == "SerialScheduler used from two event loops at once"
    finally:
        blocker.gate.set()
        await asyncio.to_thread(other.join, WAIT)
    try:
        assert sched.pending == 0
        assert await sched.run(lambda: "this loop") == "this loop"
    finally:
        sched.close()


async def test_a_failure_after_the_caller_left_is_logged_at_debug_and_a_success_is_not(
    sched: SerialScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    """Kills: the caller-left branch logging on success or not on failure (`or`, `cancelled()`
    kept, `exception() is None`), its text changed (None, missing, XX, upper case), and the
    exception left out (`exc_info=None` or missing)."""
    caplog.set_level(logging.DEBUG, logger="omnistage.admission")
    err = ValueError("late failure")
    started, gate = threading.Event(), threading.Event()

    def succeed_late() -> str:
        started.set()
        assert gate.wait(WAIT)
        return "nobody reads this"

    def fail_late() -> None:
        started.set()
        assert gate.wait(WAIT)
        raise err

    for fn in (succeed_late, fail_late):
        started.clear()
        gate.clear()
        task = asyncio.create_task(sched.run(fn))
        await wait_event(started)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await asyncio.wait_for(sched.wait_idle(), WAIT)
    records = admission_records(caplog)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.DEBUG, "work failed after its caller left")
    ]
    assert records[0].exc_info is not None and records[0].exc_info[1] is err


def test_work_withdrawn_after_its_loop_closed_still_frees_its_context() -> None:
    """The loop is gone and the pool then drops the work: the completion cannot reach the loop,
    so the scheduler resets itself and releases the request's hold.

    Kills: `_on_done` resetting without the hold (`_abandon_loop(None)`, permits kept), and the
    reset miscounting `completed` (= 1, -= 1, += 2) or leaving `running` as None.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    sched = SerialScheduler(executor=pool)
    adm = BoundedAdmission(requests=1)
    permit = adm.try_admit()
    assert permit is not None
    counted = Counter()
    call = sched.run_with_context(ExecutionContext(permits=[permit]), counted)

    async def start_without_a_task() -> Any:
        warm_up = await asyncio.wait_for(sched.run(lambda: "warm-up"), WAIT)
        assert warm_up == "warm-up"  # completed == 1
        pool.submit(gate.wait, WAIT)  # the pool's only thread is now busy
        step = call.__await__()
        next(step)  # runs `call` up to its wait for the result: the work is submitted
        return step

    loop = asyncio.new_event_loop()
    try:
        step = loop.run_until_complete(start_without_a_task())
    finally:
        loop.close()
    try:
        assert sched.running is True and sched.stats.dispatched == 2
        assert permit.released is False
        pool.shutdown(wait=False, cancel_futures=True)  # withdraws the work; no loop to tell
        assert permit.released is True and adm.report().depth == 0
        assert sched.running is False and sched.pending == 0
        assert sched.stats.completed == 2
        assert counted.calls == 0
    finally:
        gate.set()
        step.close()
