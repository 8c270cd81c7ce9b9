"""The small interface every executor implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError

from omnistage.admission import ExecutionContext
from omnistage.batching import Batch, Emit, run_alone
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
        """Run on a worker thread. Check ctx between steps; stop early when cancelled."""

    def aborted_before_start(self, job: Any) -> Outcome:
        """The reply for a request aborted while it was still queued."""
        return Outcome(aborted=True)

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
