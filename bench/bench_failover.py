"""Failover under load: kill -9 replicas of `omnistage serve`, or of stage pods on the cluster,
while requests run (issue 22).

Why: a killed replica must cost no request (docs/architecture.md, "Failover"). Two phases, each
its own pipeline on loopback, REQUESTS requests from CONCURRENCY closed-loop clients:

  plain     echo a -> echo b (4 replicas each, echoDelayMs 300), POST
            /v1/pipelines/<name>/requests, not streamed. Goal: 0 failed.
  streamed  one `ar` stage (tiny-llama, 8 replicas, --stream-tokens 768 tokens),
            /v1/chat/completions with stream: true and temperature 0. Goals: >= 99.5% of the
            streams complete, and every complete one equal to a fault-free run of its prompt
            (no token repeated or missing).

During each phase, KILLS rounds: after every REQUESTS/(KILLS+1) answers, a round sends SIGKILL
to one routable replica of each stage (the local runtime, or the pod runner, starts it again).
The goal is the cost of a failover, not of lost capacity, so kills must not pile up: a round
strikes a stage only while fewer than a quarter of its replicas (at least one) are earlier
victims not yet back (`may_strike`), and waits otherwise. A victim is back once the
orchestrator's log shows it ready and handshaken again after its kill (`back`; a handshake
alone is not enough: a restarted worker answers it before its model is loaded). The victim is
one of the routable replicas killed the fewest times so far (`victim`), so a round never waits
out a crash-loop back-off. --overlap-kills restores the earlier rule (a random routable
replica, while another is routable), under which the dead piled up (tiny-llama's routable
replicas fell from 8 to 3 over ten rounds on the cluster). Goal: every round ran.

A restarted tiny-llama replica takes 16-36 s to load on a loaded 2-CPU machine, so requests
are long (768 tokens a stream, 300 ms an echo stage) for ten paced rounds to fit in 500
requests; longer requests raise the bound below, and the absolute added latency with it. A
request counts as failed over when the orchestrator's log says so for its X-Request-Id. Goal:
the added p99 of those failed over once (each one's latency minus the median of the clean
requests that ended within a second of it, which ran under the same reduced capacity) <= loss
detection (the slowest kill -> the orchestrator's first sign of that loss: "connection closed"
from the socket monitor, or "lost" when the membership said so first) + one service time (the
clean p50, end to end).

Every stage has a dispatch window (stage.dispatch.perReplica: 2 for echo, which serves one
request at a time, maxBatchSize + 1 for ar): the orchestrator keeps at most that many tasks on
a replica and the rest wait in it, so a failed-over task goes first to the next free slot
instead of queueing again behind a survivor's queue (docs/architecture.md, "Failover").
--no-window runs the same phases without one, to compare.

With --cluster the phases run on a private local control plane (hack/cluster.sh), with the
operator as a process and the local pod runner in process mode (tests/harness): the same
manifests as OmniPipelines, requests to the orchestrator pod's loopback IP, and the SIGKILL goes
to the worker process of a stage pod (its pid from the worker's /state); the pod runner restarts
it in place, at once after its first exit, as a kubelet does.

Prints one line per phase and one summary line with PASS/MISS per goal; `--check` exits 1 on a
MISS. Run from the repository root: `python bench/bench_failover.py [--requests 500] [-c 16]
[--cluster] [--no-window] [--overlap-kills]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import Server, free_port
from goals import Goal, add_check_flag, exit_status, verdicts

from omnistage.spec import EngineOptions

REPO = str(Path(__file__).resolve().parents[1])
PROMPTS = [f"tell me about the number {i}" for i in range(8)]
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


#: The stages' dispatch windows (stage.dispatch.perReplica): what the worker runs at once plus
#: one prefetched, so a replica never idles while work waits in the orchestrator. The echo
#: worker serves one request at a time; the ar worker batches up to engine.maxBatchSize.
ECHO_WINDOW = 2
AR_WINDOW = EngineOptions.model_fields["max_batch_size"].default + 1


def manifest(name: str, streamed: bool, tokens: int, window: bool = True) -> dict[str, Any]:
    """The phase's pipeline; window: the stages get a dispatch window (--no-window: none, every
    task goes to a replica at once and queues there)."""
    admission = {"maxRequests": 256, "maxQueue": 1024}
    if streamed:
        stages = [{"name": "llm", "kind": "ar", "model": "tiny-llama", "replicas": 8,
                   "finalOutput": True, "engine": {"maxTokens": tokens},
                   "admission": admission}]
        if window:
            stages[0]["dispatch"] = {"perReplica": AR_WINDOW}
        api = ["chat"]
    else:
        echo = {"kind": "echo", "replicas": 4, "engine": {"echoDelayMs": 300},
                "admission": admission}
        if window:
            echo["dispatch"] = {"perReplica": ECHO_WINDOW}
        stages = [{"name": "a", **echo}, {"name": "b", "inputs": ["a"], "finalOutput": True,
                                          **echo}]
        api = ["generic"]
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": name}, "spec": {"orchestrator": {"api": api},
                                                 "stages": stages}}


@dataclass
class Phase:
    name: str
    latencies: dict[str, float] = field(default_factory=dict)  # request id -> seconds
    ends: dict[str, float] = field(default_factory=dict)  # request id -> when it ended
    failed: list[str] = field(default_factory=list)  # why, per failed request
    complete: int = 0
    mismatched: int = 0
    total: int = 0
    kills: list[tuple[str, float]] = field(default_factory=list)  # (replica, time.time())
    log: Path = Path()  # the orchestrator's log
    holds: int = 0  # the killer's waits (a round not due, or no victim allowed): tests see it


def log_times(log: Path, pattern: str) -> list[float]:
    """Wall-clock times of the orchestrator log lines that contain `pattern`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if m and pattern in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def ready_signs(text: str, name: str) -> tuple[int, int]:
    """How often the orchestrator's log says replica `name` became ready (a `-> ready`
    transition, or a join in state ready) and finished a handshake."""
    n = re.escape(name)
    ready = re.findall(rf"replica {n}(?:: \S+ -> ready\b| of stage \S+ joined at \S+ \(ready\))",
                       text)
    return len(ready), len(re.findall(rf"replica {n}: handshake done", text))


