"""GPU smoke run: the text-to-image pipeline with its models on CUDA; load time and latency.

Why: unit and integration tests run the tiny models on the CPU; this is the one check that the
same pipeline loads and serves on a GPU. It starts `omnistage serve FILE` (default
examples/text-to-image.yaml; pass a pipeline whose stages name hub ids, with the models pulled
beforehand by `omnistage models pull`, to time real weights), waits until it is ready, then
sends --requests chat and image requests one at a time and prints one JSON line:

  {"cuda": true, "gpus": 1, "load_s": ..., "chat_p50_ms": ..., "image_p50_ms": ..., ...}

then a summary line with its goal: every request answered (`--check` exits 1 when not).
load_s is the time from start to "ready" (model loads and warm-up included). It refuses to run
without a visible CUDA device rather than report CPU figures as GPU ones. Loopback only.

Run from the repository root: `python bench/gpu_smoke.py [FILE] [--requests 10]`.

`--speech` runs the speech pipeline instead (thinker -> talker -> vocoder, the real Qwen3-Omni
classes): it builds a combined Qwen3-Omni checkpoint with random weights in the real model's
shapes (REAL_QWEN3_OMNI, from Qwen/Qwen3-Omni-30B-A3B-Instruct's config.json) on the GPU, saves
it with save_pretrained, serves a pipeline whose three stages load their parts of it through
from_pretrained, and times --requests generic requests that end in audio. Only the thinker's
depth is cut (--thinker-layers, default 4 of 48: 48 would be a 60 GB file), since nothing can
be downloaded there and the disk is small. Prints {"speech_p50_ms", "audio_s", ...}.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import Goal, add_check_flag, exit_status

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready at (http://\S+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


def _timed(fn: Any, n: int, errors: list[str]) -> list[float]:
    """Milliseconds of each answered request; a failed one goes to errors instead."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            fn()
        except OSError as exc:  # URLError and HTTPError included
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        out.append((time.perf_counter() - t0) * 1000)
    return out


#: The shapes of Qwen/Qwen3-Omni-30B-A3B-Instruct (its config.json); the token ids of the media
#: placeholders are the bench tokenizer's own (set in build_speech_checkpoint).
REAL_QWEN3_OMNI: dict[str, Any] = {
    "thinker_config": {
        "audio_config": {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
                         "encoder_ffn_dim": 5120, "num_mel_bins": 128, "output_dim": 2048,
                         "downsample_hidden_size": 480, "n_window": 50,
                         "n_window_infer": 800, "conv_chunksize": 500,
                         "max_source_positions": 1500},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                          "num_heads": 16, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "out_hidden_size": 2048,
                          "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [8, 16, 24]},
        "text_config": {"vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768,
                        "num_hidden_layers": 48, "num_attention_heads": 32,
                        "num_key_value_heads": 4, "head_dim": 128,
                        "moe_intermediate_size": 768, "num_experts": 128,
                        "num_experts_per_tok": 8, "max_position_embeddings": 65536,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000,
                                            "mrope_section": [24, 20, 20],
                                            "interleaved": True}},
    },
    "talker_config": {
        "accept_hidden_layer": 24, "num_code_groups": 16, "thinker_hidden_size": 2048,
        "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "spatial_merge_size": 2, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "code_predictor_config": {"vocab_size": 2048, "hidden_size": 1024,
                                  "intermediate_size": 3072, "num_hidden_layers": 5,
                                  "num_attention_heads": 16, "num_key_value_heads": 8,
                                  "head_dim": 128, "num_code_groups": 16},
        "text_config": {"vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048,
                        "num_hidden_layers": 20, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "head_dim": 128,
                        "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768,
                        "num_experts": 128, "num_experts_per_tok": 6, "norm_topk_prob": True,
                        "max_position_embeddings": 65536,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000,
                                            "mrope_section": [24, 20, 20],
                                            "interleaved": True}},
    },
    "code2wav_config": {"codebook_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
                        "num_hidden_layers": 8, "num_attention_heads": 16,
                        "num_key_value_heads": 16, "num_quantizers": 16, "sliding_window": 72,
                        "decoder_dim": 1536, "upsample_rates": [8, 5, 4, 3],
                        "upsampling_ratios": [2, 2], "max_position_embeddings": 8000},
    "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
}


