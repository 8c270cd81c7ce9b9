"""Model resolution and loading: the one resolver of model references for every mode.

`omnistage serve` (prepare, before any worker starts), `omnistage models pull` (pull; also the
cluster's init container), and the worker (resolve, then from_pretrained) all come here; the
grammar itself is omnistage.modelref. Hub ids resolve through the standard Hugging Face cache
(HF_HOME / HF_HUB_CACHE) with huggingface_hub's snapshot_download.

Built-in tiny models are random-initialised from configs with a fixed seed, written once with
save_pretrained into a cache folder, and then loaded like any user model through the real
from_pretrained path: there is one loading code path, and it is the one users' weights take.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omnistage.kinds import builtin_models
from omnistage.modelref import ModelRef, parse_model_ref
from omnistage.spec import DEFAULT_VOICES, Stage

BUILTIN_VERSION = "v1"
TINY_HIDDEN = 64  # shared width: the tiny UNet cross-attends to the tiny LLM's hidden states
#: The built-in ar models' context (max_position_embeddings): known without their files, so the
#: orchestrator can state the max_tokens bound of a pipeline serving one (params.max_tokens_bound).
BUILTIN_CONTEXT = {"tiny-llama": 1024, "tiny-omni-thinker": 1024}
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
        max_position_embeddings=BUILTIN_CONTEXT["tiny-llama"],
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


# The tiny Qwen3-Omni stages: the real transformers classes in small shapes. They share the
# thinker's width (its hidden states and token embeddings feed the talker) and the codec (the
# talker's code predictor and the vocoder agree on codebook size and quantizer count).
TINY_CODEBOOK = 64  # codes per quantizer
TINY_QUANTIZERS = 4  # the talker's code groups = the vocoder's quantizers
TINY_SAMPLE_RATE = 16000  # the tiny vocoder's Hz (32 samples a frame)
#: Qwen3-Omni's vocoder makes 24 kHz audio; a checkpoint may say otherwise in its config.
QWEN3_OMNI_SAMPLE_RATE = 24000
TINY_VOICES = DEFAULT_VOICES  # the spec's default list: what the tiny talker offers
_MEDIA_TOKENS = {
    "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
_TTS_TOKENS = ("<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>")


def _omni_tokenizer() -> Any:
    """The byte-level tokenizer plus Qwen-Omni's media and TTS special tokens (the processor
    side of the thinker looks them up by these attribute names)."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer().backend_tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=base, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", extra_special_tokens=_MEDIA_TOKENS)
    tok.add_special_tokens({"additional_special_tokens": list(_TTS_TOKENS)})
    return tok


def _rope(head_dim: int) -> dict[str, Any]:
    # Multimodal RoPE: the three sections (time, height, width) split head_dim / 2.
    half = head_dim // 2
    return {"rope_type": "default", "rope_theta": 1_000_000.0,
            "mrope_section": [half // 2, half // 4, half - half // 2 - half // 4],
            "interleaved": True}


def _tiny_thinker(tok: Any) -> Any:
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    torch.manual_seed(0)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in _MEDIA_TOKENS.items()}
    cfg = Qwen3OmniMoeThinkerConfig(
        audio_config={"num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
                      "encoder_ffn_dim": 64, "d_model": 32, "output_dim": TINY_HIDDEN,
                      "downsample_hidden_size": 16, "max_source_positions": 1500},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "out_hidden_size": TINY_HIDDEN, "num_position_embeddings": 64,
                       "deepstack_visual_indexes": [0]},
        text_config={"vocab_size": len(tok), "hidden_size": TINY_HIDDEN,
                     "intermediate_size": 2 * TINY_HIDDEN, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                     "max_position_embeddings": BUILTIN_CONTEXT["tiny-omni-thinker"],
                     "rope_parameters": _rope(16), "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
        audio_token_id=ids["audio_token"], image_token_id=ids["image_token"],
        video_token_id=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
        vision_start_token_id=ids["vision_bos_token"],
    )
    return Qwen3OmniMoeThinkerForConditionalGeneration(cfg)


