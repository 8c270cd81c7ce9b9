"""Request intake: a submit becomes an admitted request, or gets its one refusal reply.

The checks run in a fixed order, the first that fails answers: a previous process's submit
(stale_incarnation), another revision (revision_mismatch), draining, still loading, an id
already in flight, chunk features the stage kind lacks, the executor's own validation
(bad_request), the admission budget (overloaded). Why apart from the worker: it is the one
place that decides whether work may start, and it holds nothing once a request runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from omnistage import protocol as p
from omnistage.admission import BoundedAdmission, ExecutionContext
from omnistage.executors import BadRequest, Executor
from omnistage.kinds import get as get_kind
from omnistage.worker.config import WorkerConfig
from omnistage.worker.replies import Replies
from omnistage.worker.request import Request
from omnistage.worker.streams import ChunkStreams

log = logging.getLogger("omnistage.worker")


class Intake:
    """Admits submits on the event loop. ``requests`` (the worker's in-flight table, read to
    refuse a duplicate id) and ``counters`` are the worker's own containers."""

    def __init__(self, cfg: WorkerConfig, *, incarnation: str, revision: str,
                 admission: BoundedAdmission, default_deadline: float,
                 requests: Mapping[tuple[bytes, str], Request],
                 counters: dict[str, int], replies: Replies, streams: ChunkStreams) -> None:
        self.cfg = cfg
        self.incarnation = incarnation
        self.revision = revision
        self.admission = admission
        self.default_deadline = default_deadline  # for a submit without timeout_s
        self.requests = requests
        self.counters = counters
        self.replies = replies
        self.streams = streams

    def submit(self, ident: bytes, msg: p.Submit, tensors: dict[str, p.WireTensor], *,
               executor: Executor | None, draining: bool) -> tuple[Request, Any] | None:
        """The admitted request (its StageIO open) and its prepared job, for the caller to
        register and run; None once a refusal is sent. ``executor`` is None while loading."""
        rid, replica = msg.id, self.cfg.replica_id
        reply = self.replies.reply
        if msg.incarnation is not None and msg.incarnation != self.incarnation:
            # Bound to a previous process at this address (sent before the client saw the
            # restart): never run it here.
            self.counters["stale_messages"] += 1
            return reply(ident, p.Error(
                code="stale_incarnation", id=rid, replica=replica,
                message=f"request was for incarnation {msg.incarnation} of replica {replica}; "
                        f"this process is {self.incarnation} (the replica restarted)"))
        mismatch = self._revision_refusal(msg)
        if mismatch is not None:  # a cross-revision hop: never run, whatever else holds
            self.counters["revision_refusals"] += 1
            log.warning("request %s refused: %s", rid, mismatch)
            return reply(ident, p.Error(code="revision_mismatch", id=rid, replica=replica,
                                        message=mismatch))
        if draining:
            self.counters["rejected_draining"] += 1
            return reply(ident, p.Draining(id=rid, replica=replica,
                                           message="replica is draining"))
        if executor is None:
            return reply(ident, p.Error(code="not_ready", id=rid, replica=replica,
                                        message="model is still loading"))
        if (ident, rid) in self.requests:
            return reply(ident, p.Error(code="bad_request", id=rid, replica=replica,
                                        message=f"id: request {rid!r} is already in flight"))
        row = get_kind(self.cfg.stage.kind)
        unsupported = ("chunk_window" if msg.chunk_window is not None and not row.chunked_output
                       else "fed" if msg.fed and not row.chunked_input else None)
        if unsupported is not None:
            what = "emit" if unsupported == "chunk_window" else "consume"
            return reply(ident, p.Error(
                code="bad_request", id=rid, replica=replica,
                message=f"{unsupported}: stage kind {self.cfg.stage.kind!r} does not {what} "
                        "chunks"))
        try:
            job = executor.prepare(msg.params, tensors)
            cost = executor.cost(job)
        except BadRequest as exc:
            return reply(ident, p.Error(code="bad_request", id=rid, replica=replica,
                                        message=str(exc)))
        permit = self.admission.try_admit(cost)
        if permit is None:
            self.counters["rejected_budget"] += 1
            return reply(ident, p.Overloaded(id=rid, replica=replica, retry_after=1.0,
                                             message=f"admission budget full (cost {cost})"))
        self.counters["admitted"] += 1
        timeout = msg.timeout_s if msg.timeout_s is not None else self.default_deadline
        ctx = ExecutionContext.with_timeout(timeout, permits=[permit])
        req = Request(ident, rid, ctx, self.streams.borrower(msg.shm),
                      admitted_at=time.monotonic(),
                      fed_revisions=frozenset(msg.upstream_revisions.values()) if msg.fed
                      else frozenset())
        self.streams.open(req, fed=msg.fed, window=msg.chunk_window)
        return req, job

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
