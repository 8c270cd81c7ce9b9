"""The orchestrator engine: per-request state, DAG routing across stage pools, one terminal outcome.

The orchestrator alone decides which stage runs next. Each request has children (one per
parallel sample); each child walks the needed part of the stage DAG, one task per stage, and a
task is bound to the replica that took it. Everything runs on one event loop, so request state
needs no locks; replies from workers arrive through ReplicaChannel callbacks.

Terminal state is monotonic: once a child or request is terminal its tasks are detached, and any
late reply, delta or abort for them is dropped and counted, never forwarded.

This module keeps the request lifecycle (admission, dispatch, replies, outcome). Its
collaborators each own their state and get what they need passed in: plan.py (request ->
stages and submits, pure), replicas.py (handshake, heartbeats, probation, loss), routing.py
(which replica; the dispatch window), holds.py (held tasks by cause; waking a stage at zero),
streams.py (chunks between stages and to the client), failover.py (a lost replica's tasks run
again), pins.py (revision pins and their counts); tasks.py holds the state they share.

With shared memory, a stage's output tensors arrive as handles to blocks the worker lent; they
go on to the next stage as the same handles (the orchestrator never touches the bytes). The
request keeps every reply it used until its outcome: then final outputs are copied out and all
its blocks go back to their workers, so no block outlives its request. A reply that is dropped
(late) gives its blocks back at once.

Revisions: at admission a request is pinned, per stage, to one stage revision (revisions.pin:
newest or previous, in proportion to the new revision's routable capacity), and every hop and
every failover retry goes only to replicas of it. Each submit says the revision it expects and
the revisions of the payloads it brings, so a worker refuses a cross-revision hop
(error/revision_mismatch): that ends the request with that error and is never taken for a lost
replica. A request counts as pinned to each of its stage revisions from admission to its one
terminal outcome (`pinned`, GET /v1/load): the operator keeps the last replica of a revision a
release leaves while requests are pinned to it, and a task whose revision has no routable
replica left goes to that draining one (StagePool.last_resort). See docs/architecture.md,
"Revisions".

A stage with `autoscaling` may have no routable replica (scaled to zero): a task that needs it
is held (holds.py) and the stage is woken through the Waker; at admission every such stage the
request will run is woken at once (warm-up along the pipeline). The engine also feeds the load
signal (load.py). See docs/architecture.md, "The load signal and hold-and-wake".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import msgspec
import zmq.asyncio

from omnistage import protocol as p
from omnistage.client import ReplicaChannel
from omnistage.curve import CurveKeyring
from omnistage.metrics import new_registry
from omnistage.orchestrator.failover import Failover
from omnistage.orchestrator.holds import HoldCause, Holds, Wakes, hold_bounds
from omnistage.orchestrator.load import LoadTracker, PipelineLoad, window_of
from omnistage.orchestrator.membership import Membership
from omnistage.orchestrator.metrics import OrchestratorCollector
from omnistage.orchestrator.pins import Pins, pipeline_revision
from omnistage.orchestrator.plan import MAX_N, Planner
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.replicas import Replicas
from omnistage.orchestrator.requests import (
    ABORT,
    FATAL,
    OK,
    REQUEST_ERROR,
    AudioChunk,
    ChildOutcome,
    Event,
    Outcome,
    PipelineRequest,
    RequestError,
    StageOutput,
)
from omnistage.orchestrator.routing import Router, wake_shares
from omnistage.orchestrator.streams import Streams
from omnistage.orchestrator.tasks import Child, Reply, Request, Stream, Task, tell_abort
from omnistage.orchestrator.wake import Waker
from omnistage.params import seed_defaults
from omnistage.shm import SegmentManager, ShmConfig, start_segment_manager
from omnistage.spec import OmniPipeline

__all__ = ["MAX_N", "Orchestrator", "RequestHandle", "_Request"]

log = logging.getLogger("omnistage.orchestrator")

_Request = Request  # its name here before tasks.py held it
_OUTPUTS = (p.Delta, p.Chunk, p.Final, p.Aborted)  # what a stage's first output may be
# What metrics.py counts (revision_refusals: tasks a worker refused with revision_mismatch).
_COUNTERS = ("late_messages", "late_aborts", "replicas_lost", "replica_restarts",
             "replicas_retired", "suspect_requests", "revision_refusals")


class RequestHandle:
    """The caller's side of one request: events in order, then exactly one Outcome."""

    def __init__(self, orch: Orchestrator, request: Request) -> None:
        self._orch = orch
        self._request = request
        self.id = request.id

    @property
    def revision(self) -> str | None:
        """The pipeline revision the request is pinned to (pins.pipeline_revision)."""
        return pipeline_revision(self._request.pins)

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._request.queue.get()
            yield event
            if isinstance(event, Outcome):
                return

    async def outcome(self) -> Outcome:
        queue = self._request.queue
        while True:  # events() without an async generator's cost per request
            event = await queue.get()
            if isinstance(event, Outcome):
                return event
            if isinstance(event, AudioChunk):
                event.credit()  # nobody delivers it: don't hold the stage back

    def abort(self, child: int | None = None) -> None:
        self._orch.abort(self.id, child)