def _save_tiny_omni_thinker(path: Path) -> None:
    """Thinker weights, the tokenizer, and the feature extractor (audio: Whisper log-mel) and
    image processor (Qwen2-VL patches) in one preprocessor_config.json, as Qwen's repos ship."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from omnistage.media import INPUT_AUDIO_SAMPLE_RATE

    tok = _omni_tokenizer()
    _tiny_thinker(tok).save_pretrained(path)
    tok.save_pretrained(path)
    images = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                      min_pixels=32 * 32, max_pixels=64 * 64)
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=INPUT_AUDIO_SAMPLE_RATE)
    merged = {**json.loads(images.to_json_string()), **json.loads(audio.to_json_string())}
    merged["image_processor_type"] = "Qwen2VLImageProcessor"
    (path / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))


def _save_tiny_omni_talker(path: Path) -> None:
    """Talker (with its code predictor) plus what a talker without a thinker needs to read
    text: the tiny thinker's tokenizer and input embedding table (text_embeddings.safetensors),
    the table Qwen-Omni's talker projects text from."""
    import torch
    from safetensors.torch import save_file
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    tok = _omni_tokenizer()
    table = _tiny_thinker(tok).get_input_embeddings().weight.detach().clone()
    torch.manual_seed(0)
    special = TINY_CODEBOOK  # codec ids past the codebook: eos, pad, bos, think marks, voices
    cfg = Qwen3OmniMoeTalkerConfig(
        code_predictor_config={"vocab_size": TINY_CODEBOOK, "hidden_size": TINY_HIDDEN,
                               "intermediate_size": 2 * TINY_HIDDEN, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "num_code_groups": TINY_QUANTIZERS,
                               "max_position_embeddings": 64},
        text_config={"vocab_size": special + 6 + len(TINY_VOICES), "hidden_size": TINY_HIDDEN,
                     "intermediate_size": 2 * TINY_HIDDEN, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                     "num_experts": 4, "num_experts_per_tok": 2,
                     "max_position_embeddings": 8192, "rope_parameters": _rope(16)},
        num_code_groups=TINY_QUANTIZERS, thinker_hidden_size=TINY_HIDDEN,
        codec_eos_token_id=special, codec_pad_id=special + 1, codec_bos_id=special + 2,
        codec_nothink_id=special + 3, codec_think_bos_id=special + 4,
        codec_think_eos_id=special + 5, accept_hidden_layer=2, spatial_merge_size=2,
        speaker_id={v: special + 6 + i for i, v in enumerate(TINY_VOICES)},
    )
    talker = Qwen3OmniMoeTalkerForConditionalGeneration(cfg)
    # transformers 5.24 leaves the talker's fused expert weights uninitialised (torch.empty):
    # give them the init every other weight gets, so the tiny model computes finite numbers.
    with torch.no_grad():
        for name, param in talker.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, cfg.initializer_range)
    talker.save_pretrained(path)
    tok.save_pretrained(path)
    save_file({"weight": table}, str(path / TEXT_EMBEDDINGS))


def _save_tiny_omni_vocoder(path: Path) -> None:
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    torch.manual_seed(0)
    cfg = Qwen3OmniMoeCode2WavConfig(
        codebook_size=TINY_CODEBOOK, hidden_size=32, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1,
        num_quantizers=TINY_QUANTIZERS, upsample_rates=(4, 4), upsampling_ratios=(2,),
        decoder_dim=16, sliding_window=16, max_position_embeddings=8192,
        sample_rate=TINY_SAMPLE_RATE,
    )
    Qwen3OmniMoeCode2Wav(cfg).save_pretrained(path)


#: A talker directory's text embedding table (the thinker's input embeddings), for TTS.
TEXT_EMBEDDINGS = "text_embeddings.safetensors"