def build_speech_checkpoint(dest: Path, shapes: dict[str, Any], thinker_layers: int,
                            device: str) -> Path:
    """A Qwen3OmniMoeForConditionalGeneration in these shapes with random weights, built on
    device and written with save_pretrained (with the bench tokenizer and preprocessors)."""
    import copy

    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeForConditionalGeneration,
    )

    from omnistage import models

    shapes = copy.deepcopy(shapes)
    tok = models._omni_tokenizer()
    thinker = shapes["thinker_config"]
    thinker["text_config"]["num_hidden_layers"] = thinker_layers
    media = {"audio_token_id": tok.audio_token_id, "image_token_id": tok.image_token_id,
             "video_token_id": tok.video_token_id,
             "audio_start_token_id": tok.audio_bos_token_id,
             "vision_start_token_id": tok.vision_bos_token_id}
    thinker.update(media)
    talker = shapes["talker_config"]
    talker.update(media)
    talker["accept_hidden_layer"] = min(talker["accept_hidden_layer"], thinker_layers)
    config = Qwen3OmniMoeConfig(**shapes)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.bfloat16)
        with torch.no_grad():  # fused experts are left as torch.empty by the constructor
            for name, param in model.named_parameters():
                if ".experts." in name or not torch.isfinite(param).all():
                    param.normal_(0.0, 0.02)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    thinker_dir = models.resolve("tiny-omni-thinker", "thinker")
    (dest / "preprocessor_config.json").write_text(
        (thinker_dir / "preprocessor_config.json").read_text())
    del model
    return dest


def speech_pipeline(model: str, voice: str, frames: int, gpus: int) -> dict[str, Any]:
    """thinker -> talker -> vocoder over one model (each stage loads its part)."""
    def stage(name: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "kind": name, "model": model, "replicas": 1,
                "resources": {"gpus": gpus, "cpu": "2", "memory": "32Gi"},
                "engine": {"dtype": "bfloat16" if gpus else "float32"}, **extra}

    talker = stage("talker", inputs=["thinker"])
    talker["engine"].update(voices=[voice], maxFrames=frames)
    thinker = stage("thinker")
    thinker["engine"]["maxTokens"] = 16
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "speech-smoke"},
            "spec": {"orchestrator": {"api": ["generic"]},
                     "stages": [thinker, talker,
                                stage("vocoder", inputs=["talker"], finalOutput=True)]}}


def speech_requests(url: str, n: int, errors: list[str]) -> tuple[list[float], list[float]]:
    """Milliseconds of each answered request and seconds of audio it returned."""
    seconds: list[float] = []

    def one() -> None:
        out = _post(f"{url}/v1/pipelines/speech-smoke/requests", {"prompt": "a red fox"})
        result = out["children"][0]["outputs"]["vocoder"]
        audio = result["tensors"]["audio"]
        if audio["dtype"] != "float32" or len(audio["shape"]) != 1:
            raise OSError(f"audio tensor {audio['dtype']} {audio['shape']}")
        seconds.append(audio["shape"][0] / result["fields"]["sample_rate"])

    return _timed(one, n, errors), seconds


