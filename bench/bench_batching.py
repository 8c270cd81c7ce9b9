"""Cross-request batching against one request at a time, with the tiny built-in models on CPU.

Why: a stage worker used to run one request at a time, which leaves most of a model's compute
idle. This measures what batching (omnistage.batching) buys on real `omnistage stage` workers.
Goals (issue 13), same run:

  ar         concurrency 16: batching >= 3x tokens/s, and p50 latency no worse (ratio <= 1)
  diffusion  concurrency 8:  batching >= 2x images/s

For each kind two workers run on loopback with the same stage: engine.maxBatchSize N (batching)
and 1 (one at a time: the SerialScheduler path, as before batching existed). A closed-loop load
(C clients on one ZMQ channel, each sending its next request when the previous one returns)
drives one worker at a time; rounds alternate between the two, and each mode's figures pool
its rounds. An idle worker waits on its socket and uses no CPU. AR requests have mixed prompt
lengths and generate exactly --ar-tokens tokens each (ignore_eos), greedy; diffusion requests
are 32x32 (the tiny UNet's native size; --diffusion-size), 4 steps, each with its own seed.
Workers keep their default of one torch thread.

"in batch" is the mean number of requests the worker was executing at once (its executor
seconds over wall seconds, from /metrics): at most 1 one at a time, up to N batched.

Prints one line per kind and mode, then one summary line with the ratios and PASS/MISS per goal.
`--check` exits 1 on a MISS. Run from the repository root: `python bench/bench_batching.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This checkout's runtime, here and in the workers (see _env).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from omnistage import protocol as p
from omnistage.client import ReplicaChannel
from omnistage.procs import WorkerProcess, spawn_worker, wait_all_ready
from omnistage.spec import Stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import Goal, add_check_flag, exit_status, verdicts

RUNTIME = str(Path(__file__).resolve().parents[1] / "runtime")
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "a",
           "Once upon a time, in a land far away, there lived a", "xyz 123", "batching",
           "Serving many requests at once keeps the accelerator busy", "q?"]
EXEC_SECONDS = "omnistage_worker_execution_seconds_sum"


@dataclass
class Mode:
    """One worker and what the rounds measured on it."""

    label: str
    worker: WorkerProcess
    window: float = 0.0  # measured seconds, all rounds
    units: int = 0  # tokens or images completed inside the windows
    latencies: list[float] = field(default_factory=list)
    exec_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.units / self.window if self.window else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")

    @property
    def in_batch(self) -> float:
        return self.exec_seconds / self.window if self.window else 0.0


def _env() -> dict[str, str]:
    """Workers import the same omnistage as this bench, installed or not."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": RUNTIME + (os.pathsep + path if path else "")}


