"""Speech pipelines with the tiny built-in Qwen3-Omni models on CPU: time to first audio,
real-time factor, and speech requests per second at concurrency 8 against one at a time.

Why: issue 20 asks what streaming between stages buys a spoken answer, how fast the speech
stages run against the audio they make, and whether they serve many requests at once. Goals:

  ttfa     time to first audio with streaming between stages, against the same pipeline with
           streaming turned off (`streaming: {enabled: false}` on every stage), same run:
           <= 0.25x for a 10-second answer
  speech   with batching on, requests/s at concurrency 8 against one at a time: >= 2x
  omni     the same for spoken chat (thinker -> talker -> vocoder, every stage batching):
           >= 3x; printed beside it, concurrency 8 with batching off in every stage

and figures without a goal: the real-time factor (processing seconds / audio seconds) of the
vocoder stage alone and of the whole pipeline (examples/tts.yaml and examples/omni-speech.yaml
shapes) at concurrency 1 and 8.

Everything runs through the engine's Python API (omnistage.orchestrator.engine.Orchestrator)
over real `omnistage stage` worker processes on loopback, without the HTTP layer's encoding in
the figures. Time to first audio is taken where the HTTP layer first has audio to send: when
the orchestrator receives the vocoder stage's first audio chunk (streaming on; /v1/audio/speech
then writes the file's first bytes, docs/http-api.md "When audio streams"), or its whole audio
(streaming off). For the vocoder to hand its audio on in chunks it needs a
downstream that takes chunks: a `bench-sink` stage (registered by this bench, no model) takes
them and returns only their count.

The tiny talker has random weights: it samples its end code after a few dozen frames, so no
answer would last 10 seconds. The bench's `bench-talker` kind is the built-in talker with its
end code masked (every frame still runs the real model), so an answer is exactly
engine.maxFrames frames long: 10 s at the tiny vocoder's sample rate is
10 * sample_rate / samples-per-frame frames (read from the tiny vocoder's config).

The vocoder stage alone is driven over its ZMQ channel with the talker's codes of a 10-second
answer. The pipelines' RTF is each request's latency over its audio seconds (the median), and
the aggregate (wall seconds over all audio seconds) at concurrency 8.

Batching: the thinker, talker and vocoder stages run with engine.maxBatchSize --batch-size (8),
so at concurrency 8 their requests share forward passes; the requests/s goals are the tts and
omni shapes at concurrency 8 against one request at a time, on the same workers in the same run.
For what batching itself adds (rather than overlapping the stages), each shape runs once more at
concurrency 8 on workers with engine.maxBatchSize 1 (requests one at a time in each stage):
printed, and named in the summary when its goal is missed.

Prints progress and one `speech ...` line per figure, then one summary line with PASS/MISS
per goal. `--check` exits 1 on a MISS. Run from the repository root:
`python bench/bench_speech.py` (about 3 to 5 minutes on 2 busy CPUs).

Against another tree, same run: `--baseline-commit REV` (or `--baseline-tree DIR`) runs this
bench from this checkout and REV's own bench from REV's checkout (each on its own runtime and
workers), alternating --rounds times, and compares the medians: time to first audio (streaming
on), the tts pipeline's requests/s at --concurrency and the speech requests/s c8/c1 ratio, each
this tree / the baseline, "no worse" within 10% (TTFA <= 1.1x, the others >= 0.9x). About 8 to
10 minutes a round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# This checkout's runtime, here and in the workers (see _env).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline import add_baseline_flags, baseline_tree
from goals import Goal, add_check_flag, exit_status, verdicts

import omnistage.kinds as stage_kinds
from omnistage.admission import ExecutionContext
from omnistage.executors.base import Emit, Executor, Outcome, StageIO
from omnistage.executors.talker import TalkerExecutor
from omnistage.kinds import Payload, StageKind
from omnistage.protocol import WireTensor

ROOT = Path(__file__).resolve().parents[1]
MODULE = "bench_speech"  # how the workers import this file (bench/ is on their path)
PROMPT = "hello there, this is a spoken answer"
TTFA_GOAL = 0.25
RPS_GOAL = 2.0
OMNI_RPS_GOAL = 3.0  # issue 41: spoken chat, its thinker batching too


# ------------------------------------------------------------------------- the bench's kinds


class FixedLengthTalker(TalkerExecutor):
    """The built-in talker with its end code masked: every answer is engine.maxFrames long."""

    def _sample(self, logits: Any, gen: Any, eos: int, may_end: bool = True) -> int:
        return super()._sample(logits, gen, eos, may_end=False)


class CountingSink(Executor):
    """Takes audio, whole or fed in chunks, and returns only how many samples came."""

    kind = "bench-sink"

    def load(self) -> None:
        pass

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> Any:
        return dict(tensors)

    def cost(self, job: Any) -> int:
        return 1

    def execute(self, job: Any, ctx: ExecutionContext, emit: Emit) -> Outcome:
        io = StageIO.of(emit)
        if io.fed:
            samples = sum(int(c.tensors["audio"].shape[0]) for c in io.inputs())
        else:
            samples = int(job["audio"].shape[0])
        # Reply fields are the protocol's own: the count goes as a one-element tensor.
        return Outcome({"finish_reason": "stop"}, {"samples": np.array([samples], np.int64)})


def _bench_kinds() -> list[StageKind]:
    talker = stage_kinds.get("talker")
    return [
        dataclasses.replace(talker, name="bench-talker", needs_model=False, builtin_models=(),
                            executor=f"{MODULE}:FixedLengthTalker",
                            summary="bench only: tiny-omni-talker with its end code masked"),
        StageKind(name="bench-sink", executor=f"{MODULE}:CountingSink",
                  summary="bench only: counts audio samples", needs_model=False,
                  consumes=frozenset({Payload.AUDIO}), emits=frozenset({Payload.AUDIO}),
                  chunked_input=True),
    ]


KINDS = _bench_kinds()  # what OMNISTAGE_STAGE_KINDS names in the workers


# ------------------------------------------------------------------------- harness


def _env() -> dict[str, str]:
    """Workers import this checkout's omnistage and this module's kinds."""
    path = os.environ.get("PYTHONPATH", "")
    own = os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "bench")])
    return {"PYTHONPATH": own + (os.pathsep + path if path else ""),
            stage_kinds.ENV_VAR: f"{MODULE}:KINDS"}


def _pipeline(name: str, stages: list[dict[str, Any]]) -> Any:
    from omnistage.spec import parse_pipeline

    return parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                           "metadata": {"name": name}, "spec": {"stages": stages}})


def _stages(shape: str, frames: int, chunk: int, streaming: bool, seed: int,
            batch: int = 8) -> list[dict[str, Any]]:
    """The stages of a shape: tts (talker -> vocoder), omni (thinker -> talker -> vocoder)
    or ttfa (talker -> vocoder -> bench-sink); streaming on or off on every stage; batch:
    the thinker's, talker's and vocoder's engine.maxBatchSize (1: one request at a time)."""
    flow = {"enabled": streaming}
    talker: dict[str, Any] = {
        "name": "talker", "kind": "bench-talker", "streaming": flow,
        "engine": {"voices": ["default"], "maxFrames": frames, "chunkFrames": chunk,
                   "seed": seed, "maxBatchSize": batch}}
    vocoder: dict[str, Any] = {"name": "vocoder", "kind": "vocoder",
                               "model": "tiny-omni-vocoder", "inputs": ["talker"],
                               "streaming": flow,
                               "engine": {"chunkFrames": chunk, "maxBatchSize": batch}}
    if shape == "tts":
        return [talker, {**vocoder, "finalOutput": True}]
    if shape == "omni":
        thinker = {"name": "thinker", "kind": "thinker", "model": "tiny-omni-thinker",
                   "streaming": flow, "engine": {"maxTokens": 16, "maxBatchSize": batch}}
        return [thinker, {**talker, "inputs": ["thinker"]}, {**vocoder, "finalOutput": True}]
    sink = {"name": "sink", "kind": "bench-sink", "inputs": ["vocoder"], "finalOutput": True,
            "streaming": flow}
    return [talker, vocoder, sink]


