"""No-model executor: returns its input. For tests, benchmarks and wiring checks."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.admission import ExecutionContext
from omnistage.executors.base import Emit, Executor, Outcome
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor


class _EchoRequest(StageParams):
    prompt: str = ""
    stream: bool = False


EchoParams = stage_params("echo", _EchoRequest)

HOLD_FILE_ENV = "OMNISTAGE_ECHO_HOLD_FILE"
"""Test-only knob: with this set to a path, every request first waits (abortable, under its
deadline) until that file exists. Tests release held work by creating the file, so work that
must be in flight while they act ends on their signal instead of a fixed `delay_ms`."""


@dataclass
class EchoJob:
    text: str
    delay_s: float
    tensors: dict[str, WireTensor]
    stream: bool


class EchoExecutor(Executor):
    kind = "echo"
    hold_file: Path | None = None  # see HOLD_FILE_ENV; set by load()

    def load(self) -> None:
        if self.model_source not in (None, "", "none"):
            raise ValueError(f"echo stages take no model, got {self.model_source!r}")
        hold = os.environ.get(HOLD_FILE_ENV)
        self.hold_file = Path(hold) if hold else None

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> EchoJob:
        req = self.parse(EchoParams, params)
        opts = req.options(self.engine)
        return EchoJob(req.prompt, opts.echo_delay_ms / 1000.0, dict(tensors), req.stream)

    def cost(self, job: EchoJob) -> int:
        return 1

    def execute(self, job: EchoJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        while self.hold_file is not None and not self.hold_file.exists():
            if ctx.token.cancelled:
                return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)
            ctx.check()
            time.sleep(0.01)
        end = time.monotonic() + job.delay_s
        while (left := end - time.monotonic()) > 0:
            if ctx.token.cancelled:
                return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)
            ctx.check()
            time.sleep(min(left, 0.01))
        if job.stream:
            emit({"text": job.text})
        return Outcome({"text": job.text, "finish_reason": "stop"}, dict(job.tensors))

    def aborted_before_start(self, job: EchoJob) -> Outcome:
        return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)
