"""Model resolution and loading.

Built-in tiny models are random-initialised from configs with a fixed seed, written once with
save_pretrained into a cache folder, and then loaded like any user model through the real
from_pretrained path: there is one loading code path, and it is the one users' weights take.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.spec import BUILTIN_MODELS as BUILTINS

BUILTIN_VERSION = "v1"
TINY_HIDDEN = 64  # shared width: the tiny UNet cross-attends to the tiny LLM's hidden states
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


def cache_dir() -> Path:
    return Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))


def build_tokenizer() -> Any:
    """A byte-level tokenizer built locally: every string round-trips, no download needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _save_tiny_llama(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=TINY_HIDDEN,
        intermediate_size=2 * TINY_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def _save_tiny_unet(path: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

    torch.manual_seed(0)
    UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TINY_HIDDEN,
        attention_head_dim=8,
        norm_num_groups=8,
    ).save_pretrained(path / "unet")
    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    ).save_pretrained(path / "vae")
    DDIMScheduler(num_train_timesteps=1000).save_pretrained(path / "scheduler")


_SAVERS = {"tiny-llama": _save_tiny_llama, "tiny-unet": _save_tiny_unet}


def save_builtin(name: str, path: str | Path) -> Path:
    """Write a built-in model with save_pretrained (atomically: readers never see half a model)."""
    if name not in _SAVERS:
        raise ValueError(f"unknown built-in model {name!r}; built-ins: {sorted(_SAVERS)}")
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _SAVERS[name](tmp)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.exists():
                raise
            # Another process finished first; both wrote identical seeded weights.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@dataclass(frozen=True)
class ModelRef:
    """Where a stage's weights come from: a built-in name or a local directory."""

    kind: str
    source: str

    def resolve(self) -> Path:
        """The directory to from_pretrained, materialising a built-in on first use."""
        if self.source in BUILTINS:
            if BUILTINS[self.source] != self.kind:
                raise ValueError(
                    f"built-in model {self.source!r} is a {BUILTINS[self.source]} model, "
                    f"not {self.kind}"
                )
            path = cache_dir() / "models" / f"{self.source}-{BUILTIN_VERSION}"
            if not path.exists():
                save_builtin(self.source, path)
            return path
        path = Path(self.source).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model path {self.source!r} is not a directory")
        return path


def torch_dtype(name: str) -> Any:
    import torch

    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            name
        ]
    except KeyError:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {name!r}") from None


def load_causal_lm(ref: ModelRef, device: Any, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ref.resolve()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    return model.to(device).eval(), tokenizer


def load_diffusion(ref: ModelRef, device: Any, dtype: str) -> tuple[Any, Any, Any]:
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

    path = ref.resolve()
    dt = torch_dtype(dtype)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=dt)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dt)
    scheduler = DDIMScheduler.from_pretrained(path, subfolder="scheduler")
    return unet.to(device).eval(), vae.to(device).eval(), scheduler
