"""Autoregressive executor: a transformers causal LM with continuous batching, token streaming
and abort.

Generation is a hand-written decode loop over the model's KV cache rather than generate(), so
the worker can stream every token, honour abort between steps (returning the prefix), hand the
last-layer hidden states to downstream stages, and let sequences join and leave a running batch
between steps (continuous batching, driven by omnistage.batching.BatchScheduler).

A batch keeps one KV cache whose rows are its sequences, left-padded to a common length, with a
per-row attention mask (1 = a real token) and per-row position ids, so a padded row computes
what it would alone. A joining sequence is prefilled on its own (its prompt pass is exactly the
one-at-a-time pass) and its cache row is merged in; a leaving sequence's row is dropped and
columns that are padding in every remaining row are trimmed.

Failover resume (omnistage.orchestrator.failover.Failover.retry): `resume_token_ids` and
`resume_text` are what a lost replica had already streamed to the client. The job starts with them
generated: its prompt pass takes prompt + those tokens, its deltas go on after that text, and its
final reply carries the whole answer. Sampling draws token i from a generator seeded with (seed, i)
(_step_seed), so a resumed sequence samples exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, BatchExecutor, Emit, Outcome, StageIO
from omnistage.executors.prefix_cache import Hit, PrefixCache, PrefixStats, cat_rows
from omnistage.models import load_causal_lm, load_thinker
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
    # A failover resumes a stream (omnistage.orchestrator.failover.Failover.retry): the tokens, and
    # the text, the client already has. Generation goes on after them, as if never cut.
    resume_token_ids: list[int] | None = None
    resume_text: str | None = None


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
    resume_text: str = ""  # the text the client already has (a resumed stream)
    #: Extra keyword inputs of the prompt's forward pass (a thinker's image and audio features).
    prefill_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Seq:
    """One sequence's decoding state."""

    job: ARJob
    emit: Emit
    gen: Any  # torch.Generator, seeded with the job's seed
    hidden: list[Any] = field(default_factory=list)
    emitted_text: str = ""
    prefilled: int = 0  # tokens its prompt pass put in the cache (prompt + resumed)
    next_token: int = -1  # fed at the next decode step
    sent: int = 0  # entries of hidden handed on as chunks (a streaming thinker) ...
    rows_sent: int = 0  # ... and the token rows they held
    rope_delta: int = 0  # a thinker's multimodal RoPE offset: position = tokens + rope_delta


