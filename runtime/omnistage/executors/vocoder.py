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

Batching (engine.maxBatchSize, omnistage.batching): a step decodes the next window of every
request, windows of equal length in one forward pass (_VocoderBatch); one request alone runs
the same steps in a batch of one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, BatchExecutor, Emit, Outcome, StageIO
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


class VocoderExecutor(BatchExecutor):
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

    # ---- batching --------------------------------------------------------------------------

    def new_batch(self) -> _VocoderBatch:
        return _VocoderBatch(self)

    def _decode(self, windows: list[tuple[Any, int]]) -> list[Any]:
        """Decode windows of equal length in one forward pass, each trimmed of its left context:
        float32 numpy samples per window. Equal lengths need no padding (Code2Wav's convolutions
        and sliding-window attention take no mask), so each row computes what it would alone."""
        import torch

        codes = torch.stack([c.t() for c, _ in windows])  # [windows, quantizers, frames]
        wav = self.model(codes)
        return [wav[i][..., context * self.upsample:].reshape(-1).float().clamp(-1.0, 1.0)
                .cpu().numpy() for i, (_, context) in enumerate(windows)]

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

    def take(self, final: bool) -> tuple[Any, int] | None:
        """The next window ready (final: the input ended, so a short last one is too), as
        (codes with left context [n, quantizers], context frames); None when none is."""
        if not (self.seen - self.decoded >= self.size or (final and self.decoded < self.seen)):
            return None
        start, end = self.decoded, min(self.decoded + self.size, self.seen)
        context = min(LEFT_CONTEXT, start)  # chunked_decode's rule
        window = self.buf[start - context - self.base:end - self.base], context
        self.decoded = end
        keep = max(0, end - LEFT_CONTEXT)
        self.buf, self.base = self.buf[keep - self.base:], keep
        return window

    @property
    def done(self) -> bool:
        return self.decoded == self.seen


@dataclass(eq=False)
class _Voice:
    """One request of a vocoder batch."""

    job: VocoderJob
    io: StageIO
    windows: _Windows
    ended: bool  # no more input comes (whole codes, or the feed's end arrived)
    pieces: list[Any] = field(default_factory=list)
    error: BaseException | None = None  # refused when it joined; answered at the next step


class _VocoderBatch:
    """The requests of one vocoder; the engine thread calls it between steps.

    A step takes what each fed request's feed holds now (without waiting for it), then decodes
    the next ready window of every request, those of equal length in one forward pass (a
    request's windows are cut by frame index, so they are the same alone or batched: see the
    module docstring). A request whose input has not come yet sits the step out; a request's
    bad chunk or failed hand-on fails it alone.
    """

    def __init__(self, ex: VocoderExecutor) -> None:
        self.ex = ex
        self.voices: dict[int, _Voice] = {}
        self.forwards = 0  # decode passes run (tests: a batch really shared them)

    def add(self, seq: int, job: VocoderJob, emit: Emit) -> None:
        ex, io = self.ex, StageIO.of(emit)
        voice = _Voice(job, io, _Windows(job.chunk_frames, ex.quantizers, ex.device),
                       ended=not io.fed)
        if job.codes is None and not io.fed:
            voice.error = BadRequest("tensors.codec_codes is required (a talker's output)")
        elif job.codes is not None:
            voice.windows.add(job.codes)
        self.voices[seq] = voice

    def abort(self, seq: int) -> Outcome:
        return self.ex._outcome(self.voices.pop(seq).pieces, aborted=True)

    def expire(self, seq: int) -> DeadlineExceeded:
        voice = self.voices.pop(seq)
        return DeadlineExceeded(f"deadline passed after {voice.windows.decoded} decoded frames")

    def step(self) -> dict[int, Outcome | BaseException]:
        import torch

        done: dict[int, Outcome | BaseException] = {}
        ready: dict[int, tuple[Any, int]] = {}
        for sid, voice in list(self.voices.items()):
            try:
                if voice.error is not None:
                    raise voice.error
                self._take_input(voice)
                window = voice.windows.take(final=voice.ended)
            except Exception as exc:
                done[sid] = exc
                del self.voices[sid]
                continue
            if window is not None:
                ready[sid] = window
            elif voice.ended and voice.windows.done:
                done[sid] = self.ex._outcome(self.voices.pop(sid).pieces)
        groups: dict[int, list[int]] = {}
        for sid, (codes, _) in ready.items():
            groups.setdefault(int(codes.shape[0]), []).append(sid)
        with torch.inference_mode():
            for sids in groups.values():
                self.forwards += 1
                pieces = self.ex._decode([ready[sid] for sid in sids])
                for sid, piece in zip(sids, pieces, strict=True):
                    self._hand_on(sid, piece, done)
        if not ready and not done:
            self._wait()
        return done

    def _take_input(self, voice: _Voice) -> None:
        """The fed chunks waiting now, checked into the request's windows."""
        if voice.ended:
            return
        chunks, voice.ended = voice.io.poll()
        for chunk in chunks:
            wt = chunk.tensors.get("codec_codes")
            if wt is None:
                raise BadRequest(f"feed {chunk.seq}: tensors.codec_codes is required (a "
                                 "talker's chunk)")
            voice.windows.add(self.ex._codes(wt, f"feed {chunk.seq}: tensors.codec_codes",
                                             voice.windows.seen))

    def _hand_on(self, sid: int, piece: Any, done: dict[int, Outcome | BaseException]) -> None:
        """Keep a decoded window's audio and hand it on as one chunk (with its rate: a
        streaming client encodes each chunk as it comes, docs/http-api.md); finished: its
        outcome."""
        import numpy as np

        voice = self.voices[sid]
        voice.pieces.append(piece)
        try:
            voice.io.emit_chunk(tensors={"audio": piece, "sample_rate": np.array(
                [self.ex.sample_rate], np.int32)})
        except Exception as exc:  # ended while waiting for credit: this request alone
            done[sid] = exc
            del self.voices[sid]
            return
        if voice.ended and voice.windows.done:
            done[sid] = self.ex._outcome(self.voices.pop(sid).pieces)

    def _wait(self) -> None:
        """Nothing to decode: wait a moment for a fed request's next chunk, not a busy loop."""
        StageIO.wait_any([v.io for v in self.voices.values() if not v.ended])
