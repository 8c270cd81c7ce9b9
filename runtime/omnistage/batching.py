"""Cross-request batching: admitted requests share the steps of one running batch.

Why: a SerialScheduler runs one request at a time, so a model that could advance many sequences
in one forward pass spends most of its compute idle. `BatchScheduler` moves the unit of
execution from a request to a step, and keeps every per-request contract of admission.py:

- FIFO. Requests queue in arrival order. Between two steps the engine thread moves requests into
  the running batch while they fit (`max_size` sequences, `max_tokens` batch tokens): sequences
  join and leave between steps (continuous batching).
- Compatibility. Every job has a batch key; only jobs with equal keys share a batch (diffusion:
  same size and guidance). A new batch starts with the oldest waiting job and takes along the
  compatible jobs behind it in order; incompatible ones are skipped and keep their place. A
  running batch takes newcomers only from the head of the queue, so an incompatible or oversized
  head closes the batch: it drains, and that job starts the next one. No job waits behind more
  than the jobs that arrived before it.
- Per request. The ExecutionContext is checked before queueing and, on the engine thread, right
  before the job joins the batch. Cancelled or expired while queued: the job leaves the queue
  without running. In the batch it is checked before every step: a cancelled sequence leaves
  with its abort outcome (an AR prefix), an expired one with DeadlineExceeded; the rest go on.
- Resources. A joined job keeps its context hold (and so its admission permits) until it leaves
  the batch, even if its caller stopped waiting; the scheduler's `max_pending` counts queued and
  running jobs, like SerialScheduler's.

`select_joiners` is the admission rule as a pure function; `run_alone` runs one job through a
batch of its own, so the one-at-a-time path executes the same step code as a shared batch.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from omnistage.admission import (
    DeadlineExceeded,
    ExecutionCancelled,
    ExecutionContext,
    Hold,
    Overloaded,
    SchedulerStats,
)

__all__ = [
    "Batch",
    "BatchEngine",
    "BatchScheduler",
    "checkpoint",
    "run_alone",
    "select_joiners",
]

_log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]
T = TypeVar("T")


class Batch(Protocol):
    """The sequences of one running batch. Only the engine thread calls it, one call at a time."""

    def add(self, seq: int, job: Any, emit: Emit) -> None:
        """Take a job in; it runs from the next `step`."""

    def step(self) -> dict[int, Any]:
        """Advance every sequence one step; the outcomes of those that finished (and left).
        An outcome that is an exception fails its sequence alone (a bad fed chunk, say); an
        exception raised by step fails the whole batch."""

    def abort(self, seq: int) -> Any:
        """Remove a cancelled sequence now; its abort outcome (an AR prefix, a dropped sample)."""

    def expire(self, seq: int) -> DeadlineExceeded:
        """Remove a sequence whose deadline passed now; the error to answer with."""


class BatchEngine(Protocol):
    """What an executor offers to be batched (executors.base.BatchExecutor implements it)."""

    def batch_key(self, job: Any) -> Hashable:
        """Jobs share a batch only when their keys are equal."""

    def batch_tokens(self, job: Any) -> int:
        """What the job counts against the batch's token budget (0: it is not counted)."""

    def new_batch(self) -> Batch:
        """An empty batch."""


def select_joiners(
    queue: Sequence[T],
    key: Callable[[T], Hashable],
    tokens: Callable[[T], int],
    *,
    running_key: Hashable | None,
    running: bool,
    size_left: int,
    tokens_left: int | None,
) -> list[T]:
    """The queued jobs that join the batch now, in queue order (see the module docstring).

    `running`: the batch has sequences; `running_key` is then their key. `tokens_left` None: no
    token budget. An empty batch always takes its first job, even one above the token budget
    (executors refuse those when they prepare them), so the queue can never stall.
    """
    if not queue or size_left <= 0:
        return []
    want = running_key if running else key(queue[0])
    taken: list[T] = []
    for job in queue:
        if len(taken) == size_left:
            break
        if key(job) != want:
            if running:
                break  # the head is incompatible: stop feeding, let the batch drain for it
            continue  # a batch being formed skips it; it keeps its place in the queue
        cost = tokens(job)
        if tokens_left is not None and cost > tokens_left and (running or taken):
            break  # no compatible job overtakes an older one that does not fit yet
        taken.append(job)
        if tokens_left is not None:
            tokens_left -= cost
    return taken