class Orchestrator:
    """Admits requests and runs each over the stage pools to exactly one outcome."""

    def __init__(
        self,
        pipeline: OmniPipeline,
        membership: Membership,
        *,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 3.0,
        notes: Callable[[], Sequence[str]] | None = None,
        shm: ShmConfig | None = None,
        waker: Waker | None = None,
        revision_rng: random.Random | None = None,
        seed_rng: random.Random | None = None,
        curve: CurveKeyring | None = None,
    ) -> None:
        """notes() adds lines to /readyz's reason, for what the placement knows and the
        orchestrator cannot (a local replica crash-looping). waker: asked to start a stage
        that is at zero replicas while a request is held for it (holds.Wakes). revision_rng:
        the random source of the newest/previous choice at admission (tests seed it).
        seed_rng: where a request without a seed gets one at admission (PipelineRequest.seeded).
        curve: the pipeline's CurveZMQ keys, for workers that require them (omnistage.curve:
        our own pair, and each replica's generation's server key)."""
        self.pipeline = pipeline
        self.shm_config = shm
        self.shm: SegmentManager | None = None
        self.spec = pipeline.spec
        self.name = pipeline.metadata.name
        self.membership = membership
        self.planner = Planner(self.spec)
        self.topo, self.final_stages = self.planner.topo, self.planner.final_stages
        self.pools = {s.name: StagePool(s.name) for s in self.spec.stages}
        self.requests: dict[str, Request] = {}
        self.tasks: dict[str, Task] = {}  # bound to a replica, by wire id
        self.accepting = False
        self.notes = notes or (lambda: ())
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.counters: dict[str, float] = {**dict.fromkeys(_COUNTERS, 0), "latency_sum": 0.0}
        self.outcomes: dict[str, int] = {}
        self._background: set[asyncio.Task[None]] = set()
        # A stage with autoscaling may be at zero replicas: its tasks are held while the waker
        # starts one. Every held task, whatever its cause, counts against one bound per stage
        # (holdQueue, holds.hold_bounds).
        self.autoscaling = {s.name: s.autoscaling for s in self.spec.stages
                            if s.autoscaling is not None}
        self.holds = Holds(hold_bounds(self.spec.stages))
        self.wakes = Wakes(waker, self.holds, clock=time.monotonic, spawn=self._in_background)
        self.router = Router(
            self.pools, self.holds, {s.name: s.dispatch.per_replica for s in self.spec.stages
                                     if s.dispatch.per_replica is not None},
            frozenset(self.autoscaling), send=self._send, fail=self._fail_child,
            shares=wake_shares(self.spec.stages))
        self.pins = Pins(self.pools, (revision_rng or random.Random()).random)
        self.seed_rng = seed_rng or random.Random()
        self.streams = Streams(self.counters, self.tasks, release=self._release,
                               start=self._start, fail=self._fail_child)
        self.failover = Failover(
            self.pools, self.planner.rows, self.spec.orchestrator.failover.max_retries,
            self.counters, clock=time.monotonic, detach=self._detach, send=self._send,
            settle=self._settle, fail=self._fail_child)
        self.replicas = Replicas(
            self.pools, self.counters, heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout, on_reply=self._on_reply,
            fail_bound=self.failover.lost, routable=self._routable, spawn=self._in_background,
            connect=ReplicaChannel, clock=time.monotonic, curve=curve)
        # The collaborators' own state that metrics, GET /v1/load and tests read here.
        self.admissions, self.pinned = self.pins.admissions, self.pins.pinned
        self.suspects, self.startup_s = self.replicas.suspects, self.wakes.startup_s
        self.failovers = self.failover.counts
        self.load_tracker = LoadTracker(self.pools, window_s=window_of(self.spec))
        # The HTTP layer adds its own request metrics to this registry; /metrics serves it.
        self.registry = new_registry(OrchestratorCollector(
            pipeline=self.name, outcomes=self.outcomes, requests=self.requests,
            pools=self.pools, counters=self.counters, load=self.load,
            failovers=self.failovers, admissions=self.admissions,
            hold_refusals=self.holds.refused))
        self._zctx: zmq.asyncio.Context | None = None
        self._stopped: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # set when the last request ends (for stop)

    @property
    def revision_holds(self) -> int:
        """Tasks ever held for a replica of their revision on its way."""
        return self.holds.total[HoldCause.REVISION]

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._zctx = zmq.asyncio.Context()
        self._stopped = asyncio.Event()
        if self.shm_config is not None:
            self.shm = start_segment_manager(self.shm_config)
        self.replicas.zctx, self.replicas.shm = self._zctx, self.shm
        try:
            await self.membership.start(self.replicas.on_member)
        except BaseException:
            if self.shm is not None:  # stop() will not run: leave no segment behind
                self.shm.close()
                self.shm = None
            self._stopped = None  # not started: a stop() returns at once (it waited forever)
            raise
        await self.replicas.start()
        self.accepting = True

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish, then close. Idempotent."""
        if self._stopped is None:
            return
        if not self.accepting:  # another stop() began: wait for it, never drain twice
            await self._stopped.wait()
            return
        self.accepting = False
        log.info("orchestrator stopping: %d requests in flight", len(self.requests))
        self._idle = asyncio.Event()
        if self.requests:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
        for request in list(self.requests.values()):
            for child in request.children:
                self._fail_child(child, RequestError("shutting_down", "orchestrator shut down"))
        await self.replicas.stop_heartbeats()
        await self.membership.stop()
        self.replicas.suspects.clear()
        for pending in list(self._background):
            pending.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.replicas.close()
        if self._zctx is not None:
            self._zctx.term()
        if self.shm is not None:  # workers take back what we still borrowed when it goes
            self.shm.close()
        self._stopped.set()

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a task that stop() cancels and waits for."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _routable(self, stage: str) -> None:
        """A replica of the stage may have become routable: dispatch its held tasks in order."""
        pool = self.pools.get(stage)
        self.router.drain_soon(stage)  # room may have come, or gone with the last replica
        if pool is None or not pool.has_routable():
            return
        self.wakes.woke(stage)
        self.router.at_wake(stage)  # held tasks spread over replicas as they arrive
        for task in self.holds.ready(stage, pool.has_routable):
            self._send(task)

    # ---- requests --------------------------------------------------------------------------

    def submit(self, req: PipelineRequest) -> RequestHandle:
        rid = req.request_id or f"req-{os.urandom(8).hex()}"
        timeout = req.timeout_s or float(self.spec.orchestrator.request_timeout_seconds)
        request = Request(rid, req, [], [], set(), time.monotonic() + timeout)
        handle = RequestHandle(self, request)
        error = self._plan(request)
        if error is not None:
            self._emit_outcome(request, Outcome(rid, error.kind, [], error))  # type: ignore[arg-type]
            return handle
        self.requests[rid] = request
        # Seeds are fixed before any task goes out, so a failover retry samples the same.
        request.req = request.req.seeded(
            seed_defaults(self.spec.stage(s) for s in request.order),
            lambda most: self.seed_rng.randint(0, most))
        self.pins.admit(request)
        request.timer = asyncio.get_running_loop().call_later(timeout, self._on_deadline, request)
        request.children = [Child(request, i) for i in range(req.n)]
        for stage in request.cold:  # warm-up: every stage this request needs, at once
            self.wakes.wake(stage)
        for child in request.children:
            child.streams = {
                up: Stream(up, down, self.planner.streaming[up].window)
                for up, down in request.streamed.items()}
            self._advance(child)
        return handle

    def _plan(self, request: Request) -> RequestError | None:
        """Plan the request; refuse at once what cannot be served; pin its revisions."""
        if not self.accepting:
            return RequestError("shutting_down", "orchestrator is not accepting requests")
        error = self.planner.plan(request)
        if error is not None:
            return error
        for stage in request.order:
            if self.pools[stage].has_routable():
                continue
            if stage not in self.autoscaling:
                return RequestError("no_replica", f"stage {stage!r} has no live replica", stage)
            refusal = self.wakes.cannot_hold(stage, request.deadline)
            if refusal is not None:
                return refusal
            request.cold.append(stage)
        self.pins.choose(request)
        return None

    def _advance(self, child: Child) -> None:
        """Start every stage whose inputs are complete; settle the child when nothing runs."""
        request = child.request
        if child.outcome is not None:
            return
        if not child.abort_requested:
            for stage in request.order:
                for companion in (False, True):
                    key = (stage, companion)
                    if key in child.started or (companion and stage not in request.companions):
                        continue
                    if self.planner.ready(child, stage):
                        self._start(child, stage, companion)
                        if child.outcome is not None:
                            return
        self._settle(child)

    def _start(self, child: Child, stage: str, companion: bool,
               fed: Stream | None = None) -> None:
        request = child.request
        child.started.add((stage, companion))
        suffix = "/neg" if companion else ""
        again = child.restarts.get(stage) if not companion else None
        suffix += f"~r{again}" if again else ""  # the aborted one may still be on its replica
        task = Task(f"{request.id}/{child.index}/{stage}{suffix}", child, stage, companion,
                    fed=fed, needed_at=self.load_tracker.arrived(stage))
        self._send(task)

    def _send(self, task: Task) -> None:
        """Send a task to a replica of its stage (and revision), or hold it (the window, a
        stage at zero, a revision on its way), or fail its child."""
        if self.router.wait_for_room(task):
            return
        child, request = task.child, task.child.request
        replica = self.router.choose(task)
        if isinstance(replica, HoldCause):  # none now: hold it, unless the stage cannot
            refusal = (self.wakes.hold(task) if replica is HoldCause.WAKE
                       else self.holds.hold(task, replica))
            if refusal is not None:
                self._fail_child(child, refusal)
            return
        if isinstance(replica, RequestError):  # none, and none on its way
            self._fail_child(child, replica)
            return
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            self._fail_child(child, RequestError("deadline", "request deadline passed",
                                                 task.stage))
            return
        submit = self.planner.submit(task, replica, remaining)
        try:
            tensors = {} if task.fed is not None else self.planner.tensors(task)
            replica.channel.send(submit, tensors)
            if task.fed is not None:  # a resent downstream gets every chunk so far again
                self.streams.resend(task, replica)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            self._fail_child(child, RequestError(
                "bad_request", f"request could not be encoded for stage {task.stage}: {exc}",
                task.stage))
            return
        except Exception as exc:
            self._fail_child(child, RequestError(
                "stage_failed", f"could not send to {replica.name}: {exc}", task.stage))
            return
        task.replica = replica
        task.incarnation = replica.incarnation
        task.sent_at = self.load_tracker.dispatched(task.stage, task.needed_at)
        task.answered = False
        task.worker_queue_s = None
        replica.inflight += 1
        replica.served += 1
        replica.bound.add(task)
        self.tasks[task.wire_id] = task
        child.running[(task.stage, task.companion)] = task

    # ---- replies ---------------------------------------------------------------------------

    def _on_reply(self, replica: Replica, msg: Reply) -> None:
        """A worker's reply about a task (replicas.py took pongs and hellos)."""
        h = msg.header
        task = self.tasks.get(getattr(h, "id", None) or "")
        if task is None or task.replica is not replica:
            self.counters["late_messages"] += 1
            self._release(msg)
            return
        if not task.answered and isinstance(h, _OUTPUTS) and task.sent_at is not None:
            task.answered = True
            task.worker_queue_s = h.queue_wait_s
            self.load_tracker.first_output(task.stage, task.sent_at, needed_at=task.needed_at,
                                           worker_queue_s=h.queue_wait_s)
        if isinstance(h, p.Delta):
            self.streams.on_delta(task, h)
        elif isinstance(h, p.Chunk):
            self._on_chunk(task, msg)
        elif isinstance(h, p.Credit):
            self.streams.on_credit(task, h)
        elif isinstance(h, p.TERMINAL_REPLIES):
            self._on_terminal(task, msg)
        else:
            self.counters["late_messages"] += 1
            self._release(msg)

    def _on_chunk(self, task: Task, msg: Reply) -> None:
        self.streams.on_chunk(task, msg)  # a method of its own: benches wrap it to watch chunks

    def _on_terminal(self, task: Task, msg: Reply) -> None:
        replica = task.replica
        if isinstance(msg.header, p.Final | p.Aborted) and task.sent_at is not None:
            self.load_tracker.finished(task.stage, task.sent_at,
                                       worker_queue_s=task.worker_queue_s)
        self._detach(task)
        child, stage = task.child, task.stage
        if child.outcome is not None:
            self.counters["late_messages"] += 1
            self._release(msg)
            return
        if msg.tensors:
            child.request.held.append(msg)
        match msg.header:
            case p.Final():
                if task.companion:
                    child.companion_done[stage] = msg  # type: ignore[assignment]
                else:
                    child.done[stage] = msg  # type: ignore[assignment]
                    if stage in child.request.finals:
                        child.outputs[stage] = _output(task, msg, replica)
                    self.streams.end(child, stage)
                self._advance(child)
            case p.Aborted(text=text):
                child.aborted = True
                child.abort_requested = True
                if not task.companion and stage in child.request.finals and text is not None:
                    child.outputs[stage] = _output(task, msg, replica)
                self._settle(child)
            case p.Draining() | p.Error(code="not_ready"):
                # The replica refused before starting: try another one of the same stage.
                task.tried.add(replica.name if replica else "")
                child.started.add((stage, task.companion))
                self._send(task)
                self._settle(child)
            case p.Overloaded(message=message, retry_after=retry_after):
                self._fail_child(child, RequestError(
                    "overloaded", f"stage {stage}: {message}", stage, retry_after=retry_after))
            case p.Error(code="stale_incarnation", message=message):
                # Sent before we saw the restart; the new process refused to run it.
                if replica is not None:
                    self.replicas.stale(replica, task.incarnation)
                if child.abort_requested:
                    child.aborted = True
                    self._settle(child)
                    return
                if self.failover.retry(task, replica.name if replica else "", "restarted"):
                    return
                self._fail_child(child, RequestError(
                    "replica_lost", f"replica {replica.name if replica else '?'} of stage "
                    f"{stage} restarted: {message}", stage))
            case p.Deadline(message=message):
                self._fail_child(child, RequestError(
                    "deadline", f"stage {stage}: {message}", stage))
            case p.Error(code="drain_timeout", message=message):
                # The replica cut it on its way out, not the client: say so (503), unless the
                # client had asked for the abort meanwhile.
                if child.abort_requested:
                    child.aborted = True
                    self._settle(child)
                else:
                    self._fail_child(child, RequestError(
                        "drain_timeout", f"stage {stage}: {message}", stage))
            case p.Error(code="revision_mismatch", message=message):
                # A cross-revision hop refused: the request ends with it (never retried, and
                # the replica is fine: it is no lost replica).
                self.counters["revision_refusals"] += 1
                log.error("request %s: replica %s refused a cross-revision hop at stage %s: "
                          "%s", child.request.id, replica.name if replica else "?", stage,
                          message)
                self._fail_child(child, RequestError(
                    "revision_mismatch", f"stage {stage}: {message}", stage))
            case p.Error(code=code, message=message):
                kind = "bad_request" if code == "bad_request" else "stage_failed"
                self._fail_child(child, RequestError(kind, f"stage {stage}: {message}", stage))

    def _release(self, *msgs: Reply) -> None:
        """Give the shared-memory blocks these replies carry back to their workers."""
        if self.shm is not None:
            for msg in msgs:
                self.shm.release(msg)

    def _detach(self, task: Task) -> None:
        self.tasks.pop(task.wire_id, None)
        task.child.running.pop((task.stage, task.companion), None)
        if task.replica is None:
            self.holds.take(task)  # held: it leaves the queue
        else:
            task.replica.bound.discard(task)
            task.replica.inflight = max(0, task.replica.inflight - 1)
            self.router.drain_soon(task.stage)  # a slot of its dispatch window freed

    # ---- terminal states -------------------------------------------------------------------

    def _settle(self, child: Child) -> None:
        """Make a child terminal once nothing of it runs (the last abort message is terminal)."""
        if child.outcome is not None or child.running:
            return
        request = child.request
        complete = all(f in child.outputs for f in request.finals)
        if child.aborted or (child.abort_requested and not complete):
            child.outcome = ChildOutcome(child.index, ABORT, dict(child.outputs))
        elif complete:
            child.outcome = ChildOutcome(child.index, OK, dict(child.outputs))
        else:
            return  # more stages to start (a retry is in progress)
        self._child_terminal(child)

    def _fail_child(self, child: Child, error: RequestError) -> None:
        if child.outcome is not None:
            return
        for task in list(child.running.values()):
            self._detach(task)
            if task.replica is not None and task.replica.alive:
                tell_abort(task, task.replica)
        child.outcome = ChildOutcome(child.index, error.kind, dict(child.outputs), error)  # type: ignore[arg-type]
        self._child_terminal(child)

    def _child_terminal(self, child: Child) -> None:
        request = child.request
        if child.outcome is not None:
            child.outcome.usage = _usage(child)
        if request.outcome is None and all(c.outcome is not None for c in request.children):
            self._emit_outcome(request, _outcome(request))

    def _emit_outcome(self, request: Request, outcome: Outcome) -> None:
        request.outcome = outcome
        self.pins.release(request)
        self._release(*request.held)  # no block outlives its request
        request.held.clear()
        if request.timer is not None:
            request.timer.cancel()
        self.requests.pop(request.id, None)
        if not self.requests and self._idle is not None:
            self._idle.set()
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1
        self.counters["latency_sum"] += time.monotonic() - request.started
        request.queue.put_nowait(outcome)

    def _on_deadline(self, request: Request) -> None:
        for child in request.children:
            self._fail_child(child, RequestError("deadline", "request deadline passed"))

    def abort(self, rid: str, child_index: int | None = None) -> None:
        """Abort a request (or one of its parallel samples); late aborts are dropped."""
        request = self.requests.get(rid)
        if request is None:
            self.counters["late_aborts"] += 1
            return
        children = request.children
        if child_index is not None:
            if not 0 <= child_index < len(children):
                self.counters["late_aborts"] += 1
                return
            children = [children[child_index]]
        for child in children:
            if child.outcome is not None:
                self.counters["late_aborts"] += 1
                continue
            child.abort_requested = True
            for task in list(child.running.values()):
                if task.replica is None:  # held: it never started, nothing to tell
                    self._detach(task)
            if not child.running:
                self._settle(child)
            for task in list(child.running.values()):
                if task.replica is not None:
                    tell_abort(task, task.replica)

    # ---- control and introspection ---------------------------------------------------------

    async def control(
        self, op: str, stages: list[str] | None = None, timeout: float = 60.0
    ) -> dict[str, dict[str, Any]]:
        """Fan a control RPC out to every live replica of the chosen stages (replicas.py)."""
        return await self.replicas.control(op, stages, timeout)

    @property
    def ready(self) -> bool:
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, str]:
        if not self.accepting:
            return False, "not accepting requests"
        notes = "".join(f"; {note}" for note in self.notes())
        cold = []
        for stage in self.topo:
            if self.pools[stage].has_routable():
                continue
            if stage not in self.autoscaling:
                return False, f"stage {stage!r} has no ready replica{notes}"
            cold.append(stage)  # at zero: its requests are held and wake it
        if cold:
            notes = f"; at zero replicas (requests wake them): {', '.join(cold)}{notes}"
        return True, f"ready{notes}"

    def load(self) -> PipelineLoad:
        """The load signal (GET /v1/load and the omnistage_stage_* gauges read this)."""
        stages, revisions = {}, {}
        for stage, pool in self.pools.items():
            stages[stage] = self.load_tracker.figures(
                stage, replicas=len(pool.routable()),
                inflight=sum(r.inflight for r in pool.replicas.values()),
                held=self.holds.held(stage), wake_pending=stage in self.wakes.pending)
            if (revs := self.pins.revisions(stage)) is not None:
                revisions[stage] = revs
        return PipelineLoad(window_s=self.load_tracker.window_s, now=self.load_tracker.wall(),
                            stages=stages, revisions=revisions,
                            held_by_cause={s: self.holds.by_cause(s) for s in self.pools})

    def status(self) -> dict[str, Any]:
        return self.replicas.status()


