"""Vocoder executor: a Qwen3-Omni Code2Wav turns codec codes [frames, quantizers] into mono PCM.

It decodes with the model's own chunked_decode (chunks with left context, as Qwen's generate
does), so long answers keep bounded memory; the streaming hand-off will feed it frame chunks
with that left context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.admission import ExecutionContext
from omnistage.executors.base import BadRequest, Emit, Executor, Outcome
from omnistage.models import load_vocoder
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor

#: Frames per decode chunk and the left context each chunk re-decodes (Qwen's generate).
CHUNK_FRAMES = 300
LEFT_CONTEXT = 25
#: Most frames one request may carry (about 22 minutes of Qwen3-Omni speech).
MAX_FRAMES = 16_384


class _VocoderRequest(StageParams):
    pass


VocoderParams = stage_params("vocoder", _VocoderRequest)


@dataclass
class VocoderJob:
    codes: Any  # [1, quantizers, frames] int64


class VocoderExecutor(Executor):
    kind = "vocoder"

    def load(self) -> None:
        self.model, self.sample_rate = load_vocoder(
            self.model_source or "tiny-omni-vocoder", self.device, self.engine.dtype, self.kind)
        self.quantizers = int(self.model.config.num_quantizers)
        self.codebook = int(self.model.config.codebook_size)

    def warmup(self) -> None:
        import numpy as np

        codes = np.zeros((2, self.quantizers), dtype=np.int64)
        wt = WireTensor("int64", codes.shape, memoryview(codes.tobytes()))
        self.execute(self.prepare({}, {"codec_codes": wt}), ExecutionContext(), lambda _d: None)

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> VocoderJob:
        self.parse(VocoderParams, params)
        wt = tensors.get("codec_codes")
        if wt is None:
            raise BadRequest("tensors.codec_codes is required (a talker's output)")
        if wt.dtype != "int64" or len(wt.shape) != 2 or wt.shape[1] != self.quantizers:
            raise BadRequest(f"tensors.codec_codes must be int64 [frames, {self.quantizers}], "
                             f"got {wt.dtype} {list(wt.shape)}")
        if wt.shape[0] > MAX_FRAMES:
            raise BadRequest(f"tensors.codec_codes: at most {MAX_FRAMES} frames, got "
                             f"{wt.shape[0]}")
        codes = wt.torch(self.device)
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
            raise BadRequest(f"tensors.codec_codes: codes must be in [0, {self.codebook})")
        return VocoderJob(codes.t().unsqueeze(0))

    def cost(self, job: VocoderJob) -> int:
        return max(1, int(job.codes.shape[-1]))

    def execute(self, job: VocoderJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        import torch

        ctx.check()
        with torch.inference_mode():
            if job.codes.shape[-1] == 0:
                wav = torch.zeros(0)
            else:
                wav = self.model.chunked_decode(job.codes, chunk_size=CHUNK_FRAMES,
                                                left_context_size=LEFT_CONTEXT)
        audio = wav.reshape(-1).float().clamp(-1.0, 1.0).cpu()
        return Outcome({"sample_rate": self.sample_rate, "finish_reason": "stop"},
                       {"audio": audio})
