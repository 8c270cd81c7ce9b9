"""The small interface every executor implements."""

from __future__ import annotations

import collections
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError

from omnistage.admission import ExecutionContext
from omnistage.batching import Batch, Emit, run_alone
from omnistage.executors.prefix_cache import PrefixStats
from omnistage.params import StageParams, describe
from omnistage.protocol import WireTensor
from omnistage.spec import EngineOptions

P = TypeVar("P", bound=StageParams)


class BadRequest(ValueError):
    """A request-scoped error: the message names the offending field as `params.<name>`."""


@dataclass
class Outcome:
    """What execute returns: reply fields, output tensors, and whether it ended by abort."""

    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    aborted: bool = False


@dataclass
class InputChunk:
    """One chunk of a fed request's input: what the upstream stage emitted as one chunk."""

    seq: int
    text: str | None = None
    tensors: dict[str, WireTensor] = field(default_factory=dict)


# How often a thread waiting on the stream looks at the request's cancellation and deadline.
_POLL_S = 0.02
# How long a batch waiting on several fed requests waits on one before looking at the others.
_MANY_POLL_S = 0.003


class StageIO:
    """What a running request talks to: the `emit` an executor's `execute` receives.

    Streaming between stages (docs/architecture.md) in three calls, all on the executor's
    thread:

    - `emit(fields)`: a text delta for the client, as before (a plain Emit callable).
    - `emit_chunk(text=..., tensors=...)`: hand one chunk of the output to the downstream stage
      as soon as it is made. When the request's output is not streamed (`streams_output` is
      false: no downstream consumes chunks, or streaming is off) it does nothing, so an
      executor calls it unconditionally; the outcome must carry the whole result either way.
      It blocks while `window` chunks are out that the downstream has not taken yet
      (back-pressure), and raises ExecutionCancelled or DeadlineExceeded when the request
      ends meanwhile.
    - `inputs()`: when `fed`, the request's input arrives in chunks: iterate them in order as
      they come (it ends after the upstream's last chunk; taking one credits the upstream).
      The iterator raises ExecutionCancelled or DeadlineExceeded, and BadRequest when the
      sender overran the window. An executor keeps the left context its model needs itself
      (the chunks taken so far). Not fed: the input is the prepared job, as before.

    The worker builds one per request and feeds it (`feed`, `credit`) from its event loop.
    Tensors of a fed chunk may be views of another process's shared memory, valid until the
    request ends: copy what must outlive it.
    """

    def __init__(
        self,
        ctx: ExecutionContext | None = None,
        delta: Callable[[dict[str, Any]], None] | None = None,
        *,
        send_chunk: Callable[[int, str | None, dict[str, Any]], None] | None = None,
        window: int = 0,
        fed: bool = False,
        consumed: Callable[[int], None] | None = None,
        max_waiting: int = 1024,
    ) -> None:
        self.ctx = ctx or ExecutionContext()
        self._delta = delta
        self._send_chunk = send_chunk
        self.window = window
        self.fed = fed
        self._consumed = consumed
        self._max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: collections.deque[InputChunk] = collections.deque()
        self._ended = False
        self._overrun = False
        self._last_fed = 0
        self.deltas = 0  # text deltas sent (the final reply's seq follows them)
        self.sent = 0  # chunks sent
        self.acked = 0  # chunks the downstream took (the highest credit)
        self.peak_outstanding = 0  # the most chunks out at once: never above window
        self.window_waits = 0  # emit_chunk calls that waited for credit

    @classmethod
    def of(cls, emit: Callable[[dict[str, Any]], None] | StageIO) -> StageIO:
        """emit as a StageIO: itself, or a plain delta callable (warm-up, tests) wrapped."""
        return emit if isinstance(emit, StageIO) else cls(delta=emit)

    @property
    def streams_output(self) -> bool:
        return self._send_chunk is not None and self.window > 0

    def __call__(self, fields: dict[str, Any]) -> None:
        self.deltas += 1
        if self._delta is not None:
            self._delta(fields)

    def emit_chunk(self, text: str | None = None, tensors: Mapping[str, Any] | None = None,
                   ) -> None:
        if self._send_chunk is None or self.window <= 0:
            return
        with self._cond:
            if self.sent - self.acked >= self.window:
                self.window_waits += 1
            while self.sent - self.acked >= self.window:
                self.ctx.check()
                self._cond.wait(_POLL_S)
            self.ctx.check()
            self.sent += 1
            seq = self.sent
            self.peak_outstanding = max(self.peak_outstanding, self.sent - self.acked)
        self._send_chunk(seq, text, dict(tensors or {}))

    def inputs(self) -> Iterator[InputChunk]:
        if not self.fed:
            return
        while True:
            with self._cond:
                while not self._waiting and not self._ended and not self._overrun:
                    self.ctx.check()
                    self._cond.wait(_POLL_S)
                if self._overrun:
                    raise BadRequest(f"feed: more than {self._max_waiting} chunks waiting; the "
                                     "sender ignored its credits")
                self.ctx.check()
                if not self._waiting:
                    return
                chunk = self._waiting.popleft()
            if self._consumed is not None:
                self._consumed(chunk.seq)
            yield chunk

    def poll(self) -> tuple[list[InputChunk], bool]:
        """`inputs()` without waiting, for an executor that runs many requests in one batch
        (one request's slow upstream must not stall the others): the chunks that arrived so
        far (each taken, so credited) and whether the input has ended with them. Raises
        BadRequest when the sender overran the window."""
        if not self.fed:
            return [], True
        with self._cond:
            if self._overrun:
                raise BadRequest(f"feed: more than {self._max_waiting} chunks waiting; the "
                                 "sender ignored its credits")
            taken, ended = list(self._waiting), self._ended
            self._waiting.clear()
        for chunk in taken:
            if self._consumed is not None:
                self._consumed(chunk.seq)
        return taken, ended

    @staticmethod
    def wait_any(ios: list[StageIO]) -> None:
        """Block a moment until one of these fed requests has input waiting (a batch with
        nothing to do but wait for its inputs, which must not spin): on the first, for up to
        _POLL_S, or _MANY_POLL_S when several wait (another's chunk is seen that late)."""
        if not ios:
            return
        io = ios[0]
        with io._cond:
            if io.fed and not io._waiting and not io._ended and not io._overrun:
                io._cond.wait(_POLL_S if len(ios) == 1 else _MANY_POLL_S)

    # ---- the worker's side (its event loop) --------------------------------------------

    @property
    def input_ended(self) -> bool:
        """The upstream's last chunk (or the bare end of input) has arrived."""
        return self._ended

    def feed(self, chunk: InputChunk, last: bool) -> bool:
        """Queue one fed chunk; False when it is out of order or after the last (dropped)."""
        with self._cond:
            if self._ended or chunk.seq <= self._last_fed:
                return False
            self._last_fed = chunk.seq
            if chunk.text is not None or chunk.tensors:
                if len(self._waiting) >= self._max_waiting:
                    self._overrun = True
                else:
                    self._waiting.append(chunk)
            self._ended = last
            self._cond.notify_all()
        return True

    def credit(self, seq: int) -> None:
        """The downstream took every chunk up to seq."""
        with self._cond:
            if seq > self.acked:
                self.acked = min(seq, self.sent)
                self._cond.notify_all()