@dataclass
class Served:
    """Workers (one per stage) and orchestrators over them."""

    workers: dict[str, Any]
    orchs: list[Any]
    first_audio: dict[str, float] = field(default_factory=dict)  # request id -> monotonic

    async def stop(self) -> None:
        for orch in self.orchs:
            await orch.stop(drain_timeout=1)
        for w in self.workers.values():
            w.kill()


async def serve(name: str, pipes: list[Any], log_dir: Path) -> Served:
    """One worker per stage of pipes[0], and an orchestrator per pipeline over them (streaming
    is the orchestrator's routing: the workers are the same for every pipeline). CurveZMQ
    between them, as `omnistage serve` has by default."""
    from omnistage import curve
    from omnistage.orchestrator.engine import Orchestrator
    from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
    from omnistage.procs import spawn_worker, wait_all_ready

    keys = curve.generate()
    env = {**_env(), curve.CURVE_KEYS_ENV: str(curve.write(keys, log_dir / f"{name}-curve"))}
    workers = {stage.name: spawn_worker(f"{name}-{stage.name}-0", stage, log_dir=log_dir,
                                        env=env) for stage in pipes[0].spec.stages}
    served = Served(workers, [])
    try:
        await asyncio.to_thread(wait_all_ready, list(workers.values()), 300)
        # Their endpoints are known once they are ready.
        infos = [ReplicaInfo(stage, w.name, w.zmq) for stage, w in workers.items()]
        for pipe in pipes:
            orch = Orchestrator(pipe, StaticMembership(infos), curve=curve.CurveKeyring.fixed(keys))
            _watch_audio(orch, served.first_audio)
            await orch.start()
            served.orchs.append(orch)
    except BaseException:
        await served.stop()
        raise
    return served


