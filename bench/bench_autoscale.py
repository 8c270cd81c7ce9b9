"""Elastic stage pools under `omnistage serve` (issue 21): pools sized by the built-in
autoscaler to a step load, scale from zero, and warm-up along the pipeline.

Why: issue 21 asks that each stage's pool follow its own load (Little's law on the measured
service time), without flapping, without losing requests when it shrinks, and that a stage at
zero, or two in a row, cost a request little more than one start-up. Everything runs as real
`omnistage serve` processes (worker processes, real ZMQ, the HTTP API) on loopback, with echo
stages whose per-request service time is `engine.echoDelayMs`.

Part A, the step load: pipeline a -> b -> c with service times 0.5 s, 1.5 s and 1.3 s,
`autoscaling: {minReplicas: 1, maxReplicas: 8, target: {inflightPerReplica: 0.8}}` with a short
period; an open-loop load of --rate requests/s (evenly spaced: the bench measures the
autoscaler, not queueing under random arrivals) in three phases 1x -> 4x -> 1x. The default
rate, 0.31/s, keeps every optimum clear of a rounding edge (the measured service time is a
little over the echo's delay): at 1x every stage needs 1 replica, at 4x a 1, b 3 and c 3. A
sampler reads GET /v1/load every 0.5 s (each pool's routable replicas). Goals:

  settle       each pool's replicas within +/-1 of the Little's-law optimum
               (ceil(rate x service / 0.8), within the bounds) after each step, and staying
               there to the phase's end, within 2 periods + the start-up measured in part C,
               counted from when the step reached the stage (`step_reaches`): the first stage
               at the phase's start, each next one when its upstream has settled and finished
               a task at the new rate (its settle time + its service time). Why: a stage's
               arrivals are its upstream's completions, so its load steps only then, and no
               autoscaler can size a pool to load that has not reached it; measured from the
               phase's start, c's goal would charge it b's whole transition (the previous
               bound did, and c missed by about b's settle + service time in a run where its
               own reaction took 2.5 s). The signal's window is not added: a stage that queues
               is sized at once on what is in flight, and the window (6 s) only delays a stage
               whose new load fits its current replicas.
  objective    requests sent once settled (each phase from its start + that bound) whose
               latency is within the objective (1.5 x the pipeline's service time, 4.95 s):
               >= 95%
  flapping     changes of direction of any pool's replicas within any 10 minutes: <= 2
  failures     failed and refused (429/503) requests over the whole step load, its
               scale-downs included: 0 each

Part C, scale from zero: a one-stage pipeline (0.5 s) at zero; a burst of --cold-burst
requests at once, repeated --cold-cycles times (idle back to zero in between). Goals: 0
failed; the first request's latency <= the pool's start-up (request sent to the replica
routable, from the sampler at 0.1 s) + 1 s.

Part D, warm-up along the pipeline: u (0.5 s) -> d (no delay), both at zero. Goal: the first
request's latency (its time to first output: d adds nothing) <= max(u's start-up + 0.5 s,
d's start-up) + 0.5 s, where the sum of the two start-ups is what waking d only when the request
reaches it would cost.

Part B, the autoscaler at fleet size (bench/autoscale_fleet.py): --fleet-pipelines pipelines
(default 500) of three autoscaled stages on the real control plane with kwok nodes and the real
operator; the operator's CPU over the same idle window with --no-autoscaler and with the
autoscaler (goal: it adds <= 10%), its writes with no desired size changed (goal: 0), and with
the load of --fleet-changed pools raised (goal: no write to any other pool). Runs last;
--fleet-pipelines 0 leaves it out.

Prints progress, one line per figure, then one summary line with PASS/MISS per goal (goals.py);
`--check` exits 1 on a MISS. Run from the repository root: `python bench/bench_autoscale.py`
(about 30 minutes: 5 minutes a phase, then the 500-pipeline fleet) or `--quick` (about 7
minutes: 1 minute a phase, 50 pipelines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autoscale_fleet
from goals import Goal, add_check_flag, exit_status, verdicts

ROOT = Path(__file__).resolve().parents[1]
SERVICE_S = {"a": 0.5, "b": 1.5, "c": 1.3}  # part A's stages, in pipeline order
TARGET = 0.8  # inflightPerReplica: the optimum keeps each replica busy 80% of the time
MAX_REPLICAS = 8
STEP = 4.0
OBJECTIVE_FACTOR = 1.5  # latency objective: this x the pipeline's service time
OBJECTIVE_SHARE = 95.0  # percent of settled requests within it
MAX_DIRECTION_CHANGES = 2  # per pool in any 10 minutes
FLAP_WINDOW_S = 600.0
COLD_SERVICE_S = 0.5  # part C's stage, and part D's upstream
COLD_SLACK_S = 1.0  # part C: first latency <= start-up + this
WARMUP_SLACK_S = 0.5  # part D: first output <= max(upstream, downstream start-up) + this


# ------------------------------------------------------------------------------ the figures


def optimum(rate: float, service_s: float, *, target: float = TARGET, low: int = 1,
            high: int = MAX_REPLICAS) -> int:
    """Little's law: the replicas a stage needs at this rate, within [low, high] (the same
    rounding as omnistage.autoscaling.decide, which tolerates float noise)."""
    return max(low, min(high, math.ceil(rate * service_s / target - 1e-9)))


Series = Sequence[tuple[float, int]]  # (seconds since the load began, routable replicas)


def step_reaches(upstream_settled: float, upstream_service_s: float) -> float:
    """When a step of the pipeline's load reaches the next stage, from the phase's start: a
    stage's arrivals are its upstream's completions, which follow the new rate only once the
    upstream has its replicas (its settle time) and they have finished a task (its service
    time). The settle goal is judged from there (module docstring)."""
    return upstream_settled + upstream_service_s


def settle_time(series: Series, start: float, end: float, want: int) -> float | None:
    """Seconds after `start` from which the replicas stay within +/-1 of `want` until `end`;
    None if they are not there by the end."""
    inside = [(t, abs(n - want) <= 1) for t, n in series if start <= t <= end]
    if not inside or not inside[-1][1]:
        return None
    since = inside[-1][0]
    for t, ok in reversed(inside):
        if not ok:
            break
        since = t
    return max(0.0, since - start)


def direction_changes(series: Series, window_s: float = FLAP_WINDOW_S) -> int:
    """The most changes of direction (up then down, or down then up) of the replicas within
    any `window_s`."""
    turns: list[float] = []
    last_dir = 0
    prev: int | None = None
    for t, n in series:
        if prev is not None and n != prev:
            d = 1 if n > prev else -1
            if last_dir and d != last_dir:
                turns.append(t)
            last_dir = d
        prev = n
    best = 0
    for i, t in enumerate(turns):
        best = max(best, sum(1 for u in turns[i:] if u - t <= window_s))
    return best


@dataclass
class Sent:
    """One request of the load: when it was sent (seconds since the load began), its status
    (0: no HTTP answer) and latency."""

    t: float
    status: int
    latency: float


def failed(sent: Sequence[Sent]) -> int:
    return sum(1 for s in sent if s.status not in (200, 429, 503))


def refused(sent: Sequence[Sent]) -> int:
    return sum(1 for s in sent if s.status in (429, 503))


@dataclass
class Figures:
    """What the summary judges; None: not measured."""

    settle_worst_s: float | None = None  # worst pool/step; inf when a pool never settled
    settle_bound_s: float | None = None
    objective_pct: float | None = None
    direction_changes: int | None = None
    step_failed: int | None = None
    step_refused: int | None = None
    cold_failed: int | None = None
    cold_first_s: float | None = None
    cold_bound_s: float | None = None
    warm_first_s: float | None = None
    warm_bound_s: float | None = None
    warm_sum_s: float | None = None  # the two start-ups one after the other, for the reason
    fleet: autoscale_fleet.FleetFigures | None = None  # part B; None: left out
    notes: list[str] = field(default_factory=list)  # why a figure is missing, or what missed


def summary(f: Figures, *, fleet_only: bool = False) -> tuple[str, list[Goal]]:
    """The summary line and its goals; reasons for misses follow the verdicts. fleet_only:
    part B's goals alone (--only-fleet)."""
    goals = [] if fleet_only else [
        Goal("settle worst", f.settle_worst_s, f.settle_bound_s or 0.0, at_least=False,
             unit="s", digits=1),
        Goal("latency objective met", f.objective_pct, OBJECTIVE_SHARE, unit="%", digits=1),
        Goal("direction changes/10min", None if f.direction_changes is None
             else float(f.direction_changes), MAX_DIRECTION_CHANGES, at_least=False, unit="",
             digits=0),
        Goal("step failed", None if f.step_failed is None else float(f.step_failed), 0,
             at_least=False, unit="", digits=0),
        Goal("step refused", None if f.step_refused is None else float(f.step_refused), 0,
             at_least=False, unit="", digits=0),
        Goal("cold failed", None if f.cold_failed is None else float(f.cold_failed), 0,
             at_least=False, unit="", digits=0),
        Goal("cold first latency", f.cold_first_s, f.cold_bound_s or 0.0, at_least=False,
             unit="s", digits=1),
        Goal("warm-up first output", f.warm_first_s, f.warm_bound_s or 0.0, at_least=False,
             unit="s", digits=1),
    ]
    if f.fleet is not None:
        goals += f.fleet.goals()
    line = "summary: " + verdicts(goals)
    notes = [*f.notes, *(f.fleet.notes if f.fleet is not None else [])]
    if notes:
        line += "; " + "; ".join(notes)
    return line, goals


