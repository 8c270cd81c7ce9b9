"""Autoregressive executor: a transformers causal LM with token streaming and abort.

Generation is a hand-written decode loop over the model's KV cache rather than generate(), so
the worker can stream every token, honour abort between tokens (returning the prefix) and
hand the last-layer hidden states to downstream stages.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, Emit, Executor, Outcome
from omnistage.models import load_causal_lm
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor


class _ARRequest(StageParams):
    prompt: str | None = None
    # Chat turns ({"role", "content"}): rendered with the tokenizer's chat template when it has
    # one; otherwise prompt (the orchestrator's model-agnostic rendering) is used.
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None
    stream: bool = False
    ignore_eos: bool = False


ARParams = stage_params("ar", _ARRequest)


@dataclass
class ARJob:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    return_hidden: bool
    ignore_eos: bool
    generated: list[int] = field(default_factory=list)


class ARExecutor(Executor):
    kind = "ar"

    def load(self) -> None:
        model = self.model_source or "tiny-llama"
        self.model, self.tokenizer = load_causal_lm(model, self.device, self.engine.dtype)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; support both spellings.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.hidden_size = int(self.model.config.hidden_size)

    def warmup(self) -> None:
        job = self.prepare({"prompt": "warmup", "max_tokens": 2}, {})
        self.execute(job, ExecutionContext(), lambda _d: None)

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> ARJob:
        req = self.parse(ARParams, params)
        opts = req.options(self.engine)
        if req.token_ids is not None:
            vocab = len(self.tokenizer)
            bad = next((i for i, t in enumerate(req.token_ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"params.token_ids[{bad}] must be a token id in [0, {vocab}), "
                                 f"got {req.token_ids[bad]}")
            ids = list(req.token_ids)
        elif req.messages is not None and getattr(self.tokenizer, "chat_template", None):
            ids = self._chat_ids(req.messages)
        elif req.prompt is not None:
            ids = self.tokenizer(req.prompt).input_ids
        else:
            raise BadRequest("params.prompt is required (or params.token_ids; params.messages "
                             "only with a model that has a chat template)")
        if not ids:
            ids = [self.tokenizer.bos_token_id]
        if len(ids) + opts.max_tokens > self.context_len:
            # Blame what the client sent: its max_tokens, else the prompt (the stage's default
            # max_tokens is not the client's to fix).
            field = "max_tokens" if req.max_tokens is not None else "prompt"
            raise BadRequest(
                f"params.{field}: prompt ({len(ids)} tokens) + max_tokens ({opts.max_tokens}) "
                f"exceeds the model context of {self.context_len}"
            )
        return ARJob(
            prompt_ids=list(ids),
            max_tokens=opts.max_tokens,
            temperature=opts.temperature,
            seed=opts.seed,
            stream=req.stream,
            return_hidden=opts.return_hidden_states,
            ignore_eos=req.ignore_eos,
        )

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The model's own chat template, ending with the assistant's turn."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # jinja errors: a template that rejects these turns
            raise BadRequest(f"params.messages: the model's chat template refused them: "
                             f"{exc}") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def cost(self, job: ARJob) -> int:
        return len(job.prompt_ids) + job.max_tokens

    def execute(self, job: ARJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        import torch

        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        eos = self.tokenizer.eos_token_id
        ids = torch.tensor([job.prompt_ids], device=self.device)
        cache = None
        hidden: list[Any] = []
        emitted_text = ""
        finish = "length"
        with torch.inference_mode():
            step = 0
            while True:
                out = self.model(
                    input_ids=ids,
                    use_cache=True,
                    output_hidden_states=job.return_hidden,
                    **{self._cache_arg: cache},
                )
                cache = getattr(out, self._cache_arg, None)
                if job.return_hidden:
                    hidden.append(out.hidden_states[-1][0])
                if step >= job.max_tokens:
                    break
                if ctx.token.cancelled:
                    return self._aborted(job)
                if ctx.deadline is not None and ctx.remaining() <= 0:
                    raise DeadlineExceeded(
                        f"deadline passed after {len(job.generated)} generated tokens"
                    )
                logits = out.logits[0, -1].float()
                if job.temperature > 0:
                    probs = torch.softmax(logits / job.temperature, dim=-1).cpu()
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                else:
                    tok = int(torch.argmax(logits))
                if tok == eos and not job.ignore_eos:
                    finish = "stop"
                    break
                job.generated.append(tok)
                step += 1
                if job.stream:
                    text = self._text(job.generated)
                    if not text.endswith("\ufffd") and len(text) > len(emitted_text):
                        emit({"text": text[len(emitted_text):], "token_ids": [tok]})
                        emitted_text = text
                    else:
                        emit({"text": "", "token_ids": [tok]})
                ids = torch.tensor([[tok]], device=self.device)
        text = self._text(job.generated)
        if job.stream and len(text) > len(emitted_text):
            # Flush what was held back waiting for a complete UTF-8 sequence.
            emit({"text": text[len(emitted_text):], "token_ids": []})
        fields = {
            "text": text,
            "token_ids": job.generated,
            "finish_reason": finish,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(job.generated),
        }
        tensors = {}
        if job.return_hidden and hidden:
            tensors["hidden_states"] = torch.cat(hidden, dim=0).float()
        return Outcome(fields, tensors)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _aborted(self, job: ARJob) -> Outcome:
        return Outcome(
            {
                "text": self._text(job.generated),
                "token_ids": list(job.generated),
                "finish_reason": "abort",
                "prompt_tokens": len(job.prompt_ids),
                "completion_tokens": len(job.generated),
            },
            aborted=True,
        )

    def aborted_before_start(self, job: ARJob) -> Outcome:
        return self._aborted(job)

    def sleep(self) -> None:
        if self.device.type != "cpu":
            self.model.to("cpu")
        super().sleep()

    def wake_up(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
        super().wake_up()
