"""Talker executor: a Qwen3-Omni talker turns text (a thinker's answer, or a TTS prompt) into
speech codec codes, frame by frame.

Each frame: the talker samples the frame's first code from its codec head; its code predictor
then predicts the residual codebooks' codes one after another (greedily), conditioned on the
talker's last hidden state; the sum of the frame's code embeddings plus the next text position
is the talker's next input. This mirrors transformers' Qwen3OmniMoeForConditionalGeneration
(its talker prefill and prepare_inputs_for_generation) step by step over the real modules, so
the worker can check for abort and deadline between frames.

Text reaches the talker as Qwen's does, through the talker's text_projection of the thinker's
input embeddings. After a thinker, those come as tensor `token_embeds` (with `token_ids`,
`encoder_hidden_states` and `prompt_length`): the prompt part is context (its image and audio
positions through hidden_projection of the thinker's hidden states) and the generated part is
what is spoken. Without a thinker (a text-to-speech pipeline), the prompt is tokenized with the
tokenizer beside the talker and embedded with the thinker's embedding table shipped there
(omnistage.models.TEXT_EMBEDDINGS, or the thinker's tensor in a combined checkpoint).

Streaming (its kind row says chunked input and output): while it generates, every
`chunk_frames` frames go to the vocoder as one chunk (tensor `codec_codes` int64 [n, groups]),
the rest at the end, so the vocoder speaks while the talker still runs. The final reply carries
every frame either way. Fed by a thinker, it starts once the thinker's prompt and first answer
token are in, and takes each further answer position as the thinker makes it (a frame that
needs a position the thinker has not made yet waits for it, or for the thinker's end), exactly
as Qwen's talker consumes the thinker's output as it comes. Each answer position is projected
on its own, whole or fed, so the codes do not depend on how the thinker's output arrived.

Batching (engine.maxBatchSize, omnistage.batching): concurrent requests make their frames in
the same steps (_TalkerBatch); one request alone runs the same steps in a batch of one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage.admission import DeadlineExceeded, ExecutionContext
from omnistage.executors.base import BadRequest, BatchExecutor, Emit, Outcome, StageIO
from omnistage.models import load_talker
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor

#: The first code's sampling (Qwen3-Omni's talker defaults); the seed makes it reproducible.
TEMPERATURE = 0.9
TOP_K = 50
_FLOATS = ("float32", "float16", "bfloat16")


class _TalkerRequest(StageParams):
    prompt: str | None = None


TalkerParams = stage_params("talker", _TalkerRequest)


@dataclass
class TalkerJob:
    prefill: Any  # [1, length, hidden] the talker's prompt pass input; None: fed (a thinker's)
    trailing: Any  # [1, text, hidden] one text position added per frame
    pad: Any  # [1, 1, hidden] added once the text is used up
    max_frames: int
    seed: int
    voice: str
    chunk_frames: int = 8  # frames per streamed chunk (engine.chunk_frames)
    speaker: int = 0
    prompt: str | None = None  # the TTS text (checked again when a job not fed has no input)
    prompt_tokens: int | None = None  # the TTS text's tokens (usage); a thinker counts its own


@dataclass
class _ThinkerFeed:
    """A thinker's output as it arrives in chunks: its rows so far, and whether it ended."""

    io: StageIO
    hidden: list[Any] = field(default_factory=list)
    embeds: list[Any] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    prompt: int | None = None  # prompt_length, from the first chunk
    rows: int = 0
    ended: bool = False


