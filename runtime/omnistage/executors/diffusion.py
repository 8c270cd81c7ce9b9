"""Diffusion executor: UNet + scheduler + VAE, conditioned on upstream hidden states.

The denoising loop is written out so abort is checked between steps; an aborted sample is
dropped whole (no partial image), as the orchestration contract requires.

Compatible requests (same height, width, steps and guidance, and conditioning of the same
number of tokens) denoise as one batch: their latents are stacked, each drawn from its own
seeded generator, so a sample is the same image it would be alone. Conditioning is not padded:
masked padding changes the float rounding of cross-attention, and so a few pixel values, which
would break "same seed, same image". A batch takes its requests when it starts (its samples
share the scheduler's timesteps); a cancelled sample leaves it at the next step.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, BatchExecutor, Emit, Outcome
from omnistage.models import ModelRef, load_diffusion, torch_dtype
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
        ref = ModelRef("diffusion", self.model_source or "tiny-unet")
        self.dtype = torch_dtype(self.engine.dtype)
        self.unet, self.vae, self.scheduler_template = load_diffusion(
            ref, self.device, self.engine.dtype
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
        """Same size, steps and guidance, and conditioning of the same length (see the module
        docstring); a request conditioned on a batch of its own ([batch, tokens, dim] with
        batch > 1) runs alone."""
        if job.cond.shape[0] != 1 or (job.neg is not None and job.neg.shape[0] != 1):
            return object()
        return (job.height, job.width, job.steps, job.guidance, job.cond.shape[1],
                None if job.neg is None else job.neg.shape[1])

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


class _DiffusionBatch:
    """Samples that denoise together; the engine thread calls it between steps."""

    def __init__(self, ex: DiffusionExecutor) -> None:
        self.ex = ex
        self.seqs: list[int] = []  # row order
        self.jobs: list[DiffusionJob] = []
        self.step_index = -1  # -1: not started; steps: denoised, the next step decodes

    def add(self, seq: int, job: DiffusionJob, emit: Emit) -> None:
        if self.step_index >= 0:
            raise RuntimeError("a diffusion batch takes requests only before its first step")
        self.seqs.append(seq)
        self.jobs.append(job)

    def abort(self, seq: int) -> Outcome:
        self._drop(seq)
        return Outcome(aborted=True)

    def expire(self, seq: int) -> DeadlineExceeded:
        self._drop(seq)
        return DeadlineExceeded(f"deadline passed at denoising step {max(self.step_index, 0)}")

    def step(self) -> dict[int, Outcome]:
        import torch

        with torch.inference_mode():
            if self.step_index < 0:
                self._start()
            if self.step_index < len(self.timesteps):
                self._denoise(self.timesteps[self.step_index])
                self.step_index += 1
                return {}
            return self._decode()

    def _start(self) -> None:
        import torch

        ex, first = self.ex, self.jobs[0]
        self.sched = type(ex.scheduler_template).from_config(ex.scheduler_template.config)
        self.sched.set_timesteps(first.steps)
        self.timesteps = list(self.sched.timesteps)
        shape = (1, ex.unet.config.in_channels, first.height // ex.scale, first.width // ex.scale)
        noise = [torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(j.seed))
                 for j in self.jobs]
        self.latents = torch.cat(noise).to(ex.device, ex.dtype) * self.sched.init_noise_sigma
        self.guidance = first.guidance
        self.cfg = first.neg is not None or first.guidance > 1.0
        self.cond = torch.cat([j.cond for j in self.jobs])
        self.uncond = torch.cat([j.neg if j.neg is not None else torch.zeros_like(j.cond[:, :1])
                                 for j in self.jobs]) if self.cfg else None
        self.step_index = 0

    def _denoise(self, ts: Any) -> None:
        inp = self.sched.scale_model_input(self.latents, ts)
        eps = self.ex.unet(inp, ts, encoder_hidden_states=self.cond).sample
        if self.cfg:
            eps_u = self.ex.unet(inp, ts, encoder_hidden_states=self.uncond).sample
            eps = eps_u + self.guidance * (eps - eps_u)
        self.latents = self.sched.step(eps, ts, self.latents).prev_sample

    def _decode(self) -> dict[int, Outcome]:
        import torch

        vae = self.ex.vae
        images = vae.decode(self.latents / vae.config.scaling_factor).sample
        pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        done = {}
        for row, (seq, job) in enumerate(zip(self.seqs, self.jobs, strict=True)):
            fields = {"height": job.height, "width": job.width, "steps": job.steps,
                      "finish_reason": "stop"}
            done[seq] = Outcome(fields, {"image": pixels[row].permute(1, 2, 0).contiguous()})
        self.seqs, self.jobs = [], []
        return done

    def _drop(self, seq: int) -> None:
        import torch

        row = self.seqs.index(seq)
        del self.seqs[row], self.jobs[row]
        if self.step_index < 0 or not self.seqs:
            return
        keep = torch.tensor([i for i in range(len(self.seqs) + 1) if i != row],
                            device=self.latents.device)
        self.latents = self.latents.index_select(0, keep)
        self.cond = self.cond.index_select(0, keep)
        if self.uncond is not None:
            self.uncond = self.uncond.index_select(0, keep)

