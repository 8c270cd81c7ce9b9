"""Worker admission: bounded request admission, deadlines/cancellation, and a FIFO serial scheduler.

A stage worker admits a request with `BoundedAdmission.try_admit`, wraps it in an
`ExecutionContext` (absolute deadline, cancellation token, retained permits) and runs its blocking
model calls through a `SerialScheduler`, which owns the one execution permit of a loaded executor.

Refusals are distinct exception types so the worker can send a distinct reply for each:

- `Overloaded` (code "overloaded"): a queue or budget is full; nothing was reserved, retry later.
- `DeadlineExceeded` (code "deadline_exceeded"): the deadline passed before the work started.
- `ExecutionCancelled` (code "cancelled"): the token was cancelled before the work started.

Work that has started is never interrupted by these checks: a finished result is returned.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

__all__ = [
    "AdmissionError",
    "AdmissionReport",
    "BoundedAdmission",
    "CancellationToken",
    "DeadlineExceeded",
    "ExecutionCancelled",
    "ExecutionContext",
    "Hold",
    "Overloaded",
    "Permit",
    "SchedulerStats",
    "SerialScheduler",
]

T = TypeVar("T")

_log = logging.getLogger(__name__)


class AdmissionError(Exception):
    """Base of every admission refusal; `code` names the reply type the worker sends."""

    code: str = "admission_error"


class Overloaded(AdmissionError):
    """Refused at once because a queue or budget is full; nothing was reserved."""

    code = "overloaded"


class DeadlineExceeded(AdmissionError):
    """The request's deadline passed before its work started."""

    code = "deadline_exceeded"


class ExecutionCancelled(AdmissionError):
    """The request was cancelled before its work started."""

    code = "cancelled"


class _Releasable(Protocol):
    def release(self) -> None: ...


def _positive_int(name: str, value: object) -> int:
    """Validate a budget: bool is an int subclass, so it is rejected explicitly."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _run_callback(cb: Callable[[], None]) -> None:
    """Run one cancel callback; one failing callback must not stop the others."""
    try:
        cb()
    except Exception:
        _log.exception("cancellation callback %r failed", cb)


def _release_all(permits: Iterable[_Releasable]) -> None:
    """Release every permit even if one of them raises."""
    for permit in permits:
        try:
            permit.release()
        except Exception:
            _log.exception("releasing retained permit %r failed", permit)


# --------------------------------------------------------------------------------------------
# Cancellation


class CancellationToken:
    """Thread-safe, one-shot cancellation shared by the caller, the loop and worker threads."""

    __slots__ = ("_callbacks", "_event", "_lock")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def cancel(self) -> None:
        """Cancel once; callbacks run on the cancelling thread, outside the lock."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            _run_callback(cb)

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def add_callback(self, cb: Callable[[], None]) -> None:
        """Call `cb` once on cancel, or right now if already cancelled (so no wake-up is lost)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                return
        _run_callback(cb)

    def remove_callback(self, cb: Callable[[], None]) -> None:
        """Forget a callback that is no longer needed, so long-lived tokens do not accumulate."""
        with self._lock:
            try:
                self._callbacks.remove(cb)
            except ValueError:
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block a worker thread until cancelled or `timeout`; True if cancelled."""
        return self._event.wait(timeout)

    def __repr__(self) -> str:
        return f"CancellationToken(cancelled={self.cancelled})"


# --------------------------------------------------------------------------------------------
# Bounded admission


class _ReleaseOnce:
    """A handle whose `release()` is idempotent and thread-safe, and runs on `with` exit.

    The owner's release method flips `_released` under its own lock, so every exit path may call
    `release()` and only the first counts.
    """

    __slots__ = ("_released",)

    def __init__(self) -> None:
        self._released = False

    def release(self) -> None:
        raise NotImplementedError

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Permit(_ReleaseOnce):
    """An admitted request's share of a `BoundedAdmission` budget."""

    __slots__ = ("_owner", "cost")

    def __init__(self, owner: BoundedAdmission, cost: int) -> None:
        super().__init__()
        self._owner = owner
        self.cost = cost

    def release(self) -> None:
        """Return the budget (the owner ignores a second release)."""
        self._owner._release(self)

    def __repr__(self) -> str:
        return f"Permit(cost={self.cost}, released={self._released})"