# ------------------------------------------------------------------------- omnistage serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """One `omnistage serve` of a manifest, on loopback; its output kept for the report."""

    def __init__(self, manifest: dict[str, Any], tmp: Path) -> None:
        self.name = manifest["metadata"]["name"]
        file = tmp / f"{self.name}.yaml"
        file.write_text(yaml.safe_dump(manifest))
        port, admin_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"  # control, /v1/load, /metrics
        path = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "runtime") + (
            os.pathsep + path if path else "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.cli", "serve", str(file), "--host", "127.0.0.1",
             "--port", str(port), "--admin-port", str(admin_port), "--log-dir",
             str(tmp / f"{self.name}-logs")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    async def load(self, session: aiohttp.ClientSession) -> dict[str, Any] | None:
        try:
            async with session.get(self.admin_url + "/v1/load",
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return dict(await resp.json()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def ready(self, session: aiohttp.ClientSession, want: dict[str, int],
                    timeout: float = 300.0) -> None:
        """Until every stage has at least `want` routable replicas (0: the stage exists)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omnistage serve exited {self.proc.returncode}:\n"
                                   + "\n".join(self.lines[-30:]))
            doc = await self.load(session)
            if doc and all(doc["stages"].get(s, {}).get("replicas", -1) >= n
                           for s, n in want.items()):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name}: not ready in {timeout:g}s:\n"
                           + "\n".join(self.lines[-30:]))

    async def request(self, session: aiohttp.ClientSession, prompt: str,
                      timeout: float) -> tuple[int, float]:
        """(HTTP status, 0 for none; latency) of one request."""
        t0 = time.monotonic()
        try:
            async with session.post(f"{self.url}/v1/pipelines/{self.name}/requests",
                                    json={"prompt": prompt},
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return resp.status, time.monotonic() - t0
        except (aiohttp.ClientError, TimeoutError):
            return 0, time.monotonic() - t0

    def stop(self) -> None:
        """SIGTERM (serve drains and stops its workers), SIGKILL to the group after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _manifest(name: str, stages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {"orchestrator": {"api": ["generic"]}, "stages": stages}}


def _echo(name: str, delay_s: float, autoscaling: dict[str, Any], *,
          inputs: list[str] | None = None, final: bool = False,
          replicas: int = 1) -> dict[str, Any]:
    stage: dict[str, Any] = {"name": name, "kind": "echo", "replicas": replicas,
                             "resources": {"gpus": 0}, "drainTimeoutSeconds": 120,
                             "engine": {"echoDelayMs": int(delay_s * 1000)},
                             "autoscaling": autoscaling}
    if inputs:
        stage["inputs"] = inputs
    if final:
        stage["finalOutput"] = True
    return stage


# ---------------------------------------------------------------------------------- parts


async def _sample(serve: Serve, session: aiohttp.ClientSession, t0: float, every: float,
                  into: dict[str, list[tuple[float, int]]]) -> None:
    """Each stage's routable replicas, every `every` seconds, until cancelled."""
    while True:
        doc = await serve.load(session)
        if doc:
            now = time.monotonic() - t0
            for stage, fig in doc["stages"].items():
                into.setdefault(stage, []).append((now, int(fig["replicas"])))
        await asyncio.sleep(every)


async def step_load(args: argparse.Namespace, tmp: Path, f: Figures, startup_s: float) -> None:
    period = args.period
    scaling = {"minReplicas": 1, "maxReplicas": MAX_REPLICAS, "periodSeconds": period,
               "windowSeconds": args.window, "coolDownSeconds": args.cool_down,
               "target": {"inflightPerReplica": TARGET}}
    names = list(SERVICE_S)
    stages = [_echo(s, SERVICE_S[s], scaling, inputs=[names[i - 1]] if i else None,
                    final=i == len(names) - 1) for i, s in enumerate(names)]
    serve = Serve(_manifest(f"step{uuid.uuid4().hex[:6]}", stages), tmp)
    phases = [(args.rate, args.phase), (args.rate * STEP, args.phase), (args.rate, args.phase)]
    objective = OBJECTIVE_FACTOR * sum(SERVICE_S.values())
    bound = 2 * period + startup_s
    f.settle_bound_s = round(bound, 2)
    sent: list[Sent] = []
    series: dict[str, list[tuple[float, int]]] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await serve.ready(session, dict.fromkeys(names, 1))
            print(f"-- step load: {' -> '.join(f'{r:g}/s for {d:g}s' for r, d in phases)}; "
                  f"objective {objective:.2f}s; settle bound 2 x {period:g}s + {startup_s:.1f}s",
                  flush=True)
            t0 = time.monotonic()
            sampler = asyncio.ensure_future(_sample(serve, session, t0, 0.5, series))

            async def one(t: float, i: int) -> None:
                status, latency = await serve.request(session, f"r{i}", args.timeout)
                sent.append(Sent(t, status, latency))

            tasks: list[asyncio.Task[None]] = []
            start, i = 0.0, 0
            for rate, duration in phases:
                n = int(rate * duration)
                for k in range(n):
                    at = start + k / rate
                    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                    tasks.append(asyncio.ensure_future(one(at, i)))
                    i += 1
                start += duration
                print(f"   phase done at {time.monotonic() - t0:.0f}s: replicas "
                      f"{ {s: v[-1][1] for s, v in series.items() if v} }", flush=True)
            await asyncio.gather(*tasks)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    finally:
        serve.stop()
    worst = 0.0
    start = 0.0
    for p, (rate, duration) in enumerate(phases):
        reached = 0.0  # when the step reached the stage, from the phase's start
        for s in names:
            want = optimum(rate, SERVICE_S[s])
            took = settle_time(series.get(s, []), start, start + duration, want)
            own = None if took is None else max(0.0, took - reached)
            shown = "never" if took is None else f"{took:.1f}s ({own:.1f}s after its load " \
                f"stepped at {reached:.1f}s)"
            print(f"autoscale settle phase {p + 1} ({rate:g}/s) stage {s}: optimum {want}, "
                  f"settled in {shown}", flush=True)
            if took is None or own is None:
                f.notes.append(f"settle MISS: stage {s} never within 1 of {want} in phase "
                               f"{p + 1}")
                worst = math.inf
                reached = duration
            else:
                worst = max(worst, own)
                if own > bound:
                    f.notes.append(f"settle MISS: stage {s} phase {p + 1} took {own:.1f}s "
                                   f"after its load stepped ({took:.1f}s after the phase's)")
                reached = step_reaches(took, SERVICE_S[s])
        start += duration
    f.settle_worst_s = worst
    settled = [x for x in sent if x.t - _phase_start(phases, x.t) >= bound]
    ok = [x for x in settled if x.status == 200 and x.latency <= objective]
    f.objective_pct = 100.0 * len(ok) / len(settled) if settled else None
    lat = sorted(x.latency for x in settled if x.status == 200)
    if lat:
        print(f"autoscale latency settled: n={len(settled)} p50={lat[len(lat) // 2]:.2f}s "
              f"p95={lat[max(0, math.ceil(0.95 * len(lat)) - 1)]:.2f}s "
              f"objective={objective:.2f}s", flush=True)
    f.direction_changes = max((direction_changes(series.get(s, [])) for s in names), default=0)
    for s in names:
        path = " ".join(str(n) for n in _changes(series.get(s, [])))
        print(f"autoscale replicas stage {s}: {path}", flush=True)
    f.step_failed, f.step_refused = failed(sent), refused(sent)
    print(f"autoscale step requests: {len(sent)} sent, {f.step_failed} failed, "
          f"{f.step_refused} refused", flush=True)
    if f.objective_pct is not None and f.objective_pct < OBJECTIVE_SHARE and lat:
        f.notes.append(f"objective MISS: settled p95 latency "
                       f"{lat[max(0, math.ceil(0.95 * len(lat)) - 1)]:.2f}s over "
                       f"{objective:.2f}s")


def _phase_start(phases: Sequence[tuple[float, float]], t: float) -> float:
    start = 0.0
    for _, duration in phases:
        if t < start + duration:
            return start
        start += duration
    return start


def _changes(series: Series) -> list[int]:
    """The replicas each time they changed (the path a pool took)."""
    out: list[int] = []
    for _, n in series:
        if not out or out[-1] != n:
            out.append(n)
    return out


def _zero(idle: float) -> dict[str, Any]:
    return {"minReplicas": 0, "maxReplicas": 2, "periodSeconds": 1, "windowSeconds": 2,
            "idleSeconds": idle, "coolDownSeconds": 0}


async def _routable_at(serve: Serve, session: aiohttp.ClientSession, stage: str,
                       t0: float, timeout: float) -> float | None:
    """Seconds from t0 until the stage has a routable replica (polled every 0.1 s)."""
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        doc = await serve.load(session)
        if doc and doc["stages"][stage]["replicas"] >= 1:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    return None


async def _at_zero(serve: Serve, session: aiohttp.ClientSession, stages: list[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        doc = await serve.load(session)
        if doc and all(doc["stages"][s]["replicas"] == 0 and doc["stages"][s]["inflight"] == 0
                       for s in stages):
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{serve.name}: stages {stages} not back at zero")


async def scale_from_zero(args: argparse.Namespace, tmp: Path, f: Figures) -> float | None:
    """Part C; returns the worst start-up measured (part A's settle bound uses it)."""
    serve = Serve(_manifest(f"zero{uuid.uuid4().hex[:6]}", [
        _echo("z", COLD_SERVICE_S, _zero(args.idle), final=True, replicas=0)]), tmp)
    fails, firsts, startups = 0, [], []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await serve.ready(session, {"z": 0})
            for cycle in range(args.cold_cycles):
                await _at_zero(serve, session, ["z"])
                t0 = time.monotonic()
                probe = asyncio.ensure_future(_routable_at(serve, session, "z", t0, 300))
                results = await asyncio.gather(*(serve.request(session, f"c{cycle}-{k}",
                                                               args.timeout)
                                                 for k in range(args.cold_burst)))
                startup = await probe
                fails += sum(1 for status, _ in results if status != 200)
                first = min(lat for _, lat in results)
                firsts.append(first)
                if startup is not None:
                    startups.append(startup)
                print(f"autoscale cold cycle {cycle + 1}: start-up "
                      f"{'n/a' if startup is None else f'{startup:.2f}s'}, first latency "
                      f"{first:.2f}s, {sum(1 for s, _ in results if s != 200)} failed of "
                      f"{len(results)}", flush=True)
    finally:
        serve.stop()
    f.cold_failed = fails
    if firsts and len(startups) == len(firsts):
        # The worst cycle against its own start-up.
        margins = [lat - st for lat, st in zip(firsts, startups, strict=True)]
        worst = max(range(len(margins)), key=margins.__getitem__)
        f.cold_first_s = firsts[worst]
        f.cold_bound_s = round(startups[worst] + COLD_SLACK_S, 2)
    else:
        f.notes.append("cold: a start-up was not measured")
    return max(startups) if startups else None


async def warm_up(args: argparse.Namespace, tmp: Path, f: Figures) -> None:
    """Part D."""
    serve = Serve(_manifest(f"warm{uuid.uuid4().hex[:6]}", [
        _echo("u", COLD_SERVICE_S, _zero(args.idle), replicas=0),
        _echo("d", 0.0, _zero(args.idle), inputs=["u"], final=True, replicas=0)]), tmp)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await serve.ready(session, {"u": 0, "d": 0})
            await _at_zero(serve, session, ["u", "d"])
            t0 = time.monotonic()
            probes = [asyncio.ensure_future(_routable_at(serve, session, s, t0, 300))
                      for s in ("u", "d")]
            status, latency = await serve.request(session, "warm", args.timeout)
            up, down = await asyncio.gather(*probes)
    finally:
        serve.stop()
    def secs(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}s"

    print(f"autoscale warm-up: u start-up {secs(up)}, d start-up {secs(down)}, first output "
          f"{latency:.2f}s (status {status})", flush=True)
    if status != 200 or up is None or down is None:
        f.notes.append(f"warm-up: status {status}, start-ups u={up} d={down}")
        return
    f.warm_first_s = latency
    f.warm_bound_s = round(max(up + COLD_SERVICE_S, down) + WARMUP_SLACK_S, 2)
    f.warm_sum_s = up + COLD_SERVICE_S + down
    if latency > f.warm_bound_s:
        f.notes.append(f"warm-up MISS: the start-ups one after the other would be "
                       f"{f.warm_sum_s:.1f}s")


async def main_async(args: argparse.Namespace) -> int:
    f = Figures()
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-autoscale-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.only_fleet:
            await serve_parts(args, tmp, f)
    if args.fleet_pipelines:
        print(f"-- the autoscaler at fleet size: {args.fleet_pipelines} pipelines on kwok",
              flush=True)
        f.fleet = await asyncio.to_thread(autoscale_fleet.run, args.fleet_pipelines,
                                          args.fleet_window, args.fleet_changed)
        print(autoscale_fleet.report(f.fleet), flush=True)
    else:
        f.notes.append("fleet part left out (--fleet-pipelines 0)")
    line, goals = summary(f, fleet_only=args.only_fleet)
    print(line, flush=True)
    return exit_status(goals, args.check)


async def serve_parts(args: argparse.Namespace, tmp: Path, f: Figures) -> None:
    """Parts C, D and A, with `omnistage serve`."""
    print(f"-- scale from zero: {args.cold_cycles} cycle(s) of {args.cold_burst} requests",
          flush=True)
    startup = await scale_from_zero(args, tmp, f)
    print("-- warm-up along the pipeline: two stages at zero", flush=True)
    await warm_up(args, tmp, f)
    if startup is None:
        f.notes.append("settle: no start-up measured, bound without it")
    await step_load(args, tmp, f, startup or 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1-minute phases, one cold cycle (development; about 4 minutes)")
    parser.add_argument("--phase", type=float, default=None,
                        help="seconds per load phase (default 300, --quick 60)")
    parser.add_argument("--rate", type=float, default=0.31,
                        help="requests/s at 1x (the 4x phase sends 4 times as many)")
    parser.add_argument("--period", type=float, default=2.0, help="autoscaling.periodSeconds")
    parser.add_argument("--window", type=float, default=6.0, help="autoscaling.windowSeconds")
    parser.add_argument("--cool-down", type=float, default=None,
                        help="autoscaling.coolDownSeconds (default 60, --quick 30)")
    parser.add_argument("--idle", type=float, default=3.0,
                        help="autoscaling.idleSeconds of the scale-from-zero stages")
    parser.add_argument("--cold-cycles", type=int, default=None,
                        help="scale-from-zero cycles (default 3, --quick 1)")
    parser.add_argument("--cold-burst", type=int, default=5,
                        help="requests sent at once to a stage at zero")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--fleet-pipelines", type=int, default=None,
                        help="part B's pipelines on kwok (default 500, --quick 50; 0: skip)")
    parser.add_argument("--fleet-window", type=float, default=None,
                        help="part B's CPU window in seconds (default 90, --quick 45)")
    parser.add_argument("--fleet-changed", type=int, default=None,
                        help="part B's pools whose load is raised (default 10, --quick 3)")
    parser.add_argument("--only-fleet", action="store_true", help="run part B alone")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    args.phase = args.phase or (60.0 if args.quick else 300.0)
    args.cool_down = args.cool_down if args.cool_down is not None else (
        30.0 if args.quick else 60.0)
    args.cold_cycles = args.cold_cycles or (1 if args.quick else 3)
    if args.fleet_pipelines is None:
        args.fleet_pipelines = 50 if args.quick else 500
    args.fleet_window = args.fleet_window or (45.0 if args.quick else 90.0)
    if args.fleet_changed is None:
        args.fleet_changed = 3 if args.quick else 10
    if args.fleet_pipelines < 0 or not 0 <= args.fleet_changed <= args.fleet_pipelines:
        parser.error("--fleet-pipelines must be >= 0 and --fleet-changed within 0..it")
    if args.only_fleet and not args.fleet_pipelines:
        parser.error("--only-fleet needs --fleet-pipelines > 0")
    for name in ("phase", "rate", "period", "window", "idle"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.cold_burst < 1 or args.cold_cycles < 1:
        parser.error("--cold-burst and --cold-cycles must be at least 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