def _watch_audio(orch: Any, first: dict[str, float]) -> None:
    """Note when the orchestrator first holds audio of each request: the vocoder's first chunk,
    or its terminal reply when it did not stream."""
    on_chunk, on_terminal = orch._on_chunk, orch._on_terminal

    def note(task: Any) -> None:
        if task.stage == "vocoder":
            first.setdefault(task.child.request.req.request_id, time.monotonic())

    def chunk(task: Any, msg: Any) -> None:
        note(task)
        on_chunk(task, msg)

    def terminal(task: Any, msg: Any) -> None:
        note(task)
        on_terminal(task, msg)

    orch._on_chunk, orch._on_terminal = chunk, terminal


_ids = itertools.count()


@dataclass
class Done:
    rid: str
    latency: float
    outcome: Any
    started: float


async def submit(orch: Any, finals: list[str], timeout: float) -> Done:
    from omnistage.orchestrator.requests import PipelineRequest

    rid = f"speech-{next(_ids)}"
    t0 = time.monotonic()
    out = await asyncio.wait_for(
        orch.submit(PipelineRequest(prompt=PROMPT, finals=finals, request_id=rid)).outcome(),
        timeout)
    if out.status != "ok":
        raise RuntimeError(f"request {rid}: {out.status}: {out.error}")
    return Done(rid, time.monotonic() - t0, out, t0)


def _samples(out: Any, stage: str) -> int:
    got = out.children[0].outputs[stage]
    if "samples" in got.tensors:
        return int(got.tensors["samples"].numpy()[0])
    return int(got.tensors["audio"].shape[0])


# ------------------------------------------------------------------------- figures


