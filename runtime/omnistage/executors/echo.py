"""No-model executor: returns its input. For tests, benchmarks and wiring checks.

It streams between stages both ways (its kind row says chunked output and input), so a
pipeline of echo stages exercises the whole streaming path without a model: its text goes out
in pieces of `chunk_chars` characters, `chunk_delay_ms` apart, each piece a chunk for the
downstream stage (with the piece's UTF-8 bytes as tensor `chunk`, so tensors stream too) and a
delta for a streaming client. Fed, it echoes each input chunk as it arrives.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.admission import ExecutionContext
from omnistage.executors.base import Emit, Executor, Outcome, StageIO
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

#: The tensor each output chunk carries: the piece's text as UTF-8 bytes (uint8 [n]).
CHUNK_TENSOR = "chunk"


@dataclass
class EchoJob:
    text: str
    delay_s: float
    tensors: dict[str, WireTensor]
    stream: bool
    chunk_chars: int = 0
    chunk_delay_s: float = 0.0


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
        return EchoJob(req.prompt, opts.echo_delay_ms / 1000.0, dict(tensors), req.stream,
                       opts.echo_chunk_chars, opts.echo_chunk_delay_ms / 1000.0)

    def cost(self, job: EchoJob) -> int:
        return 1

    def execute(self, job: EchoJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        io = StageIO.of(emit)
        while self.hold_file is not None and not self.hold_file.exists():
            if ctx.token.cancelled:
                return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)
            ctx.check()
            time.sleep(0.01)
        if not _wait(job.delay_s, ctx):
            return self.aborted_before_start(job)
        out: list[str] = []
        for piece in self._pieces(job, io):
            if not _wait(job.chunk_delay_s, ctx):
                return Outcome({"text": "".join(out), "finish_reason": "abort"}, aborted=True)
            out.append(piece)
            if io.streams_output:
                data = np.frombuffer(piece.encode(), dtype=np.uint8)
                io.emit_chunk(text=piece, tensors={CHUNK_TENSOR: data})
            if job.stream:
                io({"text": piece})
        return Outcome({"text": "".join(out), "finish_reason": "stop"}, dict(job.tensors))

    def _pieces(self, job: EchoJob, io: StageIO) -> Iterator[str]:
        """The output in pieces: the prompt's, or each fed chunk's as it arrives."""
        texts: Iterator[str] = (_chunk_text(c.text, c.tensors) for c in io.inputs()) \
            if io.fed else iter((job.text,))
        for text in texts:
            if not text:
                if not io.fed:
                    yield text  # an empty prompt is still one (empty) delta, as always
                continue
            n = job.chunk_chars or len(text)
            for i in range(0, len(text), n):
                yield text[i:i + n]

    def aborted_before_start(self, job: EchoJob) -> Outcome:
        return Outcome({"text": "", "finish_reason": "abort"}, aborted=True)


def _chunk_text(text: str | None, tensors: Mapping[str, WireTensor]) -> str:
    """A fed chunk's text: from its `chunk` tensor when it has one (so what arrives through
    shared memory is what is echoed), else its text."""
    wt = tensors.get(CHUNK_TENSOR)
    if wt is not None:
        return bytes(wt.numpy()).decode()
    return text or ""


def _wait(seconds: float, ctx: ExecutionContext) -> bool:
    """Sleep, waking for cancellation (False) and raising DeadlineExceeded at the deadline."""
    if seconds <= 0:
        return True
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if ctx.token.cancelled:
            return False
        ctx.check()
        time.sleep(min(left, 0.01))
    return not ctx.token.cancelled
