"""The coalescing work queue: each key is reconciled by one worker at a time.

A key enqueued while queued is queued once; one enqueued while it runs runs once more after.
Delayed re-enqueues are coalesced per key (the earliest wins), so a key waiting on something
never piles up timers. A failed reconcile backs off per key; one the API server refuses
(`writes.permanent`) is reported as InvalidSpec and parked until its generation changes, tried
again at most every RETRY_CAP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from omni_operator.view import Key, ObjectView, Scheduler
from omni_operator.writes import PermanentError, Writes, permanent
from omnistage.backoff import Backoff
from omnistage.kubeapi import ConfigError, namespace_terminating
from omnistage.spec import SpecError

log = logging.getLogger("omnistage.operator")

#: Retries of a failed reconcile, per key: 1 s doubling to 5 minutes, each stretched by up to
#: 20% so keys that failed together do not retry together. A success resets the key.
RETRY_BASE, RETRY_CAP, RETRY_JITTER = 1.0, 300.0, 0.2


class QueueOwner(Scheduler, Protocol):
    """What the queue runs per key, and where its own re-enqueues go (the owner's enqueue, so
    one place decides what an enqueue does)."""

    async def reconcile(self, key: Key) -> None: ...


class WorkQueue:
    """Keys waiting, running, dirty and delayed; the workers; back-off and parking per key."""

    def __init__(self, owner: QueueOwner, view: ObjectView, writes: Writes, *,
                 workers: int = 8, retry: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.owner = owner
        self.view = view  # a parked key stays parked while its object's generation does
        self.writes = writes  # a parked key's refusal is reported on its object
        self.retry = retry or Backoff(RETRY_BASE, RETRY_CAP, RETRY_JITTER)
        self.clock = clock  # when a parked key may be tried again
        # Keys whose object the API server refuses: (uid, generation, retry due on self.clock).
        self._parked: dict[Key, tuple[str, int, float]] = {}
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._running: set[Key] = set()
        self._dirty: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}  # at most one delayed enqueue per key
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []

    def enqueue(self, key: Key) -> None:
        """Queue a key once; a key running now runs once more when it is done."""
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def enqueue_later(self, key: Key, delay: float) -> None:
        """Reconcile key after delay; one pending timer per key (the earliest wins)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending.when() <= due:
                return
            pending.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key)

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.owner.enqueue(key)

    def pending_timers(self) -> int:
        """Delayed re-enqueues waiting (for tests and /metrics)."""
        return len(self._timers)

    def resync(self, keys: Iterable[Key]) -> None:
        """Enqueue every key but those backing off after a failure: their retry timer is due,
        and a resync must not turn the backoff into a retry every resync period."""
        for key in keys:
            if not self.retry.failures(key):
                self.owner.enqueue(key)

    def start(self) -> None:
        """Start the workers (the queue fills before: a primed view's keys wait for them)."""
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self._workers)]

    def cancel(self) -> list[asyncio.Future[Any]]:
        """Cancel the timers and the workers; the workers, to await."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        tasks: list[asyncio.Future[Any]] = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            if self._is_parked(key):
                await asyncio.sleep(0)
                continue
            self._running.add(key)
            try:
                await self.owner.reconcile(key)
            except Exception as exc:
                try:
                    await self._failed(key, exc)
                except Exception:  # reporting must never end the worker
                    log.exception("reporting the failure of %s failed", key)
                    self.owner.enqueue_later(key, RETRY_CAP)
            else:
                self.retry.reset(key)
                self._parked.pop(key, None)
            finally:
                self._running.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.owner.enqueue(key)
            # A converged reconcile makes no API call, so it never suspends, and get() on a
            # full queue does not either: without this a resync of thousands of objects held
            # the event loop for seconds (watches, /metrics and /healthz starved).
            await asyncio.sleep(0)

    async def _failed(self, key: Key, exc: Exception) -> None:
        """Back off, with the traceback logged once per run of failures; a terminating
        namespace is not retried; a permanent error is reported on the object and parked."""
        if namespace_terminating(exc):
            log.info("namespace of %s is terminating: not reconciling", key)
            self.retry.reset(key)
            return
        refused = permanent(exc)
        if refused is not None:
            await self._park(key, refused)
            return
        delay = self.retry.failed(key)
        count = self.retry.failures(key)
        if count == 1 and not isinstance(exc, ConfigError):
            log.warning("reconcile %s failed; retrying in %.1fs", key, delay, exc_info=exc)
        elif count == 1:  # credentials (an exec plugin failed): the message says it all
            log.warning("reconcile %s failed: %s; retrying in %.1fs", key, exc, delay)
        else:
            log.warning("reconcile %s failed again (%d in a row): %s: %s; retrying in %.1fs",
                        key, count, type(exc).__name__, exc, delay)
        self.owner.enqueue_later(key, delay)

    async def _park(self, key: Key, exc: PermanentError) -> None:
        """InvalidSpec on the object (one Warning event per generation), then no reconcile of
        the key until its generation changes, or once per RETRY_CAP."""
        obj = self.view.get(*key)
        if obj is None:
            return
        stamp = (obj["metadata"].get("uid", ""), int(obj["metadata"].get("generation", 0)))
        again = self._parked.get(key, ("", -1, 0.0))[:2] == stamp
        # Due a little before the timer fires (a timer may run a hair early), and the resync
        # lets it through after that even when an earlier timer took the key's slot.
        self._parked[key] = (*stamp, self.clock() + 0.9 * RETRY_CAP)
        self.retry.reset(key)
        if again:
            log.warning("reconcile %s still refused: %s; next try in %.0fs", key, exc, RETRY_CAP)
        else:  # Writes.refuse logs the errors themselves
            log.debug("reconcile %s refused; parked until its generation changes", key,
                      exc_info=exc)
        await self.writes.refuse(obj, SpecError(exc.errors))
        self.owner.enqueue_later(key, RETRY_CAP)

    def _is_parked(self, key: Key) -> bool:
        """A parked key stays parked while its object has the refused generation and is not
        being deleted, until its retry is due."""
        parked = self._parked.get(key)
        if parked is None:
            return False
        obj = self.view.get(*key)
        meta = (obj or {}).get("metadata") or {}
        if (obj is None or meta.get("deletionTimestamp")
                or (meta.get("uid", ""), int(meta.get("generation", 0))) != parked[:2]):
            self._parked.pop(key, None)
            return False
        return self.clock() < parked[2]