_SAVERS = {"tiny-llama": _save_tiny_llama, "tiny-unet": _save_tiny_unet,
           "tiny-omni-thinker": _save_tiny_omni_thinker,
           "tiny-omni-talker": _save_tiny_omni_talker,
           "tiny-omni-vocoder": _save_tiny_omni_vocoder}


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


class ModelUnavailable(RuntimeError):
    """A model that cannot be resolved here; str() names the model, the cause and the fix."""

    def __init__(self, model: str, problem: str, fix: str) -> None:
        super().__init__(f"model {model!r}: {problem}; {fix}")
        self.model, self.problem, self.fix = model, problem, fix

    def for_stage(self, stage: str) -> str:
        return f"stage {stage!r}: {self}"


def offline() -> bool:
    """Whether the hub may not be contacted (HF_HUB_OFFLINE, or transformers' older spelling)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at each call (HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub), so a pod's HF_HOME volume is honoured."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _pull_fix(ref: ModelRef) -> str:
    return (f"run `omnistage models pull {ref}` where the hub is reachable (it fills "
            f"{hub_cache()}), or use a local path to the model's directory")


def fetch(ref: ModelRef, *, download: bool | None = None, progress: bool = True) -> Path:
    """The snapshot directory of a hub model, from the cache or (when download) from the hub.

    download=None means "unless offline()". Progress bars go to stderr, as tqdm's do.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if download is None:
        download = not offline()
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per request otherwise
    (enable_progress_bars if progress else disable_progress_bars)()
    name = str(ref)
    try:
        path = snapshot_download(ref.source, revision=ref.revision, cache_dir=hub_cache(),
                                 local_files_only=not download)
    except GatedRepoError:
        raise ModelUnavailable(name, "the hub refused access (a gated model)",
                               "set HF_TOKEN (on a cluster: spec.modelCache.tokenSecret) to a "
                               "token that was granted access") from None
    except RevisionNotFoundError:
        raise ModelUnavailable(name, f"revision {ref.revision!r} does not exist on the hub",
                               "use a branch, tag or commit the repository has") from None
    except RepositoryNotFoundError:
        raise ModelUnavailable(name, "no such repository on the hub (or it is private)",
                               "check the id, or set HF_TOKEN for a private one") from None
    except LocalEntryNotFoundError:
        why = ("not in the Hugging Face cache and HF_HUB_OFFLINE is set" if offline() else
               "not in the Hugging Face cache" if not download else
               "not in the Hugging Face cache and the hub cannot be reached")
        raise ModelUnavailable(name, why, _pull_fix(ref)) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelUnavailable(name, f"cannot be fetched: {exc}", _pull_fix(ref)) from None
    return Path(path)


def resolved_commit(model: str) -> str | None:
    """The commit a hub reference resolves to in the hub cache, as the loader resolves it
    (the ref file of its branch or tag, `main` when it names none; a commit names itself);
    None for built-ins, local paths and a model not in the cache. No network: the revision
    a worker reports (omnistage.revision.worker_revision) must be what it loads."""
    ref = parse_model_ref(model)
    if ref.kind != "hub":
        return None
    name = ref.revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", name):
        return name
    repo = hub_cache() / ("models--" + ref.source.replace("/", "--"))
    try:
        commit = (repo / "refs" / name).read_text().strip()
    except OSError:
        return None
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def resolve(model: str, stage_kind: str) -> Path:
    """The directory to from_pretrained for a stage's model reference (omnistage.modelref).

    Built-ins are materialised on first use; hub ids come from the cache first and are only
    downloaded when they are missing and the hub may be contacted (never with HF_HUB_OFFLINE).
    """
    ref = parse_model_ref(model)
    if ref.kind == "builtin":
        if (serves := builtin_models()[ref.source]) != stage_kind:
            raise ValueError(f"built-in model {ref.source!r} is a {serves} model, "
                             f"not {stage_kind}")
        path = cache_dir() / "models" / f"{ref.source}-{BUILTIN_VERSION}"
        if not path.exists():
            save_builtin(ref.source, path)
        return path
    if ref.kind == "hub":
        try:
            return fetch(ref, download=False, progress=False)
        except ModelUnavailable:
            if offline():
                raise
        return fetch(ref, download=True)
    path = Path(ref.source).expanduser()
    if not path.is_dir():
        raise ModelUnavailable(model, "the local path is not a directory",
                               "point the stage at a saved model's directory")
    return path