@dataclass
class Ttfa:
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    audio_s: float = 0.0
    codes: Any = None  # the talker's codes of one answer (for the vocoder alone)

    @property
    def ratio(self) -> float | None:
        if not self.on or not self.off:
            return None
        return statistics.median(self.on) / statistics.median(self.off)


async def bench_ttfa(args: argparse.Namespace, frames: int, rate: int, log_dir: Path) -> Ttfa:
    on = _pipeline("ttfa-on", _stages("ttfa", frames, args.chunk_frames, True, args.seed))
    off = _pipeline("ttfa-off", _stages("ttfa", frames, args.chunk_frames, False, args.seed))
    served = await serve("ttfa", [on, off], log_dir)
    res = Ttfa()
    try:
        for i in range(args.ttfa_requests):
            for label, orch, into in (("on", served.orchs[0], res.on),
                                      ("off", served.orchs[1], res.off)):
                done = await submit(orch, ["talker", "sink"], args.timeout)
                into.append(served.first_audio[done.rid] - done.started)
                res.audio_s = _samples(done.outcome, "sink") / rate
                res.codes = done.outcome.children[0].outputs["talker"].tensors["codec_codes"]
                print(f"  ttfa request {i + 1}/{args.ttfa_requests} streaming {label}: first "
                      f"audio {into[-1]:.3f} s, whole answer {done.latency:.2f} s, "
                      f"{res.audio_s:.2f} s of audio", flush=True)
    finally:
        await served.stop()
    return res


@dataclass
class Rtf:
    """One shape at one concurrency."""

    name: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    audio_s: list[float] = field(default_factory=list)
    wall: float = 0.0

    @property
    def rtf(self) -> float:
        return statistics.median(a / b for a, b in zip(self.latencies, self.audio_s,
                                                        strict=True))

    @property
    def aggregate(self) -> float:
        return self.wall / sum(self.audio_s)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall

    def line(self) -> str:
        return (f"speech {self.name:16} c={self.concurrency:<2} RTF {self.rtf:6.3f} per request"
                f" (median), {self.aggregate:6.3f} aggregate, {self.rps:6.2f} requests/s, "
                f"{len(self.latencies)} requests of {statistics.mean(self.audio_s):.2f} s audio")


async def _load(name: str, concurrency: int, requests: int, call: Any) -> Rtf:
    """`requests` calls from `concurrency` clients, each sending its next as one returns."""
    res = Rtf(name, concurrency)
    todo = iter(range(requests))

    async def client() -> None:
        for _ in todo:
            latency, audio_s = await call()
            res.latencies.append(latency)
            res.audio_s.append(audio_s)

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    res.wall = time.monotonic() - t0
    print(res.line(), flush=True)
    return res


def _count(args: argparse.Namespace, concurrency: int) -> int:
    """Requests in a run: --requests one at a time, one per client at higher concurrency."""
    return args.requests if concurrency == 1 else concurrency


async def bench_vocoder(args: argparse.Namespace, codes: Any, rate: int,
                        log_dir: Path) -> list[Rtf]:
    """The vocoder stage alone: whole codes over its ZMQ channel, as an orchestrator sends."""
    from omnistage import protocol as p
    from omnistage.client import ReplicaChannel
    from omnistage.procs import spawn_worker, wait_all_ready
    from omnistage.spec import Stage

    stage = Stage.model_validate({"name": "vocoder", "kind": "vocoder",
                                  "model": "tiny-omni-vocoder",
                                  "engine": {"chunkFrames": args.chunk_frames}})
    w = spawn_worker("vocoder-alone", stage, log_dir=log_dir, env=_env())
    out = []
    try:
        await asyncio.to_thread(wait_all_ready, [w], 300)
        ch = ReplicaChannel(w.zmq, name=w.name)
        await ch.handshake(30)
        try:
            async def call() -> tuple[float, float]:
                t0 = time.monotonic()
                _, final = await ch.request(f"v{next(_ids)}", {}, {"codec_codes": codes},
                                            timeout_s=args.timeout)
                if not isinstance(final.header, p.Final):
                    raise RuntimeError(f"vocoder: {p.tag(final.header)}: {final.header}")
                return time.monotonic() - t0, final.tensors["audio"].shape[0] / rate

            await call()  # warm
            for c in (1, args.concurrency):
                out.append(await _load("vocoder alone", c, _count(args, c), call))
        finally:
            await ch.close()
    finally:
        w.kill()
    return out


