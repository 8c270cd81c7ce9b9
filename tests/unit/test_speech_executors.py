"""The speech executors in-process over the tiny Qwen3-Omni built-ins: what each makes, and
that every bad input is the request's error naming the field."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from omnistage.admission import ExecutionContext
from omnistage.executors.ar import ThinkerExecutor
from omnistage.executors.base import BadRequest, Executor, Outcome
from omnistage.executors.talker import TalkerExecutor
from omnistage.executors.vocoder import VocoderExecutor
from omnistage.models import TINY_QUANTIZERS, TINY_SAMPLE_RATE
from omnistage.protocol import WireTensor
from omnistage.spec import EngineOptions, Stage, stage_voices

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")


def wire(value: Any) -> WireTensor:
    return WireTensor.from_any(value)


def run(ex: Executor, params: dict[str, Any], tensors: dict[str, Any] | None = None,
        ctx: ExecutionContext | None = None) -> Outcome:
    job = ex.prepare(params, {k: wire(v) for k, v in (tensors or {}).items()})
    return ex.execute(job, ctx or ExecutionContext(), lambda _d: None)


@pytest.fixture(scope="module")
def thinker() -> ThinkerExecutor:
    ex = ThinkerExecutor("tiny-omni-thinker", EngineOptions(max_tokens=4), CPU)
    ex.load()
    return ex


@pytest.fixture(scope="module")
def talker() -> TalkerExecutor:
    ex = TalkerExecutor("tiny-omni-talker", EngineOptions(max_frames=6), CPU)
    ex.load()
    return ex


@pytest.fixture(scope="module")
def vocoder() -> VocoderExecutor:
    ex = VocoderExecutor("tiny-omni-vocoder", EngineOptions(), CPU)
    ex.load()
    return ex


def thinker_tensors(out: Outcome) -> dict[str, Any]:
    """What the engine hands a talker from a thinker (its hidden states as conditioning)."""
    return {("encoder_hidden_states" if k == "hidden_states" else k): v
            for k, v in out.tensors.items()}


def test_tts_talker_makes_codes_and_the_vocoder_audio(talker, vocoder) -> None:
    out = run(talker, {"prompt": "hello there"})
    codes = out.tensors["codec_codes"]
    assert codes.dtype == torch.int64 and codes.shape[1] == TINY_QUANTIZERS
    assert 0 < codes.shape[0] <= 6 and out.fields["completion_tokens"] == codes.shape[0]
    assert int(codes.min()) >= 0 and int(codes.max()) < talker.codebook
    assert torch.equal(run(talker, {"prompt": "hello there"}).tensors["codec_codes"], codes)
    other = run(talker, {"prompt": "hello there", "seed": 7}).tensors["codec_codes"]
    assert not torch.equal(other, codes)  # the seed draws the first codes
    assert run(talker, {"prompt": "hi", "max_frames": 2}).tensors["codec_codes"].shape[0] <= 2

    sound = run(vocoder, {}, {"codec_codes": codes})
    audio = sound.tensors["audio"]
    assert sound.fields["sample_rate"] == TINY_SAMPLE_RATE == vocoder.sample_rate
    assert audio.dtype == torch.float32 and audio.dim() == 1
    # Code2Wav upsamples each frame to total_upsample samples (its causal convolutions trim
    # a few at the end).
    per_frame = int(vocoder.model.total_upsample)
    assert (codes.shape[0] - 1) * per_frame < audio.numel() <= codes.shape[0] * per_frame
    assert torch.isfinite(audio).all() and float(audio.abs().max()) <= 1.0
    assert float(audio.abs().max()) > 0


def test_thinker_hidden_states_drive_the_talker(thinker, talker) -> None:
    job = thinker.prepare({"prompt": "hi", "return_hidden_states": True}, {})
    prompt_ids = list(job.prompt_ids)
    out = thinker.execute(job, ExecutionContext(), lambda _d: None)
    tensors = out.tensors
    rows = tensors["hidden_states"].shape[0]
    assert tensors["hidden_states"].shape == (rows, thinker.hidden_size)
    assert tensors["token_embeds"].shape == (rows, thinker.hidden_size)
    # One row per token: the prompt's, then every generated one (fed back for its state).
    assert rows == len(prompt_ids) + len(out.fields["token_ids"])
    assert tensors["token_ids"].tolist() == prompt_ids + out.fields["token_ids"]
    assert tensors["prompt_length"].tolist() == [out.fields["prompt_tokens"]]
    spoken = run(talker, {"prompt": out.fields["text"]}, thinker_tensors(out))
    assert spoken.tensors["codec_codes"].shape[1] == TINY_QUANTIZERS
    # The thinker's states, not the prompt text, condition it: other states, other codes.
    changed = dict(thinker_tensors(out))
    changed["token_embeds"] = changed["token_embeds"] * -1
    again = run(talker, {"prompt": out.fields["text"]}, changed).tensors["codec_codes"]
    assert not torch.equal(again, spoken.tensors["codec_codes"])


def test_thinker_encodes_images_and_audio(thinker) -> None:
    rng = np.random.default_rng(1)
    plain = run(thinker, {"prompt": "x"}).fields["prompt_tokens"]
    image = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    clip = rng.uniform(-0.5, 0.5, 16000).astype(np.float32)
    calls = {"visual": 0, "audio_tower": 0}
    hooks = [getattr(thinker.model.model, name).register_forward_hook(
        lambda *_a, name=name: calls.__setitem__(name, calls[name] + 1)) for name in calls]
    try:
        out = run(thinker, {"prompt": "x"}, {"input_image.0": image, "input_audio.0": clip})
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"visual": 1, "audio_tower": 1}
    assert out.fields["prompt_tokens"] > plain + 4  # each medium's tokens and its two bounds


@pytest.mark.parametrize("tensors,field", [
    ({"input_image.0": np.zeros((4, 4), dtype=np.uint8)}, "tensors.input_image.0"),
    ({"input_image.0": np.zeros((4, 4, 3), dtype=np.float32)}, "tensors.input_image.0"),
    ({"input_audio.0": np.zeros((2, 8), dtype=np.float32)}, "tensors.input_audio.0"),
    ({"input_audio.0": np.full(8, 2.0, dtype=np.float32)}, "tensors.input_audio.0"),
    ({"input_audio.0": np.full(8, np.nan, dtype=np.float32)}, "tensors.input_audio.0"),
    ({"input_audio.1": np.zeros(8, dtype=np.float32)}, "tensors.input_audio.<i>"),
    ({"input_image.0": np.zeros((1, 300, 3), dtype=np.uint8)},
     "tensors.input_image.0: the model's image processor refused it: absolute aspect ratio"),
    ({"input_audio.0": np.zeros(200, dtype=np.float32)},
     "tensors.input_audio.0: the audio is too short for this model: at least 13 ms, got "
     "12.5 ms"),
])
def test_thinker_refuses_corrupt_media(thinker, tensors, field) -> None:
    with pytest.raises(BadRequest, match=re.escape(field)):
        thinker.prepare({"prompt": "x"}, {k: wire(v) for k, v in tensors.items()})


def test_talker_voices_and_bad_requests(talker, thinker) -> None:
    assert talker.voices == ["default"] and talker.default_voice == "default"
    assert run(talker, {"prompt": "a", "voice": "DEFAULT"}).tensors["codec_codes"].numel()
    with pytest.raises(BadRequest, match=r"params\.voice: unknown voice 'nobody'.*default"):
        talker.prepare({"prompt": "a", "voice": "nobody"}, {})
    with pytest.raises(BadRequest, match=r"params\.voice"):
        talker.prepare({"prompt": "a", "voice": "bad voice!"}, {})  # outside VOICE_PATTERN
    with pytest.raises(BadRequest, match=r"params\.prompt is required"):
        run(talker, {})  # no prompt, no thinker's tensors, not fed
    with pytest.raises(BadRequest, match=r"params\.max_frames"):
        talker.prepare({"prompt": "a", "max_frames": 0}, {})
    out = run(thinker, {"prompt": "hi", "return_hidden_states": True})
    good = {k: wire(v) for k, v in thinker_tensors(out).items()}
    narrow = dict(good, encoder_hidden_states=wire(np.zeros((3, 5), dtype=np.float32)))
    with pytest.raises(BadRequest, match=r"tensors\.encoder_hidden_states must be"):
        talker.prepare({"prompt": "a"}, narrow)
    with pytest.raises(BadRequest, match=r"tensors\.token_ids is required"):
        talker.prepare({"prompt": "a"}, {k: v for k, v in good.items() if k != "token_ids"})
    wrong = dict(good, prompt_length=wire(np.array([10_000], dtype=np.int64)))
    with pytest.raises(BadRequest, match=r"tensors\.prompt_length must be in"):
        talker.prepare({"prompt": "a"}, wrong)


def test_the_first_frame_is_never_the_end_code() -> None:
    """Speech asked for is never empty: with random weights about 2% of seeds drew the end
    code first (seeds 12, 20, 37, 51, 206, 242, 246 of these 300), and a WAV with no sample
    came back. After the first frame the end code is drawn as before."""
    ex = TalkerExecutor("tiny-omni-talker", EngineOptions(max_frames=1), CPU)
    ex.load()
    frames = [run(ex, {"prompt": "hello", "seed": s}).tensors["codec_codes"].shape[0]
              for s in range(300)]
    assert frames == [1] * 300
    eos = int(ex.model.config.codec_eos_token_id)
    logits = torch.zeros(eos + 1)
    logits[eos] = 100.0  # the end code all but certain
    gen = torch.Generator().manual_seed(0)
    assert ex._sample(logits, gen, eos) == eos
    assert ex._sample(logits, gen, eos, may_end=False) < ex.codebook


def test_talker_stops_on_abort_with_the_frames_so_far(talker) -> None:
    ctx = ExecutionContext()
    ctx.cancel()
    out = run(talker, {"prompt": "hello"}, ctx=ctx)
    assert out.aborted and out.fields["finish_reason"] == "abort"
    assert out.tensors["codec_codes"].shape == (0, TINY_QUANTIZERS)


def test_talker_refuses_engine_voices_its_model_lacks() -> None:
    ex = TalkerExecutor("tiny-omni-talker", EngineOptions(voices=["Ethan"]), CPU)
    with pytest.raises(ValueError, match=r"engine\.voices: \['Ethan'\] are not voices"):
        ex.load()


@pytest.mark.parametrize("codes,why", [
    (np.zeros((3, TINY_QUANTIZERS), dtype=np.int32), "must be int64"),
    (np.zeros((3, TINY_QUANTIZERS + 1), dtype=np.int64), "must be int64"),
    (np.zeros(3, dtype=np.int64), "must be int64"),
    (np.full((3, TINY_QUANTIZERS), 64, dtype=np.int64), r"codes must be in \[0, 64\)"),
    (np.full((3, TINY_QUANTIZERS), -1, dtype=np.int64), r"codes must be in \[0, 64\)"),
])
def test_vocoder_refuses_corrupt_codes(vocoder, codes, why) -> None:
    with pytest.raises(BadRequest, match=rf"tensors\.codec_codes.*{why}"):
        vocoder.prepare({}, {"codec_codes": wire(codes)})
    with pytest.raises(BadRequest, match=r"tensors\.codec_codes is required"):
        run(vocoder, {})  # not fed either: nothing to decode


def test_stage_voices_come_from_the_spec() -> None:
    talker = Stage.model_validate({"name": "t", "kind": "talker", "model": "tiny-omni-talker"})
    assert stage_voices(talker) == ["default"]
    named = Stage.model_validate({"name": "t", "kind": "talker", "model": "org/qwen",
                                  "engine": {"voices": ["Ethan", "Chelsie"],
                                             "voice": "Chelsie"}})
    assert stage_voices(named) == ["Chelsie", "Ethan"]  # the default voice first
    chat = Stage.model_validate({"name": "c", "kind": "ar", "model": "tiny-llama"})
    assert stage_voices(chat) == []


def test_media_go_into_the_last_user_turn_of_a_chat_prompt(thinker, monkeypatch) -> None:
    """Qwen's chat template renders `<|im_start|>user\\n...`; media start that turn's content.
    (The tiny tokenizer has no template, so the turn markers are stood in for.)"""
    user = thinker.model.config.user_token_id
    monkeypatch.setattr(thinker.tokenizer, "convert_tokens_to_ids", lambda _t: 7)
    turns = [7, 9, 10, 5, 7, user, 10, 6, 7, user, 10, 4, 7, 11, 10]
    assert thinker._media_position(turns) == 11
    assert thinker._media_position([3, 4, 5]) == 0