def checkpoint(batch: Batch, seq: int, ctx: ExecutionContext) -> Any:
    """Between steps: None to go on, else what the sequence leaves with (an abort outcome, or
    the DeadlineExceeded to raise). Cancellation wins over the deadline, as in ctx.check()."""
    if ctx.token.cancelled:
        return batch.abort(seq)
    if ctx.expired:
        return batch.expire(seq)
    return None


def run_alone(batch: Batch, job: Any, ctx: ExecutionContext, emit: Emit) -> Any:
    """One job through a batch of its own (the one-at-a-time path and warm-up)."""
    batch.add(0, job, emit)
    while True:
        left = checkpoint(batch, 0, ctx)
        if isinstance(left, BaseException):
            raise left
        if left is not None:
            return left
        done = batch.step()
        if 0 in done:
            if isinstance(done[0], BaseException):
                raise done[0]
            return done[0]


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class _Entry:
    """One request in the scheduler: queued, then a sequence of the running batch."""

    seq: int
    ctx: ExecutionContext
    hold: Hold
    job: Any
    emit: Emit
    key: Hashable
    tokens: int
    future: asyncio.Future[Any]
    state: _State = _State.QUEUED
    joined_at: float = 0.0
    cleanup: list[Callable[[], None]] = field(default_factory=list)


