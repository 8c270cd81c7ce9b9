"""The small interface every executor implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omnistage.admission import ExecutionContext
from omnistage.protocol import WireTensor

Emit = Callable[[dict[str, Any]], None]


class BadRequest(ValueError):
    """A request-scoped error: the message names the offending field."""


@dataclass
class Outcome:
    """What execute returns: reply fields, output tensors, and whether it ended by abort."""

    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    aborted: bool = False


class Executor(ABC):
    kind: ClassVar[str]

    def __init__(self, model: str | None, engine: Mapping[str, Any], device: Any) -> None:
        self.model_source = model
        self.engine = dict(engine)
        self.device = device
        self.asleep = False

    def opt(self, params: Mapping[str, Any], key: str, engine_key: str, default: Any) -> Any:
        """A request parameter, else the stage's engine default, else the built-in default."""
        value = params.get(key)
        if value is None:
            value = self.engine.get(engine_key, default)
        return value

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


def check_int(params: Mapping[str, Any], key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"params.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def check_float(params: Mapping[str, Any], key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"params.{key} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)