async def bench_pipeline(shape: str, args: argparse.Namespace, frames: int, rate: int,
                         log_dir: Path, batch: int) -> list[Rtf]:
    """One shape at concurrency 1 and --concurrency; with batching off (batch 1) only the
    latter (one at a time is the same either way)."""
    pipe = _pipeline(shape, _stages(shape, frames, args.chunk_frames, True, args.seed, batch))
    served = await serve(shape, [pipe], log_dir)
    label = {"tts": "tts pipeline", "omni": "omni pipeline"}[shape]
    if batch == 1:
        label = f"{shape} unbatched"
    out = []
    try:
        async def call() -> tuple[float, float]:
            done = await submit(served.orchs[0], ["vocoder"], args.timeout)
            return done.latency, _samples(done.outcome, "vocoder") / rate

        await call()  # warm
        for c in (1, args.concurrency) if batch > 1 else (args.concurrency,):
            out.append(await _load(label, c, _count(args, c), call))
    finally:
        await served.stop()
    return out


def _c8_over_c1(results: list[Rtf], shape: str) -> tuple[float | None, float | None]:
    """A shape's requests/s at --concurrency over one at a time, batching on and off (None:
    a figure its run did not make)."""
    on = [r for r in results if r.name == f"{shape} pipeline"]
    off = [r for r in results if r.name == f"{shape} unbatched"]
    if not on or not on[0].rps:
        return None, None
    return (on[1].rps / on[0].rps if len(on) == 2 else None,
            off[0].rps / on[0].rps if off else None)


def ttfa_line(label: str, seconds: list[float], audio_s: float) -> str:
    return (f"speech ttfa streaming {label} {statistics.median(seconds) * 1000:9.1f} ms "
            f"(median of {len(seconds)}), {audio_s:.2f} s answers")


def summary(ttfa_ratio: float | None, rps_ratio: float | None,
            unbatched_ratio: float | None, omni_ratio: float | None = None,
            omni_unbatched: float | None = None) -> tuple[str, list[Goal]]:
    """The summary line and its goals. A requests/s miss names what concurrency 8 gives with
    batching off (unbatched_ratio, omni_unbatched: same run), so the line tells how much
    batching added."""
    goals = [Goal("ttfa streaming/off", ttfa_ratio, TTFA_GOAL, at_least=False),
             Goal("speech requests/s c8/c1", rps_ratio, RPS_GOAL),
             Goal("omni requests/s c8/c1", omni_ratio, OMNI_RPS_GOAL)]
    line = "summary: " + verdicts(goals)
    for goal, ratio, off, what in ((goals[1], rps_ratio, unbatched_ratio, "requests/s"),
                                   (goals[2], omni_ratio, omni_unbatched, "omni requests/s")):
        if not goal.met and ratio is not None and off:
            line += (f"; {what} MISS: c8/c1 with engine.maxBatchSize 1 is {off:.2f}x, so "
                     f"batching added {ratio / off:.2f}x")
    return line, goals


def _answer_frames(seconds: float) -> tuple[int, int, int]:
    """(frames, sample rate, samples per frame) for an answer of `seconds` with the tiny
    vocoder, from its config."""
    import torch

    from omnistage.models import load_vocoder

    model, rate = load_vocoder("tiny-omni-vocoder", torch.device("cpu"), "auto", "vocoder")
    per_frame = int(model.total_upsample)
    return math.ceil(seconds * rate / per_frame), int(rate), per_frame


