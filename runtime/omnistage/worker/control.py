"""The replica's control plane: the hello handshake and the control RPCs.

Hello checks the protocol version and offers shared memory both ways; control pauses and
resumes admission, puts the model to sleep and wakes it, or starts a drain. Why apart from the
worker: this owns the paused and asleep state, and it answers on the orchestrator's behalf, not
a request's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sized

from omnistage import protocol as p
from omnistage.admission import SerialScheduler
from omnistage.batching import BatchScheduler
from omnistage.executors import Executor
from omnistage.shm import SegmentManager
from omnistage.worker.config import WorkerConfig
from omnistage.worker.replies import Replies

log = logging.getLogger("omnistage.worker")


#: Peers whose proved segments are remembered (each channel is one; a reconnect is a new one).
MAX_PEERS = 1024


class ControlPlane:
    """``in_flight`` is the worker's in-flight table (a sleep waits for it to empty);
    ``executor``, ``drain`` and ``snapshot`` reach the worker's lifecycle without holding it."""

    def __init__(self, cfg: WorkerConfig, *, incarnation: str, revision: str,
                 scheduler: SerialScheduler | BatchScheduler, replies: Replies,
                 in_flight: Sized, executor: Callable[[], Executor | None],
                 drain: Callable[[str], None], snapshot: Callable[[], p.WorkerState]) -> None:
        self.cfg = cfg
        self.incarnation = incarnation
        self.revision = revision
        self.scheduler = scheduler
        self.replies = replies
        self.in_flight = in_flight
        self.executor = executor
        self.drain = drain
        self.snapshot = snapshot
        self.shm: SegmentManager | None = None  # our segment, set by StageWorker.serve
        # The peers that proved in their hello that they share our segment directory: only
        # they may send handles (StageWorker._resolve). A dict as an insertion-ordered set,
        # so the oldest goes first at MAX_PEERS.
        self.proved_peers: dict[bytes, None] = {}
        self.paused = False
        self.asleep = False

    def hello(self, ident: bytes, version: int, probe: p.ShmProbe | None = None) -> None:
        """Answer the handshake; a client of another protocol version is refused. A client
        whose segment we can read gets ours back: shared memory both ways."""
        cfg = self.cfg
        if version != p.PROTOCOL_VERSION:
            log.warning("refusing client %r: it speaks protocol version %s, this worker %s",
                        ident, version, p.PROTOCOL_VERSION)
            self.replies.send(ident, p.Error(
                code="version_mismatch", replica=cfg.replica_id,
                message=f"protocol version {version} is not supported: replica "
                        f"{cfg.replica_id} speaks version {p.PROTOCOL_VERSION}"))
            return
        shared = self.shm is not None and self.shm.verify(probe)
        self.proved_peers.pop(ident, None)
        if shared and probe is not None:
            if len(self.proved_peers) >= MAX_PEERS:  # the oldest: a long gone channel
                self.proved_peers.pop(next(iter(self.proved_peers)))
            self.proved_peers[ident] = None
        self.replies.send(ident, p.HelloReply(
            version=p.PROTOCOL_VERSION, replica=cfg.replica_id, stage=cfg.stage.name,
            kind=cfg.stage.kind, incarnation=self.incarnation, revision=self.revision,
            shm=self.shm.probe() if shared else None,  # type: ignore[union-attr]
            copies_fed=True,  # worker/streams.py copies fed chunks on arrival
            batches=True))  # server.py reads batches; replies.py sends them to who reads them

    async def answer(self, ident: bytes, cid: str, op: p.ControlOp) -> None:
        """Apply a control RPC and reply with the state after it, or with why it failed."""
        try:
            state = await self.apply(op)
            reply = p.ControlReply(cid=cid, op=op, ok=True, result=state)
        except Exception as exc:
            reply = p.ControlReply(cid=cid, op=op, ok=False,
                                   error=p.ControlFailure(type(exc).__name__, str(exc)))
        self.replies.send(ident, reply)

    async def apply(self, op: p.ControlOp) -> p.WorkerState:
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
            busy = len(self.in_flight)
            if busy:
                raise p.ControlConflict(f"sleep: {busy} requests in flight; pause and let them "
                                        "finish")
            if not self.asleep:
                self.scheduler.pause()
                self.paused = True
                executor = self.executor()
                if executor is not None:
                    await asyncio.to_thread(executor.sleep)
                self.asleep = True
        elif op == "wake_up":
            # Waking does not resume admission: the caller resumes explicitly.
            executor = self.executor()
            if self.asleep and executor is not None:
                await asyncio.to_thread(executor.wake_up)
            self.asleep = False
        elif op == "drain":
            self.drain("drain rpc")
        return self.snapshot()