class ARExecutor(BatchExecutor):
    kind = "ar"
    params_model: type[StageParams] = ARParams
    prefix: PrefixCache | None = None  # made at load (engine.prefixCacheMib)

    def load(self) -> None:
        model = self.model_source or "tiny-llama"
        self.model, self.tokenizer = load_causal_lm(model, self.device, self.engine.dtype,
                                                    self.kind)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; support both spellings.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.hidden_size = int(self.model.config.hidden_size)
        self.eos = self.tokenizer.eos_token_id
        self.batchable = _plain_kv_cache(self.model.config)
        self._kv_config = self.model.config
        self.prefix = self._new_prefix_cache()

    def _new_prefix_cache(self) -> PrefixCache | None:
        """engine.prefixCacheMib's cache, for a model whose KV cache is plain tensors (the
        blocks are slices of them); None when it is 0 or the model keeps other state."""
        budget = self.engine.prefix_cache_mib * 2**20
        return PrefixCache(budget) if budget and self.batchable else None

    def prefix_stats(self) -> PrefixStats | None:
        return None if self.prefix is None else self.prefix.stats

    def warmup(self) -> None:
        job = self.prepare({"prompt": "warmup", "max_tokens": 2}, {})
        prefix, self.prefix = self.prefix, None  # its counters are the requests' own
        try:
            self.execute(job, ExecutionContext(), lambda _d: None)
        finally:
            self.prefix = prefix

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> ARJob:
        req: Any = self.parse(self.params_model, params)
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
        resume = list(req.resume_token_ids or ())
        if resume:
            vocab = len(self.tokenizer)
            bad = next((i for i, t in enumerate(resume) if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"params.resume_token_ids[{bad}] must be a token id in "
                                 f"[0, {vocab}), got {resume[bad]}")
            if len(resume) > opts.max_tokens:
                raise BadRequest(f"params.resume_token_ids: {len(resume)} tokens resumed, "
                                 f"more than max_tokens ({opts.max_tokens})")
        if len(ids) + opts.max_tokens > self.context_len:
            # Blame what the client sent: its max_tokens, else the prompt (the stage's default
            # max_tokens is not the client's to fix).
            field = "max_tokens" if req.max_tokens is not None else "prompt"
            raise BadRequest(
                f"params.{field}: prompt ({len(ids)} tokens) + max_tokens ({opts.max_tokens}) "
                f"exceeds the model context of {self.context_len}"
            )
        limit = self.engine.max_batch_tokens
        if limit is not None and len(ids) + opts.max_tokens > limit:
            field = "max_tokens" if req.max_tokens is not None else "prompt"
            raise BadRequest(
                f"params.{field}: prompt ({len(ids)} tokens) + max_tokens ({opts.max_tokens}) "
                f"exceeds the stage's engine.maxBatchTokens of {limit}"
            )
        return ARJob(
            prompt_ids=list(ids),
            max_tokens=opts.max_tokens,
            temperature=opts.temperature,
            seed=opts.seed,
            stream=req.stream,
            return_hidden=opts.return_hidden_states,
            ignore_eos=req.ignore_eos,
            generated=resume,
            resume_text=req.resume_text or "",
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

    # ---- batching --------------------------------------------------------------------------

    def batch_key(self, job: ARJob) -> Hashable:
        # A model whose cache rows cannot be padded and merged runs its requests one at a time.
        return None if self.batchable else object()

    def batch_tokens(self, job: ARJob) -> int:
        """Its whole context (prompt + max_tokens): what its KV cache row may grow to."""
        return self.cost(job)

    def new_batch(self) -> _ARBatch:
        return _ARBatch(self)

    def _forward(self, ids: Any, mask: Any, positions: Any, cache: Any, hidden: bool,
                 **extra: Any) -> Any:
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          use_cache=True, output_hidden_states=hidden,
                          **{self._cache_arg: cache}, **extra)

    def _pick_hidden(self, layers: Any, row: int) -> Any:
        """What a step keeps of its hidden states for downstream stages (one row's)."""
        return layers[-1][row]

    def _prefilled(self, seq: _Seq) -> None:
        """After a sequence's prompt pass, before the next one: what it must keep of the
        model's per-sequence state (a thinker: its RoPE offset)."""

    # ---- prefix cache ----------------------------------------------------------------------

    def _prefix_limit(self, job: ARJob) -> int:
        """How many leading prompt tokens are the same KV in any request that has them."""
        return len(job.prompt_ids)

    def _prefix_lookup(self, seq: _Seq) -> Hit | None:
        if self.prefix is None:
            return None
        job = seq.job
        # At least one token of the pass is computed: its logits give the next token.
        limit = min(self._prefix_limit(job), seq.prefilled - 1)
        return self.prefix.lookup(job.prompt_ids, limit, want_rows=job.return_hidden)

    def _prefix_store(self, seq: _Seq, cache: Any, rows: Any) -> None:
        if self.prefix is not None:
            self.prefix.insert(seq.job.prompt_ids, self._prefix_limit(seq.job),
                               _kv_layers(cache), rows)

    def _cache_from(self, kv: list[tuple[Any, Any]]) -> Any:
        """A fresh KV cache that adopts a hit's keys and values (the lookup's own copies, so
        the blocks stay as they are): each layer is set up empty, then given them."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self._kv_config)
        for i, (k, v) in enumerate(kv):
            cache.update(k[..., :0, :], v[..., :0, :], i)
        _set_kv_layers(cache, kv)
        return cache

    def _suffix_positions(self, seq: _Seq, start: int) -> Any:
        """Position ids [1, n] of a prompt pass that starts at token `start` (after a hit)."""
        import torch

        return torch.arange(start, seq.prefilled, device=self.device).unsqueeze(0)

    def _decode_positions(self, positions: Any, seqs: list[_Seq]) -> Any:
        """A decode step's position ids from each row's token count [rows, 1]."""
        return positions

    def _hidden_tensors(self, seq: _Seq) -> dict[str, Any]:
        import torch

        return {"hidden_states": torch.cat(seq.hidden, dim=0).float()}

    def _advance(self, seq: _Seq, logits: Any, hidden: Any, greedy: int) -> Outcome | None:
        """After a forward pass that fed this sequence: sample its next token. Returns its
        outcome if it finished, else None (its token is fed at the next step)."""
        job = seq.job
        if job.return_hidden:
            seq.hidden.append(hidden)
        if len(job.generated) >= job.max_tokens:
            return self._finished(seq, "length")
        tok = greedy
        if job.temperature > 0:
            import torch

            # Token i draws from the generator seeded with (seed, i): a stream resumed after
            # i tokens (a failover) draws exactly what the uninterrupted one would have.
            seq.gen.manual_seed(_step_seed(job.seed, len(job.generated)))
            probs = torch.softmax(logits / job.temperature, dim=-1).cpu()
            tok = int(torch.multinomial(probs, 1, generator=seq.gen))
        if tok == self.eos and not job.ignore_eos:
            return self._finished(seq, "stop")
        job.generated.append(tok)
        if job.stream:
            text = self._text(job.generated)
            if not text.endswith("\ufffd") and len(text) > len(seq.emitted_text):
                seq.emit({"text": text[len(seq.emitted_text):], "token_ids": [tok]})
                seq.emitted_text = text
            else:
                seq.emit({"text": "", "token_ids": [tok]})
        if len(job.generated) >= job.max_tokens and not job.return_hidden:
            # Done; only hidden states would need the last token fed back through the model.
            return self._finished(seq, "length")
        seq.next_token = tok
        return None

    def _finished(self, seq: _Seq, finish: str) -> Outcome:
        job = seq.job
        text = self._text(job.generated)
        if job.stream and len(text) > len(seq.emitted_text):
            # Flush what was held back waiting for a complete UTF-8 sequence.
            seq.emit({"text": text[len(seq.emitted_text):], "token_ids": []})
        fields = {
            "text": text,
            "token_ids": job.generated,
            "finish_reason": finish,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(job.generated),
        }
        tensors = self._hidden_tensors(seq) if job.return_hidden and seq.hidden else {}
        return Outcome(fields, tensors)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _aborted(self, job: ARJob) -> Outcome:
        """Abort keeps the generated prefix (the orchestration contract)."""
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
        if self.prefix is not None:
            self.prefix.clear()
        if self.device.type != "cpu":
            self.model.to("cpu")
        super().sleep()

    def wake_up(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
        super().wake_up()


ThinkerParams = stage_params("thinker", _ARRequest)
#: Most images and audio clips one request may carry (each costs an encoder pass).
MAX_MEDIA = 16
_MEDIA = re.compile(r"^input_(image|audio)\.(\d+)$")


class ThinkerExecutor(ARExecutor):
    """A Qwen3-Omni thinker: the ar decode loop over the real model, with the request's images
    and audio run through the model's own image processor and audio feature extractor.

    Media come as tensors `input_image.<i>` and `input_audio.<i>` (omnistage.kinds,
    Payload) and go before the prompt's text (at the start of the last user turn of a
    chat-templated one), each as its placeholder tokens in the form the model was trained on
    (<|vision_start|> <|image_pad|>... <|vision_end|>, likewise for audio), as many as its
    encoder makes.

    Continuous batching as for ar: each prompt pass runs alone (its media, its multimodal
    RoPE index computed by the model), then the sequence joins the running batch. The model
    keeps only the last prompt pass's RoPE offset on itself, so each sequence takes its own
    (`_Seq.rope_delta`) and every decode step passes explicit positions: a text position after
    the media is the row's token count + its offset, the same in all three RoPE sections.

    For a talker, its hidden states are those of the layer Qwen's talker reads (the combined
    checkpoint's talker_config.accept_hidden_layer, else the last), with `token_embeds` (input
    embeddings), `token_ids` and `prompt_length` (int64 [1]: where the answer starts).

    Streaming (its kind row says chunked output): when its output streams to a talker, every
    forward pass's new rows go on as one chunk as soon as they exist: the prompt's after the
    prompt pass (with `prompt_length`), then one row per generated token (its hidden state and
    input embedding exist once the token has been fed back). Each chunk carries
    `hidden_states`, `token_embeds` and `token_ids` of its rows; the final reply still carries
    them all.
    """

    kind = "thinker"
    params_model = ThinkerParams

    def load(self) -> None:
        self.model, self.tokenizer, self.image_processor, self.feature_extractor = load_thinker(
            self.model_source or "tiny-omni-thinker", self.device, self.engine.dtype, self.kind)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        text = self.model.config.text_config
        self.context_len = int(text.max_position_embeddings)
        self.hidden_size = int(text.hidden_size)
        self.eos = self.tokenizer.eos_token_id
        self.batchable = _plain_kv_cache(self.model.config.text_config)
        self._kv_config = self.model.config.text_config
        self.prefix = self._new_prefix_cache()
        whole = getattr(self.model, "omni_config", None)
        self.hidden_layer = int(whole.talker_config.accept_hidden_layer) if whole else -1
        tok = self.tokenizer
        #: Where media begin: a prompt's KV is shared only up to its first media (after it,
        #: positions and features are the request's own).
        self._media_starts = {tok.vision_bos_token_id, tok.audio_bos_token_id}

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> ARJob:
        images, audio = self._media(tensors)
        job = super().prepare(params, {})
        if not images and not audio:
            return job
        media, job.prefill_inputs = self._encode_media(images, audio)
        at = self._media_position(job.prompt_ids)
        job.prompt_ids = job.prompt_ids[:at] + media + job.prompt_ids[at:]
        if len(job.prompt_ids) + job.max_tokens > self.context_len:
            raise BadRequest(f"params.prompt: the prompt with its media ({len(job.prompt_ids)} "
                             f"tokens) + max_tokens ({job.max_tokens}) exceeds the model "
                             f"context of {self.context_len}")
        return job

    def _media_position(self, ids: list[int]) -> int:
        """Where media go: at the start of the last user turn's content when the prompt was
        rendered with Qwen's chat template (<|im_start|> user \\n ...), else first."""
        start = self.tokenizer.convert_tokens_to_ids("<|im_start|>")
        user = getattr(self.model.config, "user_token_id", None)
        for i in range(len(ids) - 2, -1, -1):
            if ids[i] == start and ids[i + 1] == user:
                return i + 3
        return 0

    def _media(self, tensors: Mapping[str, WireTensor]) -> tuple[list[Any], list[Any]]:
        """The request's images (uint8 [H, W, 3]) and audio clips (float32 [samples] in
        [-1, 1]) as numpy arrays, in index order; a bad one is named."""
        import numpy as np

        found: dict[str, dict[int, Any]] = {"image": {}, "audio": {}}
        for name, wt in tensors.items():
            m = _MEDIA.match(name)
            if m is None:
                continue
            what, i = m.group(1), int(m.group(2))
            if what == "image":
                if wt.dtype != "uint8" or len(wt.shape) != 3 or wt.shape[2] != 3 \
                        or min(wt.shape[:2]) < 1:
                    raise BadRequest(f"tensors.{name} must be uint8 [height, width, 3] RGB, "
                                     f"got {wt.dtype} {list(wt.shape)}")
                found[what][i] = np.array(wt.numpy())
            else:
                if wt.dtype != "float32" or len(wt.shape) != 1 or wt.shape[0] < 1:
                    raise BadRequest(f"tensors.{name} must be float32 mono PCM [samples], got "
                                     f"{wt.dtype} {list(wt.shape)}")
                pcm = np.array(wt.numpy())
                if not np.isfinite(pcm).all() or float(np.abs(pcm).max()) > 1.0:
                    raise BadRequest(f"tensors.{name}: the audio's samples must be finite "
                                     "and in [-1, 1]")
                found[what][i] = pcm
        for what, got in found.items():
            if sorted(got) != list(range(len(got))):
                raise BadRequest(f"tensors.input_{what}.<i> must be numbered 0, 1, ... without "
                                 f"gaps, got {sorted(got)}")
        if len(found["image"]) + len(found["audio"]) > MAX_MEDIA:
            raise BadRequest(f"tensors: at most {MAX_MEDIA} images and audio clips a request")
        return ([found["image"][i] for i in range(len(found["image"]))],
                [found["audio"][i] for i in range(len(found["audio"]))])

    def _encode_media(self, images: list[Any], audio: list[Any]) -> tuple[list[int], dict]:
        """Placeholder token ids for the media, and the forward pass's inputs for them."""
        import torch
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        from omnistage.media import INPUT_AUDIO_SAMPLE_RATE

        tok, ids, inputs = self.tokenizer, [], {}
        if images:
            pixels, grids = [], []
            for i, image in enumerate(images):
                try:
                    out = self.image_processor(images=[image], return_tensors="pt",
                                               input_data_format="channels_last")
                except ValueError as exc:  # e.g. an aspect ratio the model cannot patch
                    raise BadRequest(f"tensors.input_image.{i}: the model's image processor "
                                     f"refused it: {exc}") from None
                pixels.append(out["pixel_values"])
                grids.append(out["image_grid_thw"])
            merge = int(self.image_processor.merge_size) ** 2
            for grid in torch.cat(grids):
                ids += [tok.vision_bos_token_id,
                        *[tok.image_token_id] * (int(grid.prod()) // merge),
                        tok.vision_eos_token_id]
            inputs["pixel_values"] = torch.cat(pixels).to(self.device, self.model.dtype)
            inputs["image_grid_thw"] = torch.cat(grids).to(self.device)
        if audio:
            # The log-mel STFT reflects half a window at each end: a clip must be longer.
            shortest = int(getattr(self.feature_extractor, "n_fft", 0)) // 2 + 1
            for i, clip in enumerate(audio):
                if clip.shape[0] < shortest:
                    ms = 1000 / INPUT_AUDIO_SAMPLE_RATE
                    raise BadRequest(f"tensors.input_audio.{i}: the audio is too short for this "
                                     f"model: at least {math.ceil(shortest * ms)} ms, got "
                                     f"{clip.shape[0] * ms:.1f} ms ({shortest} and "
                                     f"{clip.shape[0]} samples at {INPUT_AUDIO_SAMPLE_RATE} Hz)")
            out = self.feature_extractor(audio, sampling_rate=INPUT_AUDIO_SAMPLE_RATE,
                                         return_attention_mask=True, padding=True,
                                         return_tensors="pt")
            lengths = out["attention_mask"].sum(-1)
            for n in _get_feat_extract_output_lengths(lengths).tolist():
                ids += [tok.audio_bos_token_id, *[tok.audio_token_id] * int(n),
                        tok.audio_eos_token_id]
            inputs["input_features"] = out["input_features"].to(self.device, self.model.dtype)
            inputs["feature_attention_mask"] = out["attention_mask"].to(self.device)
        return ids, inputs

    def _forward(self, ids: Any, mask: Any, positions: Any, cache: Any, hidden: bool,
                 **extra: Any) -> Any:
        # A prompt pass (positions None) lets the model compute its multimodal RoPE index,
        # which needs a mask; decode steps pass positions (_decode_positions).
        import torch

        if cache is None and mask is None:
            mask = torch.ones_like(ids)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          use_cache=True, output_hidden_states=hidden,
                          **{self._cache_arg: cache}, **extra)

    def _prefilled(self, seq: _Seq) -> None:
        deltas = getattr(self.model.model, "rope_deltas", None)
        seq.rope_delta = 0 if deltas is None else int(deltas.reshape(-1)[0])

    def _prefix_limit(self, job: ARJob) -> int:
        ids = job.prompt_ids
        return next((i for i, t in enumerate(ids) if t in self._media_starts), len(ids))

    def _suffix_positions(self, seq: _Seq, start: int) -> Any:
        """The model's own multimodal RoPE index of the whole pass, from `start` on; the
        sequence keeps its offset (the model would keep a stale one from its last pass)."""
        import torch

        job = seq.job
        ids = torch.tensor([job.prompt_ids + job.generated], device=self.device)
        inputs = job.prefill_inputs
        audio = inputs.get("feature_attention_mask")
        positions, deltas = self.model.model.get_rope_index(
            ids, inputs.get("image_grid_thw"), None, torch.ones_like(ids), False,
            None if audio is None else audio.sum(-1), None)
        seq.rope_delta = int(deltas.reshape(-1)[0])
        return positions[:, :, start:]

    def _decode_positions(self, positions: Any, seqs: list[_Seq]) -> Any:
        """[3, rows, 1]: temporal, height and width positions, equal for generated text."""
        import torch

        delta = torch.tensor([[s.rope_delta] for s in seqs], device=positions.device)
        return (positions + delta).unsqueeze(0).expand(3, -1, -1)

    def _pick_hidden(self, layers: Any, row: int) -> Any:
        return layers[self.hidden_layer][row], layers[0][row]

    def _advance(self, seq: _Seq, logits: Any, hidden: Any, greedy: int) -> Outcome | None:
        outcome = super()._advance(seq, logits, hidden, greedy)
        self._emit_rows(seq)  # before the outcome: every chunk precedes the final reply
        return outcome

    def _emit_rows(self, seq: _Seq) -> None:
        """Hand the rows not yet sent on as one chunk (a no-op unless the output streams)."""
        import torch

        io = StageIO.of(seq.emit)
        fresh = seq.hidden[seq.sent:] if io.streams_output else []
        if not fresh:
            return
        start = seq.rows_sent
        hidden = torch.cat([h for h, _ in fresh], dim=0).float()
        ids = (seq.job.prompt_ids + seq.job.generated)[start:start + hidden.shape[0]]
        tensors = {"hidden_states": hidden,
                   "token_embeds": torch.cat([e for _, e in fresh], dim=0).float(),
                   "token_ids": torch.tensor(ids, dtype=torch.int64)}
        if start == 0:
            tensors["prompt_length"] = torch.tensor([len(seq.job.prompt_ids)], dtype=torch.int64)
        seq.sent, seq.rows_sent = len(seq.hidden), start + int(hidden.shape[0])
        io.emit_chunk(tensors=tensors)

    def _hidden_tensors(self, seq: _Seq) -> dict[str, Any]:
        import torch

        hidden = torch.cat([h for h, _ in seq.hidden], dim=0).float()
        ids = (seq.job.prompt_ids + seq.job.generated)[: hidden.shape[0]]
        return {"hidden_states": hidden,
                "token_embeds": torch.cat([e for _, e in seq.hidden], dim=0).float(),
                "token_ids": torch.tensor(ids, dtype=torch.int64),
                "prompt_length": torch.tensor([len(seq.job.prompt_ids)], dtype=torch.int64)}


