"""One admitted request's state on a replica: what intake, chunk streams and the run share.

Why a module of its own: the intake builds it, the streams fill its StageIO and outbox, and the
worker runs it to its terminal reply; none of them should need the others to name it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from omnistage.admission import ExecutionContext
from omnistage.executors.base import StageIO

# Until ChunkStreams.open gives a request its StageIO (which it does at admission): one shared
# placeholder, not a StageIO (a context, a lock, a condition) built per request and dropped.
_UNOPENED = StageIO()


@dataclass
class Request:
    """An admitted request, keyed in the worker's table by (client identity, request id)."""

    ident: bytes
    rid: str
    ctx: ExecutionContext
    borrower: str | None = None  # the client's segment: outputs may be lent to it
    cut: str | None = None  # why the replica itself cancelled it (a drain), if it did
    io: StageIO = field(default_factory=lambda: _UNOPENED)  # ChunkStreams.open sets its own
    # Streamed output: once a chunk has to be lent through shared memory (which may wait), it
    # and every later chunk wait here, in order, for the one task that lends and sends them.
    outbox: asyncio.Queue[tuple[int, str | None, dict[str, Any]] | None] | None = None
    sender: asyncio.Task[None] | None = None
    chunk_error: BaseException | None = None  # why a chunk could not be sent
    admitted_at: float = 0.0  # time.monotonic() at admission: the queue wait counts from here
    # Revisions a fed chunk may be stamped with (submit.upstream_revisions); empty: no check.
    fed_revisions: frozenset[str] = frozenset()
    mismatch: str | None = None  # why a fed chunk was refused (error/revision_mismatch)
    # Fed chunks: the newest that came through shared memory, and the newest credit sent (the
    # lender's block of a credited chunk goes back: see ChunkStreams.credit).
    lent_upto: int = 0
    credited: int = 0

    def queue_wait(self) -> float | None:
        """Seconds the request waited in the admission queue before its executor took it
        (what the first output and the final reply report); None if it never started."""
        started = self.ctx.started_at
        return None if started is None else max(0.0, started - self.admitted_at)