def serve(file: str, timeout: float) -> tuple[subprocess.Popen[str], str | None]:
    """`omnistage serve FILE` and its URL once ready (None if it never was)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "omnistage.cli", "serve", file,
                             "--port", str(_free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        if m := READY.search(line):
            return proc, m.group(1)
        if time.monotonic() - t0 > timeout:
            break
    return proc, None


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main_speech(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="speech-smoke-", dir=args.workdir) as tmp:
        model = build_speech_checkpoint(Path(tmp) / "qwen3-omni", REAL_QWEN3_OMNI,
                                        args.thinker_layers, "cuda")
        build_s = time.monotonic() - t0
        torch.cuda.empty_cache()
        file = Path(tmp) / "speech.yaml"
        file.write_text(yaml.safe_dump(speech_pipeline(str(model), "ethan", args.frames, 1)))
        t1 = time.monotonic()
        proc, url = serve(str(file), args.timeout)
        try:
            if url is None:
                print(json.dumps({"cuda": True, "error": "serve never became ready"}))
                print(f"summary: {Goal('answered', None, 1.0, unit='')}", flush=True)
                return 1
            load_s = time.monotonic() - t1
            errors: list[str] = []
            ms, audio_s = speech_requests(url, args.requests, errors)
        finally:
            stop(proc)
    print(json.dumps({
        "cuda": True, "gpus": torch.cuda.device_count(),
        "device": torch.cuda.get_device_name(0), "thinker_layers": args.thinker_layers,
        "build_s": round(build_s, 1), "load_s": round(load_s, 1), "requests": args.requests,
        "speech_p50_ms": round(statistics.median(ms), 1) if ms else None,
        "audio_s": round(statistics.median(audio_s), 3) if audio_s else None,
        "errors": errors[:5],
    }))
    goal = Goal("answered", len(ms) / args.requests, 1.0, unit="")
    print(f"summary: {goal}", flush=True)
    return exit_status([goal], args.check)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default=str(ROOT / "examples" / "text-to-image.yaml"))
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--size", default="64x64", help="image size to request")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for ready")
    parser.add_argument("--speech", action="store_true",
                        help="run the Qwen3-Omni speech pipeline at real shapes instead")
    parser.add_argument("--thinker-layers", type=int, default=4,
                        help="--speech: thinker depth (the real model has 48)")
    parser.add_argument("--frames", type=int, default=64, help="--speech: most codec frames")
    parser.add_argument("--workdir", default=None, help="--speech: where the checkpoint goes")
    add_check_flag(parser)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "error": "no CUDA device visible; nothing measured"}))
        print(f"summary: {Goal('answered', None, 1.0, unit='')}", flush=True)
        return 2
    if args.speech:
        return main_speech(args)
    name = yaml.safe_load(Path(args.file).read_text())["metadata"]["name"]
    t0 = time.monotonic()
    proc, url = serve(args.file, args.timeout)
    try:
        if url is None:
            print(json.dumps({"cuda": True, "error": "serve never became ready"}))
            print(f"summary: {Goal('answered', None, 1.0, unit='')}", flush=True)
            return 1
        load_s = time.monotonic() - t0
        errors: list[str] = []
        chat = _timed(lambda: _post(f"{url}/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": "a red fox"}],
            "max_tokens": 16}), args.requests, errors)
        image = _timed(lambda: _post(f"{url}/v1/images/generations", {
            "model": name, "prompt": "a red fox", "size": args.size,
            "response_format": "b64_json"}), args.requests, errors)
        def p50(ms: list[float]) -> float | None:
            return round(statistics.median(ms), 1) if ms else None

        print(json.dumps({
            "cuda": True, "gpus": torch.cuda.device_count(),
            "device": torch.cuda.get_device_name(0), "file": args.file,
            "load_s": round(load_s, 2), "requests": args.requests,
            "chat_p50_ms": p50(chat), "chat_max_ms": round(max(chat), 1) if chat else None,
            "image_p50_ms": p50(image), "image_max_ms": round(max(image), 1) if image else None,
            "errors": errors[:5],
        }))
        goal = Goal("answered", (len(chat) + len(image)) / (2 * args.requests), 1.0, unit="")
        print(f"summary: {goal}", flush=True)
        return exit_status([goal], args.check)
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
