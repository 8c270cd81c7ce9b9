"""The orchestrator engine: per-request state, DAG routing across stage pools, one terminal outcome.

The orchestrator alone decides which stage runs next. Each request has children (one per
parallel sample); each child walks the needed part of the stage DAG, one task per stage, and a
task is bound to the replica that took it. Everything runs on one event loop, so request state
needs no locks; replies from workers arrive through ReplicaChannel callbacks.

Terminal state is monotonic: once a child or request is terminal its tasks are detached, and any
late reply, delta or abort for them is dropped and counted, never forwarded.

Streaming between stages: where an upstream's kind emits chunks and its one downstream's kind
consumes them (the kind table), the upstream runs with a chunk window; its first chunk starts
the downstream (fed), and each chunk is fed on to the replica the downstream is bound to. The
downstream's credits go back to the upstream. Chunks of a terminal child are dropped like any
late reply. See docs/architecture.md, "Streaming between stages".

A final speech stage (its kind emits audio in chunks) of a request that streams runs with a chunk
window too: each chunk goes to the request as an AudioChunk event, and its credit goes back to
the stage when the consumer calls the event's credit() (the HTTP layer: once it wrote the chunk),
so a slow client holds the stage back instead of the orchestrator buffering without bound.

With shared memory, a stage's output tensors arrive as handles to blocks the worker lent; they
go on to the next stage as the same handles (the orchestrator never touches the bytes). The
request keeps every reply it used until its outcome: then final outputs are copied out and all
its blocks go back to their workers, so no block outlives its request. A reply that is dropped
(late) gives its blocks back at once.

Failover: a task whose replica is lost (kill, crash, restart) runs again on another replica of
its stage, from the upstream outputs the request still holds (see _failover and
docs/architecture.md, "Failover"): at most spec.orchestrator.failover.maxRetries times per
request, within its deadline, never once it was aborted, and never after the request lost two
replicas of the same stage (a suspect: it may be what kills them). A final AR stage whose text
already streamed to the client resumes from the tokens delivered; a stage whose output already
reached the client and cannot resume (audio chunks) fails as before.

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

Dispatch window (opt-in, stage.dispatch.perReplica): at most that many tasks on each replica of
the stage; the rest wait in the orchestrator, in order, and a task retried after a lost replica
or a refusal goes first, so a failover waits for the next free slot instead of a survivor's
whole queue. Without it every task goes to a replica at once (see _wait_for_room).

A stage with `autoscaling` may have no routable replica (scaled to zero): a task that needs it
is held in the stage's bounded FIFO (still under its request's deadline and aborts) and the
stage is woken through the Waker; at admission every such stage the request will run is woken
at once (warm-up along the pipeline). The engine also feeds the load signal (load.py). See
docs/architecture.md, "The load signal and hold-and-wake".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import zmq.asyncio

from omnistage import protocol as p
from omnistage.client import ChannelClosed, ReplicaChannel
from omnistage.kinds import Payload, StageKind
from omnistage.kinds import get as get_kind
from omnistage.metrics import new_registry
from omnistage.orchestrator.load import LoadTracker, PipelineLoad, RevisionLoad, window_of
from omnistage.orchestrator.membership import Membership, ReplicaInfo
from omnistage.orchestrator.metrics import OrchestratorCollector
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.requests import (
    ABORT,
    FATAL,
    OK,
    REQUEST_ERROR,
    AudioChunk,
    ChildOutcome,
    Delta,
    Event,
    Outcome,
    PipelineRequest,
    RequestError,
    StageOutput,
)
from omnistage.orchestrator.revisions import NEWEST, Track, count_revisions, newest, pin
from omnistage.orchestrator.wake import WAKE_INTERVAL_S, Waker
from omnistage.shm import SegmentManager, ShmConfig, start_segment_manager
from omnistage.spec import OmniPipeline

log = logging.getLogger("omnistage.orchestrator")

MAX_N = 64
_seq = itertools.count(1)
Reply = p.Message[p.Reply]
Result = p.Message[p.Final]  # a stage's successful output, kept for the stages after it
_OUTPUTS = (p.Delta, p.Chunk, p.Final, p.Aborted)  # what a stage's first output may be


@dataclass(eq=False)
class _Stream:
    """One streamed edge of one child: the upstream's chunks, fed on to the downstream."""

    upstream: str
    downstream: str
    window: int
    chunks: list[Reply] = field(default_factory=list)  # kept to feed a resent downstream
    acked: int = 0  # the downstream took every chunk up to this seq
    ended: bool = False  # the upstream's final arrived (its last feed went out)


@dataclass(eq=False)
class _Shown:
    """What of one stage's output the client was handed (Delta and AudioChunk events)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    audio_chunks: int = 0


@dataclass(eq=False)
class _Task:
    """One stage of one child, bound to one replica at a time."""

    wire_id: str
    child: _Child
    stage: str
    companion: bool = False
    replica: Replica | None = None
    incarnation: str | None = None  # the replica's process it was sent to
    tried: set[str] = field(default_factory=set)
    fed: _Stream | None = None  # its input arrives in chunks from this stream
    needed_at: float = 0.0  # when its inputs were complete (the load signal's clock)
    sent_at: float | None = None  # when it last went to a replica
    answered: bool = False  # the replica's first output came (ttfo measured)
    worker_queue_s: float | None = None  # the replica's reported queue wait (load: exec_s)
    attempt: int = 0  # failovers so far: each attempt has a wire id of its own
    waiting: bool = False  # in its stage's queue for a free slot of the dispatch window


@dataclass(eq=False)
class _Child:
    request: _Request
    index: int
    running: dict[tuple[str, bool], _Task] = field(default_factory=dict)
    started: set[tuple[str, bool]] = field(default_factory=set)
    done: dict[str, Result] = field(default_factory=dict)
    companion_done: dict[str, Result] = field(default_factory=dict)
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    streams: dict[str, _Stream] = field(default_factory=dict)  # by upstream stage
    restarts: dict[str, int] = field(default_factory=dict)  # fed stages started afresh
    shown: dict[str, _Shown] = field(default_factory=dict)  # by stage: what the client saw
    abort_requested: bool = False
    aborted: bool = False
    outcome: ChildOutcome | None = None


@dataclass(eq=False)
class _Request:
    id: str
    req: PipelineRequest
    finals: list[str]
    order: list[str]  # needed stages in topological order
    companions: set[str]  # AR stages that also run the negative prompt
    deadline: float
    streamed: dict[str, str] = field(default_factory=dict)  # upstream -> downstream
    to_client: frozenset[str] = frozenset()  # final stages whose chunks stream to the client
    started: float = field(default_factory=time.monotonic)
    children: list[_Child] = field(default_factory=list)
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    outcome: Outcome | None = None
    timer: asyncio.TimerHandle | None = None
    held: list[Reply] = field(default_factory=list)  # replies whose blocks it still uses
    cold: list[str] = field(default_factory=list)  # stages it needs that are at zero (woken)
    retries: int = 0  # failovers of its tasks so far (bounded by failover.maxRetries)
    losses: dict[str, int] = field(default_factory=dict)  # replicas lost under it, by stage
    # The revision it runs at each stage it needs (None: any replica, unchecked), and whether
    # that is the newest or the previous pipeline revision (revisions.pin).
    pins: dict[str, str | None] = field(default_factory=dict)
    track: Track = NEWEST
    # The (stage, revision) pins it holds in Orchestrator.pinned: admitted, not yet terminal.
    counted: tuple[tuple[str, str], ...] = ()


@dataclass(eq=False)
class _Wake:
    """A stage at zero that was asked to wake: since when, and when the waker was last called."""

    since: float
    asked: float | None = None


class RequestHandle:
    """The caller's side of one request: events in order, then exactly one Outcome."""

    def __init__(self, orch: Orchestrator, request: _Request) -> None:
        self._orch = orch
        self._request = request
        self.id = request.id

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._request.queue.get()
            yield event
            if isinstance(event, Outcome):
                return

    async def outcome(self) -> Outcome:
        async for event in self.events():
            if isinstance(event, Outcome):
                return event
            if isinstance(event, AudioChunk):
                event.credit()  # nobody delivers it: don't hold the stage back
        raise RuntimeError("event stream ended without an outcome")

    def abort(self, child: int | None = None) -> None:
        self._orch.abort(self.id, child)