async def main_async(args: argparse.Namespace) -> int:
    for kind in KINDS:
        if kind.name not in stage_kinds.names():
            stage_kinds.register(kind)
    frames, rate, per_frame = _answer_frames(args.answer_seconds)
    rtf_frames = math.ceil(args.rtf_seconds * rate / per_frame)
    print(f"tiny vocoder: {rate} Hz, {per_frame} samples a frame; a {args.answer_seconds:g} s "
          f"answer is {frames} frames, chunks of {args.chunk_frames} frames "
          f"({args.chunk_frames * per_frame / rate * 1000:.0f} ms)", flush=True)
    print("time to first audio is taken at the orchestrator (the vocoder stage's first chunk, "
          "or its whole audio with streaming off), where the HTTP layer first has audio to send",
          flush=True)
    results: list[Rtf] = []
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-speech-") as tmp:
        log_dir = Path(tmp)
        print(f"-- time to first audio: {args.ttfa_requests} requests per mode", flush=True)
        ttfa = Ttfa()
        try:
            ttfa = await bench_ttfa(args, frames, rate, log_dir)
        except Exception as exc:  # not measured: its goal is a MISS (n/a), the rest still runs
            print(f"speech ttfa failed: {exc!r}", flush=True)
        for label, got in (("on ", ttfa.on), ("off", ttfa.off)):
            if got:
                print(ttfa_line(label, got, ttfa.audio_s), flush=True)
        sections: list[tuple[str, Callable[[], Awaitable[list[Rtf]]]]] = []
        if ttfa.codes is not None:  # the vocoder alone decodes the talker's codes of an answer
            sections.append(("the vocoder stage alone",
                             functools.partial(bench_vocoder, args, ttfa.codes, rate, log_dir)))
        for shape, batch in (("tts", args.batch_size), ("omni", args.batch_size), ("tts", 1),
                             ("omni", 1)):
            what = f"the {shape} pipeline, {args.rtf_seconds:g} s answers" + (
                ", batching off (engine.maxBatchSize 1)" if batch == 1 else
                f", engine.maxBatchSize {batch}")
            sections.append((what, functools.partial(bench_pipeline, shape, args, rtf_frames,
                                                     rate, log_dir, batch)))
        for what, run in sections:
            print(f"-- real-time factor: {what}", flush=True)
            try:
                results += await run()
            except Exception as exc:
                print(f"speech {what} failed: {exc!r}", flush=True)
    rps_ratio, off_ratio = _c8_over_c1(results, "tts")
    omni_ratio, omni_off_ratio = _c8_over_c1(results, "omni")
    line, goals = summary(ttfa.ratio, rps_ratio, off_ratio, omni_ratio, omni_off_ratio)
    print(line, flush=True)
    return exit_status(goals, args.check)


# ------------------------------------------------------------------- against another tree

#: What the comparison reads from each run's output: label -> (pattern, lower is better).
COMPARED: dict[str, tuple[str, bool]] = {
    "ttfa streaming on": (r"^speech ttfa streaming on\s+([\d.]+) ms", True),
    "tts requests/s c={c}": (r"^speech tts pipeline\s+c={c}\s.*?([\d.]+) requests/s", False),
    "speech requests/s c8/c1": (r"speech requests/s c8/c1=([\d.]+)x", False),
}
NO_WORSE = 0.1  # the comparison's tolerance: the spread of one tree against itself


def figures(out: str, concurrency: int) -> dict[str, float]:
    """The compared figures one run printed (a figure it did not print is absent)."""
    found: dict[str, float] = {}
    for label, (pattern, _) in COMPARED.items():
        m = re.search(pattern.replace("{c}", str(concurrency)), out, re.M)
        if m:
            found[label.replace("{c}", str(concurrency))] = float(m.group(1))
    return found


