"""Failover: a task whose replica is lost (kill, crash, restart) runs again on another replica
of its stage, from the upstream outputs its request still holds.

At most spec.orchestrator.failover.maxRetries times per request, within its deadline, and never
after the request lost two replicas of the same stage (a suspect: it may be what kills them).
A final AR stage whose text already streamed to the client resumes from the tokens delivered;
a stage whose output already reached the client and cannot resume (audio chunks) fails as
before. See docs/architecture.md, "Failover".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omnistage.kinds import StageKind
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.requests import RequestError
from omnistage.orchestrator.tasks import Child, Task, tell_abort

log = logging.getLogger("omnistage.orchestrator")


class Failover:
    def __init__(self, pools: dict[str, StagePool], rows: dict[str, StageKind],
                 max_retries: int, counters: dict[str, float], *, clock: Callable[[], float],
                 detach: Callable[[Task], None], send: Callable[[Task], None],
                 settle: Callable[[Child], None],
                 fail: Callable[[Child, RequestError], None]) -> None:
        """detach: unbinds a task from its replica and child; send: dispatches a task;
        settle: makes a child terminal once nothing of it runs; fail: ends a child."""
        self.settle = settle
        self.fail = fail
        self.pools = pools
        self.rows = rows
        self.max_retries = max_retries
        self.counters = counters
        self.clock = clock
        self.detach = detach
        self.send = send
        # Failovers by stage: "retries" (a lost task sent again), "resumes" (of which a stream
        # went on from the tokens the client already had).
        self.counts: dict[str, dict[str, int]] = {"retries": {}, "resumes": {}}

    def lost(self, replica: Replica, reason: str) -> None:
        """Fail exactly the tasks bound to a lost replica, each child once, with replica_lost,
        unless it runs again elsewhere (an aborting child ends aborted instead)."""
        for task in list(replica.bound):
            self.detach(task)
            child = task.child
            if child.outcome is not None:
                continue
            if child.abort_requested:
                child.aborted = True
                self.settle(child)
            elif not self.retry(task, replica.name, reason):
                self.fail(child, RequestError(
                    "replica_lost",
                    f"replica {replica.name} of stage {task.stage} was lost: {reason}",
                    task.stage,
                ))

    def retry(self, task: Task, lost: str, reason: str) -> bool:
        """Send a task whose replica was lost to another replica of its stage; False when it
        must fail instead (the caller fails it with replica_lost).

        Its inputs are the upstream outputs the request still holds (child.done, and a fed
        task's kept chunks, all sent again: those its downstream had credited as copies in
        process memory, their blocks already given back, the rest as the same handles). A
        final AR stream the client already saw part of resumes from the delivered tokens;
        audio the client already has cannot be resumed. A lost upstream of a streamed edge
        restarts the downstream chain it fed, unless that chain's output already reached the
        client.
        """
        child, request, stage = task.child, task.child.request, task.stage
        losses = request.losses[stage] = request.losses.get(stage, 0) + 1
        if losses >= 2:
            self.counters["suspect_requests"] += 1
            log.warning("request %s is a suspect: it lost %d replicas of stage %s (the last, "
                        "%s: %s); not retried", request.id, losses, stage, lost, reason)
            return False
        if request.retries >= self.max_retries or self.clock() >= request.deadline:
            return False
        pool, revision = self.pools[stage], request.pins.get(stage)
        if not pool.routable(task.tried | {lost}, revision) and (
                revision is None or pool.last_resort(revision, task.tried | {lost}) is None):
            return False  # no other replica of its revision to go to: fail now, not wait
        chain = [] if task.companion else fed_chain(child, stage)
        resume = False
        for s in [] if task.companion else [stage, *chain]:
            shown = child.shown.get(s)
            if shown is None:
                continue
            if shown.audio_chunks or s != stage or not self.rows[s].resumable:
                return False  # the client has output of it that cannot be resumed
            resume = bool(shown.token_ids or shown.text)
        self._restart_chain(child, stage, chain)
        request.retries += 1
        for kind in ("retries", "resumes") if resume else ("retries",):  # a resume is a retry
            self.counts[kind][stage] = self.counts[kind].get(stage, 0) + 1
        base = task.wire_id.rsplit("~", 1)[0] if task.attempt else task.wire_id
        task.attempt += 1
        task.wire_id = f"{base}~{task.attempt}"
        task.tried.add(lost)
        log.info("request %s: stage %s failed over from %s (%s); retry %d of %d%s",
                 request.id, stage, lost, reason, request.retries, self.max_retries,
                 ", resuming its stream" if resume else "")
        child.started.add((stage, task.companion))
        self.send(task)
        return True

    def _restart_chain(self, child: Child, stage: str, chain: list[str]) -> None:
        """Before a lost stage runs again: abort the downstream stages its chunks fed and
        forget those chunks, so its first new chunk starts them afresh (a stage run again
        need not make the same chunks: sampling). Blocks of chunks not yet credited stay in
        request.held until the outcome: an aborted downstream may still be copying them."""
        for s in [stage, *chain]:
            stream = child.streams.get(s)
            if stream is not None:
                stream.reset()
        for s in chain:
            child.started.discard((s, False))
            child.restarts[s] = child.restarts.get(s, 0) + 1
            down = child.running.get((s, False))
            if down is None:
                continue
            self.detach(down)
            if down.replica is not None and down.replica.alive:
                tell_abort(down, down.replica)


def fed_chain(child: Child, stage: str) -> list[str]:
    """The started stages that a streamed edge from `stage` feeds, in order down."""
    chain = []
    stream = child.streams.get(stage)
    while stream is not None and (stream.downstream, False) in child.started:
        chain.append(stream.downstream)
        stream = child.streams.get(stream.downstream)
    return chain