def pull(models: list[str], *, offline_only: bool = False) -> Path:
    """`omnistage models pull`: every hub id into the cache, with progress; built-ins are
    materialised. With offline_only, only check that the cache holds them. Returns the cache."""
    for model in models:
        ref = parse_model_ref(model)
        if ref.kind == "hub":
            fetch(ref, download=not offline_only and not offline())
        elif ref.kind == "builtin":
            resolve(model, builtin_models()[model])
        else:
            raise ModelUnavailable(model, "a local path is not pulled",
                                   "pass hub ids (org/name[@revision]) or built-ins")
    return hub_cache()


def prepare(stages: list[Stage], say: Any = print) -> list[str]:
    """Before any worker starts: every hub model of stages is in the cache, or why not.

    Online, missing models are downloaded (with progress); offline, a missing one is an error.
    Returns one message per unavailable stage model, naming the stage, the id and the fix.
    """
    problems = []
    for stage in stages:
        ref = stage.model_ref()
        if ref is None or ref.kind != "hub":
            continue
        try:
            path = fetch(ref, download=False, progress=False)
        except ModelUnavailable as exc:
            if offline():
                problems.append(exc.for_stage(stage.name))
                continue
            say(f"stage {stage.name}: fetching {ref} from the hub")
            try:
                path = fetch(ref, download=True)
            except ModelUnavailable as exc2:
                problems.append(exc2.for_stage(stage.name))
                continue
        say(f"stage {stage.name}: model {ref} at {path}")
    return problems


def torch_dtype(name: str, device: Any) -> Any:
    """The torch dtype for an engine dtype; auto is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if name == "auto":
        return torch.bfloat16 if getattr(device, "type", str(device)) == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            name
        ]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {name!r}"
                         ) from None


def load_causal_lm(model: str, device: Any, dtype: str, kind: str) -> tuple[Any, Any]:
    """A causal LM and its tokenizer, for a stage of kind (which its built-in must serve)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(model, kind)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype, device))
    return model.to(device).eval(), tokenizer


def load_diffusion(model: str, device: Any, dtype: str, kind: str) -> tuple[Any, Any, Any]:
    """UNet, VAE and scheduler of a diffusers pipeline directory (unet/, vae/, scheduler/).

    The scheduler's class is the one the pipeline's model_index.json names (a hub pipeline
    such as stable-diffusion-v1-5 says PNDMScheduler); without that file, DDIM.
    """
    import diffusers
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

    path = resolve(model, kind)
    dt = torch_dtype(dtype, device)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=dt)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dt)
    scheduler_cls: Any = DDIMScheduler
    index = path / "model_index.json"
    if index.is_file():
        entry = json.loads(index.read_text()).get("scheduler") or [None, None]
        found = getattr(diffusers, str(entry[1]), None)
        if found is None or not hasattr(found, "from_pretrained"):
            raise ModelUnavailable(model, f"model_index.json names scheduler {entry[1]!r}, "
                                   f"which diffusers {diffusers.__version__} does not have",
                                   "use a pipeline with a diffusers scheduler")
        scheduler_cls = found
    scheduler = scheduler_cls.from_pretrained(path, subfolder="scheduler")
    return unet.to(device).eval(), vae.to(device).eval(), scheduler


# ---- Qwen3-Omni stages ------------------------------------------------------------------------
# A stage's model is a directory of its own component (the built-ins), or Qwen's combined
# checkpoint (model_type qwen3_omni_moe: thinker, talker and code2wav in one repository), from
# which each stage loads only its part: the part's config, and its weights with the part's
# prefix mapped away, through the same from_pretrained.