def back(now: tuple[int, int], at_kill: tuple[int, int]) -> bool:
    """Whether a victim is routable again: its ready_signs both grew since its kill (on the
    cluster a restarted worker answers the handshake before its model is loaded and its pod
    is Ready; with `omnistage serve` it joins ready, then shakes hands)."""
    return all(a > b for a, b in zip(now, at_kill, strict=True))


def may_strike(replicas: int, down: int) -> bool:
    """Whether a round may kill in a stage of `replicas` replicas of which `down` are earlier
    victims not back yet: while fewer than a quarter of them (at least one) are."""
    return down < max(1.0, replicas / 4)


def victim(routable: Collection[str], kills: Counter[str], rng: random.Random | None = None
           ) -> str:
    """One of the routable replicas killed the fewest times so far (`kills`), at random: a
    replica struck again and again would crash-loop, and a round would wait out its back-off."""
    fewest = min(kills[n] for n in routable)
    return (rng or random).choice(sorted(n for n in routable if kills[n] == fewest))


class Fleet:
    """Where the replicas run and how to find their processes: `omnistage serve`'s local
    runtime here, stage pods of the pod runner in ClusterFleet."""

    def __init__(self, pipeline: str, log: Path) -> None:
        self.pipeline, self.log = pipeline, log
        # stage -> its victims not back yet -> their ready_signs at the kill
        self.out: dict[str, dict[str, tuple[int, int]]] = {}

    def pids(self, stage: str) -> dict[str, int]:
        """Live replica processes of one stage: the local runtime names them on the command
        line."""
        pids = {}
        prefix = f"{self.pipeline}-{stage}-"
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "--replica-id" in cmd:
                name = cmd[cmd.index("--replica-id") + 1]
                if name.startswith(prefix):
                    pids[name] = int(entry.name)
        return pids

    def state(self, stage: str) -> tuple[dict[str, int], int]:
        """The stage's routable replicas (name -> pid), and how many victims are not back."""
        out = self.out.setdefault(stage, {})
        if out:
            text = self.log.read_text(errors="replace")
            for name in [n for n, mark in out.items() if back(ready_signs(text, n), mark)]:
                del out[name]
        return {n: pid for n, pid in self.pids(stage).items() if n not in out}, len(out)

    def kill(self, stage: str, name: str, pid: int) -> None:
        self.out.setdefault(stage, {})[name] = ready_signs(self.log.read_text(errors="replace"),
                                                           name)
        os.kill(pid, signal.SIGKILL)


