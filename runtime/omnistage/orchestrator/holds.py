"""Tasks the orchestrator holds instead of sending, one queue per stage, each with its cause.

Three causes put a task on hold: its stage is at zero replicas and is being woken (WAKE), its
pinned revision has a replica on its way (REVISION), or the stage's dispatch window is full
(WINDOW). A held task counts as running, so its request's deadline and aborts still reach it.
Holds is the one owner of every held task, so the stage's bound (autoscaling.holdQueue) and
GET /v1/load's `held` see them all; the bound counts every cause but today only refuses a WAKE
hold (BOUNDED), as it always did.

Wakes tracks the stages asked to wake: the waker is called at most once per WAKE_INTERVAL_S per
stage, and the last measured start-up says whether a request can wait for it at all.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from omnistage.orchestrator.requests import RequestError
from omnistage.orchestrator.tasks import Task
from omnistage.orchestrator.wake import WAKE_INTERVAL_S, Waker

log = logging.getLogger("omnistage.orchestrator")


class HoldCause(enum.Enum):
    WAKE = "wake"  # the stage is at zero replicas and is being woken
    REVISION = "revision"  # a replica of the task's pinned revision is on its way
    WINDOW = "window"  # every replica's dispatch window is full


# The causes that the stage's holdQueue bound refuses. The bound counts every held task of the
# stage whatever its cause; making it apply to every cause is adding them here.
BOUNDED = frozenset({HoldCause.WAKE})


class Holds:
    """Every held task, per stage in order (FIFO, or at a given place), with its cause."""

    def __init__(self, bounds: dict[str, int], bounded: frozenset[HoldCause] = BOUNDED) -> None:
        self.bounds = bounds  # holdQueue, by stage (the stages with autoscaling)
        self.bounded = bounded
        self._queues: dict[str, deque[Task]] = {s: deque() for s in bounds}
        self._causes: dict[Task, HoldCause] = {}
        self.counts: Counter[HoldCause] = Counter()  # held now, by cause
        self.total: Counter[HoldCause] = Counter()  # ever held, by cause

    def refusal(self, stage: str, cause: HoldCause, retry_after: float = 1.0
                ) -> RequestError | None:
        """Why a task of `cause` cannot be held at `stage` (its bound is reached), or None."""
        limit = self.bounds.get(stage)
        if cause not in self.bounded or limit is None or self.held(stage) < limit:
            return None
        why = ("is at zero replicas and its hold queue is full "
               f"({limit} requests wait for it to start)") if cause is HoldCause.WAKE else (
               f"has a full hold queue ({limit} requests wait for it)")
        return RequestError("no_replica", f"stage {stage!r} {why}; retry later", stage,
                            retry_after=retry_after)

    def hold(self, task: Task, cause: HoldCause, at: int | None = None) -> RequestError | None:
        """Hold a task, unless its stage's bound refuses it (the refusal, to fail it with)."""
        refusal = self.refusal(task.stage, cause)
        if refusal is None:
            self.park(task, cause, at)
        return refusal

    def park(self, task: Task, cause: HoldCause, at: int | None = None) -> None:
        """Hold a task (at the end, or at place `at`); it counts as running, so its request's
        deadline timer and aborts still reach it (take() lets it go)."""
        task.replica = None
        queue = self._queues.setdefault(task.stage, deque())
        if at is None:
            queue.append(task)
        else:
            queue.insert(at, task)
        self._causes[task] = cause
        self.counts[cause] += 1
        self.total[cause] += 1
        task.child.running[(task.stage, task.companion)] = task

    def take(self, task: Task) -> bool:
        """Let a task go (sent, detached or ended); whether it was held."""
        cause = self._causes.pop(task, None)
        if cause is None:
            return False
        self._queues[task.stage].remove(task)
        self.counts[cause] -= 1
        return True

    def cause(self, task: Task) -> HoldCause | None:
        return self._causes.get(task)

    def queue(self, stage: str) -> list[Task]:
        """The stage's held tasks in order (a copy: sending them changes the queue)."""
        return list(self._queues.get(stage, ()))

    def held(self, stage: str) -> int:
        return len(self._queues.get(stage, ()))

    def ready(self, stage: str, routable: Callable[[str | None], bool]) -> Iterator[Task]:
        """Take, in order, the stage's tasks held for a replica (WAKE, REVISION) that now has
        one of their revision; lazily, so a task that sending an earlier one ended is skipped."""
        for task in self.queue(stage):
            if self.cause(task) in (HoldCause.WAKE, HoldCause.REVISION) and routable(
                    task.child.request.pins.get(stage)):
                self.take(task)
                yield task


