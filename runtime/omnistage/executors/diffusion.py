"""Diffusion executor: UNet + scheduler + VAE, conditioned on upstream hidden states.

The denoising loop is written out so abort is checked between steps; an aborted sample is
dropped whole (no partial image), as the orchestration contract requires.

Compatible requests (same height, width and guidance) denoise as one batch, continuously: a
sample joins between two steps and leaves when its last step is done. Each sample keeps its own
scheduler and timestep (the UNet takes one timestep per row), its own seeded noise, so it is the
same image it would be alone up to float rounding, and may have its own number of steps.
Conditioning of different lengths is right-padded and masked out of cross-attention. A cancelled
sample leaves at the next step.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, BatchExecutor, Emit, Outcome
from omnistage.models import load_diffusion, torch_dtype
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor

COND = "encoder_hidden_states"
NEG_COND = "negative_encoder_hidden_states"


DiffusionParams = stage_params("diffusion", StageParams)


@dataclass
class DiffusionJob:
    cond: Any
    neg: Any
    height: int
    width: int
    steps: int
    guidance: float
    seed: int


class DiffusionExecutor(BatchExecutor):
    kind = "diffusion"

    def load(self) -> None:
        model = self.model_source or "tiny-unet"
        self.dtype = torch_dtype(self.engine.dtype, self.device)
        self.unet, self.vae, self.scheduler_template = load_diffusion(
            model, self.device, self.engine.dtype, self.kind
        )
        self.cross_dim = int(self.unet.config.cross_attention_dim)
        self.scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.multiple = self.scale * 2 ** (len(self.unet.config.block_out_channels) - 1)

    def warmup(self) -> None:
        job = self.prepare({"height": self.multiple * 2, "width": self.multiple * 2,
                            "num_inference_steps": 1}, {})
        self.execute(job, ExecutionContext(), lambda _d: None)

    def _cond(self, tensors: Mapping[str, WireTensor], name: str) -> Any:
        wt = tensors.get(name) or (tensors.get("hidden_states") if name == COND else None)
        if wt is None:
            return None
        if wt.dtype not in ("float32", "float16", "bfloat16"):
            raise BadRequest(f"tensors.{name} must be floating point, got {wt.dtype}")
        shape = wt.shape
        if len(shape) not in (2, 3) or shape[-1] != self.cross_dim or 0 in shape:
            raise BadRequest(
                f"tensors.{name} must have shape [tokens, {self.cross_dim}] or "
                f"[batch, tokens, {self.cross_dim}], got {list(shape)}"
            )
        t = wt.torch(self.device).to(self.dtype)
        return t if t.dim() == 3 else t.unsqueeze(0)

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> Any:
        import torch

        opts = self.parse(DiffusionParams, params).options(self.engine)
        m = self.multiple  # the spec's bounds hold; only the model knows its own multiple
        for key, val in (("height", opts.height), ("width", opts.width)):
            if val % m:
                raise BadRequest(f"params.{key} must be a multiple of {m} for this model, "
                                 f"got {val}")
        cond = self._cond(tensors, COND)
        if cond is None:
            cond = torch.zeros(1, 1, self.cross_dim, device=self.device, dtype=self.dtype)
        neg = self._cond(tensors, NEG_COND)
        return DiffusionJob(cond, neg, opts.height, opts.width, opts.num_inference_steps,
                            opts.guidance_scale, opts.seed)

    def cost(self, job: DiffusionJob) -> int:
        return job.height * job.width * job.steps

    # ---- batching --------------------------------------------------------------------------

    def batch_key(self, job: DiffusionJob) -> Hashable:
        """Same size and guidance (and so the same use of guidance); a request conditioned on
        a batch of its own ([batch, tokens, dim] with batch > 1) runs alone."""
        if job.cond.shape[0] != 1 or (job.neg is not None and job.neg.shape[0] != 1):
            return object()
        return (job.height, job.width, job.guidance, job.neg is not None)

    def new_batch(self) -> _DiffusionBatch:
        return _DiffusionBatch(self)

    def sleep(self) -> None:
        if self.device.type != "cpu":
            self.unet.to("cpu")
            self.vae.to("cpu")
        super().sleep()

    def wake_up(self) -> None:
        if self.device.type != "cpu":
            self.unet.to(self.device)
            self.vae.to(self.device)
        super().wake_up()


@dataclass(eq=False)
class _Sample:
    """One request's denoising state."""

    seq: int
    job: DiffusionJob
    sched: Any  # its own scheduler: per-sample timesteps and state
    latents: Any  # [1, channels, h, w]
    done_steps: int = 0

    @property
    def denoised(self) -> bool:
        return self.done_steps == len(self.sched.timesteps)