class Executor(ABC):
    kind: ClassVar[str]

    def __init__(self, model: str | None, engine: EngineOptions, device: Any) -> None:
        self.model_source = model
        self.engine = engine
        self.device = device
        self.asleep = False

    @staticmethod
    def parse(model: type[P], params: Mapping[str, Any]) -> P:
        """A request's params as the kind's typed model (omnistage.params.stage_params), so they
        are checked against the same bounds as the spec and the HTTP API."""
        try:
            return model.model_validate(params)
        except ValidationError as exc:
            raise BadRequest(describe(exc.errors()[0], prefix="params").message) from None

    @abstractmethod
    def load(self) -> None:
        """Load weights onto the device (slow; runs off the event loop)."""

    def warmup(self) -> None:  # noqa: B027 - optional hook; executors without lazy init skip it
        """Run one tiny request so the first real one does not pay for lazy init."""

    @abstractmethod
    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> Any:
        """Validate a request into a job; raises BadRequest naming the field."""

    @abstractmethod
    def cost(self, job: Any) -> int:
        """Admission cost units: tokens for AR, pixels x steps for diffusion."""

    @abstractmethod
    def execute(self, job: Any, ctx: ExecutionContext, emit: Emit) -> Outcome:
        """Run on a worker thread. Check ctx between steps; stop early when cancelled.

        emit is a StageIO (StageIO.of(emit) also takes a plain callable): text deltas, and for
        a kind whose row says so, output chunks (emit_chunk) and fed input chunks (inputs()).
        """

    def aborted_before_start(self, job: Any) -> Outcome:
        """The reply for a request aborted while it was still queued."""
        return Outcome(aborted=True)

    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters, for /metrics (None: this executor keeps none)."""
        return None

    def sleep(self) -> None:
        """Release accelerator memory; weights stay in host memory."""
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False


class BatchExecutor(Executor):
    """An executor whose requests can share forward steps (omnistage.batching.BatchEngine).

    With engine.maxBatchSize above 1 the worker feeds it through a BatchScheduler; otherwise
    (and for warm-up) `execute` runs one job through a batch of its own, so there is one step
    code path either way.
    """

    def batch_key(self, job: Any) -> Hashable:
        """Jobs share a batch only when their keys are equal; all do by default."""
        return None

    def batch_tokens(self, job: Any) -> int:
        """What the job counts against engine.maxBatchTokens (0: not counted)."""
        return 0

    @abstractmethod
    def new_batch(self) -> Batch:
        """An empty batch over this executor's model."""

    def execute(self, job: Any, ctx: ExecutionContext, emit: Emit) -> Outcome:
        return run_alone(self.new_batch(), job, ctx, emit)