def _exec_seconds(w: WorkerProcess) -> float:
    with urllib.request.urlopen(w.http + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(EXEC_SECONDS):
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{w.name}: no {EXEC_SECONDS} in /metrics")


def _ar_params(i: int, tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "ignore_eos": True}


def _diffusion_params(i: int, size: int) -> dict[str, Any]:
    return {"height": size, "width": size, "num_inference_steps": 4, "seed": i}


async def _round(mode: Mode, kind: str, concurrency: int, args: argparse.Namespace) -> None:
    """Closed-loop load for warmup + duration seconds; requests that finish inside the
    measured window count."""
    ch = ReplicaChannel(mode.worker.zmq, name=mode.worker.name)
    await ch.handshake(30)
    ids = itertools.count()
    t_measure = time.monotonic() + args.warmup
    t_end = t_measure + args.duration
    exec_before = 0.0

    async def client() -> None:
        while time.monotonic() < t_end:
            i = next(ids)
            params = (_ar_params(i, args.ar_tokens) if kind == "ar"
                      else _diffusion_params(i, args.diffusion_size))
            t0 = time.monotonic()
            _, final = await ch.request(f"r{i}", params)
            t1 = time.monotonic()
            if not isinstance(final.header, p.Final):
                mode.errors.append(f"{p.tag(final.header)}: {final.header}")
                continue
            if t0 >= t_measure and t1 <= t_end:
                mode.latencies.append(t1 - t0)
            if t_measure <= t1 <= t_end:
                mode.units += final.header.completion_tokens if kind == "ar" else 1

    async def sample_exec() -> None:
        nonlocal exec_before
        await asyncio.sleep(max(0.0, t_measure - time.monotonic()))
        exec_before = await asyncio.to_thread(_exec_seconds, mode.worker)
        await asyncio.sleep(max(0.0, t_end - time.monotonic()))
        mode.exec_seconds += await asyncio.to_thread(_exec_seconds, mode.worker) - exec_before

    try:
        await asyncio.gather(sample_exec(), *(client() for _ in range(concurrency)))
    finally:
        await ch.close()
    mode.window += args.duration


def _line(kind: str, m: Mode, concurrency: int) -> str:
    unit = "tokens/s" if kind == "ar" else "images/s"
    text = (f"{kind:9} {m.label:14} c={concurrency:<3} {m.rate:9.1f} {unit}  "
            f"p50 {m.p50 * 1000:8.1f} ms  in batch {m.in_batch:5.2f}  "
            f"({len(m.latencies)} requests measured)")
    if m.errors:
        text += f"  {len(m.errors)} errors, first: {m.errors[0]}"
    return text


async def bench_kind(kind: str, batch: int, concurrency: int, args: argparse.Namespace,
                     log_dir: Path) -> tuple[Mode, Mode]:
    model = "tiny-llama" if kind == "ar" else "tiny-unet"
    admission = {"maxRequests": 4 * concurrency, "maxQueue": 4 * concurrency}
    modes = []
    for label, size in (("one-at-a-time", 1), (f"batched({batch})", batch)):
        stage = Stage.model_validate({"name": kind, "kind": kind, "model": model,
                                      "engine": {"maxBatchSize": size},
                                      "admission": admission})
        modes.append(Mode(label, spawn_worker(f"{kind}-{size}", stage, log_dir=log_dir,
                                              env=_env())))
    try:
        wait_all_ready([m.worker for m in modes], 300)
        for _ in range(args.rounds):
            for m in modes:
                await _round(m, kind, concurrency, args)
    finally:
        for m in modes:
            m.worker.kill()
    for m in modes:
        print(_line(kind, m, concurrency), flush=True)
    return modes[0], modes[1]


def summary(ar: tuple[Mode, Mode] | None, dif: tuple[Mode, Mode] | None) -> list[Goal]:
    """The goals: a kind whose runs had errors (or no rate) is not measured, hence a MISS."""
    goals = []
    for pair, name in ((ar, "ar"), (dif, "diffusion")):
        if pair is None:
            continue
        one, batched = pair
        ok = not (one.errors or batched.errors or not one.rate or not batched.latencies)
        unit = "tokens/s" if name == "ar" else "images/s"
        goals.append(Goal(f"{name} {unit}", batched.rate / one.rate if ok else None,
                          3.0 if name == "ar" else 2.0))
        if name == "ar":
            goals.append(Goal("ar p50 latency", batched.p50 / one.p50 if ok else None, 1.0,
                              at_least=False))
    return goals


async def main_async(args: argparse.Namespace) -> int:
    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-batching-") as tmp:
        ar = (await bench_kind("ar", args.ar_batch, args.ar_concurrency, args, Path(tmp))
              if "ar" in kinds else None)
        dif = (await bench_kind("diffusion", args.diffusion_batch, args.diffusion_concurrency,
                                args, Path(tmp)) if "diffusion" in kinds else None)
    goals = summary(ar, dif)
    print("summary: " + verdicts(goals), flush=True)
    return exit_status(goals, args.check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="ar,diffusion", help="comma-separated: ar,diffusion")
    parser.add_argument("--ar-concurrency", type=int, default=16)
    parser.add_argument("--ar-batch", type=int, default=16, help="engine.maxBatchSize (ar)")
    parser.add_argument("--ar-tokens", type=int, default=32, help="tokens per AR request")
    parser.add_argument("--diffusion-concurrency", type=int, default=8)
    parser.add_argument("--diffusion-batch", type=int, default=8,
                        help="engine.maxBatchSize (diffusion)")
    parser.add_argument("--diffusion-size", type=int, default=32,
                        help="image height and width in pixels (a multiple of 8)")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per round")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    add_check_flag(parser)
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
