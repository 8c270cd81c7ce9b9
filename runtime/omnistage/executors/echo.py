"""No-model executor: returns its input. For tests, benchmarks and wiring checks."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from omnistage.admission import ExecutionContext
from omnistage.executors.base import BadRequest, Emit, Executor, Outcome, check_int
from omnistage.protocol import WireTensor


class EchoExecutor(Executor):
    kind = "echo"

    def load(self) -> None:
        if self.model_source not in (None, "", "none"):
            raise ValueError(f"echo stages take no model, got {self.model_source!r}")

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> Any:
        text = params.get("prompt", params.get("text", ""))
        if not isinstance(text, str):
            raise BadRequest(f"params.prompt must be a string, got {type(text).__name__}")
        delay = check_int(params, "delay_ms", self.opt(params, "delay_ms", "echoDelayMs", 0), 0,
                          600_000)
        return {"text": text, "delay": delay / 1000.0, "tensors": dict(tensors),
                "stream": bool(params.get("stream", False))}

    def cost(self, job: Any) -> int:
        return 1

    def execute(self, job: Any, ctx: ExecutionContext, emit: Emit) -> Outcome:
        end = time.monotonic() + job["delay"]
        while (left := end - time.monotonic()) > 0:
            if ctx.token.cancelled:
                return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)
            ctx.check()
            time.sleep(min(left, 0.01))
        if job["stream"]:
            emit({"text": job["text"]})
        return Outcome({"text": job["text"], "finish_reason": "stop"}, dict(job["tensors"]))

    def aborted_before_start(self, job: Any) -> Outcome:
        return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)