class _DiffusionBatch:
    """Samples that share UNet passes; the engine thread calls it between steps."""

    def __init__(self, ex: DiffusionExecutor) -> None:
        self.ex = ex
        self.samples: list[_Sample] = []

    def add(self, seq: int, job: DiffusionJob, emit: Emit) -> None:
        import torch

        ex, template = self.ex, self.ex.scheduler_template
        sched = type(template).from_config(template.config)
        sched.set_timesteps(job.steps)
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        shape = (1, ex.unet.config.in_channels, job.height // ex.scale, job.width // ex.scale)
        latents = torch.randn(shape, generator=gen).to(ex.device, ex.dtype)
        self.samples.append(_Sample(seq, job, sched, latents * sched.init_noise_sigma))

    def abort(self, seq: int) -> Outcome:
        self._remove(seq)
        return Outcome(aborted=True)

    def expire(self, seq: int) -> DeadlineExceeded:
        sample = self._remove(seq)
        return DeadlineExceeded(f"deadline passed at denoising step {sample.done_steps}")

    def step(self) -> dict[int, Outcome]:
        """One denoising step for every sample, then decode those whose last step it was.

        Decoding in the same step, not the next one, answers a request one UNet pass sooner
        and frees its row for a newcomer at once."""
        import torch

        with torch.inference_mode():
            live = [s for s in self.samples if not s.denoised]
            if live:
                self._denoise(live)
            return self._decode([s for s in self.samples if s.denoised])

    def _remove(self, seq: int) -> _Sample:
        sample = next(s for s in self.samples if s.seq == seq)
        self.samples.remove(sample)
        return sample

    def _denoise(self, live: list[_Sample]) -> None:
        import torch

        unet, job = self.ex.unet, live[0].job  # one batch key: the same guidance for all
        ts = [s.sched.timesteps[s.done_steps] for s in live]
        inp = torch.cat([s.sched.scale_model_input(s.latents, t)
                         for s, t in zip(live, ts, strict=True)])
        t = torch.stack(ts)
        cond, mask = _stack_padded([s.job.cond for s in live])
        eps = unet(inp, t, encoder_hidden_states=cond, encoder_attention_mask=mask).sample
        if job.neg is not None or job.guidance > 1.0:
            uncond, umask = _stack_padded([
                s.job.neg if s.job.neg is not None else torch.zeros_like(s.job.cond[:, :1])
                for s in live])
            eps_u = unet(inp, t, encoder_hidden_states=uncond,
                         encoder_attention_mask=umask).sample
            eps = eps_u + job.guidance * (eps - eps_u)
        for row, (s, ts_row) in enumerate(zip(live, ts, strict=True)):
            s.latents = s.sched.step(eps[row:row + 1], ts_row, s.latents).prev_sample
            s.done_steps += 1

    def _decode(self, finished: list[_Sample]) -> dict[int, Outcome]:
        import torch

        if not finished:
            return {}
        vae = self.ex.vae
        latents = torch.cat([s.latents for s in finished])
        images = vae.decode(latents / vae.config.scaling_factor).sample
        pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        done = {}
        for row, s in enumerate(finished):
            job = s.job
            fields = {"height": job.height, "width": job.width, "steps": job.steps,
                      "finish_reason": "stop"}
            done[s.seq] = Outcome(fields, {"image": pixels[row].permute(1, 2, 0).contiguous()})
            self.samples.remove(s)
        return done


def _stack_padded(conds: list[Any]) -> tuple[Any, Any]:
    """[1, tokens_i, dim] tensors as one [n, tokens, dim] batch, right-padded with zeros, and
    the cross-attention mask of real tokens (None when no row needed padding)."""
    import torch
    import torch.nn.functional as F

    longest = max(c.shape[1] for c in conds)
    if all(c.shape[1] == longest for c in conds):
        return torch.cat(conds), None
    mask = torch.zeros(len(conds), longest, device=conds[0].device, dtype=conds[0].dtype)
    for row, c in enumerate(conds):
        mask[row, : c.shape[1]] = 1
    return torch.cat([F.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds]), mask