class ClusterFleet(Fleet):
    """Stage pods of the local pod runner: a Ready pod's worker pid from its /state."""

    def __init__(self, pipeline: str, log: Path, cluster: Any, namespace: str) -> None:
        super().__init__(pipeline, log)
        self.cluster, self.namespace = cluster, namespace

    def pids(self, stage: str) -> dict[str, int]:
        from tests.harness.cluster import pods

        from omnistage import kube as k

        out = {}
        selector = f"{k.stage_selector(self.pipeline)},{k.LABEL_STAGE}={stage}"
        for pod in pods(self.cluster.kube, self.namespace, selector):
            if pod["metadata"].get("deletionTimestamp") or \
                    k.condition_status(pod, "Ready") != "True":
                continue
            try:
                state = json.loads(http_get(
                    f"http://{pod['status']['podIP']}:{k.WORKER_HTTP_PORT}/state"))
            except (OSError, ValueError):
                continue
            out[pod["metadata"]["name"]] = int(state["pid"])
        return out


def http_get(url: str, timeout: float = 5) -> str:
    """GET on loopback, never through an environment's proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as resp:
        return str(resp.read().decode(errors="replace"))


async def killer(phase: Phase, fleet: Fleet, stages: dict[str, int], every: int, kills: int,
                 done: asyncio.Event, overlap: bool = False) -> None:
    """A round of kills after every `every` answers: in each stage (name -> its replicas), a
    `victim` once `may_strike` allows it (overlap: a random one, at once) and another replica
    is routable. A round waits for that rather than skip the stage."""
    rounds = 0
    while rounds < kills and not done.is_set():
        if phase.total < every * (rounds + 1):
            phase.holds += 1
            await asyncio.sleep(0.05)
            continue
        for stage, replicas in stages.items():
            while not done.is_set():
                up, down = await asyncio.to_thread(fleet.state, stage)
                if len(up) >= 2 and (overlap or may_strike(replicas, down)):
                    break
                phase.holds += 1
                await asyncio.sleep(0.2)
            else:
                return
            struck = Counter(name for name, _ in phase.kills)
            name = random.choice(sorted(up)) if overlap else victim(up, struck)
            fleet.kill(stage, name, up[name])
            phase.kills.append((name, time.time()))
        rounds += 1


async def drive(args: argparse.Namespace, phase: Phase, fleet: Fleet, url: str, name: str,
                streamed: bool) -> None:
    """The fault-free references (streamed), then REQUESTS requests with the kill rounds."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        refs = {}
        if streamed:  # the fault-free answers, before any kill
            for prompt in PROMPTS:
                ok, text, _ = await chat(session, url, name, prompt, args.stream_tokens)
                assert ok, f"fault-free stream failed: {text}"
                refs[prompt] = text
        done = asyncio.Event()
        stages = {s["name"]: s["replicas"] for s in manifest(name, streamed, 1)["spec"]["stages"]}
        kill = asyncio.ensure_future(killer(phase, fleet, stages,
                                            args.requests // (args.kills + 1), args.kills, done,
                                            args.overlap_kills))
        counter = iter(range(args.requests))

        async def client() -> None:
            for i in counter:
                start = time.monotonic()
                if streamed:
                    prompt = PROMPTS[i % len(PROMPTS)]
                    ok, text, rid = await chat(session, url, name, prompt, args.stream_tokens)
                    if ok:
                        phase.complete += 1
                        phase.mismatched += text != refs[prompt]
                else:
                    ok, text, rid = await plain(session, url, name, f"p{i}")
                phase.total += 1
                if ok:
                    phase.ends[rid] = time.monotonic()
                    phase.latencies[rid] = phase.ends[rid] - start
                else:
                    phase.failed.append(text)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        done.set()
        await kill


async def run_phase(args: argparse.Namespace, tmp: Path, streamed: bool) -> Phase:
    """One phase on its own `omnistage serve`."""
    name = "fochat" if streamed else "foecho"
    phase = Phase("streamed" if streamed else "plain", log=tmp / f"{name}.log")
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(manifest(name, streamed, args.stream_tokens, args.window)))
    port = free_port()
    server = Server([sys.executable, "-m", "omnistage.cli", "serve", str(path), "--host",
                     "127.0.0.1", "--port", str(port), "--log-dir", str(tmp / f"{name}-logs")],
                    r"ready at (http://\S+)", phase.log)
    try:
        url = server.wait_ready(300).group(1)
        await drive(args, phase, Fleet(name, phase.log), url, name, streamed)
    finally:
        server.stop()
    return phase


