"""Vocoder executor: a Qwen3-Omni Code2Wav turns codec codes [frames, quantizers] into mono PCM.

It decodes `chunk_frames` frames at a time, each window with up to LEFT_CONTEXT frames of left
context that it re-decodes and trims (the rule of the model's own chunked_decode, as Qwen's
generate does), so long answers keep bounded memory.

Streaming (its kind row says chunked input and output): fed by a talker, it decodes each window
as soon as its frames have arrived, and hands each window's audio on as one chunk (tensor
`audio` float32 [samples]) to a downstream that streams. The windows are the same whether the
codes come whole or in chunks of any size, so streamed and whole decoding run the same
computations on the same inputs: the audio is identical, not merely close. (Code2Wav's output
depends on where windows start: its transformer's positions restart in each window and each
window's last samples are trimmed, so decoding the talker's chunks as they happen to come would
not match.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.admission import ExecutionContext
from omnistage.executors.base import BadRequest, Emit, Executor, Outcome, StageIO
from omnistage.models import load_vocoder
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor

#: Frames of left context each decode window re-decodes (Qwen's generate).
LEFT_CONTEXT = 25
#: Most frames one request may carry (about 22 minutes of Qwen3-Omni speech).
MAX_FRAMES = 16_384


class _VocoderRequest(StageParams):
    pass


VocoderParams = stage_params("vocoder", _VocoderRequest)


@dataclass
class VocoderJob:
    codes: Any  # [frames, quantizers] int64 on the device; None: fed in chunks (streaming)
    chunk_frames: int  # frames per decode window (engine.chunk_frames)


class VocoderExecutor(Executor):
    kind = "vocoder"

    def load(self) -> None:
        self.model, self.sample_rate = load_vocoder(
            self.model_source or "tiny-omni-vocoder", self.device, self.engine.dtype, self.kind)
        self.quantizers = int(self.model.config.num_quantizers)
        self.codebook = int(self.model.config.codebook_size)
        self.upsample = int(self.model.total_upsample)

    def warmup(self) -> None:
        import numpy as np

        codes = np.zeros((2, self.quantizers), dtype=np.int64)
        wt = WireTensor("int64", codes.shape, memoryview(codes.tobytes()))
        self.execute(self.prepare({}, {"codec_codes": wt}), ExecutionContext(), lambda _d: None)

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> VocoderJob:
        req: Any = self.parse(VocoderParams, params)
        opts = req.options(self.engine)
        wt = tensors.get("codec_codes")
        codes = None if wt is None else self._codes(wt, "tensors.codec_codes", 0)
        return VocoderJob(codes, opts.chunk_frames)

    def _codes(self, wt: WireTensor, name: str, before: int) -> Any:
        """A codes tensor checked (dtype, shape, range, MAX_FRAMES with `before` frames already
        taken) and copied onto the device; BadRequest names it."""
        if wt.dtype != "int64" or len(wt.shape) != 2 or wt.shape[1] != self.quantizers:
            raise BadRequest(f"{name} must be int64 [frames, {self.quantizers}], got "
                             f"{wt.dtype} {list(wt.shape)}")
        if before + wt.shape[0] > MAX_FRAMES:
            raise BadRequest(f"{name}: at most {MAX_FRAMES} frames, got {before + wt.shape[0]}")
        codes = wt.torch(self.device).clone()  # a fed chunk may be a view of shared memory
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
            raise BadRequest(f"{name}: codes must be in [0, {self.codebook})")
        return codes

    def cost(self, job: VocoderJob) -> int:
        """Frames; a fed request holds one window and its context at a time."""
        if job.codes is None:
            return job.chunk_frames + LEFT_CONTEXT
        return max(1, int(job.codes.shape[0]))

    def execute(self, job: VocoderJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        import torch

        io = StageIO.of(emit)
        if job.codes is None and not io.fed:
            raise BadRequest("tensors.codec_codes is required (a talker's output)")
        ctx.check()
        pieces: list[Any] = []
        with torch.inference_mode():
            window = _Windows(job.chunk_frames, self.quantizers, self.device)
            if job.codes is not None:
                window.add(job.codes)
            for chunk in io.inputs():
                wt = chunk.tensors.get("codec_codes")
                if wt is None:
                    raise BadRequest(f"feed {chunk.seq}: tensors.codec_codes is required (a "
                                     "talker's chunk)")
                window.add(self._codes(wt, f"feed {chunk.seq}: tensors.codec_codes",
                                       window.seen))
                if not self._decode_ready(window, ctx, io, pieces, final=False):
                    return self._outcome(pieces, aborted=True)
            if not self._decode_ready(window, ctx, io, pieces, final=True):
                return self._outcome(pieces, aborted=True)
        return self._outcome(pieces)

    def _decode_ready(self, window: _Windows, ctx: ExecutionContext, io: StageIO,
                      pieces: list[Any], final: bool) -> bool:
        """Decode every full window (final: and the rest), each handed on as one chunk; False
        when the request was aborted meanwhile."""
        import numpy as np

        for codes, context in window.ready(final):
            if ctx.token.cancelled:
                return False
            ctx.check()
            wav = self.model(codes.t().unsqueeze(0))[..., context * self.upsample:]
            piece = wav.reshape(-1).float().clamp(-1.0, 1.0).cpu().numpy()
            pieces.append(piece)
            # Its rate too: a streaming client encodes each chunk as it comes (docs/http-api.md).
            io.emit_chunk(tensors={"audio": piece,
                                   "sample_rate": np.array([self.sample_rate], np.int32)})
        return True

    def _outcome(self, pieces: list[Any], aborted: bool = False) -> Outcome:
        import numpy as np
        import torch

        audio = torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, np.float32))
        return Outcome({"sample_rate": self.sample_rate,
                        "finish_reason": "abort" if aborted else "stop"},
                       {"audio": audio}, aborted=aborted)


class _Windows:
    """The frames taken so far, cut into decode windows of `size` frames: the cut depends only
    on the frame index, never on how the frames arrived (whole or in chunks of any size)."""

    def __init__(self, size: int, quantizers: int, device: Any) -> None:
        import torch

        self.size = size
        self.buf = torch.zeros((0, quantizers), dtype=torch.int64, device=device)
        self.base = 0  # the frame index of buf[0]: older frames are no context any more
        self.decoded = 0  # frames decoded so far
        self.seen = 0  # frames taken so far

    def add(self, codes: Any) -> None:
        import torch

        self.buf = torch.cat([self.buf, codes]) if self.buf.shape[0] else codes
        self.seen += int(codes.shape[0])

    def ready(self, final: bool) -> Any:
        """(codes with left context [n, quantizers], context frames) of each window ready."""
        while self.seen - self.decoded >= self.size or (final and self.decoded < self.seen):
            start, end = self.decoded, min(self.decoded + self.size, self.seen)
            context = min(LEFT_CONTEXT, start)  # chunked_decode's rule
            yield self.buf[start - context - self.base:end - self.base], context
            self.decoded = end
            keep = max(0, end - LEFT_CONTEXT)
            self.buf, self.base = self.buf[keep - self.base:], keep