@dataclass
class _Wake:
    """A stage at zero that was asked to wake: since when, and when the waker was last called."""

    since: float
    asked: float | None = None


class Wakes:
    """Stages at zero replicas asked to wake, and how long each took to start last time."""

    def __init__(self, waker: Waker | None, holds: Holds, *, clock: Callable[[], float],
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]) -> None:
        self.waker = waker
        self.holds = holds
        self.clock = clock
        self.spawn = spawn
        self.pending: dict[str, _Wake] = {}  # asked to wake and not routable yet
        self.startup_s: dict[str, float] = {}  # the last measured wake -> routable, per stage

    def cannot_hold(self, stage: str, deadline: float) -> RequestError | None:
        """Why a request that needs this stage at zero is refused now (503 with Retry-After),
        or None: its hold queue is full, or the stage's last measured start-up cannot end
        before the request's deadline."""
        now = self.clock()
        wake = self.pending.get(stage)
        startup = self.startup_s.get(stage)
        ready_at = None if startup is None else (wake.since if wake else now) + startup
        retry = max(1.0, ready_at - now) if ready_at is not None else 1.0
        refusal = self.holds.refusal(stage, HoldCause.WAKE, retry)
        if refusal is not None:
            return refusal
        if ready_at is not None and ready_at > deadline:
            return RequestError(
                "no_replica", f"stage {stage!r} is at zero replicas and takes about "
                f"{startup:.1f}s to start, past the request's deadline "
                f"({max(0.0, deadline - now):.1f}s left)", stage, retry_after=retry)
        return None

    def hold(self, task: Task) -> RequestError | None:
        """Hold a task for its stage at zero and wake the stage; or why it cannot wait."""
        refusal = self.cannot_hold(task.stage, task.child.request.deadline)
        if refusal is not None:
            return refusal
        task.tried.clear()  # a replica that comes back under the same name is a new process
        self.holds.park(task, HoldCause.WAKE)
        self.wake(task.stage)
        return None

    def wake(self, stage: str) -> None:
        """Ask the waker to start a replica of a stage at zero (at most once per
        WAKE_INTERVAL_S); the stage counts as waking until one is routable."""
        now = self.clock()
        wake = self.pending.setdefault(stage, _Wake(now))
        if wake.asked is not None and now - wake.asked < WAKE_INTERVAL_S:
            return
        wake.asked = now
        if self.waker is None:
            log.warning("stage %s is at zero replicas and nothing can wake it (no waker); "
                        "held requests wait until a replica joins or their deadline", stage)
            return
        log.info("waking stage %s (at zero replicas)", stage)
        self.spawn(self._ask(self.waker, stage))

    async def _ask(self, waker: Waker, stage: str) -> None:
        try:
            await waker.wake(stage)
        except Exception as exc:  # held requests still end by their deadline
            log.warning("could not wake stage %s: %s", stage, exc)

    def woke(self, stage: str) -> None:
        """A replica of the stage is routable: it is awake (its start-up time is measured)."""
        wake = self.pending.pop(stage, None)
        if wake is not None:
            self.startup_s[stage] = self.clock() - wake.since
            log.info("stage %s woke in %.1fs; %d held request(s) go on", stage,
                     self.startup_s[stage], self.holds.held(stage))