class ControlPlane:
    """A private local control plane, the local pod runner in process mode and the operator as
    a process (tests/harness, the cluster tests' own): started once for every cluster phase."""

    def __init__(self, tmp: Path) -> None:
        os.environ["OMNISTAGE_POD_MODE"] = "process"  # read when tests.harness.cluster loads
        from tests.harness.cluster import start_local_cluster, start_podrunner
        from tests.harness.operator import Operator, apply_crds

        self.cluster = start_local_cluster()
        self.runner = self.operator = None
        try:
            self.runner = start_podrunner(self.cluster)
            apply_crds(self.cluster)
            self.operator = Operator(self.cluster, tmp / "operator.log", webhook=False)
            self.operator.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        from tests.harness.cluster import stop_local_cluster, stop_podrunner

        if self.operator is not None:
            self.operator.stop()
        if self.runner is not None:
            stop_podrunner(self.runner)
        stop_local_cluster(self.cluster)


async def run_cluster_phase(args: argparse.Namespace, plane: ControlPlane, tmp: Path,
                            streamed: bool) -> Phase:
    """One phase as an OmniPipeline in a namespace of its own on the control plane."""
    from tests.harness.cluster import pods, temp_namespace
    from tests.harness.operator import apply, get, wait_for

    from omnistage import kube as k

    name = "fochat" if streamed else "foecho"
    with temp_namespace(plane.cluster.kube, prefix="bench-fo-") as ns:
        apply(plane.cluster, ns, manifest(name, streamed, args.stream_tokens, args.window))

        def ready() -> bool:
            cond = k.condition(get(plane.cluster, ns, "omnipipe", name), "Ready")
            return bool(cond and cond["status"] == "True")

        await asyncio.to_thread(wait_for, ready, 600, f"{name} Ready",
                                plane.operator.log_tail, 1)
        [orch] = [p for p in pods(plane.cluster.kube, ns,
                                  f"{k.LABEL_PIPELINE}={name},{k.LABEL_COMPONENT}=orchestrator")
                  if not p["metadata"].get("deletionTimestamp")]
        log = plane.runner.log_path(ns, orch["metadata"]["name"], "orchestrator")
        phase = Phase(("streamed" if streamed else "plain") + " cluster", log=log)
        await drive(args, phase, ClusterFleet(name, log, plane.cluster, ns),
                    f"http://{orch['status']['podIP']}:8000", name, streamed)
        phase.log = tmp / f"{name}-cluster.log"  # a copy: the pod's goes with its namespace
        phase.log.write_bytes(log.read_bytes())
    return phase


async def plain(session: aiohttp.ClientSession, url: str, name: str,
                prompt: str) -> tuple[bool, str, str]:
    try:
        async with session.post(f"{url}/v1/pipelines/{name}/requests",
                                json={"prompt": prompt}) as resp:
            body = await resp.text()
            rid = resp.headers.get("X-Request-Id", "")
            return resp.status == 200, f"{resp.status} {body[:200]}", rid
    except (aiohttp.ClientError, TimeoutError) as exc:
        return False, repr(exc), ""


async def chat(session: aiohttp.ClientSession, url: str, name: str, prompt: str,
               tokens: int) -> tuple[bool, str, str]:
    """A streamed chat completion: (completed with [DONE], its text, its request id)."""
    body = {"model": name, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0, "max_tokens": tokens}
    text, finished = [], False
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            rid = resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                return False, f"{resp.status} {(await resp.text())[:200]}", rid
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return False, json.dumps(event["error"])[:200], rid
                for choice in event.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return False, repr(exc), ""
    return finished, "".join(text), rid


def judge(phase: Phase) -> tuple[str, float | None, float | None]:
    """Its line, the added p99 of failed-over requests, and its bound."""
    log = phase.log
    text = log.read_text(errors="replace")
    times: dict[str, int] = {}  # request id -> its failovers
    for rid in re.findall(r"request (\S+): stage \S+ failed over", text):
        times[rid] = times.get(rid, 0) + 1
    over = set(times) & set(phase.latencies)
    # The goal is about one failover; a request two kills hit (at two stages) is shown apart.
    once = {rid for rid in over if times[rid] == 1}
    clean = [v for k, v in phase.latencies.items() if k not in over]
    p50 = statistics.median(clean) if clean else float("nan")
    detect = []
    for name, at in phase.kills:
        # Whichever sign reached the orchestrator first: under load the runtime's "gone" can
        # beat the socket monitor, and the close of a replica already gone is not logged.
        signs = log_times(log, f"replica {name}: connection closed") + \
            log_times(log, f"replica {name} lost (")
        seen = [t - at for t in signs
                if t >= at - 0.01]
        if seen:
            detect.append(max(0.0, min(seen)))
    detection = max(detect) if detect else None
    added = None
    if once:
        # What failing over added: its latency over that of the clean requests that ended
        # within a second of it (they ran under the same reduced capacity, so the kill's
        # queueing is not charged to the failover), else over the clean p50.
        lat = []
        for rid in once:
            end = phase.ends[rid]
            peers = [v for k, v in phase.latencies.items()
                     if k not in over and abs(phase.ends[k] - end) <= 1.0]
            lat.append(phase.latencies[rid] - (statistics.median(peers) if peers else p50))
        lat.sort()
        added = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    bound = None if detection is None else detection + p50
    line = (f"failover {phase.name}: {phase.total} requests, {len(phase.failed)} failed, "
            f"{len(phase.kills)} kills, {len(over)} failed over ({len(over) - len(once)} "
            f"twice); clean p50 {p50 * 1000:.0f} ms, "
            f"detection max {0 if detection is None else detection * 1000:.0f} ms, added p99 "
            f"(failed over once) "
            f"{'n/a' if added is None else f'{added * 1000:.0f} ms'}")
    if phase.name.startswith("streamed"):
        line += f"; complete {phase.complete}, differing from fault-free {phase.mismatched}"
    if phase.failed:
        line += f"; first failure: {phase.failed[0]}"
    return line, added, bound


