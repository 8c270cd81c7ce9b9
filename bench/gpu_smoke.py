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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default=str(ROOT / "examples" / "text-to-image.yaml"))
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--size", default="64x64", help="image size to request")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for ready")
    add_check_flag(parser)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "error": "no CUDA device visible; nothing measured"}))
        print(f"summary: {Goal('answered', None, 1.0, unit='')}", flush=True)
        return 2
    name = yaml.safe_load(Path(args.file).read_text())["metadata"]["name"]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "omnistage.cli", "serve", args.file,
                             "--port", str(_free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        url = None
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)
            if m := READY.search(line):
                url = m.group(1)
                break
            if time.monotonic() - t0 > args.timeout:
                break
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
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
