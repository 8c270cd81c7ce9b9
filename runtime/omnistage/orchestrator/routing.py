"""Which replica takes a task: one of its request's revision (or, as a last resort, a draining
one of it), within the stage's dispatch window; or why none does now (hold it, or fail).

The dispatch window (opt-in, stage.dispatch.perReplica): at most that many tasks on each
replica of the stage; the rest wait, in order, and a retried task goes first. Why: a task
queued in a replica's admission queue is lost with it, and its retry queues again at the tail
of a survivor's queue. With a window the rest wait in the stage's hold queue (Holds, cause
WINDOW: so deadlines, aborts and GET /v1/load's `held` cover them), and a failover waits for
the next free slot instead of a survivor's whole queue. Room comes when a task leaves a replica
(the engine's detach) and when a replica becomes routable (or stops being): a drain (a loop
turn later, coalesced, so never inside another operation) then sends waiting tasks in order
while there is room. Until it ran, a new task waits behind them (FIFO). A waiting task only
waits for a replica that is full, so one of its tasks ends and drains again: none is stranded.

A wake spreads (`at_wake`): when a stage at zero gets its first routable replica, the tasks
held for it go out only up to a share per replica (`wake_shares`: its dispatch window, else what
a replica runs at once plus one queued), the rest wait as above (cause WINDOW) and go as more
replicas arrive or slots free. Why: replicas of a woken stage come up a fraction of a second
apart, and sent all at once the held tasks queued on the first one and ran one after another
while the others sat idle. The stage routes as before once nothing waits any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from omnistage.kinds import get as get_kind
from omnistage.orchestrator.holds import HoldCause, Holds
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.requests import RequestError
from omnistage.orchestrator.tasks import Child, Task
from omnistage.spec import Stage

log = logging.getLogger("omnistage.orchestrator")


class Router:
    """Replica choice for tasks, and the dispatch window's queue (held in Holds)."""

    def __init__(self, pools: dict[str, StagePool], holds: Holds, windows: dict[str, int],
                 scalable: frozenset[str], *, send: Callable[[Task], None],
                 fail: Callable[[Child, RequestError], None],
                 shares: dict[str, int] | None = None) -> None:
        """windows: perReplica by stage (the stages that have one); scalable: the stages with
        autoscaling (they may be at zero). send: the engine's send, for a task whose turn
        came; fail: ends a child whose task cannot wait. shares: tasks per replica while a
        woken stage spreads its held ones (wake_shares; a stage without one sends all)."""
        self.windows = windows
        self.scalable = scalable
        self.shares = shares or {}
        self.waking: set[str] = set()  # woken stages spreading their held tasks (at_wake)
        self.pools = pools
        self.holds = holds
        self.send = send
        self.fail = fail
        self.pending: set[str] = set()  # windowed stages whose queue a loop turn will drain
        self._dispatching: Task | None = None  # the waiting task drain() is sending now

    def _limit(self, task: Task) -> int | None:
        """The task's dispatch window per replica; None: none (a session's task goes to its
        replica, as without one)."""
        if task.child.request.req.session is not None:
            return None
        return self.window(task.stage)

    def window(self, stage: str) -> int | None:
        """The stage's tasks per replica now: its dispatch window, or its share while it
        spreads a wake (until nothing waits: the task drain() sends counts as waiting);
        None: no limit."""
        if stage in self.windows:
            return self.windows[stage]
        if stage in self.waking:
            sending = self._dispatching is not None and self._dispatching.stage == stage
            if sending or self.holds.held(stage, HoldCause.WINDOW):
                return self.shares[stage]
            self.waking.discard(stage)  # nothing waits any more: the wake is spread
        return None

    def at_wake(self, stage: str) -> None:
        """The stage has a routable replica: its tasks held for the wake (those a routable
        replica may take) now wait for room instead, and go up to its share per replica, the
        rest as replicas arrive or slots free (see the module's docstring)."""
        if stage not in self.shares or stage in self.windows:
            return
        pool = self.pools[stage]
        if self.holds.recause(stage, HoldCause.WAKE, HoldCause.WINDOW, lambda task: (
                pool.has_routable(task.child.request.pins.get(stage)))):
            self.waking.add(stage)
            self.drain_soon(stage)

    def wait_for_room(self, task: Task) -> bool:
        """Whether the task waits for a free slot (queued, True) instead of going now."""
        limit = self._limit(task)
        if limit is None or task is self._dispatching:
            return False
        revision = task.child.request.pins.get(task.stage)
        candidates = self.pools[task.stage].routable(task.tried, revision)
        if not candidates:
            return False  # no replica to wait for: choose()'s own rules (hold, or fail)
        retry = bool(task.tried)  # after a lost replica or a refusal: its request is older
        if room(candidates, limit) and (retry or task.stage not in self.pending):
            return False
        at = None
        if retry:  # to the front, behind the retries needed before it
            at = 0
            for other in self.holds.queue(task.stage):
                if not (self.holds.cause(other) is HoldCause.WINDOW and other.tried
                        and other.needed_at <= task.needed_at):
                    break
                at += 1
        refusal = self.holds.hold(task, HoldCause.WINDOW, at)
        if refusal is not None:
            self.fail(task.child, refusal)
        return True

    def choose(self, task: Task) -> Replica | HoldCause | RequestError:
        """The replica for a task now; else the cause to hold it for, or why it fails."""
        request, revision = task.child.request, task.child.request.pins.get(task.stage)
        pool = self.pools[task.stage]
        replica = self._pick(task, revision)
        if replica is None and task.stage in self.scalable and not pool.has_routable():
            return HoldCause.WAKE
        if replica is None and revision is not None:
            # A release or a revert left its revision no routable replica here: a draining
            # one of it still finishes work, and the operator keeps it while we pin to it.
            replica = pool.last_resort(revision, task.tried)
            if replica is not None:
                log.info("request %s: stage %s has no routable replica of revision %s (the "
                         "request's); sent to draining %s", request.id, task.stage, revision,
                         replica.name)
        if replica is None and revision is not None and not task.tried \
                and pool.coming(revision):
            return HoldCause.REVISION
        if replica is None:
            code = "draining" if task.tried else "no_replica"
            of = "" if revision is None else f" of revision {revision} (the request's)"
            return RequestError(code, f"stage {task.stage!r} has no live replica{of}",
                                task.stage)
        return replica

    def _pick(self, task: Task, revision: str | None) -> Replica | None:
        """The replica for a task: with a window, only among those with a free slot."""
        pool, limit = self.pools[task.stage], self._limit(task)
        if limit is None:
            return pool.pick(task.child.request.req.session, exclude=task.tried,
                             revision=revision)
        candidates = pool.routable(task.tried, revision)
        free = room(candidates, limit)
        full = {r.name for r in candidates if r not in free}
        return pool.pick(None, exclude=task.tried | full, revision=revision)

    def drain_soon(self, stage: str) -> None:
        """Drain a windowed stage's waiting tasks on the next loop turn (once per turn)."""
        if (stage not in self.windows and stage not in self.waking) or stage in self.pending:
            return
        if not any(self.holds.cause(t) is HoldCause.WINDOW for t in self.holds.queue(stage)):
            return
        self.pending.add(stage)
        asyncio.get_running_loop().call_soon(self.drain, stage)

    def drain(self, stage: str) -> None:
        """Send a stage's waiting tasks, in order, each one a replica it may go to has room
        for; one that no replica may take any more (they left) goes through the engine's own
        rules (held for a replica on its way, or failed), so none is stranded."""
        self.pending.discard(stage)
        limit, pool = self.window(stage), self.pools[stage]
        if limit is None:  # a wake spread whose waiting tasks all ended meanwhile
            return
        for task in self.holds.queue(stage):
            if (self.holds.cause(task) is not HoldCause.WINDOW
                    or task.child.running.get((stage, task.companion)) is not task):
                continue
            candidates = pool.routable(task.tried, task.child.request.pins.get(stage))
            if candidates and not room(candidates, limit):
                continue
            self.holds.take(task)
            self._dispatching = task
            try:
                self.send(task)
            finally:
                self._dispatching = None
        self.window(stage)  # a spread wake ends once nothing waits


def room(replicas: Iterable[Replica], limit: int) -> list[Replica]:
    """The replicas with a free slot of a dispatch window of `limit` tasks each."""
    return [r for r in replicas if r.inflight < limit]


def wake_shares(stages: Iterable[Stage]) -> dict[str, int]:
    """Per stage with autoscaling, the tasks one replica takes while a wake spreads: its
    dispatch window, else what it runs at once (maxBatchSize for a kind that batches, else 1)
    plus one queued so it never idles between two, within its admission's maxRequests."""
    shares = {}
    for stage in stages:
        if stage.autoscaling is None:
            continue
        if stage.dispatch.per_replica is not None:
            shares[stage.name] = stage.dispatch.per_replica
            continue
        batches = "max_batch_size" in get_kind(stage.kind).engine_options
        at_once = stage.engine.max_batch_size if batches else 1
        shares[stage.name] = max(1, min(at_once + 1, stage.admission.max_requests))
    return shares