def _usage(child: Child) -> dict[str, dict[str, int]]:
    """The token counts every stage of the child reported on success, final or not."""
    usage = {}
    for stage, msg in child.done.items():
        counts = {f: v for f in ("prompt_tokens", "completion_tokens")
                  if isinstance(v := getattr(msg.header, f, None), int)}
        if counts:
            usage[stage] = counts
    return usage


def _output(task: Task, msg: Reply, replica: Replica | None) -> StageOutput:
    """A final stage's result: the outcome fields the executor set, and its tensors (in memory
    of their own: shared-memory blocks go back when the request ends)."""
    h = msg.header
    fields = {f: v for f in p.RESULT_FIELDS if (v := getattr(h, f)) is not None}
    tensors = {name: wt.detached() for name, wt in msg.tensors.items()}
    return StageOutput(task.stage, fields, tensors, replica.name if replica else "")


def _outcome(request: Request) -> Outcome:
    """A request's outcome once every child has its own."""
    outcomes = [c.outcome for c in request.children if c.outcome is not None]
    errors = [o for o in outcomes if o.status in (REQUEST_ERROR, FATAL)]
    if len(errors) == len(outcomes):
        # Every sample failed, so did the request: with the first sample's error. When only
        # some failed, the request succeeded and each failed child carries its own error.
        first = errors[0]
        status, error = first.status, first.error
    elif all(o.status in (ABORT, REQUEST_ERROR, FATAL) for o in outcomes):
        status, error = ABORT, None
    else:
        status, error = OK, None
    return Outcome(request.id, status, outcomes, error)