class BatchScheduler:
    """FIFO admission of admitted requests into one running batch of a `BatchEngine`.

    It has SerialScheduler's public surface (queued, running, pending, paused, stats, pause,
    resume, wait_idle, close), so the worker and its metrics treat both alike. Except `close()`,
    methods are called from the event loop thread; one engine thread runs the batch.
    """

    def __init__(
        self,
        *,
        max_size: int,
        max_tokens: int | None = None,
        max_pending: int | None = None,
        name: str = "omnistage-batch",
    ) -> None:
        for label, value in (("max_size", max_size), ("max_tokens", max_tokens),
                             ("max_pending", max_pending)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        self._engine: BatchEngine | None = None  # the executor; set by run_with_context
        self._max_size = max_size
        self._max_tokens = max_tokens
        self._max_pending = max_pending
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Entry] = collections.deque()  # guarded by _lock
        self._members: dict[int, _Entry] = {}  # engine thread only
        self._batch: Batch | None = None  # engine thread only
        self._batch_key: Hashable | None = None
        self._paused = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seqs = itertools.count()
        # loop thread only:
        self._pending = 0
        self._idle_waiters: list[asyncio.Future[None]] = []
        # engine thread writes, scrapes read:
        self._running = 0
        self._dispatched = 0
        self._completed = 0
        self._exec_seconds_total = 0.0

    # -- public state ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting to join the batch."""
        return len(self._queue)

    @property
    def running(self) -> bool:
        """True while the batch has sequences."""
        return self._running > 0

    @property
    def pending(self) -> int:
        """Queued plus running requests; what `max_pending` limits."""
        return self._pending

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> SchedulerStats:
        """`exec_seconds_total` sums each request's time in the batch, join to leave."""
        return SchedulerStats(self._dispatched, self._completed, self._exec_seconds_total)

    # -- running work ------------------------------------------------------------------------

    async def run_with_context(
        self, ctx: ExecutionContext, engine: BatchEngine, job: Any, emit: Emit
    ) -> Any:
        """Queue `job` of `engine` (the one loaded executor, the same at every call), let it
        join the batch in its turn, and return its outcome.

        Raises ExecutionCancelled / DeadlineExceeded when the request dies before joining,
        DeadlineExceeded when its deadline passes in the batch, Overloaded when `max_pending`
        requests are already pending. Caller cancelled while queued: the job never runs;
        after joining: it keeps running to its end (the CancelledError propagates).
        """
        ctx.check()
        if self._engine is not None and engine is not self._engine and self._pending:
            raise RuntimeError("BatchScheduler serves one executor at a time")
        loop = self._enter()
        hold = ctx.hold()
        try:
            entry = _Entry(next(self._seqs), ctx, hold, job, emit, engine.batch_key(job),
                           engine.batch_tokens(job), loop.create_future())
        except BaseException:
            hold.release()
            self._pending -= 1
            raise
        self._watch(loop, entry)
        with self._lock:
            self._engine = engine
            self._queue.append(entry)
            self._wake.notify()
        self._start_thread()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._withdraw(entry, None)  # only takes effect while it is still queued
            raise

    def pause(self) -> None:
        """Stop taking requests into the batch (order is kept); running sequences go on."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._wake.notify()

    async def wait_idle(self) -> None:
        """Return once nothing is queued or running (a paused queue keeps this waiting)."""
        if self._pending == 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._idle_waiters:
                self._idle_waiters.remove(fut)

    def close(self, wait: bool = False) -> None:
        """Refuse new work; the engine thread finishes its batch, fails what is still queued
        with RuntimeError, and exits."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- loop side ---------------------------------------------------------------------------

    def _enter(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise RuntimeError("BatchScheduler is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and self._pending:
                raise RuntimeError("BatchScheduler used from two event loops at once")
            self._loop = loop
        if self._max_pending is not None and self._pending >= self._max_pending:
            raise Overloaded(f"{self._pending} calls pending (max_pending={self._max_pending})")
        self._pending += 1
        return loop

    def _watch(self, loop: asyncio.AbstractEventLoop, entry: _Entry) -> None:
        """While queued, the deadline and the token take the entry out of the queue at once."""
        remaining = entry.ctx.remaining()
        if remaining is not None:
            timer = loop.call_later(remaining, self._withdraw, entry,
                                    DeadlineExceeded("deadline passed while queued"))
            entry.cleanup.append(timer.cancel)

        def wake() -> None:  # any thread
            try:
                loop.call_soon_threadsafe(self._withdraw, entry,
                                          ExecutionCancelled("cancelled while queued"))
            except RuntimeError:
                pass  # loop closed: nobody waits any more

        entry.ctx.token.add_callback(wake)
        entry.cleanup.append(functools.partial(entry.ctx.token.remove_callback, wake))

    def _withdraw(self, entry: _Entry, exc: BaseException | None) -> None:
        """Loop thread: take a still-queued entry out and end it with `exc` (None: the caller
        left). Once it has joined the batch this does nothing: the batch checks it per step."""
        with self._lock:
            if entry.state is not _State.QUEUED:
                return
            self._queue.remove(entry)
            entry.state = _State.DONE
        self._settle(entry, exc, failed=True)

    def _settle(self, entry: _Entry, result: Any, *, failed: bool) -> None:
        """Loop thread: the entry is over; return its resources, then answer its caller."""
        self._pending -= 1
        entry.hold.release()
        for undo in entry.cleanup:
            undo()
        entry.cleanup.clear()
        fut = entry.future
        if not fut.done() and result is not None:
            if failed:
                fut.set_exception(result)
            else:
                fut.set_result(result)
        if self._pending == 0 and self._idle_waiters:
            idle, self._idle_waiters = self._idle_waiters, []
            for w in idle:
                if not w.done():
                    w.set_result(None)

    # -- engine thread -----------------------------------------------------------------------

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._engine_loop, name=self._name,
                                            daemon=True)
        self._thread.start()

    def _post(self, entry: _Entry, result: Any, *, failed: bool) -> None:
        """Engine thread: the entry left the batch (or never joined); settle it on the loop."""
        entry.hold.release()  # resources come back at once, not one loop turn later
        loop = self._loop
        try:
            assert loop is not None
            loop.call_soon_threadsafe(functools.partial(self._settle, entry, result,
                                                        failed=failed))
        except (RuntimeError, AssertionError):
            # The loop is gone, and its callers with it: nobody else counts any more, so
            # count here, or a scheduler that outlives its loop could never be used again.
            self._pending = max(0, self._pending - 1)

    def _leave(self, entry: _Entry, result: Any, *, failed: bool) -> None:
        self._members.pop(entry.seq, None)
        self._running = len(self._members)
        entry.state = _State.DONE
        self._completed += 1
        self._exec_seconds_total += time.perf_counter() - entry.joined_at
        self._post(entry, result, failed=failed)

    def _engine_loop(self) -> None:
        while True:
            with self._lock:
                while not self._members and not self._closed and (self._paused or not self._queue):
                    self._wake.wait()
                if self._closed and not self._members:
                    leftovers = list(self._queue)
                    self._queue.clear()
                    for e in leftovers:
                        e.state = _State.DONE
                    self._thread = None
                    break
                joiners = [] if self._closed else self._take_joiners()
                engine = self._engine
            try:
                self._admit(engine, joiners)
                self._step()
            except BaseException as exc:  # a bug here must not strand the callers
                _log.exception("batch engine failed; failing its %d sequences",
                               len(self._members))
                self._fail_batch(exc)
        for e in leftovers:
            self._post(e, RuntimeError("BatchScheduler is closed"), failed=True)

    def _take_joiners(self) -> list[_Entry]:
        """Under the lock: the queued entries that join now, moved out of the queue."""
        if self._paused or self._engine is None:
            return []
        used = sum(e.tokens for e in self._members.values())
        taken = select_joiners(
            self._queue, lambda e: e.key, lambda e: e.tokens,
            running_key=self._batch_key, running=bool(self._members),
            size_left=self._max_size - len(self._members),
            tokens_left=None if self._max_tokens is None else self._max_tokens - used)
        for e in taken:
            self._queue.remove(e)
            e.state = _State.RUNNING
        return taken

    def _admit(self, engine: BatchEngine | None, joiners: list[_Entry]) -> None:
        """Engine thread: the joiners become members of the batch, each on its own: one that
        died while queued, or that the batch refuses, ends alone."""
        for e in joiners:
            e.joined_at = time.perf_counter()
            e.ctx.started_at = time.monotonic()  # the worker's queue wait ends here
            self._dispatched += 1
            try:
                e.ctx.check()  # right before it runs: it may have died while queued
                if not self._members:
                    assert engine is not None  # set before anything was queued
                    self._batch = engine.new_batch()
                    self._batch_key = e.key
                assert self._batch is not None
                self._batch.add(e.seq, e.job, e.emit)
            except Exception as exc:
                e.state = _State.DONE
                self._completed += 1
                self._post(e, exc, failed=True)
                continue
            self._members[e.seq] = e
            self._running = len(self._members)

    def _step(self) -> None:
        batch = self._batch
        if batch is None or not self._members:
            return
        for e in list(self._members.values()):
            left = checkpoint(batch, e.seq, e.ctx)
            if left is not None:
                self._leave(e, left, failed=isinstance(left, BaseException))
        if not self._members:
            self._batch = None
            return
        done = batch.step()
        for seq, outcome in done.items():
            entry = self._members.get(seq)
            if entry is not None:
                self._leave(entry, outcome, failed=isinstance(outcome, BaseException))
        if not self._members:
            self._batch = None

    def _fail_batch(self, exc: BaseException) -> None:
        for e in list(self._members.values()):
            self._leave(e, exc, failed=True)
        self._batch = None

    def __repr__(self) -> str:
        return (f"BatchScheduler(name={self._name!r}, running={self._running}, "
                f"queued={self.queued}, pending={self._pending}, paused={self._paused})")