class _ARBatch:
    """The running sequences of one AR executor; the engine thread calls it between steps."""

    def __init__(self, ex: ARExecutor) -> None:
        self.ex = ex
        self.joining: dict[int, _Seq] = {}  # added, prefilled at the next step
        self.seqs: dict[int, _Seq] = {}  # in the cache
        self.rows: list[int] = []  # seq ids in cache row order
        self.cache: Any = None
        self.mask: Any = None  # [rows, length] int64, 1 = a real token, 0 = left padding
        self.padded = False  # some row has padding, so the mask must be passed

    def add(self, seq: int, job: ARJob, emit: Emit) -> None:
        import torch

        self.joining[seq] = _Seq(job, emit, torch.Generator(device="cpu").manual_seed(job.seed),
                                 emitted_text=job.resume_text)

    def abort(self, seq: int) -> Outcome:
        return self.ex._aborted(self._remove(seq).job)

    def expire(self, seq: int) -> DeadlineExceeded:
        job = self._remove(seq).job
        return DeadlineExceeded(f"deadline passed after {len(job.generated)} generated tokens")

    def step(self) -> dict[int, Outcome]:
        import torch

        done: dict[int, Outcome] = {}
        with torch.inference_mode():
            if self.joining:
                self._prefill(done)
            if self.rows:
                self._decode(done)
        return done

    def _remove(self, seq: int) -> _Seq:
        if seq in self.joining:
            return self.joining.pop(seq)
        self._drop([self.rows.index(seq)])
        return self.seqs.pop(seq)

    def _prefill(self, done: dict[int, Outcome]) -> None:
        """Each joiner's prompt alone (batch of one, no padding); survivors join the cache."""
        import torch

        ex, joined = self.ex, []
        joining, self.joining = self.joining, {}
        for sid, seq in joining.items():
            job = seq.job
            # A resumed stream's prompt pass takes the tokens already delivered too.
            tokens = job.prompt_ids + job.generated
            seq.prefilled = len(tokens)
            hit = ex._prefix_lookup(seq)
            if hit is None:
                ids = torch.tensor([tokens], device=ex.device)
                out = ex._forward(ids, None, None, None, job.return_hidden,
                                  **job.prefill_inputs)
                ex._prefilled(seq)
            else:  # only what follows the cached prefix is computed
                ids = torch.tensor([tokens[hit.tokens:]], device=ex.device)
                out = ex._forward(ids, None, ex._suffix_positions(seq, hit.tokens),
                                  ex._cache_from(hit.kv), job.return_hidden,
                                  **job.prefill_inputs)
            cache = getattr(out, ex._cache_arg)
            logits = out.logits[0, -1].float()
            hidden = ex._pick_hidden(out.hidden_states, 0) if job.return_hidden else None
            if hit is not None and hidden is not None:
                hidden = cat_rows([hit.rows, hidden])
            ex._prefix_store(seq, cache, hidden)
            outcome = ex._advance(seq, logits, hidden, int(torch.argmax(logits)))
            if outcome is not None:
                done[sid] = outcome
            else:
                joined.append((sid, seq, cache))
        if joined:
            self._merge(joined)

    def _decode(self, done: dict[int, Outcome]) -> None:
        """One token for every row, in one forward pass."""
        import torch

        ex, rows = self.ex, self.rows
        seqs = [self.seqs[sid] for sid in rows]
        ids = torch.tensor([[s.next_token] for s in seqs], device=ex.device)
        # Each row's own next position (its real tokens so far; a thinker adds its offset).
        positions = ex._decode_positions(self.mask.sum(dim=1, keepdim=True), seqs)
        mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        want_hidden = any(s.job.return_hidden for s in seqs)
        out = ex._forward(ids, mask if self.padded else None, positions, self.cache,
                          want_hidden)
        self.cache, self.mask = getattr(out, ex._cache_arg), mask
        logits = out.logits[:, -1].float()
        greedy = logits.argmax(dim=-1).tolist()
        hidden = out.hidden_states if want_hidden else None
        gone = []
        for row, (sid, seq) in enumerate(zip(rows, seqs, strict=True)):
            h = ex._pick_hidden(hidden, row) if hidden is not None and seq.job.return_hidden \
                else None
            outcome = ex._advance(seq, logits[row], h, greedy[row])
            if outcome is not None:
                done[sid] = outcome
                gone.append(row)
        for row in gone:
            del self.seqs[rows[row]]
        if gone:
            self._drop(gone)

    def _merge(self, joined: list[tuple[int, _Seq, Any]]) -> None:
        """Add prefilled caches as new rows, left-padding every row to the longest."""
        import torch

        for sid, seq, _ in joined:
            self.seqs[sid] = seq
            self.rows.append(sid)
        if self.cache is None and len(joined) == 1:
            _, seq, cache = joined[0]  # a batch of one: adopt its cache as it is
            self.cache = cache
            self.mask = torch.ones(1, seq.prefilled, dtype=torch.long,
                                   device=self.ex.device)
            return
        old = _kv_layers(self.cache) if self.cache is not None else None
        width0 = 0 if self.mask is None else self.mask.shape[1]
        parts = [_kv_layers(c) for _, _, c in joined]
        lengths = [p[0][0].shape[-2] for p in parts]
        width = max([width0, *lengths])
        layers = []
        for i in range(len(parts[0])):
            ks = [] if old is None else [_pad_kv(old[i][0], width - width0)]
            vs = [] if old is None else [_pad_kv(old[i][1], width - width0)]
            for part, n in zip(parts, lengths, strict=True):
                ks.append(_pad_kv(part[i][0], width - n))
                vs.append(_pad_kv(part[i][1], width - n))
            layers.append((torch.cat(ks), torch.cat(vs)))
        masks = [] if self.mask is None else [_pad_mask(self.mask, width - width0)]
        masks += [_pad_mask(torch.ones(1, n, dtype=torch.long, device=self.ex.device),
                            width - n) for n in lengths]
        self.mask = torch.cat(masks)
        self.cache = self.cache if self.cache is not None else joined[0][2]
        _set_kv_layers(self.cache, layers)
        self.padded = bool((self.mask == 0).any())

    def _drop(self, rows: list[int]) -> None:
        """Remove cache rows, then the columns that are padding in every remaining row."""
        import torch

        gone = set(rows)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            self.padded = False
            return
        idx = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        lead = int(mask.any(dim=0).long().argmax())  # first column with a real token
        self.mask = mask[:, lead:]
        _set_kv_layers(self.cache, [(k.index_select(0, idx)[..., lead:, :],
                                     v.index_select(0, idx)[..., lead:, :])
                                    for k, v in _kv_layers(self.cache)])
        self.padded = bool((self.mask == 0).any())


