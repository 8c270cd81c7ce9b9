"""The engine's per-request state: a request, its children (one per sample), their tasks (one
per stage) and streamed edges. Plain data in a module of its own, so the engine and its
collaborators (plan, holds, streams, failover) share it without importing one another."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from omnistage import protocol as p
from omnistage.orchestrator.pools import Replica
from omnistage.orchestrator.requests import (
    ChildOutcome,
    Event,
    Outcome,
    PipelineRequest,
    StageOutput,
)
from omnistage.orchestrator.revisions import NEWEST, Track

Reply = p.Message[p.Reply]
Result = p.Message[p.Final]  # a stage's successful output, kept for the stages after it


class Mailbox:
    """A request's events for its one reader (RequestHandle.events): asyncio.Queue without
    what a single reader never uses (its Event, its getters' and putters' deques, its loop
    binding), built once per request on the hot path."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, event: Event) -> None:
        self._items.append(event)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> Event:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> Event:
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("a request's events have one reader")
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled while waiting: nobody is reading
                    self._waiter = None
        return self._items.popleft()


@dataclass(eq=False)
class Stream:
    """One streamed edge of one child: the upstream's chunks, fed on to the downstream."""

    upstream: str
    downstream: str
    window: int
    chunks: list[Reply] = field(default_factory=list)  # kept to feed a resent downstream
    acked: int = 0  # the downstream took every chunk up to this seq
    ended: bool = False  # the upstream's final arrived (its last feed went out)

    def reset(self) -> None:
        """Forget the chunks: the upstream runs again (a failover) and need not make the same."""
        self.chunks.clear()
        self.acked = 0
        self.ended = False


@dataclass(eq=False)
class Shown:
    """What of one stage's output the client was handed (Delta and AudioChunk events)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    audio_chunks: int = 0


@dataclass(eq=False)
class Task:
    """One stage of one child, bound to one replica at a time."""

    wire_id: str
    child: Child
    stage: str
    companion: bool = False
    replica: Replica | None = None
    incarnation: str | None = None  # the replica's process it was sent to
    tried: set[str] = field(default_factory=set)
    fed: Stream | None = None  # its input arrives in chunks from this stream
    needed_at: float = 0.0  # when its inputs were complete (the load signal's clock)
    sent_at: float | None = None  # when it last went to a replica
    answered: bool = False  # the replica's first output came (ttfo measured)
    worker_queue_s: float | None = None  # the replica's reported queue wait (load: exec_s)
    attempt: int = 0  # failovers so far: each attempt has a wire id of its own


@dataclass(eq=False)
class Child:
    request: Request
    index: int
    running: dict[tuple[str, bool], Task] = field(default_factory=dict)
    started: set[tuple[str, bool]] = field(default_factory=set)
    done: dict[str, Result] = field(default_factory=dict)
    companion_done: dict[str, Result] = field(default_factory=dict)
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    streams: dict[str, Stream] = field(default_factory=dict)  # by upstream stage
    restarts: dict[str, int] = field(default_factory=dict)  # fed stages started afresh
    shown: dict[str, Shown] = field(default_factory=dict)  # by stage: what the client saw
    abort_requested: bool = False
    aborted: bool = False
    outcome: ChildOutcome | None = None


@dataclass(eq=False)
class Request:
    id: str
    req: PipelineRequest
    finals: list[str]
    order: list[str]  # needed stages in topological order
    companions: set[str]  # AR stages that also run the negative prompt
    deadline: float
    streamed: dict[str, str] = field(default_factory=dict)  # upstream -> downstream
    to_client: frozenset[str] = frozenset()  # final stages whose chunks stream to the client
    started: float = field(default_factory=time.monotonic)
    children: list[Child] = field(default_factory=list)
    queue: Mailbox = field(default_factory=Mailbox)
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


def tell_abort(task: Task, replica: Replica) -> None:
    """Ask the replica to abort the task; best effort (a lost replica fails it anyway)."""
    with contextlib.suppress(Exception):
        replica.channel.send(p.Abort(id=task.wire_id, incarnation=task.incarnation))