class Orchestrator:
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
    ) -> None:
        """notes() adds lines to /readyz's reason, for what the placement knows and the
        orchestrator cannot (a local replica crash-looping). waker: asked to start a stage
        that is at zero replicas while a request is held for it (see _hold). revision_rng:
        the random source of the newest/previous choice at admission (tests seed it)."""
        self.pipeline = pipeline
        self.shm_config = shm
        self.shm: SegmentManager | None = None
        self.spec = pipeline.spec
        self.name = pipeline.metadata.name
        self.membership = membership
        self.kinds = {s.name: s.kind for s in self.spec.stages}
        # What each stage consumes and emits (the kind table): routing reads these, not names.
        self.rows: dict[str, StageKind] = {s.name: get_kind(s.kind) for s in self.spec.stages}
        self.default_deadlines = {
            s.name: float(s.admission.default_deadline_seconds) for s in self.spec.stages}
        self.inputs = {s.name: list(s.inputs) for s in self.spec.stages}
        self.streaming = {s.name: s.streaming for s in self.spec.stages}
        self.topo = self.spec.topo_order()
        self.final_stages = tuple(self.spec.final_stages())
        self._plans: dict[tuple[str, ...], tuple[tuple[str, ...], frozenset[str]]] = {}
        self.pools = {s.name: StagePool(s.name) for s in self.spec.stages}
        self.requests: dict[str, _Request] = {}
        self.tasks: dict[str, _Task] = {}
        # Hold-and-wake: a stage with autoscaling may be at zero replicas; a task that needs it
        # waits in its bounded FIFO while the waker starts a replica.
        self.autoscaling = {s.name: s.autoscaling for s in self.spec.stages
                            if s.autoscaling is not None}
        self.holds: dict[str, deque[_Task]] = {s: deque() for s in self.autoscaling}
        self.revision_holds = 0  # tasks held for a replica of their revision on its way
        # Dispatch windows (spec stage.dispatch.perReplica): at most this many tasks on each
        # replica of the stage; more wait, in order, in the stage's hold queue (_wait_for_room).
        self.windows = {s.name: s.dispatch.per_replica for s in self.spec.stages
                        if s.dispatch.per_replica is not None}
        self._drains: set[str] = set()  # windowed stages whose queue a loop turn will drain
        self._dispatching: _Task | None = None  # the waiting task _drain is sending now
        self.waker = waker
        self.wakes: dict[str, _Wake] = {}  # stages asked to wake and not routable yet
        self.startup_s: dict[str, float] = {}  # the last measured wake -> routable, per stage
        self.suspects: dict[str, ReplicaInfo] = {}  # lost to heartbeats, still in membership
        self.accepting = False
        self.notes = notes or (lambda: ())
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.counters: dict[str, float] = {
            "late_messages": 0,
            "late_aborts": 0,
            "replicas_lost": 0,
            "replica_restarts": 0,
            "latency_sum": 0.0,
            "suspect_requests": 0,
            "revision_refusals": 0,  # tasks a worker refused with revision_mismatch
        }
        self._draw = (revision_rng or random.Random()).random
        # Requests admitted, by stage and the revision they were pinned to there.
        self.admissions: dict[tuple[str, str], int] = {}
        # Requests in flight (admitted, not terminal), by stage and the revision they are pinned
        # to there: GET /v1/load's `pinned`. A key leaves when its count is back to 0.
        self.pinned: dict[tuple[str, str], int] = {}
        self.max_retries = self.spec.orchestrator.failover.max_retries
        # Failovers by stage: "retries" (a lost task sent again), "resumes" (of which a stream
        # went on from the tokens the client already had).
        self.failovers: dict[str, dict[str, int]] = {"retries": {}, "resumes": {}}
        self.outcomes: dict[str, int] = {}
        self.load_tracker = LoadTracker(self.pools, window_s=window_of(self.spec))
        # The HTTP layer adds its own request metrics to this registry; /metrics serves it.
        self.registry = new_registry(OrchestratorCollector(
            pipeline=self.name, outcomes=self.outcomes, requests=self.requests,
            pools=self.pools, counters=self.counters, load=self.load,
            failovers=self.failovers, admissions=self.admissions))
        self._zctx: zmq.asyncio.Context | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._stopped: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # set when the last request ends (for stop)
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._zctx = zmq.asyncio.Context()
        self._stopped = asyncio.Event()
        if self.shm_config is not None:
            self.shm = start_segment_manager(self.shm_config)
        try:
            await self.membership.start(self._on_member)
        except BaseException:
            if self.shm is not None:  # stop() will not run: leave no segment behind
                self.shm.close()
                self.shm = None
            self._stopped = None  # not started: a stop() returns at once (it waited forever)
            raise
        # Replicas known at start become routable as their handshakes complete: wait for
        # those (bounded), so the first requests find them.
        pending = [r.handshake for pool in self.pools.values() for r in pool.replicas.values()
                   if r.handshake is not None and not r.handshake.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.heartbeat_timeout)
        self._heartbeat = asyncio.create_task(self._heartbeat_loop())
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
        for rid in list(self.requests):
            request = self.requests[rid]
            for child in request.children:
                self._fail_child(child, RequestError("shutting_down", "orchestrator shut down"))
        hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hb
        await self.membership.stop()
        self.suspects.clear()
        for pending in list(self._background):
            pending.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for pool in self.pools.values():
            for replica in list(pool.replicas.values()):
                await replica.channel.close()
            pool.replicas.clear()
        if self._zctx is not None:
            self._zctx.term()
        if self.shm is not None:  # workers take back what we still borrowed when it goes
            self.shm.close()
        self._stopped.set()

    # ---- membership and liveness -----------------------------------------------------------

    def _on_member(self, info: ReplicaInfo) -> None:
        pool = self.pools.get(info.stage)
        if pool is None:
            log.warning("ignoring replica %s of unknown stage %r", info.name, info.stage)
            return
        current = pool.replicas.get(info.name)
        suspect = self.suspects.get(info.name)
        if info.state == "gone":
            self.suspects.pop(info.name, None)
            if current is not None:
                self._lose(current, "replica left the membership")
            return
        if suspect is not None:
            if suspect.endpoint == info.endpoint:
                self.suspects[info.name] = info  # still on probation: it missed heartbeats
                return
            self.suspects.pop(info.name, None)  # a new instance replaces the silent one
        if current is not None and current.info.endpoint != info.endpoint:
            self._lose(current, f"replaced by a new instance at {info.endpoint}")
            current = None
        if current is not None:
            if current.info.state != info.state:
                log.info("replica %s: %s -> %s", info.name, current.info.state, info.state)
            current.info = info
            self._routable(info.stage)
            return
        replica = Replica(info)
        replica.channel = ReplicaChannel(
            info.endpoint, name=info.name, zctx=self._zctx,
            on_message=partial(self._on_message, replica),
            on_disconnect=partial(self._on_disconnect, replica), shm=self.shm,
        )
        pool.replicas[info.name] = replica
        replica.handshake = self._in_background(self._handshake(replica))
        log.info("replica %s of stage %s joined at %s (%s); handshake sent", info.name,
                 info.stage, info.endpoint, info.state)

    async def _handshake(self, replica: Replica) -> None:
        """Route to a replica only once it answered the hello with our protocol version."""
        try:
            hello = await replica.channel.handshake(self.heartbeat_timeout)
        except p.VersionMismatch as exc:
            replica.refused = str(exc)
            log.error("not routing to replica %s: %s", replica.name, exc)
            return
        except TimeoutError:
            self._lose(replica, f"no hello reply within {self.heartbeat_timeout:.1f}s",
                       probation=True)
            return
        except ChannelClosed:
            return
        replica.last_seen = time.monotonic()
        replica.incarnation = hello.incarnation
        self._said_revision(replica, hello.revision)
        log.info("replica %s: handshake done (protocol %d, incarnation %s)", replica.name,
                 hello.version, hello.incarnation)
        self._routable(replica.info.stage)

    # A replica's identity is (name, incarnation): a process restarted at the same address is
    # a new incarnation, and the work bound to the old one is lost with it. Three signs, the
    # first one seen wins: the connection closes (at once, from the socket monitor), a pong or
    # hello_reply names another incarnation, or the worker refuses a submit meant for the old
    # one (stale_incarnation). The replica is routed to again once the new process has
    # answered a hello.

    def _on_disconnect(self, replica: Replica) -> None:
        if replica.alive and replica.incarnation is not None:
            self._restarted(replica, f"connection closed: incarnation {replica.incarnation} "
                                     "is gone")

    def _on_pong(self, replica: Replica, pong: p.Pong) -> None:
        new = pong.state.incarnation
        if replica.incarnation is not None and new != replica.incarnation:
            self._restarted(replica, f"restarted: incarnation {replica.incarnation} -> {new}")
            replica.channel.hello()

    def _on_hello(self, replica: Replica, hello: p.HelloReply | p.Error) -> None:
        """A handshake after a reconnect: the new process may be routed to."""
        if not replica.alive:
            return
        if isinstance(hello, p.Error) or hello.version != p.PROTOCOL_VERSION:
            why = (f"{hello.code}: {hello.message}" if isinstance(hello, p.Error)
                   else f"it speaks protocol version {hello.version}")
            replica.refused = f"replica {replica.name} refused the handshake after a restart: {why}"
            log.error("not routing to replica %s: %s", replica.name, replica.refused)
            if replica.incarnation is not None:
                self._restarted(replica, "restarted with another protocol version")
            return
        if replica.incarnation is not None and hello.incarnation != replica.incarnation:
            self._restarted(replica, f"restarted: incarnation {replica.incarnation} -> "
                                     f"{hello.incarnation}")
        if replica.incarnation is None:
            replica.incarnation = hello.incarnation
            self._said_revision(replica, hello.revision)
            replica.refused = ""
            log.info("replica %s: handshake done (incarnation %s); routable again",
                     replica.name, hello.incarnation)
            self._routable(replica.info.stage)

    def _said_revision(self, replica: Replica, revision: str | None) -> None:
        """Record the revision a replica's hello named: what it checks submits against, so
        what routing goes by. A membership label that disagrees is logged (the label lies)."""
        label = replica.info.revision
        if revision is not None and label is not None and revision != label:
            log.warning("replica %s says it is revision %s but its membership says %s; "
                        "routing by what it says", replica.name, revision, label)
        replica.said_revision = revision

    def _restarted(self, replica: Replica, reason: str) -> None:
        """The process behind a replica is gone: fail the work bound to it at once and route
        nothing more to the replica until the next process answers a hello."""
        self.counters["replica_restarts"] += 1
        log.warning("replica %s: %s; failing %d bound tasks", replica.name, reason,
                    len(replica.bound))
        replica.incarnation = None
        self._fail_bound(replica, reason)

    def _in_background(self, coro: Any) -> asyncio.Task[None]:
        """Run a task that stop() cancels and waits for."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _lose(self, replica: Replica, reason: str, *, probation: bool = False) -> None:
        """Remove a replica from routing and fail exactly the tasks bound to it.

        A replica lost to missed heartbeats goes on probation: membership still lists it, so
        it is pinged on a fresh channel and re-admitted (as a new binding) once it answers.
        """
        if not replica.alive:
            return
        if probation:
            self.suspects[replica.name] = replica.info
            self._in_background(self._probe(replica.info))
        replica.alive = False
        self.counters["replicas_lost"] += 1
        self.pools[replica.info.stage].remove(replica.name)
        log.warning("replica %s lost (%s): failing %d bound tasks", replica.name, reason,
                    len(replica.bound))
        self._fail_bound(replica, reason)
        self._in_background(replica.channel.close())

    def _fail_bound(self, replica: Replica, reason: str) -> None:
        """Fail exactly the tasks bound to a replica, each child once, with replica_lost."""
        for task in list(replica.bound):
            self._detach(task)
            child = task.child
            if child.outcome is not None:
                continue
            if child.abort_requested:
                child.aborted = True
                self._settle(child)
            elif not self._failover(task, replica.name, reason):
                self._fail_child(child, RequestError(
                    "replica_lost",
                    f"replica {replica.name} of stage {task.stage} was lost: {reason}",
                    task.stage,
                ))

    def _failover(self, task: _Task, lost: str, reason: str) -> bool:
        """Send a task whose replica was lost to another replica of its stage; False when it
        must fail instead (the caller fails it with replica_lost).

        Its inputs are the upstream outputs the request still holds (child.done, and a fed
        task's kept chunks, all sent again). A final AR stream the client already saw part of
        resumes from the delivered tokens; audio the client already has cannot be resumed. A
        lost upstream of a streamed edge restarts the downstream chain it fed, unless that
        chain's output already reached the client.
        """
        child, request, stage = task.child, task.child.request, task.stage
        losses = request.losses[stage] = request.losses.get(stage, 0) + 1
        if losses >= 2:
            self.counters["suspect_requests"] += 1
            log.warning("request %s is a suspect: it lost %d replicas of stage %s (the last, "
                        "%s: %s); not retried", request.id, losses, stage, lost, reason)
            return False
        if request.retries >= self.max_retries or time.monotonic() >= request.deadline:
            return False
        pool, revision = self.pools[stage], request.pins.get(stage)
        if not pool.routable(task.tried | {lost}, revision) and (
                revision is None or pool.last_resort(revision, task.tried | {lost}) is None):
            return False  # no other replica of its revision to go to: fail now, not wait
        chain = [] if task.companion else self._fed_chain(child, stage)
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
            self.failovers[kind][stage] = self.failovers[kind].get(stage, 0) + 1
        base = task.wire_id.rsplit("~", 1)[0] if task.attempt else task.wire_id
        task.attempt += 1
        task.wire_id = f"{base}~{task.attempt}"
        task.tried.add(lost)
        log.info("request %s: stage %s failed over from %s (%s); retry %d of %d%s",
                 request.id, stage, lost, reason, request.retries, self.max_retries,
                 ", resuming its stream" if resume else "")
        child.started.add((stage, task.companion))
        self._send(task)
        return True

    def _fed_chain(self, child: _Child, stage: str) -> list[str]:
        """The started stages that a streamed edge from `stage` feeds, in order down."""
        chain = []
        stream = child.streams.get(stage)
        while stream is not None and (stream.downstream, False) in child.started:
            chain.append(stream.downstream)
            stream = child.streams.get(stream.downstream)
        return chain

    def _restart_chain(self, child: _Child, stage: str, chain: list[str]) -> None:
        """Before a lost stage runs again: abort the downstream stages its chunks fed and
        forget those chunks, so its first new chunk starts them afresh (a stage run again
        need not make the same chunks: sampling). Their blocks stay in request.held until the
        outcome: an aborted downstream may still be reading them."""
        for s in [stage, *chain]:
            stream = child.streams.get(s)
            if stream is None:
                continue
            stream.chunks.clear()
            stream.acked = 0
            stream.ended = False
        for s in chain:
            child.started.discard((s, False))
            child.restarts[s] = child.restarts.get(s, 0) + 1
            down = child.running.get((s, False))
            if down is None:
                continue
            self._detach(down)
            if down.replica is not None and down.replica.alive:
                with contextlib.suppress(Exception):
                    down.replica.channel.send(p.Abort(id=down.wire_id,
                                                      incarnation=down.incarnation))

    async def _probe(self, info: ReplicaInfo) -> None:
        channel = ReplicaChannel(info.endpoint, name=f"probe-{info.name}", zctx=self._zctx)
        try:
            while self.suspects.get(info.name) is not None:
                try:
                    await channel.ping(timeout=self.heartbeat_timeout)
                except (TimeoutError, ConnectionError):
                    await asyncio.sleep(self.heartbeat_interval)
                    continue
                current = self.suspects.pop(info.name, None)
                if current is not None:
                    log.info("replica %s answers again: re-admitted", info.name)
                    self._on_member(current)
                return
        finally:
            await channel.close()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            for pool in self.pools.values():
                for replica in list(pool.replicas.values()):
                    if replica.refused:  # never routed to; membership decides when it goes
                        continue
                    if now - replica.last_seen > self.heartbeat_timeout:
                        self._lose(replica, f"no heartbeat for {now - replica.last_seen:.1f}s",
                                   probation=True)
                        continue
                    with contextlib.suppress(Exception):
                        replica.channel.send(p.Ping(cid=f"hb-{next(_seq)}"))

    # ---- requests --------------------------------------------------------------------------

    def submit(self, req: PipelineRequest) -> RequestHandle:
        rid = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        timeout = req.timeout_s or float(self.spec.orchestrator.request_timeout_seconds)
        request = _Request(rid, req, [], [], set(), time.monotonic() + timeout)
        handle = RequestHandle(self, request)
        error = self._plan(request)
        if error is not None:
            self._finish_early(request, error)
            return handle
        self.requests[rid] = request
        request.counted = tuple((s, rev) for s, rev in request.pins.items() if rev is not None)
        for key in request.counted:
            self.admissions[key] = self.admissions.get(key, 0) + 1
            self.pinned[key] = self.pinned.get(key, 0) + 1
        request.timer = asyncio.get_running_loop().call_later(timeout, self._on_deadline, request)
        request.children = [_Child(request, i) for i in range(req.n)]
        for stage in request.cold:  # warm-up: every stage this request needs, at once
            self._wake(stage)
        for child in request.children:
            child.streams = {
                up: _Stream(up, down, self.streaming[up].window)
                for up, down in request.streamed.items()}
            self._advance(child)
        return handle

    def _plan(self, request: _Request) -> RequestError | None:
        """Resolve finals and needed stages; refuse at once what cannot be served."""
        req = request.req
        if not self.accepting:
            return RequestError("shutting_down", "orchestrator is not accepting requests")
        if isinstance(req.n, bool) or not isinstance(req.n, int) or not 1 <= req.n <= MAX_N:
            return RequestError("bad_request", f"n must be an integer in [1, {MAX_N}]")
        finals = list(req.finals) if req.finals else list(self.final_stages)
        unknown = [s for s in finals if s not in self.pools]
        if unknown:
            return RequestError("bad_request", f"finals: unknown stage(s) {unknown}")
        unknown = [s for s in req.params if s != "*" and s not in self.pools]
        if unknown:
            return RequestError("bad_request", f"params: unknown stage(s) {unknown}")
        order, needed = self._stage_plan(tuple(finals))
        request.finals = finals
        request.order = list(order)
        for stage in request.order:
            if self.pools[stage].has_routable():
                continue
            if stage not in self.autoscaling:
                return RequestError("no_replica", f"stage {stage!r} has no live replica", stage)
            refusal = self._cannot_hold(stage, request.deadline)
            if refusal is not None:
                return refusal
            request.cold.append(stage)
        request.track, request.pins = pin(
            {s: count_revisions(self.pools[s].replicas.values()) for s in request.order},
            self._draw)
        if req.negative_prompt is not None:
            request.companions = {
                s for s in request.order if self._feeds_hidden_states(s, needed)}
        request.streamed = self._streamed_edges(request)
        if req.stream:
            request.to_client = frozenset(
                s for s in finals if self.rows[s].chunked_output
                and Payload.AUDIO in self.rows[s].emits and self.streaming[s].enabled
                and s not in request.streamed)
        return None

    def _streamed_edges(self, request: _Request) -> dict[str, str]:
        """The edges of this request that stream (upstream -> downstream): the upstream's row
        emits chunks, the downstream's consumes them, neither stage turned streaming off, the
        downstream has that one input, the upstream feeds no other stage of the request, and
        no negative-prompt companion runs on either."""
        edges: dict[str, str] = {}
        for down in request.order:
            ins = self.inputs[down]
            if len(ins) != 1:
                continue
            up = ins[0]
            consumers = [d for d in request.order if up in self.inputs[d]]
            if (consumers == [down] and self.rows[up].chunked_output
                    and self.rows[down].chunked_input and self.streaming[up].enabled
                    and self.streaming[down].enabled
                    and not {up, down} & request.companions):
                edges[up] = down
        return edges

    def _feeds_hidden_states(self, stage: str, among: Sequence[str] | frozenset[str]) -> bool:
        """Whether stage emits hidden states that a stage among `among` consumes: it must then
        return them, and run the negative prompt too when there is one."""
        return Payload.HIDDEN_STATES in self.rows[stage].emits and any(
            Payload.HIDDEN_STATES in self.rows[d].consumes and stage in self.inputs[d]
            for d in among)

    def _stage_plan(self, finals: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset[str]]:
        """The stages that finals need, in topological order, and as a set. Computed once
        per distinct finals (a pipeline has few), not on every request."""
        plan = self._plans.get(finals)
        if plan is None:
            needed: set[str] = set()
            stack = list(finals)
            while stack:
                stage = stack.pop()
                if stage not in needed:
                    needed.add(stage)
                    stack.extend(self.inputs[stage])
            plan = tuple(s for s in self.topo if s in needed), frozenset(needed)
            self._plans[finals] = plan
        return plan

    def _advance(self, child: _Child) -> None:
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
                    ins = self.inputs[stage]
                    if all(i in child.done for i in ins) and all(
                        i in child.companion_done for i in ins if i in request.companions
                    ):
                        self._start(child, stage, companion)
                        if child.outcome is not None:
                            return
        self._settle(child)

    def _start(self, child: _Child, stage: str, companion: bool,
               fed: _Stream | None = None) -> None:
        request = child.request
        child.started.add((stage, companion))
        suffix = "/neg" if companion else ""
        again = child.restarts.get(stage) if not companion else None
        suffix += f"~r{again}" if again else ""  # the aborted one may still be on its replica
        task = _Task(f"{request.id}/{child.index}/{stage}{suffix}", child, stage, companion,
                     fed=fed, needed_at=self.load_tracker.arrived(stage))
        self._send(task)

    def _send(self, task: _Task) -> None:
        if self._wait_for_room(task):
            return
        child, request = task.child, task.child.request
        revision = request.pins.get(task.stage)
        pool = self.pools[task.stage]
        replica = self._pick(task, revision)
        if replica is None and task.stage in self.autoscaling and not pool.has_routable():
            self._hold(task)
            return
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
            self._hold_for_revision(task)
            return
        if replica is None:
            code = "draining" if task.tried else "no_replica"
            of = "" if revision is None else f" of revision {revision} (the request's)"
            self._fail_child(child, RequestError(
                code, f"stage {task.stage!r} has no live replica{of}", task.stage))
            return
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            self._fail_child(child, RequestError("deadline", "request deadline passed",
                                                 task.stage))
            return
        if request.req.timeout_s is None:
            # No deadline of the client's own: the stage's default applies to this stage, within
            # the orchestrator's bound on the whole request.
            remaining = min(remaining, self.default_deadlines[task.stage])
        out = None if task.companion else child.streams.get(task.stage)
        window = out.window if out is not None else None
        if not task.companion and task.stage in request.to_client:
            window = self.streaming[task.stage].window
        params = self._params(task)
        if task.fed is not None:
            params.pop("prompt", None)  # the fed chunks bring the input
        submit = p.Submit(id=task.wire_id, params=params, timeout_s=remaining,
                          incarnation=replica.incarnation, shm=replica.channel.borrower,
                          chunk_window=window,
                          fed=task.fed is not None, revision=revision,
                          **self._revision_fields(task))
        try:
            replica.channel.send(submit, {} if task.fed is not None else self._tensors(task))
            if task.fed is not None:  # a resent downstream gets every chunk so far again
                for chunk in task.fed.chunks:
                    self._feed(task, chunk, replica)
                if task.fed.ended:
                    self._feed(task, None, replica)
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

    def _revision_fields(self, task: _Task) -> dict[str, dict[str, str]]:
        """Submit's upstream_revisions (what the request's pins expect of each producer whose
        payload the task brings) and payload_revisions (the stamps of the results attached; a
        fed task's chunks carry theirs in each feed). A companion brings no payload."""
        if task.companion:
            return {}
        child, pins = task.child, task.child.request.pins
        ins = self.inputs[task.stage]
        expected = {up: rev for up in ins if (rev := pins.get(up)) is not None}
        stamps: dict[str, str] = {}
        if task.fed is None:
            for up in ins:
                done, neg = child.done.get(up), child.companion_done.get(up)
                if done is not None and done.header.revision is not None:
                    stamps[up] = done.header.revision
                if neg is not None and neg.header.revision is not None:
                    stamps[f"{up}/neg"] = neg.header.revision
        return {"upstream_revisions": expected, "payload_revisions": stamps}

    def _params(self, task: _Task) -> dict[str, Any]:
        request, child = task.child.request, task.child
        req = request.req
        params = req.stage_params(task.stage)
        if req.n > 1:
            params["seed"] = int(params.get("seed", 0)) + child.index
        row = self.rows[task.stage]
        ins = self.inputs[task.stage]
        takes_text = Payload.TEXT in row.consumes
        if task.companion:
            params["prompt"] = req.negative_prompt
        elif ins and takes_text:
            upstream = child.done[ins[0]].header.text if ins[0] in child.done else None
            params["prompt"] = req.prompt if upstream is None else upstream
        elif takes_text:
            params["prompt"] = req.prompt
        if self._feeds_hidden_states(task.stage, request.order):
            params["return_hidden_states"] = True  # a stage of this request conditions on them
        final = task.stage in request.finals and not task.companion
        # Streamed deltas are text: only a stage that emits text streams.
        params["stream"] = req.stream and final and Payload.TEXT in row.emits
        shown = None if task.companion else child.shown.get(task.stage)
        if shown is not None and (shown.token_ids or shown.text):
            # A failover of a stream the client already saw part of: go on from there.
            params["resume_token_ids"] = list(shown.token_ids)
            params["resume_text"] = shown.text
        return params

    def _tensors(self, task: _Task) -> dict[str, Any]:
        """Upstream outputs become inputs: the first input's tensors as they are, others by name."""
        child = task.child
        if task.companion:
            return {}
        ins = self.inputs[task.stage]
        row = self.rows[task.stage]
        # A stage that consumes hidden states gets them as its conditioning.
        conditioned = Payload.HIDDEN_STATES in row.consumes
        tensors: dict[str, Any] = {}
        if not ins:  # an entry stage gets the request's media of the payloads it consumes
            media = {f"input_{pl.value}." for pl in (Payload.IMAGE, Payload.AUDIO)
                     if pl in row.consumes}
            tensors.update({name: t for name, t in child.request.req.tensors.items()
                            if name[:name.find(".") + 1] in media})
        for i, upstream in enumerate(ins):
            for name, wt in child.done[upstream].tensors.items():
                if conditioned and name == "hidden_states":
                    name = "encoder_hidden_states" if i == 0 else f"{upstream}.{name}"
                elif i:
                    name = f"{upstream}.{name}"
                tensors[name] = wt
            neg = child.companion_done.get(upstream)
            if neg is not None and "hidden_states" in neg.tensors and conditioned:
                tensors["negative_encoder_hidden_states"] = neg.tensors["hidden_states"]
        return tensors

    # ---- hold and wake (a stage at zero replicas) -------------------------------------------

    def _cannot_hold(self, stage: str, deadline: float) -> RequestError | None:
        """Why a request that needs this stage at zero is refused now (503 with Retry-After),
        or None: its hold queue is full, or the stage's last measured start-up cannot end
        before the request's deadline."""
        now = time.monotonic()
        wake = self.wakes.get(stage)
        startup = self.startup_s.get(stage)
        ready_at = None if startup is None else (wake.since if wake else now) + startup
        retry = max(1.0, ready_at - now) if ready_at is not None else 1.0
        limit = self.autoscaling[stage].hold_queue
        if len(self.holds[stage]) >= limit:
            return RequestError(
                "no_replica", f"stage {stage!r} is at zero replicas and its hold queue is full "
                f"({limit} requests wait for it to start); retry later", stage, retry_after=retry)
        if ready_at is not None and ready_at > deadline:
            return RequestError(
                "no_replica", f"stage {stage!r} is at zero replicas and takes about "
                f"{startup:.1f}s to start, past the request's deadline "
                f"({max(0.0, deadline - now):.1f}s left)", stage, retry_after=retry)
        return None

    def _hold(self, task: _Task) -> None:
        """Keep a task for a stage at zero until a replica is routable (FIFO, bounded); its
        request's deadline and aborts still apply (the task counts as running)."""
        child = task.child
        refusal = self._cannot_hold(task.stage, child.request.deadline)
        if refusal is not None:
            self._fail_child(child, refusal)
            return
        task.tried.clear()  # a replica that comes back under the same name is a new process
        self._park(task)
        self._wake(task.stage)

    def _hold_for_revision(self, task: _Task) -> None:
        """Keep a task whose pinned revision has a replica on its way (a release or a revert
        brings it up) until it is routable, instead of failing it while replicas of another
        revision serve; its request's deadline and aborts still apply. Nothing is woken."""
        self._park(task)
        self.revision_holds += 1

    def _park(self, task: _Task, at: int | None = None) -> None:
        """Queue a task in its stage's hold queue (FIFO; `at`: at that place instead of the
        end); it counts as running, so its request's deadline timer and aborts still reach it
        (_detach takes it out)."""
        task.replica = None
        held = self.holds.setdefault(task.stage, deque())
        if at is None:
            held.append(task)
        else:
            held.insert(at, task)
        task.child.running[(task.stage, task.companion)] = task

    def _wake(self, stage: str) -> None:
        """Ask the waker to start a replica of a stage at zero (at most once per
        WAKE_INTERVAL_S); the stage counts as waking until one is routable."""
        now = time.monotonic()
        wake = self.wakes.setdefault(stage, _Wake(now))
        if wake.asked is not None and now - wake.asked < WAKE_INTERVAL_S:
            return
        wake.asked = now
        if self.waker is None:
            log.warning("stage %s is at zero replicas and nothing can wake it (no waker); "
                        "held requests wait until a replica joins or their deadline", stage)
            return
        log.info("waking stage %s (at zero replicas)", stage)
        self._in_background(self._ask(stage))

    async def _ask(self, stage: str) -> None:
        assert self.waker is not None
        try:
            await self.waker.wake(stage)
        except Exception as exc:  # held requests still end by their deadline
            log.warning("could not wake stage %s: %s", stage, exc)

    def _routable(self, stage: str) -> None:
        """A replica of the stage may have become routable: dispatch its held tasks in order."""
        pool = self.pools.get(stage)
        self._drain_soon(stage)  # room may have come, or gone with the last replica
        if pool is None or not pool.has_routable():
            return
        wake = self.wakes.pop(stage, None)
        if wake is not None:
            self.startup_s[stage] = time.monotonic() - wake.since
            log.info("stage %s woke in %.1fs; %d held request(s) go on", stage,
                     self.startup_s[stage], len(self.holds.get(stage, ())))
        held = self.holds.get(stage)
        for task in list(held or ()):  # in order; a task waits for a replica of its revision
            pinned = task.child.request.pins.get(stage)
            if held and task in held and not task.waiting and pool.has_routable(pinned):
                held.remove(task)
                self._send(task)

    # ---- the dispatch window (stage.dispatch.perReplica) --------------------------------------
    #
    # Why: a task queued in a replica's admission queue is lost with it, and its retry queues
    # again at the tail of a survivor's queue. With a window, at most perReplica tasks are on
    # each replica (running and queued there); the rest wait here in the stage's hold queue
    # (the one held tasks use, so deadlines, aborts and GET /v1/load's `held` cover them), in
    # order, and a retried task goes to the front. Room comes when a task leaves a replica
    # (_detach: an end, an abort, a lost replica's tasks) and when a replica becomes routable
    # (_routable, which also runs when one stops being routable): a drain (a loop turn later,
    # coalesced, so never inside another operation) then sends waiting tasks in order while
    # there is room. Until it ran, a new task waits behind them (FIFO). A waiting task only
    # waits for a replica that is full, so one of its tasks ends and drains again: none is
    # stranded.

    def _window(self, task: _Task) -> int | None:
        """The task's dispatch window per replica; None: none (a session's task goes to its
        replica, as without one)."""
        if task.child.request.req.session is not None:
            return None
        return self.windows.get(task.stage)

    def _wait_for_room(self, task: _Task) -> bool:
        """Whether the task waits for a free slot (queued, True) instead of going now."""
        limit = self._window(task)
        if limit is None or task is self._dispatching:
            return False
        revision = task.child.request.pins.get(task.stage)
        candidates = self.pools[task.stage].routable(task.tried, revision)
        if not candidates:
            return False  # no replica to wait for: _send's own rules (hold, or fail)
        retry = bool(task.tried)  # after a lost replica or a refusal: its request is older
        if _room(candidates, limit) and (retry or task.stage not in self._drains):
            return False
        at = None
        if retry:  # to the front, behind the retries needed before it
            at = 0
            for other in self.holds.get(task.stage, ()):
                if not (other.waiting and other.tried and other.needed_at <= task.needed_at):
                    break
                at += 1
        self._park(task, at)
        task.waiting = True
        return True

    def _pick(self, task: _Task, revision: str | None) -> Replica | None:
        """The replica for a task: with a window, only among those with a free slot."""
        pool, limit = self.pools[task.stage], self._window(task)
        if limit is None:
            return pool.pick(task.child.request.req.session, exclude=task.tried,
                             revision=revision)
        candidates = pool.routable(task.tried, revision)
        room = _room(candidates, limit)
        full = {r.name for r in candidates if r not in room}
        return pool.pick(None, exclude=task.tried | full, revision=revision)

    def _drain_soon(self, stage: str) -> None:
        """Drain a windowed stage's waiting tasks on the next loop turn (once per turn)."""
        if stage not in self.windows or stage in self._drains:
            return
        if not any(t.waiting for t in self.holds.get(stage, ())):
            return
        self._drains.add(stage)
        asyncio.get_running_loop().call_soon(self._drain, stage)

    def _drain(self, stage: str) -> None:
        """Send a stage's waiting tasks, in order, each one a replica it may go to has room
        for; one that no replica may take any more (they left) goes through _send's own
        rules (held for a replica on its way, or failed), so none is stranded."""
        self._drains.discard(stage)
        held, limit, pool = self.holds.get(stage), self.windows[stage], self.pools[stage]
        for task in list(held or ()):
            if not task.waiting or task.child.running.get((stage, task.companion)) is not task:
                continue
            candidates = pool.routable(task.tried, task.child.request.pins.get(stage))
            if candidates and not _room(candidates, limit):
                continue
            with contextlib.suppress(ValueError):
                held.remove(task)  # type: ignore[union-attr]
            task.waiting = False
            self._dispatching = task
            try:
                self._send(task)
            finally:
                self._dispatching = None

    # ---- replies ---------------------------------------------------------------------------

    def _on_message(self, replica: Replica, msg: Reply) -> None:
        replica.last_seen = time.monotonic()
        h = msg.header
        if isinstance(h, p.Pong):
            return self._on_pong(replica, h)
        if isinstance(h, p.HelloReply) or (isinstance(h, p.Error) and h.id is None
                                           and h.cid is None):
            return self._on_hello(replica, h)
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
            self._on_delta(task, h)
        elif isinstance(h, p.Chunk):
            self._on_chunk(task, msg)
        elif isinstance(h, p.Credit):
            self._on_credit(task, h)
        elif isinstance(h, p.TERMINAL_REPLIES):
            self._on_terminal(task, msg)
        else:
            self.counters["late_messages"] += 1
            self._release(msg)

    def _on_delta(self, task: _Task, h: p.Delta) -> None:
        child = task.child
        if child.outcome is not None or task.companion:
            self.counters["late_messages"] += 1
            return
        shown = child.shown.setdefault(task.stage, _Shown())
        shown.token_ids.extend(h.token_ids)
        shown.text += h.text
        child.request.queue.put_nowait(Delta(child.index, task.stage, h.text, h.token_ids))

    # ---- streaming between stages ----------------------------------------------------------

    def _on_chunk(self, task: _Task, msg: Reply) -> None:
        """An upstream's chunk: the first one starts its downstream (fed); each is fed to the
        replica the downstream is bound to. Never to a terminal or aborting child."""
        child = task.child
        if not task.companion and task.stage in child.request.to_client:
            self._chunk_to_client(task, msg)
            return
        stream = None if task.companion else child.streams.get(task.stage)
        if child.outcome is not None or child.abort_requested or stream is None or stream.ended:
            self.counters["late_messages"] += 1
            self._release(msg)
            return
        if msg.tensors:
            child.request.held.append(msg)  # its blocks go back when the request ends
        stream.chunks.append(msg)
        if (stream.downstream, False) not in child.started:
            self._start(child, stream.downstream, False, fed=stream)  # feeds what came so far
            return
        down = child.running.get((stream.downstream, False))
        if down is not None and down.replica is not None:
            self._feed(down, msg, down.replica)

    def _chunk_to_client(self, task: _Task, msg: Reply) -> None:
        """A final stage's chunk for a streaming client: an AudioChunk event holding a copy of
        its audio (its blocks go back at once); never to a terminal or aborting child."""
        child, h = task.child, msg.header
        assert isinstance(h, p.Chunk)
        audio = msg.tensors.get("audio")
        rate = msg.tensors.get("sample_rate")
        if child.outcome is not None or child.abort_requested:
            self.counters["late_messages"] += 1
            self._release(msg)
            return
        if audio is None:  # nothing for the client: credit it at once, so the stage goes on
            self._release(msg)
            self._client_credit(task, h.seq)
            return
        sample_rate = None
        try:
            with contextlib.suppress(ValueError, TypeError, IndexError, KeyError):
                sample_rate = int(rate.numpy().reshape(-1)[0]) if rate is not None else None
            audio = audio.detached()
        finally:
            self._release(msg)
        child.shown.setdefault(task.stage, _Shown()).audio_chunks += 1
        child.request.queue.put_nowait(AudioChunk(
            child.index, task.stage, h.seq, audio, sample_rate,
            partial(self._client_credit, task, h.seq)))

    def _client_credit(self, task: _Task, seq: int) -> None:
        """The client took a final stage's chunks up to seq: open the stage's window."""
        if self.tasks.get(task.wire_id) is not task or task.replica is None:
            return  # it ended (or was detached) meanwhile: nothing waits for the credit
        with contextlib.suppress(Exception):  # a lost replica fails the child anyway
            task.replica.channel.send(p.Credit(id=task.wire_id, seq=seq,
                                               incarnation=task.incarnation))

    def _feed(self, task: _Task, chunk: Reply | None, replica: Replica) -> None:
        """Send one chunk (None: the end of the input) to a fed task's replica."""
        assert task.fed is not None
        if chunk is None:
            header = p.Feed(id=task.wire_id, seq=len(task.fed.chunks) + 1, last=True,
                            incarnation=replica.incarnation)
            replica.channel.send(header)
            return
        h = chunk.header
        assert isinstance(h, p.Chunk)
        replica.channel.send(p.Feed(id=task.wire_id, seq=h.seq, text=h.text,
                                    incarnation=replica.incarnation, revision=h.revision),
                             chunk.tensors)

    def _end_stream(self, child: _Child, upstream: str) -> None:
        """The upstream finished: its fed downstream (if it started) gets the end of input.
        If no chunk came, the downstream has not started: _advance starts it whole."""
        stream = child.streams.get(upstream)
        if stream is None:
            return
        stream.ended = True
        down = child.running.get((stream.downstream, False))
        if down is not None and down.fed is stream and down.replica is not None:
            try:
                self._feed(down, None, down.replica)
            except Exception as exc:
                self._fail_child(child, RequestError(
                    "stage_failed", f"could not send to {down.replica.name}: {exc}",
                    down.stage))

    def _on_credit(self, task: _Task, h: p.Credit) -> None:
        """A fed downstream took chunks: open the upstream's window by as many."""
        stream = task.fed
        if stream is None or task.child.outcome is not None:
            self.counters["late_messages"] += 1
            return
        if h.seq <= stream.acked:
            return
        stream.acked = h.seq
        up = task.child.running.get((stream.upstream, False))
        if up is not None and up.replica is not None:
            with contextlib.suppress(Exception):  # a lost upstream fails the child anyway
                up.replica.channel.send(p.Credit(id=up.wire_id, seq=h.seq,
                                                 incarnation=up.incarnation))

    def _on_terminal(self, task: _Task, msg: Reply) -> None:
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
                        child.outputs[stage] = self._output(task, msg, replica)
                    self._end_stream(child, stage)
                self._advance(child)
            case p.Aborted(text=text):
                child.aborted = True
                child.abort_requested = True
                if not task.companion and stage in child.request.finals and text is not None:
                    child.outputs[stage] = self._output(task, msg, replica)
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
                if replica is not None and replica.incarnation == task.incarnation:
                    self._restarted(replica, "refused a request for its previous incarnation")
                    replica.channel.hello()
                if child.abort_requested:
                    child.aborted = True
                    self._settle(child)
                    return
                if self._failover(task, replica.name if replica else "", "restarted"):
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

    def _output(self, task: _Task, msg: Reply, replica: Replica | None) -> StageOutput:
        """A final stage's result: the outcome fields the executor set, and its tensors (in
        memory of their own: shared-memory blocks go back when the request ends)."""
        h = msg.header
        fields = {f: v for f in p.RESULT_FIELDS if (v := getattr(h, f)) is not None}
        tensors = {name: wt.detached() for name, wt in msg.tensors.items()}
        return StageOutput(task.stage, fields, tensors, replica.name if replica else "")

    def _release(self, *msgs: Reply) -> None:
        """Give the shared-memory blocks these replies carry back to their workers."""
        if self.shm is not None:
            for msg in msgs:
                self.shm.release(msg)

    def _detach(self, task: _Task) -> None:
        self.tasks.pop(task.wire_id, None)
        task.child.running.pop((task.stage, task.companion), None)
        if task.replica is None and task.stage in self.holds:
            with contextlib.suppress(ValueError):  # held: it leaves the queue
                self.holds[task.stage].remove(task)
        if task.replica is not None:
            task.replica.bound.discard(task)
            task.replica.inflight = max(0, task.replica.inflight - 1)
            self._drain_soon(task.stage)  # a slot of its dispatch window freed

    # ---- terminal states -------------------------------------------------------------------

    def _settle(self, child: _Child) -> None:
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

    def _fail_child(self, child: _Child, error: RequestError) -> None:
        if child.outcome is not None:
            return
        for task in list(child.running.values()):
            self._detach(task)
            if task.replica is not None and task.replica.alive:
                with contextlib.suppress(Exception):
                    task.replica.channel.send(p.Abort(id=task.wire_id,
                                                      incarnation=task.incarnation))
        child.outcome = ChildOutcome(child.index, error.kind, dict(child.outputs), error)  # type: ignore[arg-type]
        self._child_terminal(child)

    def _child_terminal(self, child: _Child) -> None:
        request = child.request
        if request.outcome is not None or any(c.outcome is None for c in request.children):
            return
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
        self._emit_outcome(request, Outcome(request.id, status, outcomes, error))

    def _finish_early(self, request: _Request, error: RequestError) -> None:
        self._emit_outcome(request, Outcome(request.id, error.kind, [], error))  # type: ignore[arg-type]

    def _emit_outcome(self, request: _Request, outcome: Outcome) -> None:
        request.outcome = outcome
        self._unpin(request)
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

    def _unpin(self, request: _Request) -> None:
        """Its terminal outcome: it no longer holds its revisions (once, whatever the path)."""
        counted, request.counted = request.counted, ()
        for key in counted:
            left = self.pinned.get(key, 0) - 1
            if left > 0:
                self.pinned[key] = left
            else:
                self.pinned.pop(key, None)

    def _on_deadline(self, request: _Request) -> None:
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
                    with contextlib.suppress(Exception):
                        task.replica.channel.send(p.Abort(id=task.wire_id,
                                                          incarnation=task.incarnation))

    # ---- control RPCs ----------------------------------------------------------------------

    async def control(
        self, op: str, stages: list[str] | None = None, timeout: float = 60.0
    ) -> dict[str, dict[str, Any]]:
        """Fan a control RPC out to every live replica of the chosen stages.

        Unknown ops and stage names are rejected before anything is sent; a worker exception
        is raised here (ControlError) after every replica has answered.
        """
        if op not in p.PIPELINE_CONTROL_OPS:
            raise ValueError(f"op: unknown control op {op!r}; "
                             f"expected one of {list(p.PIPELINE_CONTROL_OPS)}")
        names = list(stages) if stages else list(self.pools)
        unknown = [s for s in names if s not in self.pools]
        if unknown:
            raise ValueError(f"stages: unknown stage(s) {unknown}; pipeline has {list(self.pools)}")
        replicas = [r for s in names for r in self.pools[s].replicas.values() if r.alive]
        results = await asyncio.gather(
            *(r.channel.control(op, timeout) for r in replicas), return_exceptions=True
        )
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return {r.name: res for r, res in zip(replicas, results, strict=True)}  # type: ignore[misc]

    # ---- introspection ---------------------------------------------------------------------

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
                held=len(self.holds.get(stage, ())), wake_pending=stage in self.wakes)
            counts = count_revisions(pool.replicas.values())
            top = newest(counts)
            if counts:
                revisions[stage] = {
                    rev: RevisionLoad(order=c.order, newest=rev == top, replicas=c.replicas,
                                      routable=c.routable,
                                      pinned=self.pinned.get((stage, rev), 0))
                    for rev, c in counts.items()}
        return PipelineLoad(window_s=self.load_tracker.window_s, now=self.load_tracker.wall(),
                            stages=stages, revisions=revisions)

    def status(self) -> dict[str, Any]:
        return {
            stage: [
                {"name": r.name, "endpoint": r.info.endpoint, "state": r.info.state,
                 "inflight": r.inflight, "served": r.served, "incarnation": r.incarnation,
                 "refused": r.refused}
                for r in pool.replicas.values()
            ]
            for stage, pool in self.pools.items()
        }


def _room(replicas: Iterable[Replica], limit: int) -> list[Replica]:
    """The replicas with a free slot of a dispatch window of `limit` tasks each."""
    return [r for r in replicas if r.inflight < limit]