def compared(runs: dict[str, list[dict[str, float]]], concurrency: int) -> list[Goal]:
    """This tree's median of each figure over the baseline's: "no worse" within NO_WORSE."""
    goals = []
    for label, (_, lower_better) in COMPARED.items():
        label = label.replace("{c}", str(concurrency))
        this = [f[label] for f in runs["this"] if label in f]
        base = [f[label] for f in runs["base"] if label in f]
        ratio = (statistics.median(this) / statistics.median(base)
                 if this and base and statistics.median(base) else None)
        goals.append(Goal(f"{label} this/base", ratio,
                          1 + NO_WORSE if lower_better else 1 - NO_WORSE,
                          at_least=not lower_better))
    return goals


def _passthrough(args: argparse.Namespace) -> list[str]:
    """The figure options, for both trees' runs (the comparison's own flags stay here)."""
    return [f"--answer-seconds={args.answer_seconds}", f"--rtf-seconds={args.rtf_seconds}",
            f"--chunk-frames={args.chunk_frames}", f"--ttfa-requests={args.ttfa_requests}",
            f"--requests={args.requests}", f"--concurrency={args.concurrency}",
            f"--batch-size={args.batch_size}", f"--seed={args.seed}",
            f"--timeout={args.timeout}"]


def _run_side(side: str, script: Path, argv: list[str]) -> str:
    """One run of a tree's own bench, its lines echoed with the side's name; its output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # each tree its own
    proc = subprocess.Popen([sys.executable, str(script), *argv], cwd=script.parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        print(f"[{side}] {line}", end="", flush=True)
    if proc.wait() != 0:
        print(f"[{side}] exited {proc.returncode}", flush=True)
    return "".join(lines)


def compare(args: argparse.Namespace, tree: Path) -> int:
    runs: dict[str, list[dict[str, float]]] = {"this": [], "base": []}
    scripts = {"this": Path(__file__).resolve(), "base": tree / "bench" / "bench_speech.py"}
    if not scripts["base"].is_file():
        print(f"error: {tree} has no bench/bench_speech.py to compare with", file=sys.stderr)
        return 2
    for n in range(args.rounds):
        for side in ("this", "base") if n % 2 == 0 else ("base", "this"):
            print(f"-- round {n + 1}/{args.rounds}: {side} ({scripts[side].parents[1]})",
                  flush=True)
            runs[side].append(figures(_run_side(side, scripts[side], _passthrough(args)),
                                      args.concurrency))
    for side, got in runs.items():
        print(f"speech compared {side}: {got}", flush=True)
    goals = compared(runs, args.concurrency)
    print("summary: " + verdicts(goals), flush=True)
    return exit_status(goals, args.check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answer-seconds", type=float, default=10.0,
                        help="audio seconds of the time-to-first-audio answers")
    parser.add_argument("--rtf-seconds", type=float, default=1.0,
                        help="audio seconds of the pipelines' answers in the RTF runs")
    parser.add_argument("--chunk-frames", type=int, default=25,
                        help="engine.chunkFrames of the talker and the vocoder")
    parser.add_argument("--ttfa-requests", type=int, default=2,
                        help="time-to-first-audio requests per mode (on, off alternate)")
    parser.add_argument("--requests", type=int, default=3,
                        help="requests one at a time in the RTF runs (one per client at "
                             "--concurrency)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="engine.maxBatchSize of the thinker, talker and vocoder (batching on)")
    parser.add_argument("--seed", type=int, default=3, help="the talker's sampling seed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    add_baseline_flags(parser, "this bench (that tree's own bench/bench_speech.py)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with a baseline: runs of each tree, alternating (default 2)")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    if args.batch_size < 2:
        parser.error(f"--batch-size must be at least 2 (batching on), got {args.batch_size}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    with baseline_tree(args, parser) as tree:
        if tree is not None:
            return compare(args, tree)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
