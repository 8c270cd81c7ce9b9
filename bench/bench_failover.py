"""Failover under load: kill -9 replicas of `omnistage serve` while requests run (issue 22).

Why: a killed replica must cost no request (docs/architecture.md, "Failover"). Two phases, each
its own `omnistage serve` on loopback, REQUESTS requests from CONCURRENCY closed-loop clients:

  plain     echo a -> echo b (4 replicas each, echoDelayMs 100), POST
            /v1/pipelines/<name>/requests, not streamed. Goal: 0 failed.
  streamed  one `ar` stage (tiny-llama, 6 replicas, 48 tokens), /v1/chat/completions with
            stream: true and temperature 0. Goals: >= 99.5% of the streams complete, and
            every complete one equal to a fault-free run of its prompt (no token repeated or
            missing).

During each phase, KILLS rounds: after every REQUESTS/(KILLS+1) answers, one random routable
replica of each stage gets SIGKILL, while at least one other is routable (the local runtime
starts a killed one again; it is routable once the log shows its new handshake). Goal: every
round ran. A request counts as failed over when the orchestrator's log says so for its
X-Request-Id. Goal: the added p99 of those failed over once (each one's latency minus the
median of the clean requests that ended within a second of it, which ran under the same
reduced capacity) <= loss detection (the slowest kill -> "connection closed" log line) + one
service time (the clean p50, end to end).

Prints one line per phase and one summary line with PASS/MISS per goal; `--check` exits 1 on a
MISS. Run from the repository root: `python bench/bench_failover.py [--requests 500] [-c 16]`.
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
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import Server, free_port
from goals import Goal, add_check_flag, exit_status, verdicts

PROMPTS = [f"tell me about the number {i}" for i in range(8)]
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def manifest(name: str, streamed: bool) -> dict[str, Any]:
    admission = {"maxRequests": 256, "maxQueue": 1024}
    if streamed:
        stages = [{"name": "llm", "kind": "ar", "model": "tiny-llama", "replicas": 6,
                   "finalOutput": True, "engine": {"maxTokens": 48}, "admission": admission}]
        api = ["chat"]
    else:
        echo = {"kind": "echo", "replicas": 4, "engine": {"echoDelayMs": 100},
                "admission": admission}
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
    log: Path = Path()  # the server's log


def replica_pids(pipeline: str, stage: str) -> dict[str, int]:
    """Live replica processes of one stage: the local runtime names them on the command line."""
    pids = {}
    prefix = f"{pipeline}-{stage}-"
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


def log_times(log: Path, pattern: str) -> list[float]:
    """Wall-clock times of the server log lines that contain `pattern`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if m and pattern in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


async def killer(phase: Phase, pipeline: str, stages: list[str], log: Path, every: int,
                 kills: int, done: asyncio.Event) -> None:
    """A round of kills after every `every` answers: in each stage, a random replica that is
    routable, while at least one other is (a killed replica is routable again once the log
    shows its new process's handshake)."""
    handshakes = {}  # killed replica -> its handshake lines at the kill

    def routable(names: list[str]) -> list[str]:
        return [n for n in names if n not in handshakes
                or len(log_times(log, f"replica {n}: handshake done")) > handshakes[n]]

    rounds = 0
    while rounds < kills and not done.is_set():
        if phase.total < every * (rounds + 1):
            await asyncio.sleep(0.05)
            continue
        for stage in stages:
            while not done.is_set():
                pids = replica_pids(pipeline, stage)
                up = routable(sorted(pids))
                if len(up) >= 2:
                    break
                await asyncio.sleep(0.2)
            else:
                return
            name = random.choice(up)
            handshakes[name] = len(log_times(log, f"replica {name}: handshake done"))
            os.kill(pids[name], signal.SIGKILL)
            phase.kills.append((name, time.time()))
        rounds += 1


async def run_phase(args: argparse.Namespace, tmp: Path, streamed: bool) -> Phase:
    name = "fochat" if streamed else "foecho"
    phase = Phase("streamed" if streamed else "plain", log=tmp / f"{name}.log")
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(manifest(name, streamed)))
    port = free_port()
    log = phase.log
    server = Server([sys.executable, "-m", "omnistage.cli", "serve", str(path), "--host",
                     "127.0.0.1", "--port", str(port), "--log-dir", str(tmp / f"{name}-logs")],
                    r"ready at (http://\S+)", log)
    try:
        url = server.wait_ready(300).group(1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            refs = {}
            if streamed:  # the fault-free answers, before any kill
                for prompt in PROMPTS:
                    ok, text, _ = await chat(session, url, name, prompt)
                    assert ok, f"fault-free stream failed: {text}"
                    refs[prompt] = text
            done = asyncio.Event()
            stages = ["llm"] if streamed else ["a", "b"]
            kill = asyncio.ensure_future(killer(phase, name, stages, log,
                                                args.requests // (args.kills + 1), args.kills,
                                                done))
            counter = iter(range(args.requests))

            async def client() -> None:
                for i in counter:
                    start = time.monotonic()
                    if streamed:
                        prompt = PROMPTS[i % len(PROMPTS)]
                        ok, text, rid = await chat(session, url, name, prompt)
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
    finally:
        server.stop()
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


async def chat(session: aiohttp.ClientSession, url: str, name: str,
               prompt: str) -> tuple[bool, str, str]:
    """A streamed chat completion: (completed with [DONE], its text, its request id)."""
    body = {"model": name, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0, "max_tokens": 48}
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
        seen = [t - at for t in log_times(log, f"replica {name}: connection closed")
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
    if phase.name == "streamed":
        line += f"; complete {phase.complete}, differing from fault-free {phase.mismatched}"
    if phase.failed:
        line += f"; first failure: {phase.failed[0]}"
    return line, added, bound


async def main_async(args: argparse.Namespace) -> list[Goal]:
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as name:
        tmp = Path(args.keep) if args.keep else Path(name)
        tmp.mkdir(parents=True, exist_ok=True)
        goals = []
        for streamed in [p == "streamed" for p in args.phases.split(",")]:
            phase = await run_phase(args, tmp, streamed)
            line, added, bound = judge(phase)
            print(line, flush=True)
            if streamed:
                goals.append(Goal("streamed_complete_pct", 100.0 * phase.complete
                                  / max(1, phase.total), 99.5, unit="%", digits=1))
                goals.append(Goal("streamed_differing", float(phase.mismatched), 0,
                                  at_least=False, unit="", digits=0))
            else:
                goals.append(Goal("plain_failed", float(len(phase.failed)), 0, at_least=False,
                                  unit="", digits=0))
            goals.append(Goal(f"{phase.name}_kills", float(len(phase.kills)),
                              args.kills * (1 if streamed else 2), unit="", digits=0))
            goals.append(Goal(f"{phase.name}_added_p99_ms",
                              None if added is None else added * 1000,
                              float("nan") if bound is None else bound * 1000,
                              at_least=False, unit="ms", digits=0))
        return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("--kills", type=int, default=10, help="kill rounds per phase")
    parser.add_argument("--phases", default="plain,streamed",
                        help="comma-separated: plain, streamed")
    parser.add_argument("--keep", default="", help="keep the servers' logs in this folder")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    goals = asyncio.run(main_async(args))
    print(f"summary: {verdicts(goals)}", flush=True)
    return exit_status(goals, args.check)


if __name__ == "__main__":
    sys.exit(main())
