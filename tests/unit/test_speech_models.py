"""The tiny Qwen3-Omni built-ins, and the combined checkpoint layout of Qwen's real repositories
(thinker, talker and code2wav in one model) from which each speech stage loads its own part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from omnistage import models
from omnistage.spec import DEFAULT_VOICES

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")


def test_builtins_are_the_real_classes_in_small_shapes() -> None:
    thinker, tokenizer, images, audio = models.load_thinker("tiny-omni-thinker", CPU, "auto",
                                                            "thinker")
    talker, talker_tok, table = models.load_talker("tiny-omni-talker", CPU, "auto", "talker")
    vocoder, rate = models.load_vocoder("tiny-omni-vocoder", CPU, "auto", "vocoder")
    assert type(thinker).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert type(talker).__name__ == "Qwen3OmniMoeTalkerForConditionalGeneration"
    assert type(vocoder).__name__ == "Qwen3OmniMoeCode2Wav"
    # The parts fit together: widths, codebooks, vocabularies, and the input audio's rate.
    assert talker.config.thinker_hidden_size == thinker.config.text_config.hidden_size
    assert talker.config.num_code_groups == vocoder.config.num_quantizers
    assert talker.config.code_predictor_config.vocab_size == vocoder.config.codebook_size
    assert table.shape == thinker.get_input_embeddings().weight.shape
    assert torch.equal(table, thinker.get_input_embeddings().weight)
    assert len(talker_tok) == len(tokenizer) and audio.sampling_rate == 16000
    assert tokenizer.image_token_id == thinker.config.image_token_id
    assert tokenizer.audio_token_id == thinker.config.audio_token_id
    assert tuple(talker.config.speaker_id) == DEFAULT_VOICES
    assert rate == models.TINY_SAMPLE_RATE and images.merge_size == 2
    assert all(torch.isfinite(p).all() for p in talker.parameters())  # experts initialised


@pytest.fixture(scope="module")
def combined(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A Qwen3OmniMoeForConditionalGeneration built from the tiny parts' configs, saved the way
    Qwen's repositories are (sharded, experts one by one)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeForConditionalGeneration,
    )

    parts = {k: models.resolve(f"tiny-omni-{k}", k) for k in ("thinker", "talker", "vocoder")}
    cfgs = {k: json.loads((p / "config.json").read_text()) for k, p in parts.items()}
    tok = models._omni_tokenizer()
    pad, bos, eos = tok.convert_tokens_to_ids(["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"])
    cfg = Qwen3OmniMoeConfig(thinker_config=cfgs["thinker"], talker_config=cfgs["talker"],
                             code2wav_config=cfgs["vocoder"], tts_pad_token_id=pad,
                             tts_bos_token_id=bos, tts_eos_token_id=eos)
    torch.manual_seed(0)
    whole = Qwen3OmniMoeForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, param in whole.named_parameters():
            if not torch.isfinite(param).all() or ".experts." in name:
                param.normal_(0.0, 0.02)
    path = tmp_path_factory.mktemp("qwen3-omni")
    whole.save_pretrained(path, max_shard_size="500KB")
    tok.save_pretrained(path)
    shutil.copy(parts["thinker"] / "preprocessor_config.json", path)
    return path, whole


def test_each_stage_loads_its_part_of_a_combined_checkpoint(combined) -> None:
    path, whole = combined
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.0." in k for k in index)  # stored expert by expert, as Qwen's are
    thinker = models.load_thinker(str(path), CPU, "auto", "thinker")[0]
    assert torch.equal(thinker.get_input_embeddings().weight,
                       whole.thinker.get_input_embeddings().weight)
    assert thinker.omni_config.talker_config.accept_hidden_layer == 2
    talker, _, table = models.load_talker(str(path), CPU, "auto", "talker")
    assert torch.equal(talker.codec_head.weight, whole.talker.codec_head.weight)
    experts = talker.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(experts, whole.talker.model.layers[0].mlp.experts.gate_up_proj)
    assert torch.equal(table, whole.thinker.get_input_embeddings().weight)  # TTS reads this
    vocoder, rate = models.load_vocoder(str(path), CPU, "auto", "vocoder")
    assert torch.equal(vocoder.code_embedding.weight, whole.code2wav.code_embedding.weight)
    assert rate == models.TINY_SAMPLE_RATE  # the config's; Qwen's own config has none: 24 kHz
