"""Test-only stage kinds for the audio and media routes (tests/integration/test_audio_api.py).

- `listen`: a chat-capable entry stage (text in, text and token counts out) that also
  consumes IMAGE and AUDIO and says in its answer what it received (the last user turn, then
  `image <i> WxH` / `audio <i> N samples` per input tensor), so a test can prove that decoded
  media reached the entry stage.
- `tone`: consumes TEXT, emits AUDIO: a sine at TONE_RATE Hz lasting SECONDS_PER_CHAR per
  prompt character, pitched by voice; it lists the engine options voices and voice, as a
  speech stage does. Where the request streams (a chunk window), it emits the sine in
  TONE_CHUNKS chunks (tensor `audio`, and `sample_rate`), as a streamed vocoder does; with
  TONE_GATE_ENV set to a folder, a prompt `gated <name> ...` holds its last chunk back until
  the file <folder>/<name> exists, so a test sees what reached the client before that chunk.

`omnistage serve` and its workers learn them through OMNISTAGE_STAGE_KINDS=ENTRY.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.admission import ExecutionContext
from omnistage.batching import Emit
from omnistage.executors.base import BadRequest, Executor, Outcome, StageIO
from omnistage.kinds import ENV_VAR, Payload, StageKind
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor

TONE_RATE = 22050
TONE_CHUNKS = 4
TONE_GATE_ENV = "OMNISTAGE_TEST_TONE_GATE"
SECONDS_PER_CHAR = 0.02
PITCH = {"default": 220.0, "alto": 440.0, "bass": 110.0}


class _ListenRequest(StageParams):
    prompt: str = ""
    messages: list[dict[str, Any]] | None = None
    stream: bool = False


@dataclass
class ListenJob:
    text: str
    prompt_tokens: int
    stream: bool


def describe_inputs(tensors: Mapping[str, WireTensor]) -> list[str]:
    """`image <i> WxH` / `audio <i> N samples` for each input tensor, in index order."""
    out = []
    for name in sorted(tensors, key=lambda n: int(n.rpartition(".")[2] or 0)):
        kind, _, index = name.partition(".")
        shape = tensors[name].shape
        if kind == "input_image":
            out.append(f"image {index} {shape[1]}x{shape[0]}")
        elif kind == "input_audio":
            out.append(f"audio {index} {shape[0]} samples")
    return out


class ListenExecutor(Executor):
    kind = "listen"

    def load(self) -> None:
        self.params = stage_params("listen", _ListenRequest)

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> ListenJob:
        req = self.parse(self.params, params)
        said = str(req.messages[-1].get("content", "")) if req.messages else req.prompt
        text = " ".join([said, *describe_inputs(tensors)])
        return ListenJob(text, len(req.prompt.split()), req.stream)

    def cost(self, job: ListenJob) -> int:
        return 1

    def execute(self, job: ListenJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        words = job.text.split(" ")
        if job.stream:
            for i, word in enumerate(words):
                emit({"text": word if i == 0 else " " + word})
        return Outcome({"text": job.text, "finish_reason": "stop",
                        "prompt_tokens": job.prompt_tokens, "completion_tokens": len(words)})


class _ToneRequest(StageParams):
    prompt: str = ""


@dataclass
class ToneJob:
    text: str
    voice: str


class ToneExecutor(Executor):
    kind = "tone"

    def load(self) -> None:
        self.params = stage_params("tone", _ToneRequest)
        self.voices = list(self.engine.voices or ["default"])

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> ToneJob:
        req = self.parse(self.params, params)
        voice = req.options(self.engine).voice or self.voices[0]
        if voice not in self.voices:
            raise BadRequest(f"params.voice: unknown voice {voice!r}")
        return ToneJob(req.prompt, voice)

    def cost(self, job: ToneJob) -> int:
        return 1

    def execute(self, job: ToneJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        samples = max(1, round(len(job.text) * SECONDS_PER_CHAR * TONE_RATE))
        t = np.arange(samples, dtype=np.float32) / TONE_RATE
        wave = (0.5 * np.sin(2 * np.pi * PITCH.get(job.voice, 330.0) * t)).astype(np.float32)
        io = StageIO.of(emit)
        if io.streams_output:
            rate = np.array([TONE_RATE], np.int32)
            pieces = np.array_split(wave, TONE_CHUNKS)
            for i, piece in enumerate(pieces):
                if i == len(pieces) - 1:
                    self._gate(job.text, ctx)
                elif i:
                    ctx.token.wait(0.01)  # a little work per chunk, as a vocoder's window
                ctx.check()
                io.emit_chunk(tensors={"audio": piece, "sample_rate": rate})
        return Outcome({"sample_rate": TONE_RATE}, {"audio": wave})


    @staticmethod
    def _gate(text: str, ctx: ExecutionContext) -> None:
        """A `gated <name>` prompt waits (abortable) for the test's file <gate folder>/<name>."""
        folder = os.environ.get(TONE_GATE_ENV)
        words = text.split()
        if not folder or len(words) < 2 or words[0] != "gated":
            return
        gate = Path(folder) / words[1]
        while not gate.exists():
            if ctx.token.wait(0.02):
                ctx.check()  # aborted: ends the request here


LISTEN = StageKind(
    name="listen", executor=f"{__name__}:ListenExecutor",
    summary="test only: says what it received", needs_model=False,
    consumes=frozenset({Payload.TEXT, Payload.IMAGE, Payload.AUDIO}),
    emits=frozenset({Payload.TEXT, Payload.TOKENS}))
TONE = StageKind(
    name="tone", executor=f"{__name__}:ToneExecutor",
    summary="test only: a sine per prompt", needs_model=False,
    engine_options=("voices", "voice"),
    consumes=frozenset({Payload.TEXT}), emits=frozenset({Payload.AUDIO}),
    chunked_output=True)
KINDS = [LISTEN, TONE]
ENTRY = f"{__name__}:KINDS"
VOICES = ["alto", "bass"]
_ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def kinds_env() -> Iterator[None]:
    """Inside the block, processes started (an `omnistage serve`, and so its workers) know
    these kinds: OMNISTAGE_STAGE_KINDS names them and PYTHONPATH reaches this module."""
    saved = {k: os.environ.get(k) for k in (ENV_VAR, "PYTHONPATH")}
    os.environ[ENV_VAR] = ENTRY
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(_ROOT), str(_ROOT / "runtime"), str(_ROOT / "operator"), saved["PYTHONPATH"] or ""])
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def manifest(name: str, speech: bool) -> dict[str, Any]:
    """`talk` (listen), and with speech `talk -> speak` (tone, voices VOICES)."""
    stages: list[dict[str, Any]] = [
        {"name": "talk", "kind": "listen", "finalOutput": not speech, "replicas": 1,
         "resources": {"cpu": "1", "memory": "256Mi"}}]
    if speech:
        stages.append({"name": "speak", "kind": "tone", "inputs": ["talk"], "finalOutput": True,
                       "engine": {"voices": VOICES}, "replicas": 1,
                       "resources": {"cpu": "1", "memory": "256Mi"}})
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {"orchestrator": {"api": ["chat", "speech", "generic"]}, "stages": stages}}
