"""Diffusion executor: UNet + scheduler + VAE, conditioned on upstream hidden states.

The denoising loop is written out so abort is checked between steps; an aborted sample is
dropped whole (no partial image), as the orchestration contract requires.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, Emit, Executor, Outcome
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


class DiffusionExecutor(Executor):
    kind = "diffusion"

    def load(self) -> None:
        model = self.model_source or "tiny-unet"
        self.dtype = torch_dtype(self.engine.dtype, self.device)
        self.unet, self.vae, self.scheduler_template = load_diffusion(
            model, self.device, self.engine.dtype
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

    def execute(self, job: DiffusionJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        import torch

        sched = type(self.scheduler_template).from_config(self.scheduler_template.config)
        sched.set_timesteps(job.steps)
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        shape = (1, self.unet.config.in_channels, job.height // self.scale,
                 job.width // self.scale)
        latents = torch.randn(shape, generator=gen).to(self.device, self.dtype)
        latents = latents * sched.init_noise_sigma
        use_cfg = job.neg is not None or job.guidance > 1.0
        uncond = job.neg if job.neg is not None else torch.zeros_like(job.cond[:, :1])
        with torch.inference_mode():
            for i, ts in enumerate(sched.timesteps):
                if ctx.token.cancelled:
                    return Outcome(aborted=True)
                if ctx.deadline is not None and ctx.remaining() <= 0:
                    raise DeadlineExceeded(f"deadline passed at denoising step {i}")
                inp = sched.scale_model_input(latents, ts)
                eps = self.unet(inp, ts, encoder_hidden_states=job.cond).sample
                if use_cfg:
                    eps_u = self.unet(inp, ts, encoder_hidden_states=uncond).sample
                    eps = eps_u + job.guidance * (eps - eps_u)
                latents = sched.step(eps, ts, latents).prev_sample
            if ctx.token.cancelled:
                return Outcome(aborted=True)
            image = self.vae.decode(latents / self.vae.config.scaling_factor).sample
        pixels = ((image[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        fields = {"height": job.height, "width": job.width, "steps": job.steps,
                  "finish_reason": "stop"}
        return Outcome(fields, {"image": pixels.permute(1, 2, 0).contiguous()})

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
