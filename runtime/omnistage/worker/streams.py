"""Streaming between stages on a replica: each request's StageIO, its chunks out, fed chunks in.

Out: deltas go straight to the client; chunks are sent as they come, at most `chunk_window`
unacknowledged (the downstream's credits open the window). From a request's first chunk with a
tensor to lend through shared memory on, its chunks queue in a per-request outbox that one task
lends and sends in order. A chunk waits at most CHUNK_PATIENCE_S for room in our segment, then
goes as frames: its window already bounds it, and the blocks that fill the segment may be other
requests' (their streams wait on theirs). In: fed chunks go to the request's StageIO, checked
against the revisions it expects, their shared-memory tensors copied out at once (the
orchestrator gives a chunk's block back once it is credited, and the executor may keep a chunk
longer, as left context), and each one the executor takes is credited upstream; once the input
has ended only a lent chunk's credit is sent (nothing upstream waits for room any more). Why
apart from the worker: this is the only part that touches a request from the executor's thread
(StageIO's callbacks hop back onto the event loop here), and it owns the lending of blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any

from omnistage import protocol as p
from omnistage.executors import Outcome
from omnistage.executors.base import InputChunk, StageIO
from omnistage.shm import SegmentManager
from omnistage.worker.replies import Replies
from omnistage.worker.request import Request

log = logging.getLogger("omnistage.worker")

#: How long a chunk waits for room in our segment before it goes as frames (docs/protocol.md,
#: "Back-pressure"). Short: a chunk's window bounds it, not the segment.
CHUNK_PATIENCE_S = 0.05


class ChunkStreams:
    """Chunk I/O of every request on this replica. ``counters`` is the worker's own dict (the
    chunk and revision counts /state and /metrics read)."""

    def __init__(self, *, revision: str, replies: Replies, counters: dict[str, int]) -> None:
        self.revision = revision  # stamped on every chunk sent
        self.replies = replies
        self.counters = counters
        self.shm: SegmentManager | None = None  # our segment, set by StageWorker.serve

    def borrower(self, segment: str | None) -> str | None:
        """The client's segment when outputs may be lent to it (we can read it), else None."""
        return segment if self.shm is not None and segment in self.shm.peers else None

    def open(self, req: Request, *, fed: bool, window: int | None) -> None:
        """Give an admitted request its StageIO: deltas to the client, chunks (when the submit
        asked for a ``window``) through its outbox, fed chunks credited as they are taken.
        Runs on the event loop; the callbacks hop back to it from the executor's thread."""
        loop = asyncio.get_running_loop()
        req.io = StageIO(
            req.ctx, partial(self._delta, loop, req), fed=fed, window=window or 0,
            send_chunk=partial(self._chunk, loop, req) if window else None,
            consumed=partial(self._consumed, loop, req), max_waiting=p.MAX_CHUNK_WINDOW)

    # ---- out: the executor's StageIO calls these on its thread ---------------------------

    def _delta(self, loop: asyncio.AbstractEventLoop, req: Request,
               fields: dict[str, Any]) -> None:
        seq = req.io.deltas
        delta = p.Delta(id=req.rid, seq=seq, queue_wait_s=req.queue_wait() if seq == 1 else None,
                        **fields)
        loop.call_soon_threadsafe(self.replies.send, req.ident, delta)

    def _chunk(self, loop: asyncio.AbstractEventLoop, req: Request, seq: int, text: str | None,
               tensors: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(self._out, req, (seq, text, tensors))

    def _out(self, req: Request, item: tuple[int, str | None, dict[str, Any]]) -> None:
        """One chunk on the loop: sent now, unless it (or one before it) needs lending."""
        seq, text, tensors = item
        if req.outbox is None:
            lend = req.borrower is not None and self.shm is not None and any(
                self.shm.wants(v) for v in tensors.values())
            if not lend:
                self._send_chunk(req, seq, text, tensors)
                return
            req.outbox = asyncio.Queue()
            req.sender = asyncio.ensure_future(self._send_chunks(req))
        req.outbox.put_nowait(item)

    def _send_chunk(self, req: Request, seq: int, text: str | None,
                    tensors: dict[str, Any]) -> None:
        """Encode and send one chunk (its tensors lent already, or frames); a chunk that
        cannot be encoded ends the request with that error (`complete` raises chunk_error)."""
        if req.chunk_error is not None:
            self.take_back(tensors)
            return
        try:
            wait = req.queue_wait() if seq == 1 else None
            frames = p.encode(p.Chunk(id=req.rid, seq=seq, text=text, queue_wait_s=wait,
                                      revision=self.revision),
                              tensors, shm=req.borrower is not None)
        except Exception as exc:
            self.take_back(tensors)
            req.chunk_error = exc
            req.ctx.cancel()  # the executor stops at its next look at the context
            return
        self.counters["chunks_sent"] += 1
        self.replies.send_frames(req.ident, frames, on_fail=partial(self.take_back, tensors))

    def _consumed(self, loop: asyncio.AbstractEventLoop, req: Request, seq: int) -> None:
        """The executor took fed chunk seq (on its thread): credit it from the loop."""
        loop.call_soon_threadsafe(self.credit, req, seq)

    def credit(self, req: Request, seq: int) -> None:
        """Credit the upstream (through the orchestrator) for fed chunks up to seq. Once the
        input has ended nothing upstream waits for room, so the credit is left out unless it
        gives back a chunk lent through shared memory (the orchestrator returns a credited
        chunk's block to its lender at once): a message fewer per streamed request."""
        if seq <= req.credited or (req.io.input_ended and req.lent_upto <= req.credited):
            return
        req.credited = seq
        self.replies.send(req.ident, p.Credit(id=req.rid, seq=seq))

    async def _send_chunks(self, req: Request) -> None:
        """Send a request's chunks in order, large tensors lent as for a final reply. After a
        failure the rest are dropped (and their blocks taken back): the request then ends with
        the error (`complete` raises chunk_error)."""
        assert req.outbox is not None
        while (item := await req.outbox.get()) is not None:
            seq, text, tensors = item
            if req.chunk_error is None and req.borrower is not None and tensors:
                try:
                    tensors = await self.lend(req, tensors, patience=CHUNK_PATIENCE_S)
                except Exception as exc:  # TimeoutError, WaitCancelled
                    self.take_back(tensors)
                    req.chunk_error = exc
                    req.ctx.cancel()
                    continue
            self._send_chunk(req, seq, text, tensors)

    async def _flush(self, req: Request) -> None:
        """Every chunk of the request on its way before its terminal reply."""
        if req.sender is not None and req.outbox is not None:
            req.outbox.put_nowait(None)
            await req.sender
        io = req.io
        if not io.window:
            return
        self.counters["window_waits"] += io.window_waits
        self.counters["chunks_outstanding_peak"] = max(
            self.counters["chunks_outstanding_peak"], io.peak_outstanding)

    async def complete(self, req: Request, execute: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """Execute, then see every chunk sent; a chunk that could not be sent is what the
        request ends with (its deadline, its abort, or an internal error)."""
        try:
            outcome = await execute()
        except BaseException:
            await self._flush(req)
            if req.chunk_error is not None:
                raise req.chunk_error from None
            raise
        await self._flush(req)
        if req.chunk_error is not None:
            raise req.chunk_error
        return outcome

    # ---- lending through shared memory ---------------------------------------------------

    async def lend(self, req: Request, tensors: dict[str, Any],
                   patience: float | None = None) -> dict[str, Any]:
        """Large outputs copied into our segment and lent to the client (it releases them).

        A full segment makes this wait for the client to give blocks back (back-pressure), up
        to the request's deadline (TimeoutError) or its cancellation (WaitCancelled), or with
        patience (chunks) that many seconds, after which the tensor goes as frames. Tensors
        already in shared memory (an input passed through) keep their handle.
        """
        assert self.shm is not None
        out = dict(tensors)
        try:
            for name, value in tensors.items():
                if self.shm.wants(value):
                    placed = await self.shm.place(value, req.borrower, req.ctx.deadline,
                                                  lambda: req.ctx.token.cancelled, patience)
                    if placed is not None:
                        out[name] = placed
        except BaseException:
            self.take_back(out)
            raise
        return out

    def take_back(self, tensors: dict[str, Any]) -> None:
        """Free the blocks of our segment that tensors were lent in."""
        if self.shm is None:
            return
        self.shm.free([v.shm.lease for v in tensors.values()
                       if isinstance(v, p.WireTensor) and v.shm is not None
                       and v.shm.segment == self.shm.name])

    # ---- in: fed chunks ------------------------------------------------------------------

    def feed(self, req: Request, feed: p.Feed, tensors: dict[str, p.WireTensor]) -> None:
        """One chunk of a fed request's input, queued for its executor's inputs()."""
        if not req.io.fed:
            return self._misused(req, f"feed: request {feed.id!r} was not submitted "
                                      "with fed=true")
        if (feed.revision is not None and req.fed_revisions
                and feed.revision not in req.fed_revisions):
            return self._refuse_feed(req, feed)
        if any(wt.shm is not None for wt in tensors.values()):
            # Copied now: the block goes back to its lender once we credit the chunk, and the
            # executor may still read it after that (left context).
            tensors = {name: wt.detached() for name, wt in tensors.items()}
            req.lent_upto = max(req.lent_upto, feed.seq)
        if req.io.feed(InputChunk(feed.seq, feed.text, tensors), feed.last):
            if feed.text is not None or tensors:  # not a bare end of input
                self.counters["chunks_fed"] += 1
        else:
            self.counters["late_feeds"] += 1

    def _refuse_feed(self, req: Request, feed: p.Feed) -> None:
        """A fed chunk of another revision than the request expects: the request ends with
        error/revision_mismatch (its one terminal reply, from the worker's run), and the chunk
        is dropped. Later feeds of a refused request are dropped and not counted again."""
        if req.mismatch is not None:
            return
        self.counters["revision_refusals"] += 1
        expected = ", ".join(sorted(req.fed_revisions))
        req.mismatch = (f"feed {feed.seq}: the chunk is of revision {feed.revision}; the request "
                        f"expects its upstream at revision {expected}")
        log.warning("request %s: %s", req.rid, req.mismatch)
        req.ctx.cancel()

    def _misused(self, req: Request, message: str) -> None:
        """A protocol misuse on a running request: log it and cancel the request (its one
        terminal reply says aborted); a stray message never crashes the worker."""
        log.warning("request %s: %s", req.rid, message)
        self.counters["malformed"] += 1
        req.ctx.cancel()

    def stats(self, live: Iterable[Request]) -> dict[str, int]:
        """The chunk figures of /state: the counters plus what requests in flight hold now."""
        c = self.counters
        ios = [r.io for r in live]
        return {
            "sent": c["chunks_sent"], "fed": c["chunks_fed"], "late_feeds": c["late_feeds"],
            "window_waits": c["window_waits"] + sum(io.window_waits for io in ios),
            "outstanding_peak": max([c["chunks_outstanding_peak"],
                                     *(io.peak_outstanding for io in ios)]),
            "outstanding": sum(io.sent - io.acked for io in ios),
        }