class TalkerExecutor(BatchExecutor):
    kind = "talker"

    def load(self) -> None:
        self.model, self.tokenizer, self.text_table = load_talker(
            self.model_source or "tiny-omni-talker", self.device, self.engine.dtype, self.kind)
        cfg = self.model.config
        self.speakers = {str(k).lower(): int(v) for k, v in (cfg.speaker_id or {}).items()}
        if not self.speakers:
            raise ValueError("the talker's config lists no speakers (speaker_id)")
        names = list(self.engine.voices or cfg.speaker_id)
        missing = [v for v in names if v.lower() not in self.speakers]
        if missing:
            raise ValueError(f"engine.voices: {missing} are not voices of this model "
                             f"(it has: {', '.join(cfg.speaker_id)})")
        self.voices = names  # what this stage offers; the first is the default
        self.default_voice = self.engine.voice or names[0]
        if self.default_voice.lower() not in {v.lower() for v in names}:
            raise ValueError(f"engine.voice {self.default_voice!r} is not one of engine.voices "
                             f"{names}")
        self.codebook = int(cfg.code_predictor_config.vocab_size)
        self.groups = int(cfg.num_code_groups)
        self.context_len = int(cfg.text_config.max_position_embeddings)
        self.thinker_hidden = int(cfg.thinker_hidden_size)
        whole = getattr(self.model, "omni_config", None)
        self.media_ids = {int(cfg.audio_token_id), int(cfg.image_token_id),
                          int(cfg.video_token_id)}
        self._tts_ids = self._tts_token_ids(whole)

    def _tts_token_ids(self, whole: Any) -> list[int] | None:
        """tts_pad, tts_bos, tts_eos in the thinker's vocabulary."""
        if whole is not None:
            return [int(whole.tts_pad_token_id), int(whole.tts_bos_token_id),
                    int(whole.tts_eos_token_id)]
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.convert_tokens_to_ids(["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"])
        return None if self.tokenizer.unk_token_id in ids or None in ids else list(ids)

    def warmup(self) -> None:
        if self.text_table is not None:
            job = self.prepare({"prompt": "warmup", "max_frames": 2}, {})
            self.execute(job, ExecutionContext(), lambda _d: None)

    # ---- requests ---------------------------------------------------------------------------

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> TalkerJob:
        import torch

        req: Any = self.parse(TalkerParams, params)
        opts = req.options(self.engine)
        voice = req.voice or self.default_voice
        offered = {v.lower(): v for v in self.voices}
        if voice.lower() not in offered:
            raise BadRequest(f"params.voice: unknown voice {voice!r}; this stage offers: "
                             f"{', '.join(self.voices)}")
        speaker = self.speakers[voice.lower()]
        job = TalkerJob(None, None, None, opts.max_frames, opts.seed, offered[voice.lower()],
                        opts.chunk_frames, speaker, req.prompt)
        if "encoder_hidden_states" not in tensors and not req.prompt:
            return job  # fed by a thinker (streaming), or refused in execute
        with torch.inference_mode():
            if "encoder_hidden_states" in tensors:
                context, text = self._from_thinker(tensors)
            else:
                context, text = self._from_prompt(req.prompt)
                job.prompt_tokens = int(text.shape[1])
            job.prefill, job.trailing, job.pad = self._talker_inputs(context, text, speaker)
        self._check_length(job)
        return job

    def _check_length(self, job: TalkerJob) -> None:
        if job.prefill.shape[1] + job.max_frames > self.context_len:
            raise BadRequest(f"params.max_frames: the talker's prompt ({job.prefill.shape[1]} "
                             f"positions) + max_frames ({job.max_frames}) exceeds the talker's "
                             f"context of {self.context_len}")

    def _tensor(self, tensors: Mapping[str, WireTensor], name: str, dtypes: tuple[str, ...],
                shape: tuple[int | None, ...]) -> Any:
        wt = tensors.get(name)
        if wt is None:
            raise BadRequest(f"tensors.{name} is required with tensors.encoder_hidden_states "
                             "(a thinker's outputs)")
        ok = wt.dtype in dtypes and len(wt.shape) == len(shape) and all(
            want is None or got == want for got, want in zip(wt.shape, shape, strict=True))
        if not ok or 0 in wt.shape:
            want = ", ".join("n" if d is None else str(d) for d in shape)
            raise BadRequest(f"tensors.{name} must be {'/'.join(dtypes)} [{want}], got "
                             f"{wt.dtype} {list(wt.shape)}")
        return wt.torch(self.device)

    def _from_thinker(self, tensors: Mapping[str, WireTensor]) -> tuple[Any, Any]:
        """(context [1, n, talker hidden], spoken text [1, m, talker hidden]) from a thinker."""

        dim = self.thinker_hidden
        hidden = self._tensor(tensors, "encoder_hidden_states", _FLOATS, (None, dim))
        n = hidden.shape[0]
        embeds = self._tensor(tensors, "token_embeds", _FLOATS, (n, dim))
        ids = self._tensor(tensors, "token_ids", ("int64",), (n,))
        length = self._tensor(tensors, "prompt_length", ("int64",), (1,))
        prompt = int(length[0])
        if not 0 < prompt <= n:
            raise BadRequest(f"tensors.prompt_length must be in [1, {n}], got {prompt}")
        return (self._context(hidden[:prompt], embeds[:prompt], ids[:prompt]),
                self._spoken(embeds[prompt:]))

    def _context(self, hidden: Any, embeds: Any, ids: Any) -> Any:
        """[1, prompt, talker hidden]: the thinker's prompt positions, text through
        text_projection, image and audio positions through hidden_projection."""
        import torch

        dt = self.model.dtype
        hidden, embeds = hidden.to(dt), embeds.to(dt)
        media = torch.isin(ids, torch.tensor(sorted(self.media_ids), device=ids.device))
        context = self.model.text_projection(embeds)
        if media.any():
            context[media] = self.model.hidden_projection(hidden[media])
        return context.unsqueeze(0)

    def _spoken(self, embeds: Any) -> Any:
        """[1, m, talker hidden]: answer positions, each projected on its own (one row's
        result does not depend on how many came with it: whole and fed agree)."""
        import torch

        dt = self.model.dtype
        hid = int(self.model.config.text_config.hidden_size)
        rows = [self.model.text_projection(embeds[i:i + 1].to(dt)) for i in range(len(embeds))]
        return torch.cat(rows).unsqueeze(0) if rows else torch.zeros(
            1, 0, hid, dtype=dt, device=self.device)

    def _from_prompt(self, prompt: str | None) -> tuple[Any, Any]:
        if self.text_table is None:
            raise BadRequest("tensors.encoder_hidden_states is required: this talker's model has "
                             "no text embedding table, so it speaks only a thinker's output")
        if not prompt:
            raise BadRequest("params.prompt is required (the text to speak)")
        ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        if not ids:
            raise BadRequest("params.prompt has no tokens to speak")
        table = self.text_table
        if max(ids) >= table.shape[0]:
            raise BadRequest("params.prompt: a token is outside the talker's text table")
        text = self.model.text_projection(table[ids]).unsqueeze(0)
        return text[:, :0], text

    def _talker_inputs(self, context: Any, text: Any, speaker: int) -> tuple[Any, Any, Any]:
        """Qwen's assistant part: text side tts_pad x4, tts_bos, the first text position; codec
        side nothink, think_bos, think_eos, the speaker, pad, bos; the rest of the text (then
        tts_eos) is added one position per frame."""
        import torch

        cfg, dt = self.model.config, self.model.dtype
        hid = int(cfg.text_config.hidden_size)
        if self._tts_ids is not None and self.text_table is not None:
            marks = self.model.text_projection(self.text_table[self._tts_ids].to(dt))
            pad, bos, eos = (marks[i].view(1, 1, hid) for i in range(3))
        else:  # no thinker vocabulary here: neutral markers
            pad = bos = eos = torch.zeros(1, 1, hid, dtype=dt, device=self.device)
        first, rest = text[:, :1], text[:, 1:]
        if first.shape[1] == 0:
            first = pad
        text_side = torch.cat([pad.expand(1, 4, hid), bos, first], dim=1)
        codec = torch.tensor([[cfg.codec_nothink_id, cfg.codec_think_bos_id,
                               cfg.codec_think_eos_id, speaker, cfg.codec_pad_id,
                               cfg.codec_bos_id]], device=self.device)
        assistant = text_side + self.model.get_input_embeddings()(codec)
        prefill = torch.cat([context.to(dt), assistant], dim=1)
        return prefill, torch.cat([rest, eos], dim=1), pad

    def cost(self, job: TalkerJob) -> int:
        """Positions the talker holds: its prompt (a fed one's is not known yet) and frames."""
        return (0 if job.prefill is None else int(job.prefill.shape[1])) + job.max_frames

    # ---- batching --------------------------------------------------------------------------

    def new_batch(self) -> _TalkerBatch:
        return _TalkerBatch(self)

    # ---- fed by a thinker (streaming) -------------------------------------------------------

    def _pull(self, feed: _ThinkerFeed) -> None:
        """Take the thinker's chunks that arrived (without waiting), checked; at the end of its
        output, mark it ended."""
        chunks, feed.ended = feed.io.poll()
        for chunk in chunks:
            self._add_rows(feed, chunk)

    def _add_rows(self, feed: _ThinkerFeed, chunk: Any) -> None:
        dim = self.thinker_hidden
        try:
            hidden = self._tensor(chunk.tensors, "hidden_states", _FLOATS, (None, dim))
            n = hidden.shape[0]
            embeds = self._tensor(chunk.tensors, "token_embeds", _FLOATS, (n, dim))
            ids = self._tensor(chunk.tensors, "token_ids", ("int64",), (n,))
            if feed.prompt is None:
                length = self._tensor(chunk.tensors, "prompt_length", ("int64",), (1,))
                feed.prompt = int(length[0])
                if feed.prompt < 1:
                    raise BadRequest(f"tensors.prompt_length must be at least 1, got "
                                     f"{feed.prompt}")
        except BadRequest as exc:
            raise BadRequest(f"feed {chunk.seq}: {exc}") from None
        feed.hidden.extend(hidden.unbind(0))
        feed.embeds.extend(embeds.unbind(0))
        feed.ids.extend(ids.unbind(0))
        feed.rows += n

    def _start_fed(self, job: TalkerJob, feed: _ThinkerFeed) -> bool:
        """The talker's prompt pass input, once the thinker's prompt and first answer position
        are in (or its output ended): what prepare builds from a whole thinker output. False
        while they have not arrived yet."""
        import torch

        if not feed.ended and (feed.prompt is None or feed.rows <= feed.prompt):
            self._pull(feed)
            if not feed.ended and (feed.prompt is None or feed.rows <= feed.prompt):
                return False
        prompt = feed.prompt
        if prompt is None or feed.rows < prompt:
            raise BadRequest(f"tensors.prompt_length: the thinker's output ended after "
                             f"{feed.rows} positions, before its prompt ({prompt})")
        context = self._context(torch.stack(feed.hidden[:prompt]),
                                torch.stack(feed.embeds[:prompt]), torch.stack(feed.ids[:prompt]))
        first = self._spoken(feed.embeds[prompt].unsqueeze(0) if feed.rows > prompt
                             else torch.zeros(0, self.thinker_hidden))
        job.prefill, job.trailing, job.pad = self._talker_inputs(context, first, job.speaker)
        self._check_length(job)
        return True

    def _fed_text(self, job: TalkerJob, feed: _ThinkerFeed, step: int) -> Any:
        """The text position frame `step` adds: answer position step + 1 when the thinker
        makes it, then its end marker, then padding (as the whole trailing text would be).
        None while that position has not arrived yet."""
        assert feed.prompt is not None
        if not feed.ended and feed.rows - feed.prompt < step + 2:
            self._pull(feed)
            if not feed.ended and feed.rows - feed.prompt < step + 2:
                return None
        answer = feed.rows - feed.prompt
        if step + 1 < answer:
            row = feed.prompt + step + 1
            return self._spoken(feed.embeds[row].unsqueeze(0))
        if step == max(answer - 1, 0):
            return job.trailing  # the end marker: _talker_inputs' trailing of one position
        return job.pad

    def _emit_frames(self, io: StageIO, frames: list[list[int]]) -> None:
        """Hand frames to the streamed downstream (a no-op when the output is not streamed)."""
        if frames and io.streams_output:
            import numpy as np

            io.emit_chunk(tensors={"codec_codes": np.asarray(frames, dtype=np.int64)})

    def _sample(self, logits: Any, gen: Any, eos: int, may_end: bool = True) -> int:
        """The frame's first code: top-k sampling over the codebook and the end code only.

        may_end is False for a voice's first frame (generate's min_new_tokens=1: the end code
        masked before top-k): speech asked for is never an empty waveform (a random-weight
        talker drew the end code first for ~2% of seeds)."""
        import torch

        allowed = torch.full_like(logits, float("-inf"))
        allowed[: self.codebook] = 0.0
        if may_end:
            allowed[eos] = 0.0
        logits = logits + allowed
        top = torch.topk(logits, min(TOP_K, self.codebook + int(may_end)))
        probs = torch.softmax(top.values / TEMPERATURE, dim=-1).cpu()
        return int(top.indices[int(torch.multinomial(probs, 1, generator=gen))])

    def _outcome(self, frames: list[list[int]], finish: str, job: TalkerJob,
                 aborted: bool = False) -> Outcome:
        import torch

        codes = torch.tensor(frames, dtype=torch.int64).reshape(len(frames), self.groups)
        fields: dict[str, Any] = {"finish_reason": finish, "completion_tokens": len(frames)}
        if job.prompt_tokens is not None:
            fields["prompt_tokens"] = job.prompt_tokens
        return Outcome(fields, {"codec_codes": codes}, aborted=aborted)

    def aborted_before_start(self, job: TalkerJob) -> Outcome:
        return self._outcome([], "abort", job, aborted=True)


