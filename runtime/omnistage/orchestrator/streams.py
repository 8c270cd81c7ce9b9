"""Streaming: between stages (an upstream's chunks feed its downstream) and to the client
(text deltas, and a final speech stage's audio chunks).

Where an upstream's kind emits chunks and its one downstream's kind consumes them, the upstream
runs with a chunk window; its first chunk starts the downstream (fed), and each chunk is fed on
to the replica the downstream is bound to. The downstream's credits go back to the upstream. A
final speech stage of a streaming request sends each chunk to the request as an AudioChunk
event, and its credit goes back when the consumer calls the event's credit(), so a slow client
holds the stage back instead of the orchestrator buffering without bound. Chunks of a terminal
or aborting child are dropped like any late reply. See docs/architecture.md, "Streaming between
stages".

Shared memory: a chunk's blocks go back to its upstream as soon as the downstream credits it
(its worker copied the chunk on arrival), kept here as a copy in process memory for a resend
after failover. So a stream holds at most its window's blocks, never its whole output: many long
streams cannot fill their upstream's segment and wait on each other until their deadlines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from functools import partial

from omnistage import protocol as p
from omnistage.orchestrator.pools import Replica
from omnistage.orchestrator.requests import AudioChunk, Delta, RequestError
from omnistage.orchestrator.tasks import Child, Reply, Shown, Stream, Task


class Streams:
    def __init__(self, counters: dict[str, float], tasks: Mapping[str, Task], *,
                 release: Callable[[Reply], None],
                 start: Callable[[Child, str, bool, Stream], None],
                 fail: Callable[[Child, RequestError], None]) -> None:
        """tasks: the engine's bound tasks by wire id (read only); release: gives a reply's
        shared-memory blocks back; start: starts a fed downstream; fail: ends a child."""
        self.counters = counters
        self.tasks = tasks
        self.release = release
        self.start = start
        self.fail = fail

    def on_delta(self, task: Task, h: p.Delta) -> None:
        child = task.child
        if child.outcome is not None or task.companion:
            self.counters["late_messages"] += 1
            return
        shown = child.shown.setdefault(task.stage, Shown())
        shown.token_ids.extend(h.token_ids)
        shown.text += h.text
        child.request.queue.put_nowait(Delta(child.index, task.stage, h.text, h.token_ids))

    def on_chunk(self, task: Task, msg: Reply) -> None:
        """An upstream's chunk: the first one starts its downstream (fed); each is fed to the
        replica the downstream is bound to. Never to a terminal or aborting child."""
        child = task.child
        if not task.companion and task.stage in child.request.to_client:
            self._to_client(task, msg)
            return
        stream = None if task.companion else child.streams.get(task.stage)
        if child.outcome is not None or child.abort_requested or stream is None or stream.ended:
            self.counters["late_messages"] += 1
            self.release(msg)
            return
        if msg.tensors:
            child.request.held.append(msg)  # its blocks go back when the request ends
        stream.chunks.append(msg)
        if (stream.downstream, False) not in child.started:
            self.start(child, stream.downstream, False, stream)  # feeds what came so far
            return
        down = child.running.get((stream.downstream, False))
        if down is not None and down.replica is not None:
            self.feed(down, msg, down.replica)

    def _to_client(self, task: Task, msg: Reply) -> None:
        """A final stage's chunk for a streaming client: an AudioChunk event holding a copy of
        its audio (its blocks go back at once); never to a terminal or aborting child."""
        child, h = task.child, msg.header
        assert isinstance(h, p.Chunk)
        audio = msg.tensors.get("audio")
        rate = msg.tensors.get("sample_rate")
        if child.outcome is not None or child.abort_requested:
            self.counters["late_messages"] += 1
            self.release(msg)
            return
        if audio is None:  # nothing for the client: credit it at once, so the stage goes on
            self.release(msg)
            self._client_credit(task, h.seq)
            return
        sample_rate = None
        try:
            with contextlib.suppress(ValueError, TypeError, IndexError, KeyError):
                sample_rate = int(rate.numpy().reshape(-1)[0]) if rate is not None else None
            audio = audio.detached()
        finally:
            self.release(msg)
        child.shown.setdefault(task.stage, Shown()).audio_chunks += 1
        child.request.queue.put_nowait(AudioChunk(
            child.index, task.stage, h.seq, audio, sample_rate,
            partial(self._client_credit, task, h.seq)))

    def _client_credit(self, task: Task, seq: int) -> None:
        """The client took a final stage's chunks up to seq: open the stage's window."""
        if self.tasks.get(task.wire_id) is not task or task.replica is None:
            return  # it ended (or was detached) meanwhile: nothing waits for the credit
        with contextlib.suppress(Exception):  # a lost replica fails the child anyway
            task.replica.channel.send(p.Credit(id=task.wire_id, seq=seq,
                                               incarnation=task.incarnation))

    def resend(self, task: Task, replica: Replica) -> None:
        """A fed task just sent (again) gets every chunk so far, and the end if it came."""
        assert task.fed is not None
        for chunk in task.fed.chunks:
            self.feed(task, chunk, replica)
        if task.fed.ended:
            self.feed(task, None, replica)

    def feed(self, task: Task, chunk: Reply | None, replica: Replica) -> None:
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

    def end(self, child: Child, upstream: str) -> None:
        """The upstream finished: its fed downstream (if it started) gets the end of input.
        If no chunk came, the downstream has not started: the engine starts it whole."""
        stream = child.streams.get(upstream)
        if stream is None:
            return
        stream.ended = True
        down = child.running.get((stream.downstream, False))
        if down is not None and down.fed is stream and down.replica is not None:
            try:
                self.feed(down, None, down.replica)
            except Exception as exc:
                self.fail(child, RequestError(
                    "stage_failed", f"could not send to {down.replica.name}: {exc}",
                    down.stage))

    def on_credit(self, task: Task, h: p.Credit) -> None:
        """A fed downstream took chunks: open the upstream's window by as many."""
        stream = task.fed
        if stream is None or task.child.outcome is not None:
            self.counters["late_messages"] += 1
            return
        if h.seq <= stream.acked:
            return
        peer = task.replica.channel.peer if task.replica is not None else None
        if peer is not None and peer.copies_fed:  # an older worker reads the blocks in place
            self._let_go(stream, stream.acked, h.seq)
        stream.acked = h.seq
        up = task.child.running.get((stream.upstream, False))
        if up is not None and up.replica is not None:
            with contextlib.suppress(Exception):  # a lost upstream fails the child anyway
                up.replica.channel.send(p.Credit(id=up.wire_id, seq=h.seq,
                                                 incarnation=up.incarnation))

    def _let_go(self, stream: Stream, after: int, upto: int) -> None:
        """The downstream took chunks after..upto (its worker copied their tensors when they
        arrived): each one's blocks go back to the upstream now, and the chunk stays, copied
        into process memory, to feed a resent downstream (failover) as frames. The message is
        changed in place, so request.held (released at the outcome) finds no block left in it."""
        for msg in stream.chunks[after:upto]:  # chunk seq n is stream.chunks[n - 1]
            h = msg.header
            if not isinstance(h, p.Chunk) or h.seq > upto:
                break
            if not any(wt.shm is not None for wt in msg.tensors.values()):
                continue
            kept = {name: wt.detached() for name, wt in msg.tensors.items()}
            self.release(msg)
            msg.tensors, msg.lender = kept, None
