"""One replica of one stage: a ZMQ ROUTER in front of admission control and an executor.

The event loop only moves messages; model work runs on the SerialScheduler's worker thread.
Every submit gets exactly one terminal reply (see protocol.TERMINAL_REPLIES).

Given a shared-memory directory ($OMNISTAGE_SHM_DIR), the worker owns a segment there: it reads
clients' tensors in place and lends its large outputs to clients that offered theirs (see
omnistage.shm).

StageWorker owns the socket, the lifecycle (load, drain), the in-flight table and each
request's run to its terminal reply. Its collaborators, each with its own state: `Intake`
(worker/intake.py: a submit admitted or refused), `ChunkStreams` (worker/streams.py: deltas,
chunks, feeds, credits, lending), `ControlPlane` (worker/control.py: hello and the control
RPCs) and `Replies` (worker/replies.py: sends, reply counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import zmq

from omnistage import kube
from omnistage import protocol as p
from omnistage.admission import (
    BoundedAdmission,
    DeadlineExceeded,
    ExecutionCancelled,
    ExecutionContext,
    Overloaded,
    SerialScheduler,
)
from omnistage.batching import BatchScheduler, Emit
from omnistage.curve import CurveKeyring, PeerGate, keyring_from_env
from omnistage.executors import (
    BadRequest,
    BatchExecutor,
    Executor,
    Outcome,
    create_executor,
    executor_class,
)
from omnistage.executors.prefix_cache import PrefixStats
from omnistage.kinds import get as get_kind
from omnistage.metrics import new_registry
from omnistage.revision import worker_revision
from omnistage.shm import SegmentManager, ShmConfig, WaitCancelled, start_segment_manager
from omnistage.sideport import start_side_port
from omnistage.spec import Stage
from omnistage.worker.config import WorkerConfig
from omnistage.worker.control import ControlPlane
from omnistage.worker.intake import Intake
from omnistage.worker.metrics import WorkerCollector
from omnistage.worker.replies import Replies
from omnistage.worker.request import Request
from omnistage.worker.streams import ChunkStreams
from omnistage.zmqio import LoopSocket

log = logging.getLogger("omnistage.worker")


class StageWorker:
    """One replica: the socket, the lifecycle and each admitted request's run to its one
    terminal reply; intake, chunk streams, control and replies are its collaborators."""

    def __init__(
        self, cfg: WorkerConfig, executor: Executor | None = None,
        shm: ShmConfig | None = None,
        curve: CurveKeyring | None = None,
    ) -> None:
        """curve: the pipeline's CurveZMQ keys (default: $OMNISTAGE_CURVE_KEYS at generation
        $OMNISTAGE_CURVE_GENERATION, else none); with them only a peer holding a pair of the
        pipeline's (any generation in the key directory) is heard (omnistage.curve)."""
        self.cfg = cfg
        self.shm_config = shm if shm is not None else ShmConfig.from_env()
        self.curve = curve if curve is not None else keyring_from_env()
        self.gate: PeerGate | None = None
        self.shm: SegmentManager | None = None
        self.executor = executor
        # The only place the worker reads its stage's settings.
        stage = cfg.stage
        self.admission = BoundedAdmission(stage.admission.max_requests, stage.admission.max_cost)
        self.scheduler = new_scheduler(stage, executor)
        # What this replica stamps on its outputs and checks submits and fed chunks against.
        self.revision = worker_revision(stage)  # with its image and resolved hub commit
        self.drain_timeout = float(stage.drain_timeout_seconds)
        self.requests: dict[tuple[bytes, str], Request] = {}
        self.loaded = False
        self.load_error: str | None = None
        self.draining = False
        self.counters: dict[str, int] = {
            "admitted": 0,
            "rejected_budget": 0,
            "rejected_queue": 0,
            "rejected_draining": 0,
            "malformed": 0,
            "late_aborts": 0,
            "stale_messages": 0,
            "late_feeds": 0,  # feeds and credits for a request no longer (or never) here
            "chunks_sent": 0,
            "chunks_fed": 0,
            "window_waits": 0,  # emit_chunk calls that waited for credit (back-pressure)
            "chunks_outstanding_peak": 0,  # the most chunks of one request out at once
            "revision_refusals": 0,  # submits and fed chunks of another revision, refused
        }
        self.incarnation = uuid.uuid4().hex  # this process: a restart at the same address differs
        self.replies = Replies()
        self.streams = ChunkStreams(revision=self.revision, replies=self.replies,
                                    counters=self.counters)
        self.intake = Intake(
            cfg, incarnation=self.incarnation, revision=self.revision, admission=self.admission,
            default_deadline=stage.admission.default_deadline_seconds, requests=self.requests,
            counters=self.counters, replies=self.replies, streams=self.streams)
        self.control_plane = ControlPlane(
            cfg, incarnation=self.incarnation, revision=self.revision, scheduler=self.scheduler,
            replies=self.replies, in_flight=self.requests, executor=lambda: self.executor,
            drain=self.begin_drain, snapshot=self.snapshot)
        self.registry = new_registry(WorkerCollector(
            stage=cfg.stage.name, replica=cfg.replica_id, ready=lambda: self.ready,
            admission=self.admission, scheduler=self.scheduler, requests=self.requests,
            counters=self.counters, outcomes=self.replies.outcomes,
            refused=lambda: self.gate.refused if self.gate is not None else {},
            prefix=self._prefix_stats))
        self._exit = asyncio.Event()
        self._quiet = asyncio.Event()  # set whenever a request or task finishes
        self._tasks: set[asyncio.Task[Any]] = set()
        self.zmq_endpoint = ""
        self.http_url = ""

    # ---- lifecycle -----------------------------------------------------------------------

    async def serve(self) -> int:
        """Run until drained; returns the process exit code."""
        loop = asyncio.get_running_loop()
        zctx = zmq.Context()
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if self.curve is not None:  # before bind: no connection may come before its gate
            self.gate = PeerGate(zctx, self.sock, self.curve, loop)
        if self.cfg.port:
            self.sock.bind(f"tcp://{self.cfg.host}:{self.cfg.port}")
        else:
            self.sock.bind_to_random_port(f"tcp://{self.cfg.host}")
        # Read and written from the loop directly (zmqio: no futures on the request path).
        self.io = LoopSocket(self.sock.underlying, self._on_readable, loop)
        self.replies.io = self.io
        self.zmq_endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ipc_endpoint = ""
        if self.cfg.ipc:
            self.sock.bind(f"ipc://{self.cfg.ipc}")
            self.ipc_endpoint = f"ipc://{self.cfg.ipc}"
        runner, self.http_url = await start_side_port(
            self.cfg.host, self.cfg.http_port, readiness=self.readiness, registry=self.registry,
            state=self.state)
        if self.shm_config is not None:  # last: from here on the finally below closes it
            self.shm = start_segment_manager(self.shm_config)
            self.streams.shm = self.control_plane.shm = self.shm
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain, f"signal {sig.name}")
        self._write_port_file()
        log.info("replica %s of stage %s (%s) zmq=%s (%s) http=%s", self.cfg.replica_id,
                 self.cfg.stage.name, self.cfg.stage.kind, self.zmq_endpoint,
                 "CurveZMQ: the pipeline's key only" if self.gate else "plain: no CurveZMQ",
                 self.http_url)
        load = asyncio.create_task(self._load())
        self.io.read_soon()  # anything that came before the reader was watching
        try:
            await self._exit.wait()
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await load
            await runner.cleanup()
            self.io.close()
            if self.gate is not None:
                self.gate.close()
            self.sock.close(linger=2000)
            zctx.term()
            self.scheduler.close()
            if self.cfg.ipc:  # ZMQ leaves the socket file of a named ipc endpoint
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.cfg.ipc)
            if self.shm is not None:
                self.shm.close()
        log.info("replica %s exited after drain", self.cfg.replica_id)
        if self.load_error:
            # The last line is the pod's termination message: the operator reports it.
            stage = self.cfg.stage
            print(f"model load failed: stage {stage.name!r}, model {stage.model!r}: "
                  f"{self.load_error}", file=sys.stderr, flush=True)
            return kube.MODEL_FAILED_EXIT
        return 0

    def _write_port_file(self) -> None:
        if not self.cfg.port_file:
            return
        path = Path(self.cfg.port_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"zmq": self.zmq_endpoint, "ipc": self.ipc_endpoint,
                                   "http": self.http_url, "pid": os.getpid()}))
        tmp.replace(path)

    async def _load(self) -> None:
        try:
            t0 = time.monotonic()
            await asyncio.to_thread(self._load_blocking)
            self.loaded = True
            log.info("model loaded and warmed up in %.2fs", time.monotonic() - t0)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed: %s\n%s", self.load_error, traceback.format_exc())
            self._exit.set()

    def _prefix_stats(self) -> PrefixStats | None:
        """The executor's prefix-cache counters, for /metrics (None: none, or not made yet)."""
        return None if self.executor is None else self.executor.prefix_stats()

    def _load_blocking(self) -> None:
        """Import, load and warm up off the event loop, so /livez answers meanwhile."""
        if self.executor is None:
            device = None
            # A kind without a model (echo) never imports torch: it starts in ms.
            if get_kind(self.cfg.stage.kind).needs_model:
                from omnistage.devices import configure_threads, select_device

                configure_threads()
                device = select_device(self.cfg.device)
            self.executor = create_executor(self.cfg.stage, device)
        self.executor.load()
        self.executor.warmup()

    def begin_drain(self, reason: str = "drain") -> None:
        """Stop admitting; exit once in-flight work is done. Safe to call repeatedly."""
        if self.draining:
            log.info("already draining (%s ignored)", reason)
            return
        self.draining = True
        log.info("draining (%s): %d in flight", reason, len(self.requests))
        if self.control_plane.asleep:  # no model to finish queued work with: cut it now
            self._cut_all("it was asleep when its drain began, with no model to run it")
        self.scheduler.resume()  # admitted work finishes even if the replica was paused
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self._wait_idle(), self.drain_timeout)
        except TimeoutError:
            log.warning("drain timeout %.1fs: cutting %d requests", self.drain_timeout,
                        len(self.requests))
            self._cut_all(f"its drain timeout ({self.drain_timeout:g}s) passed")
            self.scheduler.resume()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_idle(), 10)
        # Let the final replies leave the socket before it closes.
        await asyncio.sleep(0.05)
        self._exit.set()

    def _cut_all(self, why: str) -> None:
        """Cancel every request in flight because this replica is going away: each ends with
        `error/drain_timeout` (not `aborted`, which answers the client's own abort), so the
        client can tell that the server cut it. A request its client already aborted stays
        an abort."""
        for req in list(self.requests.values()):
            if not req.ctx.token.cancelled:
                req.cut = why
            req.ctx.cancel()

    def _cut_reply(self, req: Request) -> p.Error:
        replica = self.cfg.replica_id
        return p.Error(code="drain_timeout", id=req.rid, replica=replica,
                       message=f"replica {replica} cut the request while draining: {req.cut}")

    async def _wait_idle(self) -> None:
        while self.requests or self._tasks:
            self._quiet.clear()
            await self._quiet.wait()
        await self.scheduler.wait_idle()

    @property
    def ready(self) -> bool:
        return self.loaded and not self.draining

    def readiness(self) -> tuple[bool, str]:
        """What /readyz answers: ready, or why not."""
        if self.ready:
            return True, "ready"
        if self.draining:
            return False, "draining"
        return False, f"load failed: {self.load_error}" if self.load_error else "loading"

    # ---- message handling ----------------------------------------------------------------

    def _on_readable(self) -> None:
        """Handle every message that arrived (zmqio.LoopSocket calls this), a batch's in order."""
        while (frames := self.io.recv()) is not None:
            ident = frames[0].bytes
            try:
                parts = p.unbatch(frames[1:])
            except p.ProtocolError as exc:
                self._malformed(ident, frames[1:], exc)
                continue
            for part in parts:
                self._receive(ident, part)

    def _receive(self, ident: bytes, frames: Any) -> None:
        try:
            msg = p.decode_request(frames, partial(self._resolve, ident) if self.shm else None)
        except p.ProtocolError as exc:
            self._malformed(ident, frames, exc)
            return
        try:
            self._dispatch(ident, msg)
        except Exception as exc:  # never let one message stop the worker
            log.exception("failed to handle %s", msg.type)
            h = msg.header
            self.replies.send(ident, p.Error(code="internal", message=str(exc),
                                             id=getattr(h, "id", None),
                                             cid=getattr(h, "cid", None),
                                             replica=self.cfg.replica_id))

    def _resolve(self, ident: bytes, desc: p.ShmTensor, nbytes: int) -> memoryview:
        """A shared-memory handle in a message from `ident`: heard only from a peer that proved
        in its hello that it shares our segment directory (with CurveZMQ, an authenticated
        one). It may name another worker's segment: an orchestrator forwards lent blocks."""
        assert self.shm is not None
        if desc.segment != self.shm.name and ident not in self.control_plane.proved_peers:
            raise p.ShmUnavailable(f"segment {desc.segment}: this peer offered no shared "
                                   "memory in its hello, so it may not name a segment")
        return self.shm.resolve(desc, nbytes)

    def _malformed(self, ident: bytes, frames: Any, exc: p.ProtocolError) -> None:
        """Answer what cannot be read with error/malformed, naming its ids when they can be
        read, so whoever waits for it is answered."""
        self.counters["malformed"] += 1
        log.warning("malformed message from %r: %s", ident, exc)
        rid, cid = p.salvage_ids(frames)
        self.replies.send(ident, p.Error(code="malformed", message=str(exc), id=rid,
                                         cid=cid, replica=self.cfg.replica_id))

    def _dispatch(self, ident: bytes, msg: p.Message[p.Request]) -> None:
        match msg.header:
            case p.Submit() as submit:
                self._submit(ident, submit, msg.tensors)
            case p.Abort(id=rid, incarnation=incarnation):
                if incarnation is not None and incarnation != self.incarnation:
                    self.counters["stale_messages"] += 1  # meant for a previous process
                    return
                req = self.requests.get((ident, rid))
                if req is None:
                    self.counters["late_aborts"] += 1
                else:
                    req.ctx.cancel()
            case p.Feed() as feed:
                req = self._streamed(ident, feed.id, feed.incarnation)
                if req is not None:
                    self.streams.feed(req, feed, msg.tensors)
            case p.Credit(id=rid, seq=seq, incarnation=incarnation):
                req = self._streamed(ident, rid, incarnation)
                if req is not None:
                    req.io.credit(seq)
            case p.Ping(cid=cid):
                self.replies.send(ident, p.Pong(cid=cid, state=self.snapshot()))
            case p.Control(cid=cid, op=op):
                self._spawn(self.control_plane.answer(ident, cid, op))
            case p.Hello(version=version, shm=probe, batches=batches):
                self.replies.batching(ident, batches)
                self.control_plane.hello(ident, version, probe)
            case p.Release(leases=leases):
                if self.shm is not None:
                    self.shm.free(leases)
            case other:  # a request type added to the union without a handler here
                raise TypeError(f"no handler for {p.tag(other)} messages")

    def _streamed(self, ident: bytes, rid: str, incarnation: str | None) -> Request | None:
        """The request a feed or credit is for, or None (counted) when it is not here: it
        ended, was refused, or was meant for a previous process."""
        if incarnation is not None and incarnation != self.incarnation:
            self.counters["stale_messages"] += 1
            return None
        req = self.requests.get((ident, rid))
        if req is None:
            self.counters["late_feeds"] += 1
        return req

    def _submit(self, ident: bytes, msg: p.Submit, tensors: dict[str, p.WireTensor]) -> None:
        """Admit through the intake; an admitted request is registered and run."""
        admitted = self.intake.submit(ident, msg, tensors,
                                      executor=self.executor if self.loaded else None,
                                      draining=self.draining)
        if admitted is None:
            return
        req, job = admitted
        self.requests[(ident, req.rid)] = req
        self._spawn(self._run(req, job))

    # ---- running an admitted request to its one terminal reply ---------------------------

    async def _run(self, req: Request, job: Any) -> None:
        rid, replica = req.rid, self.cfg.replica_id
        reply = self.replies.reply
        assert self.executor is not None
        with req.ctx.hold():
            try:
                outcome: Outcome = await self.streams.complete(
                    req, partial(self._execute, req.ctx, job, req.io))
            except (ExecutionCancelled, WaitCancelled):
                outcome = self.executor.aborted_before_start(job)
            except (DeadlineExceeded, TimeoutError) as exc:
                reply(req.ident, p.Deadline(id=rid, replica=replica,
                                            message=str(exc) or "deadline exceeded"))
                return self._finish(req)
            except Overloaded as exc:
                self.counters["rejected_queue"] += 1
                reply(req.ident, p.Overloaded(id=rid, replica=replica, retry_after=1.0,
                                              message=str(exc) or "execution queue full"))
                return self._finish(req)
            except BadRequest as exc:
                reply(req.ident, p.Error(code="bad_request", id=rid, replica=replica,
                                         message=str(exc)))
                return self._finish(req)
            except Exception as exc:
                log.exception("request %s failed", rid)
                reply(req.ident, p.Error(code="internal", id=rid, replica=replica,
                                         message=f"{type(exc).__name__}: {exc}"))
                return self._finish(req)
            if req.mismatch is not None:  # a fed chunk was refused: the output lacks it
                reply(req.ident, p.Error(code="revision_mismatch", id=rid,
                                         replica=replica, message=req.mismatch))
                return self._finish(req)
            if outcome.aborted and req.cut is not None:
                reply(req.ident, self._cut_reply(req))
                return self._finish(req)
            result = p.Aborted if outcome.aborted else p.Final
            seq = req.io.deltas
            tensors: dict[str, Any] = outcome.tensors
            try:
                if req.borrower is not None and tensors:
                    tensors = await self.streams.lend(req, tensors)
                frames = p.encode(result(id=rid, replica=replica, seq=seq + 1,
                                         queue_wait_s=req.queue_wait(), revision=self.revision,
                                         **outcome.fields),
                                  tensors, shm=req.borrower is not None)
            except TimeoutError as exc:
                reply(req.ident, p.Deadline(id=rid, replica=replica, message=str(exc)))
                return self._finish(req)
            except WaitCancelled:
                reply(req.ident, self._cut_reply(req) if req.cut is not None else
                      p.Aborted(id=rid, replica=replica, seq=seq + 1,
                                finish_reason="abort"))
                return self._finish(req)
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
                self.streams.take_back(tensors)
                log.exception("request %s: the executor's outcome cannot be sent", rid)
                reply(req.ident, p.Error(code="internal", id=rid, replica=replica,
                                         message=f"outcome cannot be encoded: {exc}"))
                return self._finish(req)
            self.replies.count(p.tag(result))
            # A reply that never leaves (the client is gone) lends nothing: take it back.
            self.replies.send_frames(req.ident, frames,
                                     on_fail=lambda: self.streams.take_back(tensors))
            self._finish(req)

    def _execute(self, ctx: ExecutionContext, job: Any, emit: Emit) -> Awaitable[Outcome]:
        """Hand one admitted request to the scheduler: into the running batch (a batching
        executor) or to run alone. Admission, deadline and cancellation stay per request."""
        executor = self.executor
        assert executor is not None
        if isinstance(self.scheduler, BatchScheduler):
            assert isinstance(executor, BatchExecutor)
            return self.scheduler.run_with_context(ctx, executor, job, emit)
        return self.scheduler.run_with_context(ctx, executor.execute, job, ctx, emit)

    def _finish(self, req: Request) -> None:
        self.requests.pop((req.ident, req.rid), None)
        self._quiet.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._quiet.set()

    # ---- state ---------------------------------------------------------------------------

    def snapshot(self) -> p.WorkerState:
        """The state that pong and control_reply carry."""
        return p.WorkerState(
            replica_id=self.cfg.replica_id,
            stage=self.cfg.stage.name,
            kind=self.cfg.stage.kind,
            incarnation=self.incarnation,
            ready=self.ready,
            loaded=self.loaded,
            draining=self.draining,
            paused=self.control_plane.paused,
            asleep=self.control_plane.asleep,
            in_flight=len(self.requests),
            queued=self.scheduler.queued,
            pid=os.getpid(),
            revision=self.revision,
        )

    def state(self) -> dict[str, Any]:
        """The same state as plain builtins, for the HTTP side port's /state (plus the
        shared-memory segment's figures when there is one)."""
        state = msgspec.structs.asdict(self.snapshot())
        state["chunks"] = self.streams.stats(self.requests.values())
        state["revision_refusals"] = self.counters["revision_refusals"]
        if self.shm is not None:
            state["shm"] = {"segment": self.shm.name, **self.shm.stats()}
        return state


def new_scheduler(
    stage: Stage, executor: Executor | None = None
) -> SerialScheduler | BatchScheduler:
    """A BatchScheduler when the stage's executor batches and engine.maxBatchSize > 1, else a
    SerialScheduler (echo, or batching turned off): either way maxQueue bounds what waits."""
    cls = type(executor) if executor is not None else executor_class(stage.kind)
    engine, queue = stage.engine, stage.admission.max_queue
    if issubclass(cls, BatchExecutor) and engine.max_batch_size > 1:
        return BatchScheduler(max_size=engine.max_batch_size,
                              max_tokens=engine.max_batch_tokens, max_pending=queue)
    return SerialScheduler(max_pending=queue)