@dataclass(eq=False)
class _Voice:
    """One request of a talker batch, in one of its phases (see _TalkerBatch)."""

    job: TalkerJob
    io: StageIO
    gen: Any  # torch.Generator seeded with the job's seed: its first codes' sampling
    feed: _ThinkerFeed | None = None
    phase: str = "start"
    frames: list[list[int]] = field(default_factory=list)
    finish: str = "length"
    cache: Any = None  # its own KV cache while it is not a row of the batch's merged one
    length: int = 0  # positions in its cache
    logits: Any = None  # [codes] of its last talker pass ("frame")
    last: Any = None  # [1, 1, hidden] last hidden state of that pass
    codes_sum: Any = None  # [1, 1, hidden] its last frame's code embeddings, summed ("text")
    next_input: Any = None  # [1, 1, hidden] its next talker input ("input")
    error: BaseException | None = None


class _TalkerBatch:
    """The requests of one talker; the engine thread calls it between steps.

    A request moves through phases, at most one frame a step:
    start (its prompt pass, alone: a fed one's once the thinker's prompt and first answer
    position are in) -> frame (sample the frame's first code; the code predictor then predicts
    the residual codes of every request's frame in one pass per code group: all frames have the
    same two positions there, so no padding) -> text (the text position the next input adds; a
    fed request waits here for its thinker) -> input (the talker's pass over every waiting
    request's next position in one forward, their KV caches merged as left-padded rows with an
    attention mask and per-row positions) -> frame ... until the end code or max_frames, then
    drain (a fed request takes the rest of its feed, so the thinker is not held) and done.

    Nothing here waits for a request's input: a request whose thinker is behind sits the step
    out. Alone (a batch of one, the one-at-a-time path) each pass is the model call the
    unbatched loop made; in a batch, rows are independent (masked padding), so the codes are
    the same up to float rounding of batched matrix products.
    """

    def __init__(self, ex: TalkerExecutor) -> None:
        self.ex = ex
        self.voices: dict[int, _Voice] = {}
        self.rows: list[int] = []  # the requests whose caches are merged, in row order
        self.cache: Any = None  # the merged cache, while rows has two or more
        self.forwards = 0  # talker decode passes run (tests: a batch really shared them)

    def add(self, seq: int, job: TalkerJob, emit: Emit) -> None:
        import torch

        io = StageIO.of(emit)
        voice = _Voice(job, io, torch.Generator(device="cpu").manual_seed(job.seed))
        if job.prefill is None:
            if io.fed:
                voice.feed = _ThinkerFeed(io)
            else:
                try:
                    self.ex._from_prompt(job.prompt)  # the request's error: it has no input
                except BadRequest as exc:
                    voice.error = exc
        self.voices[seq] = voice

    def abort(self, seq: int) -> Outcome:
        voice = self._remove(seq)
        return self.ex._outcome(voice.frames, "abort", voice.job, aborted=True)

    def expire(self, seq: int) -> DeadlineExceeded:
        voice = self._remove(seq)
        return DeadlineExceeded(f"deadline passed after {len(voice.frames)} frames")

    def _remove(self, seq: int) -> _Voice:
        if seq in self.rows:
            self._scatter()
        return self.voices.pop(seq)

    def step(self) -> dict[int, Outcome | BaseException]:
        import torch

        done: dict[int, Outcome | BaseException] = {}
        moved = False
        with torch.inference_mode():
            for phase, run in (("start", self._start), ("drain", self._drain),
                               ("text", self._text)):
                for sid in [s for s, v in self.voices.items() if v.phase == phase]:
                    moved |= self._guard(sid, done, run)
            inputs = [s for s, v in self.voices.items() if v.phase == "input"]
            if inputs:
                self._forward(inputs)
                moved = True
            framing = [s for s, v in self.voices.items() if v.phase == "frame"]
            if framing:
                self._frames(framing, done)
                moved = True
        if not moved and not done:
            self._wait()
        return done

    def _guard(self, sid: int, done: dict[int, Outcome | BaseException], run: Any) -> bool:
        """Run one request's phase; its error ends it alone. Whether it moved on."""
        voice = self.voices[sid]
        try:
            if voice.error is not None:
                raise voice.error
            outcome = run(voice)
        except Exception as exc:
            self._remove(sid)
            done[sid] = exc
            return True
        if isinstance(outcome, Outcome):
            self._remove(sid)
            done[sid] = outcome
            return True
        return bool(outcome)

    def _start(self, voice: _Voice) -> bool:
        """Its prompt pass, alone, as soon as its input is there."""
        import torch

        ex, job = self.ex, voice.job
        if voice.feed is not None and not ex._start_fed(job, voice.feed):
            return False
        mask = torch.ones(job.prefill.shape[:2], dtype=torch.long, device=ex.device)
        out = ex.model(inputs_embeds=job.prefill, attention_mask=mask, use_cache=True,
                       output_hidden_states=True)
        voice.cache, voice.length = out.cache, int(job.prefill.shape[1])
        self._took(voice, out.logits[0, -1], out.hidden_states[0][-1][:, -1:])
        return True

    def _took(self, voice: _Voice, logits: Any, last: Any) -> None:
        voice.logits, voice.last, voice.phase = logits.float(), last, "frame"

    def _text(self, voice: _Voice) -> bool:
        """The next input: its frame's codes plus the text position that frame adds."""
        job, step = voice.job, len(voice.frames) - 1
        if voice.feed is not None:
            text = self.ex._fed_text(job, voice.feed, step)
            if text is None:
                return False
        else:
            text = job.trailing[:, step:step + 1] if step < job.trailing.shape[1] else job.pad
        voice.next_input, voice.codes_sum = voice.codes_sum + text, None
        voice.phase = "input"
        return True

    def _drain(self, voice: _Voice) -> Outcome | bool:
        """Finished: take the rest of a fed request's input, then its outcome."""
        feed = voice.feed
        if feed is not None and not feed.ended:
            chunks, feed.ended = voice.io.poll()  # taken and dropped: nothing more is spoken
            if not feed.ended:
                return bool(chunks)
        return self.ex._outcome(voice.frames, voice.finish, voice.job)

    def _forward(self, sids: list[int]) -> None:
        """One talker pass over the next position of every request in sids."""
        import torch

        ex = self.ex
        voices = [self.voices[s] for s in sids]
        self.forwards += 1
        if len(sids) == 1:  # alone: its own cache, the unbatched call exactly
            if sids[0] in self.rows:
                self._scatter()
            voice = voices[0]
            out = ex.model(inputs_embeds=voice.next_input, cache=voice.cache, use_cache=True,
                           output_hidden_states=True, generation_step=len(voice.frames) - 1)
            voice.cache, voice.length = out.cache, voice.length + 1
            self._took(voice, out.logits[0, -1], out.hidden_states[0][-1][:, -1:])
            return
        if sids != self.rows:
            self._scatter()
            self._gather(sids)
        lengths = torch.tensor([v.length for v in voices], device=ex.device)
        width = int(lengths.max())
        padded = bool((lengths != width).any())
        mask = None
        if padded:  # 1 for each row's real positions (left-padded) and the new one
            cols = torch.arange(width + 1, device=ex.device)
            mask = (cols >= (width - lengths).unsqueeze(1)).long()
        positions = lengths.view(1, -1, 1).expand(3, -1, 1)  # each row's own next position
        out = ex.model(inputs_embeds=torch.cat([v.next_input for v in voices]),
                       attention_mask=mask, position_ids=positions, cache=self.cache,
                       use_cache=True, output_hidden_states=True, generation_step=0)
        self.cache = out.cache
        last = out.hidden_states[0][-1][:, -1:]
        for row, voice in enumerate(voices):
            voice.length += 1
            self._took(voice, out.logits[row, -1], last[row:row + 1])

    def _gather(self, sids: list[int]) -> None:
        """Merge the requests' own caches into one, each row left-padded to the longest."""
        import torch

        from omnistage.executors.ar import _kv_layers, _pad_kv

        voices = [self.voices[s] for s in sids]
        width = max(v.length for v in voices)
        parts = [_kv_layers(v.cache) for v in voices]
        layers = []
        for i in range(len(parts[0])):
            layers.append(tuple(torch.cat([_pad_kv(p[i][kv], width - v.length)
                                           for p, v in zip(parts, voices, strict=True)])
                                for kv in (0, 1)))
        self.cache = self._new_cache(layers)
        for v in voices:
            v.cache = None
        self.rows = list(sids)

    def _scatter(self) -> None:
        """Hand every row of the merged cache back to its request, its padding cut off."""
        from omnistage.executors.ar import _kv_layers

        if not self.rows:
            return
        layers = _kv_layers(self.cache)
        width = layers[0][0].shape[-2]
        for row, sid in enumerate(self.rows):
            voice = self.voices[sid]
            lead = width - voice.length
            voice.cache = self._new_cache([(k[row:row + 1, :, lead:], v[row:row + 1, :, lead:])
                                           for k, v in layers])
        self.rows, self.cache = [], None

    def _new_cache(self, layers: list[tuple[Any, Any]]) -> Any:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.ex.model.model.config)
        for layer, (k, v) in zip(cache.layers, layers, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    def _frames(self, sids: list[int], done: dict[int, Outcome | BaseException]) -> None:
        """One frame for every request in sids: its first code sampled from its own logits,
        the residual codes of all of them predicted together."""
        import torch

        ex = self.ex
        model, predictor = ex.model, ex.model.code_predictor
        eos = int(model.config.codec_eos_token_id)
        going: list[tuple[int, int]] = []
        for sid in sids:
            voice = self.voices[sid]
            if len(voice.frames) >= voice.job.max_frames:
                self._end(sid, "length", done)
                continue
            first = ex._sample(voice.logits, voice.gen, eos, may_end=bool(voice.frames))
            if first == eos:
                self._end(sid, "stop", done)
                continue
            going.append((sid, first))
        if not going:
            return
        voices = [self.voices[s] for s, _ in going]
        code = torch.tensor([[f] for _, f in going], device=ex.device)
        embeds = [model.get_input_embeddings()(code)]
        last = torch.cat([v.last for v in voices])
        p = predictor(inputs_embeds=torch.cat([last, embeds[0]], dim=1), use_cache=True)
        codes = [[f] for _, f in going]
        for g in range(1, ex.groups):
            code = p.logits[:, -1:].argmax(-1)
            for row, c in enumerate(code[:, 0].tolist()):
                codes[row].append(int(c))
            embeds.append(predictor.get_input_embeddings()[g - 1](code))
            if g < ex.groups - 1:
                p = predictor(input_ids=code, cache=p.cache, use_cache=True,
                              generation_steps=p.generation_steps)
        summed = torch.stack(embeds, dim=0).sum(0)
        for row, ((sid, _), voice) in enumerate(zip(going, voices, strict=True)):
            voice.frames.append(codes[row])
            voice.codes_sum, voice.logits, voice.last = summed[row:row + 1], None, None
            voice.phase = "text"
            chunk = voice.job.chunk_frames
            if len(voice.frames) % chunk == 0:
                try:
                    ex._emit_frames(voice.io, voice.frames[-chunk:])
                except Exception as exc:  # ended while waiting for credit: this request alone
                    self._remove(sid)
                    done[sid] = exc
                    continue
            if len(voice.frames) >= voice.job.max_frames:
                self._end(sid, "length", done)

    def _end(self, sid: int, finish: str, done: dict[int, Outcome | BaseException]) -> None:
        """No more frames: the rest goes downstream, then it drains its feed."""
        voice = self.voices[sid]
        voice.finish, voice.phase = finish, "drain"
        if sid in self.rows:
            self._scatter()
        voice.cache = None
        frames, chunk = voice.frames, voice.job.chunk_frames
        try:
            self.ex._emit_frames(voice.io, frames[len(frames) - len(frames) % chunk:])
        except Exception as exc:
            self._remove(sid)
            done[sid] = exc
            return
        self._guard(sid, done, self._drain)

    def _wait(self) -> None:
        """Nothing moved: wait a moment for a fed request's next chunk, not a busy loop."""
        StageIO.wait_any([v.io for v in self.voices.values() if v.feed is not None])
