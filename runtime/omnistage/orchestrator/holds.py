"""Tasks the orchestrator holds instead of sending, one queue per stage, each with its cause.

Three causes put a task on hold: its stage is at zero replicas and is being woken (WAKE), its
pinned revision has a replica on its way (REVISION), or every replica it may go to has no room
(WINDOW: the stage's dispatch window is full, or a stage that just woke spreads its held tasks
over the replicas as they arrive, routing.Router.at_wake). A held task counts as running, so
its request's deadline and aborts still reach it. Holds is the one owner of every held task, so
one bound per stage (hold_bounds: `autoscaling.holdQueue`, else DEFAULT_HOLD_QUEUE) counts them
all, whatever their cause, and refuses a new one of any cause past it, naming the cause; GET
/v1/load (`held`, `held_by_cause`) and the metrics read the same counts. Why one bound: a hold
is memory in the orchestrator and time a client waits, whatever put it there.

A task that was sent before (a failover retry, or a replica refused it) is held past the bound
rather than failed: the bound refuses new work, it never drops work the pipeline took.

Wakes tracks the stages asked to wake: the waker is called at most once per WAKE_INTERVAL_S per
stage, and the last measured start-up says whether a request can wait for it at all.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from omnistage.orchestrator.requests import RequestError
from omnistage.orchestrator.tasks import Task
from omnistage.orchestrator.wake import WAKE_INTERVAL_S, Waker
from omnistage.spec import Autoscaling, Stage

log = logging.getLogger("omnistage.orchestrator")


class HoldCause(enum.Enum):
    WAKE = "wake"  # the stage is at zero replicas and is being woken
    REVISION = "revision"  # a replica of the task's pinned revision is on its way
    WINDOW = "window"  # every replica's dispatch window is full


DEFAULT_HOLD_QUEUE: int = Autoscaling.model_fields["hold_queue"].default
"""The bound of a stage without `autoscaling` (whose holdQueue it is not given): its REVISION
and WINDOW holds are bounded too, at autoscaling.holdQueue's default."""

# What a refusal says about each cause (after "stage 'x' "), so a client knows what it waited for.
_WHY = {
    HoldCause.WAKE: "is at zero replicas and its hold queue is full ({limit} requests wait "
                    "for it to start)",
    HoldCause.REVISION: "has no ready replica of the request's revision yet and its hold "
                        "queue is full ({limit} requests wait)",
    HoldCause.WINDOW: "has no room on any replica (dispatch window) and its hold queue is "
                      "full ({limit} requests wait)",
}


def hold_bounds(stages: Iterable[Stage]) -> dict[str, int]:
    """Every stage's one bound on held tasks: autoscaling.holdQueue, else DEFAULT_HOLD_QUEUE."""
    return {s.name: s.autoscaling.hold_queue if s.autoscaling is not None
            else DEFAULT_HOLD_QUEUE for s in stages}


class Holds:
    """Every held task, per stage in order (FIFO, or at a given place), with its cause."""

    def __init__(self, bounds: dict[str, int]) -> None:
        self.bounds = bounds  # the bound, by stage (hold_bounds)
        self._queues: dict[str, deque[Task]] = {s: deque() for s in bounds}
        self._causes: dict[Task, HoldCause] = {}
        self._by_stage: dict[str, Counter[HoldCause]] = {s: Counter() for s in bounds}
        self.counts: Counter[HoldCause] = Counter()  # held now, by cause
        self.total: Counter[HoldCause] = Counter()  # ever held, by cause
        self.refused: Counter[tuple[str, HoldCause]] = Counter()  # refusals, by stage and cause

    def refusal(self, stage: str, cause: HoldCause, retry_after: float = 1.0
                ) -> RequestError | None:
        """Why a new task of `cause` cannot be held at `stage` (its bound is reached), or None.
        The code stays `no_replica` (503 with Retry-After) for every cause; the message names
        the cause."""
        limit = self.bounds.get(stage)
        if limit is None or self.held(stage) < limit:
            return None
        self.refused[(stage, cause)] += 1
        why = _WHY[cause].format(limit=limit)
        return RequestError("no_replica", f"stage {stage!r} {why}; retry later", stage,
                            retry_after=retry_after)

    def hold(self, task: Task, cause: HoldCause, at: int | None = None) -> RequestError | None:
        """Hold a task, unless its stage's bound refuses it (the refusal, to fail it with); a
        task sent before (task.tried) is never refused (see the module's docstring)."""
        refusal = None if task.tried else self.refusal(task.stage, cause)
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
        self._by_stage.setdefault(task.stage, Counter())[cause] += 1
        self.counts[cause] += 1
        self.total[cause] += 1
        task.child.running[(task.stage, task.companion)] = task

    def take(self, task: Task) -> bool:
        """Let a task go (sent, detached or ended); whether it was held."""
        cause = self._causes.pop(task, None)
        if cause is None:
            return False
        self._queues[task.stage].remove(task)
        self._by_stage[task.stage][cause] -= 1
        self.counts[cause] -= 1
        return True

    def recause(self, stage: str, old: HoldCause, new: HoldCause,
                which: Callable[[Task], bool]) -> int:
        """Hold the stage's tasks of cause `old` that `which` picks for `new` instead, in
        place (a wake's held tasks become tasks waiting for room); how many."""
        moved = 0
        for task in self._queues.get(stage, ()):
            if self._causes.get(task) is old and which(task):
                self._causes[task] = new
                self._by_stage[stage][old] -= 1
                self._by_stage[stage][new] += 1
                self.counts[old] -= 1
                self.counts[new] += 1
                moved += 1
        return moved

    def cause(self, task: Task) -> HoldCause | None:
        return self._causes.get(task)

    def queue(self, stage: str) -> list[Task]:
        """The stage's held tasks in order (a copy: sending them changes the queue)."""
        return list(self._queues.get(stage, ()))

    def held(self, stage: str, cause: HoldCause | None = None) -> int:
        """The stage's held tasks (of `cause`, when given)."""
        if cause is not None:
            return self._by_stage.get(stage, Counter())[cause]
        return len(self._queues.get(stage, ()))

    def by_cause(self, stage: str) -> dict[str, int]:
        """The stage's held tasks by cause, every cause named (GET /v1/load `held_by_cause`)."""
        counts = self._by_stage.get(stage, Counter())
        return {cause.value: counts[cause] for cause in HoldCause}

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

    def cannot_hold(self, stage: str, deadline: float, *, bounded: bool = True
                    ) -> RequestError | None:
        """Why a request that needs this stage at zero is refused now (503 with Retry-After),
        or None: its hold queue is full (unless not `bounded`: a task sent before), or the
        stage's last measured start-up cannot end before the request's deadline."""
        now = self.clock()
        wake = self.pending.get(stage)
        startup = self.startup_s.get(stage)
        ready_at = None if startup is None else (wake.since if wake else now) + startup
        retry = max(1.0, ready_at - now) if ready_at is not None else 1.0
        refusal = self.holds.refusal(stage, HoldCause.WAKE, retry) if bounded else None
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
        refusal = self.cannot_hold(task.stage, task.child.request.deadline,
                                   bounded=not task.tried)
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