@dataclass(frozen=True, slots=True)
class AdmissionReport:
    """A consistent snapshot of a `BoundedAdmission`, for /metrics and /state."""

    depth: int
    capacity: int
    units_in_use: int
    unit_capacity: int | None
    admitted: int
    rejected: int


class BoundedAdmission:
    """Non-blocking admission against a request-count budget and an optional cost budget.

    The worker calls `try_admit` at request entry and answers `Overloaded` on None, so a full
    worker sheds load at once instead of queueing without bound.
    """

    def __init__(self, requests: int, units: int | None = None) -> None:
        self._requests = _positive_int("requests", requests)
        self._units = None if units is None else _positive_int("units", units)
        self._lock = threading.Lock()
        self._depth = 0
        self._units_in_use = 0
        self._admitted = 0
        self._rejected = 0

    def try_admit(self, cost: int = 1) -> Permit | None:
        """Admit one request of `cost` units, or return None having reserved nothing.

        A cost above the whole unit budget can never fit and is refused, never clamped.
        """
        if isinstance(cost, bool) or not isinstance(cost, int):
            raise TypeError(f"cost must be an int, got {type(cost).__name__} {cost!r}")
        if cost < 0:
            raise ValueError(f"cost must be >= 0, got {cost!r}")
        with self._lock:
            if self._depth >= self._requests or (
                self._units is not None and cost > self._units - self._units_in_use
            ):
                self._rejected += 1
                return None
            self._depth += 1
            self._units_in_use += cost
            self._admitted += 1
        return Permit(self, cost)

    def _release(self, permit: Permit) -> None:
        with self._lock:
            if permit._released:
                return
            permit._released = True
            self._depth -= 1
            self._units_in_use -= permit.cost

    def report(self) -> AdmissionReport:
        """Snapshot all counters under one lock so they agree with each other."""
        with self._lock:
            return AdmissionReport(
                depth=self._depth,
                capacity=self._requests,
                units_in_use=self._units_in_use,
                unit_capacity=self._units,
                admitted=self._admitted,
                rejected=self._rejected,
            )

    def __repr__(self) -> str:
        r = self.report()
        return (
            f"BoundedAdmission(depth={r.depth}/{r.capacity}, "
            f"units={r.units_in_use}/{r.unit_capacity})"
        )


# --------------------------------------------------------------------------------------------
# Execution context