def _omni_part(cls: Any, path: Path, part: str, dtype: Any) -> Any:
    from transformers import AutoConfig

    try:
        combined = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        combined = None  # from_pretrained below says what is missing
    if combined == "qwen3_omni_moe":
        config = AutoConfig.from_pretrained(path)
        prefix = part.removesuffix("_config")  # thinker_config's weights are thinker.*
        _fuse_experts_like_the_whole(cls, config)
        model = cls.from_pretrained(path, config=getattr(config, part), dtype=dtype,
                                    key_mapping={rf"^{prefix}\.": ""})
        model.omni_config = config  # the whole model's config (token ids, the talker's layer)
        return model
    return cls.from_pretrained(path, dtype=dtype)


def _fuse_experts_like_the_whole(cls: Any, config: Any) -> None:
    """The combined checkpoint stores MoE experts one by one; transformers fuses them on load by
    the model type's conversion mapping, which the whole model has and the talker alone lacks.
    Give the part the whole model's mapping (it matches only expert weights)."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    name = cls.__name__
    whole = get_checkpoint_conversion_mapping(config.model_type)
    if whole and get_checkpoint_conversion_mapping(name) is None:
        register_checkpoint_conversion_mapping(name, whole)


def load_thinker(model: str, device: Any, dtype: str, kind: str) -> tuple[Any, Any, Any, Any]:
    """A Qwen3-Omni thinker, its tokenizer, image processor and audio feature extractor."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    path = resolve(model, kind)
    lm = _omni_part(Qwen3OmniMoeThinkerForConditionalGeneration, path, "thinker_config",
                    torch_dtype(dtype, device))
    tokenizer = AutoTokenizer.from_pretrained(path)
    images = Qwen2VLImageProcessorPil.from_pretrained(path)
    audio = WhisperFeatureExtractor.from_pretrained(path)
    return lm.to(device).eval(), tokenizer, images, audio


def load_talker(model: str, device: Any, dtype: str, kind: str) -> tuple[Any, Any, Any]:
    """A Qwen3-Omni talker (with its code predictor), and for text without a thinker: the
    tokenizer and the thinker's input embedding table (None, None when the directory has no
    table: such a talker only follows a thinker)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    path = resolve(model, kind)
    dt = torch_dtype(dtype, device)
    talker = _omni_part(Qwen3OmniMoeTalkerForConditionalGeneration, path, "talker_config", dt)
    table = _text_table(path)
    tokenizer = AutoTokenizer.from_pretrained(path) if table is not None else None
    if table is not None:
        table = table.to(device=device, dtype=dt)
    return talker.to(device).eval(), tokenizer, table


def _text_table(path: Path) -> Any:
    """The thinker's input embedding table beside a talker: TEXT_EMBEDDINGS, or the thinker's
    own tensor inside a combined checkpoint."""
    from safetensors import safe_open

    own = path / TEXT_EMBEDDINGS
    if own.is_file():
        with safe_open(str(own), framework="pt") as f:
            return f.get_tensor("weight")
    key = "thinker.model.embed_tokens.weight"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(key)
        if shard:
            with safe_open(str(path / shard), framework="pt") as f:
                return f.get_tensor(key)
    return None


def load_vocoder(model: str, device: Any, dtype: str, kind: str) -> tuple[Any, int]:
    """A Qwen3-Omni Code2Wav and its sample rate (the config's sample_rate, else 24 kHz)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    path = resolve(model, kind)
    vocoder = _omni_part(Qwen3OmniMoeCode2Wav, path, "code2wav_config",
                         torch_dtype(dtype, device))
    rate = int(getattr(vocoder.config, "sample_rate", None) or QWEN3_OMNI_SAMPLE_RATE)
    return vocoder.to(device).eval(), rate
