"""One replica of one stage: a ZMQ ROUTER in front of admission control and an executor.

The event loop only moves messages; model work runs on the SerialScheduler's worker thread.
Every submit gets exactly one terminal reply (see protocol.TERMINAL_REPLIES).

Given a shared-memory directory ($OMNISTAGE_SHM_DIR), the worker owns a segment there: it reads
clients' tensors in place and lends its large outputs to clients that offered theirs (see
omnistage.shm).
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

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
from omnistage.executors import (
    BadRequest,
    BatchExecutor,
    Executor,
    Outcome,
    create_executor,
    executor_class,
)
from omnistage.executors.base import InputChunk, StageIO
from omnistage.kinds import get as get_kind
from omnistage.metrics import new_registry
from omnistage.revision import stage_revision
from omnistage.shm import SegmentManager, ShmConfig, WaitCancelled, start_segment_manager
from omnistage.sideport import start_side_port
from omnistage.spec import Stage
from omnistage.worker.config import WorkerConfig
from omnistage.worker.metrics import WorkerCollector

log = logging.getLogger("omnistage.worker")


@dataclass
class _Request:
    ident: bytes
    rid: str
    ctx: ExecutionContext
    borrower: str | None = None  # the client's segment: outputs may be lent to it
    cut: str | None = None  # why the replica itself cancelled it (a drain), if it did
    io: StageIO = field(default_factory=StageIO)
    # Streamed output: chunks wait here (in order) to be lent and sent by one task per request.
    outbox: asyncio.Queue[tuple[int, str | None, dict[str, Any]] | None] | None = None
    sender: asyncio.Task[None] | None = None
    chunk_error: BaseException | None = None  # why a chunk could not be sent
    admitted_at: float = 0.0  # time.monotonic() at admission: the queue wait counts from here
    # Revisions a fed chunk may be stamped with (submit.upstream_revisions); empty: no check.
    fed_revisions: frozenset[str] = frozenset()
    mismatch: str | None = None  # why a fed chunk was refused (error/revision_mismatch)

    def queue_wait(self) -> float | None:
        """Seconds the request waited in the admission queue before its executor took it
        (what the first output and the final reply report); None if it never started."""
        started = self.ctx.started_at
        return None if started is None else max(0.0, started - self.admitted_at)


class StageWorker:
    def __init__(
        self, cfg: WorkerConfig, executor: Executor | None = None,
        shm: ShmConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.shm_config = shm if shm is not None else ShmConfig.from_env()
        self.shm: SegmentManager | None = None
        self.executor = executor
        # The only place the worker reads its stage's settings.
        stage = cfg.stage
        self.admission = BoundedAdmission(stage.admission.max_requests, stage.admission.max_cost)
        self.scheduler = new_scheduler(stage, executor)
        self.default_deadline = stage.admission.default_deadline_seconds
        # What this replica stamps on its outputs and checks submits and fed chunks against.
        self.revision = stage_revision(stage)
        self.drain_timeout = float(stage.drain_timeout_seconds)
        self.requests: dict[tuple[bytes, str], _Request] = {}
        self.loaded = False
        self.load_error: str | None = None
        self.draining = False
        self.paused = False
        self.asleep = False
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
        self.outcomes: dict[str, int] = {}
        self.registry = new_registry(WorkerCollector(
            stage=cfg.stage.name, replica=cfg.replica_id, ready=lambda: self.ready,
            admission=self.admission, scheduler=self.scheduler, requests=self.requests,
            counters=self.counters, outcomes=self.outcomes))
        self._exit = asyncio.Event()
        self._quiet = asyncio.Event()  # set whenever a request or task finishes
        self._tasks: set[asyncio.Task[Any]] = set()
        self.zmq_endpoint = ""
        self.http_url = ""
        self.incarnation = uuid.uuid4().hex  # this process: a restart at the same address differs

    # ---- lifecycle -----------------------------------------------------------------------

    async def serve(self) -> int:
        """Run until drained; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        zctx = zmq.asyncio.Context()
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if self.cfg.port:
            self.sock.bind(f"tcp://{self.cfg.host}:{self.cfg.port}")
        else:
            self.sock.bind_to_random_port(f"tcp://{self.cfg.host}")
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
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain, f"signal {sig.name}")
        self._write_port_file()
        log.info("replica %s of stage %s (%s) zmq=%s http=%s", self.cfg.replica_id,
                 self.cfg.stage.name, self.cfg.stage.kind, self.zmq_endpoint, self.http_url)
        recv = asyncio.create_task(self._recv_loop())
        load = asyncio.create_task(self._load())
        try:
            await self._exit.wait()
        finally:
            recv.cancel()
            load.cancel()
            for t in (recv, load):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await runner.cleanup()
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
        if self.asleep:  # no model to finish queued work with: cut it now
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

    def _cut_reply(self, req: _Request) -> p.Error:
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

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg = p.decode_request(frames[1:], self.shm.resolve if self.shm else None)
            except p.ProtocolError as exc:
                self.counters["malformed"] += 1
                log.warning("malformed message from %r: %s", ident, exc)
                rid, cid = p.salvage_ids(frames[1:])
                self._send(ident, p.Error(code="malformed", message=str(exc), id=rid, cid=cid,
                                          replica=self.cfg.replica_id))
                continue
            try:
                self._dispatch(ident, msg)
            except Exception as exc:  # never let one message stop the worker
                log.exception("failed to handle %s", msg.type)
                h = msg.header
                self._send(ident, p.Error(code="internal", message=str(exc),
                                          id=getattr(h, "id", None), cid=getattr(h, "cid", None),
                                          replica=self.cfg.replica_id))

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
                self._feed(ident, feed, msg.tensors)
            case p.Credit(id=rid, seq=seq, incarnation=incarnation):
                req = self._streamed(ident, rid, incarnation)
                if req is not None:
                    req.io.credit(seq)
            case p.Ping(cid=cid):
                self._send(ident, p.Pong(cid=cid, state=self.snapshot()))
            case p.Control(cid=cid, op=op):
                self._spawn(self._control(ident, cid, op))
            case p.Hello(version=version, shm=probe):
                self._hello(ident, version, probe)
            case p.Release(leases=leases):
                if self.shm is not None:
                    self.shm.free(leases)
            case other:  # a request type added to the union without a handler here
                raise TypeError(f"no handler for {p.tag(other)} messages")

    def _hello(self, ident: bytes, version: int, probe: p.ShmProbe | None = None) -> None:
        """Answer the handshake; a client of another protocol version is refused. A client
        whose segment we can read gets ours back: shared memory both ways."""
        cfg = self.cfg
        if version != p.PROTOCOL_VERSION:
            log.warning("refusing client %r: it speaks protocol version %s, this worker %s",
                        ident, version, p.PROTOCOL_VERSION)
            self._send(ident, p.Error(
                code="version_mismatch", replica=cfg.replica_id,
                message=f"protocol version {version} is not supported: replica "
                        f"{cfg.replica_id} speaks version {p.PROTOCOL_VERSION}"))
            return
        shared = self.shm is not None and self.shm.verify(probe)
        self._send(ident, p.HelloReply(version=p.PROTOCOL_VERSION, replica=cfg.replica_id,
                                       stage=cfg.stage.name, kind=cfg.stage.kind,
                                       incarnation=self.incarnation, revision=self.revision,
                                       shm=self.shm.probe() if shared else None))  # type: ignore[union-attr]

    def _streamed(self, ident: bytes, rid: str, incarnation: str | None) -> _Request | None:
        """The request a feed or credit is for, or None (counted) when it is not here: it
        ended, was refused, or was meant for a previous process."""
        if incarnation is not None and incarnation != self.incarnation:
            self.counters["stale_messages"] += 1
            return None
        req = self.requests.get((ident, rid))
        if req is None:
            self.counters["late_feeds"] += 1
        return req

    def _feed(self, ident: bytes, feed: p.Feed, tensors: dict[str, p.WireTensor]) -> None:
        """One chunk of a fed request's input, queued for its executor's inputs()."""
        req = self._streamed(ident, feed.id, feed.incarnation)
        if req is None:
            return
        if not req.io.fed:
            return self._misused(req, f"feed: request {feed.id!r} was not submitted "
                                               "with fed=true")
        if (feed.revision is not None and req.fed_revisions
                and feed.revision not in req.fed_revisions):
            return self._refuse_feed(req, feed)
        if req.io.feed(InputChunk(feed.seq, feed.text, tensors), feed.last):
            if feed.text is not None or tensors:  # not a bare end of input
                self.counters["chunks_fed"] += 1
        else:
            self.counters["late_feeds"] += 1

    def _refuse_feed(self, req: _Request, feed: p.Feed) -> None:
        """A fed chunk of another revision than the request expects: the request ends with
        error/revision_mismatch (its one terminal reply, from _run), and the chunk is dropped.
        Later feeds of a refused request are dropped and not counted again."""
        if req.mismatch is not None:
            return
        self.counters["revision_refusals"] += 1
        expected = ", ".join(sorted(req.fed_revisions))
        req.mismatch = (f"feed {feed.seq}: the chunk is of revision {feed.revision}; the request "
                        f"expects its upstream at revision {expected}")
        log.warning("request %s: %s", req.rid, req.mismatch)
        req.ctx.cancel()

    def _revision_refusal(self, msg: p.Submit) -> str | None:
        """Why a submit must not run on this replica's revision, or None. Absent fields are
        not checked (a client older than revisions)."""
        if msg.revision is not None and msg.revision != self.revision:
            return (f"revision: the request is pinned to revision {msg.revision} of stage "
                    f"{self.cfg.stage.name}; replica {self.cfg.replica_id} is revision "
                    f"{self.revision}")
        for producer, stamp in sorted(msg.payload_revisions.items()):
            expected = msg.upstream_revisions.get(producer.split("/", 1)[0])
            if expected is not None and stamp != expected:
                return (f"payload_revisions.{producer}: the payload of stage {producer} is of "
                        f"revision {stamp}; the request expects revision {expected}")
        return None

    def _misused(self, req: _Request, message: str) -> None:
        """A protocol misuse on a running request: log it and cancel the request (its one
        terminal reply says aborted); a stray message never crashes the worker."""
        log.warning("request %s: %s", req.rid, message)
        self.counters["malformed"] += 1
        req.ctx.cancel()

    def _submit(self, ident: bytes, msg: p.Submit, tensors: dict[str, p.WireTensor]) -> None:
        rid, replica = msg.id, self.cfg.replica_id
        if msg.incarnation is not None and msg.incarnation != self.incarnation:
            # Bound to a previous process at this address (sent before the client saw the
            # restart): never run it here.
            self.counters["stale_messages"] += 1
            return self._reply(ident, p.Error(
                code="stale_incarnation", id=rid, replica=replica,
                message=f"request was for incarnation {msg.incarnation} of replica {replica}; "
                        f"this process is {self.incarnation} (the replica restarted)"))
        mismatch = self._revision_refusal(msg)
        if mismatch is not None:  # a cross-revision hop: never run, whatever else holds
            self.counters["revision_refusals"] += 1
            log.warning("request %s refused: %s", rid, mismatch)
            return self._reply(ident, p.Error(code="revision_mismatch", id=rid, replica=replica,
                                              message=mismatch))
        if self.draining:
            self.counters["rejected_draining"] += 1
            return self._reply(ident, p.Draining(id=rid, replica=replica,
                                                 message="replica is draining"))
        if not self.loaded or self.executor is None:
            return self._reply(ident, p.Error(code="not_ready", id=rid, replica=replica,
                                              message="model is still loading"))
        if (ident, rid) in self.requests:
            return self._reply(ident, p.Error(code="bad_request", id=rid, replica=replica,
                                              message=f"id: request {rid!r} is already in flight"))
        row = get_kind(self.cfg.stage.kind)
        unsupported = ("chunk_window" if msg.chunk_window is not None and not row.chunked_output
                       else "fed" if msg.fed and not row.chunked_input else None)
        if unsupported is not None:
            what = "emit" if unsupported == "chunk_window" else "consume"
            return self._reply(ident, p.Error(
                code="bad_request", id=rid, replica=replica,
                message=f"{unsupported}: stage kind {self.cfg.stage.kind!r} does not {what} "
                        "chunks"))
        try:
            job = self.executor.prepare(msg.params, tensors)
            cost = self.executor.cost(job)
        except BadRequest as exc:
            return self._reply(ident, p.Error(code="bad_request", id=rid, replica=replica,
                                              message=str(exc)))
        permit = self.admission.try_admit(cost)
        if permit is None:
            self.counters["rejected_budget"] += 1
            return self._reply(ident, p.Overloaded(id=rid, replica=replica, retry_after=1.0,
                                                   message=f"admission budget full (cost {cost})"))
        self.counters["admitted"] += 1
        timeout = msg.timeout_s if msg.timeout_s is not None else self.default_deadline
        ctx = ExecutionContext.with_timeout(timeout, permits=[permit])
        borrower = msg.shm if self.shm is not None and msg.shm in self.shm.peers else None
        req = _Request(ident, rid, ctx, borrower, admitted_at=time.monotonic(),
                       fed_revisions=frozenset(msg.upstream_revisions.values()) if msg.fed
                       else frozenset())
        req.io = StageIO(
            ctx, partial(self._delta, req), fed=msg.fed, window=msg.chunk_window or 0,
            send_chunk=partial(self._chunk, req) if msg.chunk_window else None,
            consumed=partial(self._consumed, req), max_waiting=p.MAX_CHUNK_WINDOW)
        if msg.chunk_window:
            req.outbox = asyncio.Queue()
            req.sender = asyncio.ensure_future(self._send_chunks(req))
        self.requests[(ident, rid)] = req
        self._spawn(self._run(req, job))

    # ---- streaming between stages (the executor's StageIO calls these on its thread) -----

    def _delta(self, req: _Request, fields: dict[str, Any]) -> None:
        seq = req.io.deltas
        delta = p.Delta(id=req.rid, seq=seq, queue_wait_s=req.queue_wait() if seq == 1 else None,
                        **fields)
        self._loop.call_soon_threadsafe(self._send, req.ident, delta)

    def _chunk(self, req: _Request, seq: int, text: str | None, tensors: dict[str, Any]) -> None:
        assert req.outbox is not None
        self._loop.call_soon_threadsafe(req.outbox.put_nowait, (seq, text, tensors))

    def _consumed(self, req: _Request, seq: int) -> None:
        """The executor took fed chunk seq: credit the upstream (through the orchestrator)."""
        self._loop.call_soon_threadsafe(self._send, req.ident, p.Credit(id=req.rid, seq=seq))

    async def _send_chunks(self, req: _Request) -> None:
        """Send a request's chunks in order, large tensors lent as for a final reply. After a
        failure the rest are dropped (and their blocks taken back): the request then ends with
        the error (_run reads chunk_error)."""
        assert req.outbox is not None
        while (item := await req.outbox.get()) is not None:
            seq, text, tensors = item
            if req.chunk_error is not None:
                self._take_back(tensors)
                continue
            try:
                if req.borrower is not None and tensors:
                    tensors = await self._lend(req, tensors)
                wait = req.queue_wait() if seq == 1 else None
                frames = p.encode(p.Chunk(id=req.rid, seq=seq, text=text, queue_wait_s=wait,
                                          revision=self.revision),
                                  tensors, shm=req.borrower is not None)
            except Exception as exc:  # TimeoutError, WaitCancelled, an unencodable chunk
                self._take_back(tensors)
                req.chunk_error = exc
                req.ctx.cancel()  # the executor stops at its next look at the context
                continue
            self.counters["chunks_sent"] += 1
            self._send_frames(req.ident, frames, on_fail=partial(self._take_back, tensors))

    async def _flush_chunks(self, req: _Request) -> None:
        """Every chunk of the request on its way before its terminal reply."""
        if req.sender is None or req.outbox is None:
            return
        req.outbox.put_nowait(None)
        await req.sender
        io = req.io
        self.counters["window_waits"] += io.window_waits
        self.counters["chunks_outstanding_peak"] = max(
            self.counters["chunks_outstanding_peak"], io.peak_outstanding)

    async def _execute_streamed(self, req: _Request, job: Any) -> Outcome:
        """Execute, then see every chunk sent; a chunk that could not be sent is what the
        request ends with (its deadline, its abort, or an internal error)."""
        try:
            outcome = await self._execute(req.ctx, job, req.io)
        except BaseException:
            await self._flush_chunks(req)
            if req.chunk_error is not None:
                raise req.chunk_error from None
            raise
        await self._flush_chunks(req)
        if req.chunk_error is not None:
            raise req.chunk_error
        return outcome

    async def _run(self, req: _Request, job: Any) -> None:
        rid, replica = req.rid, self.cfg.replica_id
        assert self.executor is not None
        with req.ctx.hold():
            try:
                outcome: Outcome = await self._execute_streamed(req, job)
            except (ExecutionCancelled, WaitCancelled):
                outcome = self.executor.aborted_before_start(job)
            except (DeadlineExceeded, TimeoutError) as exc:
                self._reply(req.ident, p.Deadline(id=rid, replica=replica,
                                                  message=str(exc) or "deadline exceeded"))
                return self._finish(req)
            except Overloaded as exc:
                self.counters["rejected_queue"] += 1
                self._reply(req.ident, p.Overloaded(id=rid, replica=replica, retry_after=1.0,
                                                    message=str(exc) or "execution queue full"))
                return self._finish(req)
            except BadRequest as exc:
                self._reply(req.ident, p.Error(code="bad_request", id=rid, replica=replica,
                                               message=str(exc)))
                return self._finish(req)
            except Exception as exc:
                log.exception("request %s failed", rid)
                self._reply(req.ident, p.Error(code="internal", id=rid, replica=replica,
                                               message=f"{type(exc).__name__}: {exc}"))
                return self._finish(req)
            if req.mismatch is not None:  # a fed chunk was refused: the output lacks it
                self._reply(req.ident, p.Error(code="revision_mismatch", id=rid,
                                               replica=replica, message=req.mismatch))
                return self._finish(req)
            if outcome.aborted and req.cut is not None:
                self._reply(req.ident, self._cut_reply(req))
                return self._finish(req)
            result = p.Aborted if outcome.aborted else p.Final
            seq = req.io.deltas
            tensors: dict[str, Any] = outcome.tensors
            try:
                if req.borrower is not None and tensors:
                    tensors = await self._lend(req, tensors)
                frames = p.encode(result(id=rid, replica=replica, seq=seq + 1,
                                         queue_wait_s=req.queue_wait(), revision=self.revision,
                                         **outcome.fields),
                                  tensors, shm=req.borrower is not None)
            except TimeoutError as exc:
                self._reply(req.ident, p.Deadline(id=rid, replica=replica, message=str(exc)))
                return self._finish(req)
            except WaitCancelled:
                self._reply(req.ident, self._cut_reply(req) if req.cut is not None else
                            p.Aborted(id=rid, replica=replica, seq=seq + 1,
                                      finish_reason="abort"))
                return self._finish(req)
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
                self._take_back(tensors)
                log.exception("request %s: the executor's outcome cannot be sent", rid)
                self._reply(req.ident, p.Error(code="internal", id=rid, replica=replica,
                                               message=f"outcome cannot be encoded: {exc}"))
                return self._finish(req)
            self._count(p.tag(result))
            # A reply that never leaves (the client is gone) lends nothing: take it back.
            self._send_frames(req.ident, frames, on_fail=lambda: self._take_back(tensors))
            self._finish(req)

    async def _lend(self, req: _Request, tensors: dict[str, Any]) -> dict[str, Any]:
        """Large outputs copied into our segment and lent to the client (it releases them).

        A full segment makes this wait for the client to give blocks back (back-pressure), up
        to the request's deadline (TimeoutError) or its cancellation (WaitCancelled). Tensors
        already in shared memory (an input passed through) keep their handle.
        """
        assert self.shm is not None
        out = dict(tensors)
        try:
            for name, value in tensors.items():
                if self.shm.wants(value):
                    placed = await self.shm.place(value, req.borrower, req.ctx.deadline,
                                                  lambda: req.ctx.token.cancelled)
                    if placed is not None:
                        out[name] = placed
        except BaseException:
            self._take_back(out)
            raise
        return out

    def _take_back(self, tensors: dict[str, Any]) -> None:
        """Free the blocks of our segment that tensors were lent in."""
        if self.shm is None:
            return
        self.shm.free([v.shm.lease for v in tensors.values()
                       if isinstance(v, p.WireTensor) and v.shm is not None
                       and v.shm.segment == self.shm.name])

    def _execute(self, ctx: ExecutionContext, job: Any, emit: Emit) -> Awaitable[Outcome]:
        """Hand one admitted request to the scheduler: into the running batch (a batching
        executor) or to run alone. Admission, deadline and cancellation stay per request."""
        executor = self.executor
        assert executor is not None
        if isinstance(self.scheduler, BatchScheduler):
            assert isinstance(executor, BatchExecutor)
            return self.scheduler.run_with_context(ctx, executor, job, emit)
        return self.scheduler.run_with_context(ctx, executor.execute, job, ctx, emit)

    def _finish(self, req: _Request) -> None:
        self.requests.pop((req.ident, req.rid), None)
        self._quiet.set()

    def _count(self, reply_type: str) -> None:
        self.outcomes[reply_type] = self.outcomes.get(reply_type, 0) + 1

    def _reply(self, ident: bytes, reply: msgspec.Struct) -> None:
        """Send a terminal reply and count it by type (for /metrics)."""
        self._count(p.tag(reply))
        self._send(ident, reply)

    def _send(self, ident: bytes, header: msgspec.Struct) -> None:
        try:
            frames = p.encode(header)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            log.exception("cannot encode a %s reply; dropped", p.tag(header))
            return
        self._send_frames(ident, frames)

    def _send_frames(self, ident: bytes, frames: list[Any],
                     on_fail: Callable[[], None] | None = None) -> None:
        try:
            fut = self.sock.send_multipart([ident, *frames], copy=False)
        except zmq.ZMQError as exc:  # the peer went away; its requests are its problem
            log.warning("dropping reply for gone peer %r: %s", ident, exc)
            if on_fail is not None:
                on_fail()
            return
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(partial(_log_send_failure, on_fail=on_fail))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._quiet.set()

    # ---- control -------------------------------------------------------------------------

    async def _control(self, ident: bytes, cid: str, op: p.ControlOp) -> None:
        try:
            state = await self.control(op)
            reply = p.ControlReply(cid=cid, op=op, ok=True, result=state)
        except Exception as exc:
            reply = p.ControlReply(cid=cid, op=op, ok=False,
                                   error=p.ControlFailure(type(exc).__name__, str(exc)))
        self._send(ident, reply)

    async def control(self, op: p.ControlOp) -> p.WorkerState:
        """Apply a control RPC; exceptions propagate to the caller's reply."""
        if op == "pause":
            self.scheduler.pause()
            self.paused = True
        elif op == "resume":
            if self.asleep:
                raise p.ControlConflict("resume: replica is asleep; call wake_up first")
            self.scheduler.resume()
            self.paused = False
        elif op == "sleep":
            busy = len(self.requests)
            if busy:
                raise p.ControlConflict(f"sleep: {busy} requests in flight; pause and let them "
                                        "finish")
            if not self.asleep:
                self.scheduler.pause()
                self.paused = True
                if self.executor is not None:
                    await asyncio.to_thread(self.executor.sleep)
                self.asleep = True
        elif op == "wake_up":
            # Waking does not resume admission: the caller resumes explicitly.
            if self.asleep and self.executor is not None:
                await asyncio.to_thread(self.executor.wake_up)
            self.asleep = False
        elif op == "drain":
            self.begin_drain("drain rpc")
        return self.snapshot()

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
            paused=self.paused,
            asleep=self.asleep,
            in_flight=len(self.requests),
            queued=self.scheduler.queued,
            pid=os.getpid(),
            revision=self.revision,
        )

    def state(self) -> dict[str, Any]:
        """The same state as plain builtins, for the HTTP side port's /state (plus the
        shared-memory segment's figures when there is one)."""
        state = msgspec.structs.asdict(self.snapshot())
        c = self.counters
        live = [r.io for r in self.requests.values()]
        state["chunks"] = {
            "sent": c["chunks_sent"], "fed": c["chunks_fed"], "late_feeds": c["late_feeds"],
            "window_waits": c["window_waits"] + sum(io.window_waits for io in live),
            "outstanding_peak": max([c["chunks_outstanding_peak"],
                                     *(io.peak_outstanding for io in live)]),
            "outstanding": sum(io.sent - io.acked for io in live),
        }
        state["revision_refusals"] = c["revision_refusals"]
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


def _log_send_failure(fut: asyncio.Future[Any], on_fail: Callable[[], None] | None) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("reply not delivered: %s", fut.exception())
        if on_fail is not None:
            on_fail()