class Hold(_ReleaseOnce):
    """One holder of an `ExecutionContext`; the last holder to release frees its permits."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ExecutionContext) -> None:
        super().__init__()
        self._ctx = ctx

    def release(self) -> None:
        """Drop this hold (the worker thread may be the one that does)."""
        self._ctx._drop_hold(self)


class ExecutionContext:
    """A request's absolute deadline, shared cancellation token and retained permits.

    `check()` is called before queueing and again on the worker thread right before the work, so
    a request that died while waiting never burns executor time.
    """

    def __init__(
        self,
        deadline: float | None = None,
        token: CancellationToken | None = None,
        permits: Iterable[Permit] = (),
    ) -> None:
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, (int, float))
            or math.isnan(deadline)
        ):
            raise ValueError(f"deadline must be a time.monotonic() value or None, got {deadline!r}")
        self.deadline: float | None = None if deadline is None else float(deadline)
        self.token: CancellationToken = token if token is not None else CancellationToken()
        self._lock = threading.Lock()
        self._permits: list[Permit] = list(permits)
        self._holders = 0
        # time.monotonic() when a scheduler dispatched the work (None while it waits): the
        # worker reports the wait in its admission queue from it (the load signal's queue wait).
        self.started_at: float | None = None

    @classmethod
    def with_timeout(
        cls,
        seconds: float | None,
        token: CancellationToken | None = None,
        permits: Iterable[Permit] = (),
    ) -> ExecutionContext:
        """Build a context whose deadline is `seconds` from now (None: no deadline)."""
        if seconds is None:
            return cls(None, token, permits)
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or math.isnan(seconds)
        ):
            raise ValueError(f"seconds must be a number or None, got {seconds!r}")
        return cls(time.monotonic() + seconds, token, permits)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (0.0 once passed), or None without a deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check(self) -> None:
        """Raise if the work should not start; cancellation wins over the deadline."""
        if self.token.cancelled:
            raise ExecutionCancelled("request was cancelled")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceeded("request deadline passed before execution")

    def cancel(self) -> None:
        self.token.cancel()

    @property
    def cancelled(self) -> bool:
        return self.token.cancelled

    def hold(self) -> Hold:
        """Register a holder (the caller, or the worker thread running this request's work)."""
        with self._lock:
            self._holders += 1
        return Hold(self)

    def _drop_hold(self, hold: Hold) -> None:
        with self._lock:
            if hold._released:
                return
            hold._released = True
            self._holders -= 1
            if self._holders > 0:
                return
            permits, self._permits = self._permits, []
        _release_all(permits)

    def __repr__(self) -> str:
        return (
            f"ExecutionContext(remaining={self.remaining()}, cancelled={self.cancelled}, "
            f"holders={self._holders}, permits={len(self._permits)})"
        )


# --------------------------------------------------------------------------------------------
# Serial scheduler


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters for Prometheus: `completed` counts dispatched work whose permit came back."""

    dispatched: int
    completed: int
    exec_seconds_total: float


class SerialScheduler:
    """FIFO, one-at-a-time execution of blocking calls for one loaded executor.

    Admission is a hand-written FIFO of futures rather than asyncio.Semaphore/Lock, whose
    fairness and wake-up handoff have had bugs (CPython gh-90155). The permit is handed directly
    to the next waiter; a waiter cancelled at the moment it is handed the permit passes it on.

    Once `fn` is dispatched its permit stays taken until `fn` returns, even if the caller stops
    waiting: the executor (a GPU model) really is busy until then. All methods except `close()`
    must be called from the event loop thread the scheduler is used on.
    """

    def __init__(
        self,
        executor: concurrent.futures.Executor | None = None,
        max_pending: int | None = None,
        *,
        name: str = "omnistage-serial",
    ) -> None:
        self._max_pending = (
            None if max_pending is None else _positive_int("max_pending", max_pending)
        )
        self._executor = executor
        self._owns_executor = executor is None
        self._name = name
        self._executor_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy = False  # the permit is taken (by running work or a just-granted waiter)
        self._paused = False
        self._closed = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._pending = 0  # admitted calls whose permit has not come back (queued or dispatched)
        self._dispatched = 0
        self._completed = 0
        self._exec_seconds_total = 0.0

    # -- public state ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Callers waiting for the permit."""
        return sum(1 for w in self._waiters if not w.done())

    @property
    def running(self) -> bool:
        """True while the permit is taken, including by work whose caller has left."""
        return self._busy

    @property
    def pending(self) -> int:
        """Queued plus dispatched-but-unfinished calls; what `max_pending` limits."""
        return self._pending

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(self._dispatched, self._completed, self._exec_seconds_total)

    # -- running work ------------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Wait for the permit in FIFO order, then run `fn(*args)` on the executor.

        Cancelled while queued: `fn` never runs. Cancelled after dispatch: the caller's
        CancelledError propagates, `fn` keeps running and keeps the permit until it returns
        (work not yet started by a shared, busy executor is withdrawn instead).
        """
        loop = self._enter()
        if self._busy or self._paused or self._waiters:
            await self._wait_turn(loop, None)
        else:
            self._busy = True  # fast path: permit free, no waiter allocated
        afut, cfut = self._dispatch(loop, self._call, (fn, args), None)
        try:
            return await afut
        except asyncio.CancelledError:
            cfut.cancel()  # only succeeds if the executor has not started it yet
            raise

    async def run_with_context(
        self, ctx: ExecutionContext, fn: Callable[..., T], /, *args: Any
    ) -> T:
        """Like `run`, honouring `ctx`: checked before queueing and on the worker right before `fn`.

        While queued, a token cancel raises ExecutionCancelled and the deadline raises
        DeadlineExceeded without dispatching. `ctx` is held until `fn` finishes, so its retained
        permits outlive a caller that left. No check after `fn`: a finished result is returned.
        """
        ctx.check()
        loop = self._enter()
        hold = ctx.hold()
        try:
            if self._busy or self._paused or self._waiters:
                await self._wait_turn(loop, ctx)
            else:
                self._busy = True
        except BaseException:
            hold.release()
            raise
        afut, cfut = self._dispatch(loop, self._call_checked, (ctx, hold, fn, args), hold)
        try:
            return await afut
        except asyncio.CancelledError:
            cfut.cancel()
            raise

    def pause(self) -> None:
        """Stop dispatching queued work (order is kept); running work continues."""
        self._paused = True

    def resume(self) -> None:
        """Dispatch queued work again."""
        self._paused = False
        if not self._busy:
            self._release()

    async def wait_idle(self) -> None:
        """Return once nothing is queued or running (a paused queue keeps this waiting)."""
        if self._pending == 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        try:
            await fut
        finally:
            if not fut.done() or fut.cancelled():
                try:
                    self._idle_waiters.remove(fut)
                except ValueError:
                    pass

    def close(self, wait: bool = False) -> None:
        """Refuse new work and shut down the private executor (a caller-supplied one is kept)."""
        with self._executor_lock:
            self._closed = True
            executor = self._executor if self._owns_executor else None
        if executor is not None:
            executor.shutdown(wait=wait)

    # -- internals ---------------------------------------------------------------------------

    def _enter(self) -> asyncio.AbstractEventLoop:
        """Admit one call: bind to the running loop and apply `max_pending`."""
        if self._closed:
            raise RuntimeError("SerialScheduler is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and self._pending:
                raise RuntimeError("SerialScheduler used from two event loops at once")
            self._loop = loop
        if self._max_pending is not None and self._pending >= self._max_pending:
            raise Overloaded(f"{self._pending} calls pending (max_pending={self._max_pending})")
        self._pending += 1
        return loop

    def _private_executor(self) -> concurrent.futures.Executor:
        with self._executor_lock:
            if self._closed:
                raise RuntimeError("SerialScheduler is closed")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self._name
                )
            return self._executor

    async def _wait_turn(
        self, loop: asyncio.AbstractEventLoop, ctx: ExecutionContext | None
    ) -> None:
        """Queue until the permit is handed to us; on any exit without it, leave the queue."""
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        if not self._busy and not self._paused:
            self._release()  # permit is free but stale waiters were ahead of us
        timer: asyncio.TimerHandle | None = None
        wake: Callable[[], None] | None = None
        if ctx is not None:
            remaining = ctx.remaining()
            if remaining is not None:
                expired = DeadlineExceeded("deadline passed while queued")
                timer = loop.call_later(remaining, self._expire, waiter, expired)
            wake = functools.partial(self._wake_cancelled, loop, waiter)
            ctx.token.add_callback(wake)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed the permit at the same moment we were cancelled: pass it on.
                self._pending -= 1
                self._release()
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass  # already skipped by _release
                self._pending -= 1
                self._maybe_idle()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if wake is not None and ctx is not None:
                ctx.token.remove_callback(wake)

    def _wake_cancelled(
        self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None]
    ) -> None:
        """Token callback (any thread): fail the waiter on the loop thread."""
        try:
            loop.call_soon_threadsafe(
                self._expire, waiter, ExecutionCancelled("cancelled while queued")
            )
        except RuntimeError:
            pass  # loop closed: nobody is waiting any more

    @staticmethod
    def _expire(waiter: asyncio.Future[None], exc: AdmissionError) -> None:
        if not waiter.done():
            waiter.set_exception(exc)

    def _release(self) -> None:
        """Hand the permit to the first live waiter, or mark it free."""
        waiters = self._waiters
        while waiters and not self._paused:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._busy = True
                return
        self._busy = False
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self._pending == 0 and self._idle_waiters:
            idle, self._idle_waiters = self._idle_waiters, []
            for fut in idle:
                if not fut.done():
                    fut.set_result(None)

    def _dispatch(
        self,
        loop: asyncio.AbstractEventLoop,
        call: Callable[..., Any],
        args: tuple[Any, ...],
        hold: Hold | None,
    ) -> tuple[asyncio.Future[Any], concurrent.futures.Future[Any]]:
        """Submit while holding the permit; it comes back via the concurrent future's callback."""
        try:
            executor = self._executor
            if executor is None:
                executor = self._private_executor()
            cfut = executor.submit(contextvars.copy_context().run, call, *args)
        except BaseException:
            self._pending -= 1
            if hold is not None:
                hold.release()
            self._release()
            raise
        self._dispatched += 1
        afut = loop.create_future()
        cfut.add_done_callback(functools.partial(self._on_done, loop, afut, hold))
        return afut, cfut

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """Worker thread: run `fn`, accounting its wall time (one writer at a time: the permit)."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._exec_seconds_total += time.perf_counter() - start

    def _call_checked(
        self, ctx: ExecutionContext, hold: Hold, fn: Callable[..., T], args: tuple[Any, ...]
    ) -> T:
        """Worker thread: last check right before `fn` (the pool may have been busy); hold ctx."""
        try:
            ctx.check()
            ctx.started_at = time.monotonic()
            return self._call(fn, args)
        finally:
            hold.release()

    def _on_done(
        self,
        loop: asyncio.AbstractEventLoop,
        afut: asyncio.Future[Any],
        hold: Hold | None,
        cfut: concurrent.futures.Future[Any],
    ) -> None:
        """Executor thread (or loop, on withdrawal): finish on the loop with one thread hop."""
        try:
            loop.call_soon_threadsafe(self._complete, cfut, afut, hold)
        except RuntimeError:
            self._abandon_loop(hold)

    def _abandon_loop(self, hold: Hold | None) -> None:
        """The loop closed under running work: everything queued died with it, so reset.

        Without this a scheduler that outlives its loop (tests, restarts) would stay busy forever.
        """
        if hold is not None:
            hold.release()
        self._completed += 1
        self._waiters.clear()
        self._idle_waiters.clear()
        self._pending = 0
        self._busy = False

    def _complete(
        self,
        cfut: concurrent.futures.Future[Any],
        afut: asyncio.Future[Any],
        hold: Hold | None,
    ) -> None:
        """Loop thread: return the permit first, then deliver the outcome if the caller waits."""
        self._pending -= 1
        self._completed += 1
        if hold is not None:
            hold.release()  # covers work withdrawn before it started
        self._release()
        if afut.done():  # the caller left
            if not cfut.cancelled() and cfut.exception() is not None:
                _log.debug("work failed after its caller left", exc_info=cfut.exception())
            return
        if cfut.cancelled():
            afut.cancel()
            return
        exc = cfut.exception()
        if exc is None:
            afut.set_result(cfut.result())
        elif isinstance(exc, StopIteration):
            # asyncio futures cannot carry StopIteration (PEP 479); wrap it like asyncio does.
            err = RuntimeError(f"{type(exc).__name__} raised by scheduled work")
            err.__cause__ = exc
            afut.set_exception(err)
        else:
            afut.set_exception(exc)

    def __repr__(self) -> str:
        return (
            f"SerialScheduler(name={self._name!r}, running={self._busy}, queued={self.queued}, "
            f"pending={self._pending}, paused={self._paused})"
        )