def _step_seed(seed: int, step: int) -> int:
    """The sampling seed of a sequence's token number `step` (a 63-bit mix of both)."""
    return (seed * 1_000_003 + step * 7_919 + 1) % (1 << 63)


def _plain_kv_cache(config: Any) -> bool:
    """Whether this model's KV cache is one plain tensor pair per layer (transformers >= 5
    DynamicLayer), whose rows can be padded, merged and dropped. Sliding-window or recurrent
    layers, and older transformers, keep more state: those models run one request at a time."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        layers = DynamicCache(config=config).layers
    except (ImportError, TypeError, AttributeError, ValueError):
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _kv_layers(cache: Any) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _set_kv_layers(cache: Any, layers: list[tuple[Any, Any]]) -> None:
    for layer, (k, v) in zip(cache.layers, layers, strict=True):
        layer.keys, layer.values = k, v


def _pad_kv(t: Any, n: int) -> Any:
    """Left-pad a [batch, heads, length, dim] key or value tensor with n zero positions."""
    if n == 0:
        return t
    import torch.nn.functional as F

    return F.pad(t, (0, 0, n, 0))


def _pad_mask(mask: Any, n: int) -> Any:
    if n == 0:
        return mask
    import torch.nn.functional as F

    return F.pad(mask, (n, 0))