async def main_async(args: argparse.Namespace) -> list[Goal]:
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as name:
        tmp = Path(args.keep) if args.keep else Path(name)
        tmp.mkdir(parents=True, exist_ok=True)
        goals: list[Goal] = []
        streams = [p == "streamed" for p in args.phases.split(",")]
        if not args.cluster:
            for streamed in streams:
                goals += judged(await run_phase(args, tmp, streamed), args)
            return goals
        sys.path.insert(0, REPO)  # tests.harness
        plane = await asyncio.to_thread(ControlPlane, tmp)
        try:
            for streamed in streams:
                phase = await run_cluster_phase(args, plane, tmp, streamed)
                goals += judged(phase, args)
        finally:
            await asyncio.to_thread(plane.stop)
        return goals


def judged(phase: Phase, args: argparse.Namespace) -> list[Goal]:
    """Print the phase's line; its goals."""
    line, added, bound = judge(phase)
    print(line, flush=True)
    if args.keep:  # every request's figures, to read a tail afterwards
        kept = Path(args.keep) / f"{phase.name.replace(' ', '-')}-requests.json"
        kept.write_text(json.dumps({
            "kills": phase.kills,  # (replica, unix time)
            "requests": {rid: {"seconds": phase.latencies[rid], "ended": phase.ends[rid]}
                         for rid in phase.latencies},  # ended: time.monotonic()
        }, indent=1))
    label = phase.name.replace(" ", "_")
    streamed = phase.name.startswith("streamed")
    goals = []
    if streamed:
        goals.append(Goal(f"{label}_complete_pct", 100.0 * phase.complete
                          / max(1, phase.total), 99.5, unit="%", digits=1))
        goals.append(Goal(f"{label}_differing", float(phase.mismatched), 0, at_least=False,
                          unit="", digits=0))
    else:
        goals.append(Goal(f"{label}_failed", float(len(phase.failed)), 0, at_least=False,
                          unit="", digits=0))
    goals.append(Goal(f"{label}_kills", float(len(phase.kills)),
                      args.kills * (1 if streamed else 2), unit="", digits=0))
    goals.append(Goal(f"{label}_added_p99_ms", None if added is None else added * 1000,
                      float("nan") if bound is None else bound * 1000, at_least=False,
                      unit="ms", digits=0))
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("--kills", type=int, default=10, help="kill rounds per phase")
    parser.add_argument("--phases", default="plain,streamed",
                        help="comma-separated: plain, streamed")
    parser.add_argument("--stream-tokens", type=int, default=768,
                        help="tokens per stream in the streamed phase")
    parser.add_argument("--cluster", action="store_true",
                        help="run the phases on a private local control plane with the operator "
                             "and the local pod runner in process mode")
    parser.add_argument("--keep", default="", help="keep the servers' logs and each phase's "
                        "per-request figures (PHASE-requests.json) in this folder")
    parser.add_argument("--no-window", dest="window", action="store_false",
                        help="no dispatch window on the stages (every task goes to a replica at "
                             "once and queues there), to compare with the default window")
    parser.add_argument("--overlap-kills", action="store_true",
                        help="the earlier kill rule: a random routable replica while another "
                             "is routable, however many earlier victims are not back yet")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    print("dispatch window (perReplica): " + (f"echo {ECHO_WINDOW}, ar {AR_WINDOW}"
                                              if args.window else "none (--no-window)"),
          flush=True)
    goals = asyncio.run(main_async(args))
    print(f"summary: {verdicts(goals)}", flush=True)
    return exit_status(goals, args.check)


if __name__ == "__main__":
    sys.exit(main())
