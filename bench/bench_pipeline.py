"""Throughput and latency of the 2-stage echo pipeline (examples/echo.yaml: a -> b) under load.

Why: the echo stages do no model work, so what is measured is the serving system itself. Three
systems get the same closed-loop load (CONCURRENCY clients, each sending its next request as
soon as the previous one returns) from the same aiohttp/asyncio load generator:

  omnistage   `omnistage serve examples/echo.yaml` (LocalStageRuntime + Orchestrator + HTTP),
              POST /v1/pipelines/echo/requests
  ray-serve   baseline (a): bench/ray_echo.py, an ingress deployment doing stage a's echo and
              calling a second deployment (stage b) through a DeploymentHandle, over HTTP.
              Goal: omnistage >= 2x its throughput.
  zmq-direct  baseline (b): the same two echo workers driven over ZMQ by the client itself
              (request to a, then its output to b): an upper bound, so the gap to it is the
              orchestrator's + HTTP's overhead. Plain ZMQ: it measures the limit.
  plain       `omnistage serve --no-curve`: this tree without CurveZMQ between the orchestrator
              and its workers, so `--systems omnistage,plain` prices the authentication in one
              run. Goal: omnistage (CurveZMQ, the default) >= 0.9x of it.

Loopback only; each run is bounded by --duration and --max-requests. Prints one line per
system and a summary line with the ratios. Ray needs `pip install "ray[serve]"`; without it
that line says why and the other two still run.

Run from the repository root: `python bench/bench_pipeline.py [--duration 10] [-c 64]`.

Regression check (about a minute): `python bench/bench_pipeline.py --regression
--baseline-commit REV` (or `--baseline-tree DIR`) runs only omnistage, from this tree and from
REV (a temporary git worktree), alternating 8 short rounds, and fails (exit 1) when this tree's
throughput falls below 0.9x the baseline's (the median of the rounds' ratios) or its front CPU
per request rises above 1.1x. Ratios of two systems measured side by side, never an absolute
time, so a loaded machine slows both alike. docs/benchmarks.md says when to run it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import add_baseline_flags, baseline_tree
from goals import Goal, add_check_flag, exit_status

ROOT = Path(__file__).resolve().parents[1]
ECHO_YAML = ROOT / "examples" / "echo.yaml"
PROMPT = "hello omnistage"


@dataclass
class Result:
    name: str
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    elapsed: float = 0.0
    note: str = ""
    rounds: list[float] = field(default_factory=list)  # req/s of each measured round
    warm_ok: int = 0  # requests answered during the warm-up
    cpu_s: float = 0.0  # the front process's CPU time over warm-up + measured rounds
    cpu_requests: int = 0

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def rps(self) -> float:
        return self.ok / self.elapsed if self.elapsed else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        if len(self.latencies) < 2:
            return self.latencies[0] * 1000
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[int(q) - 1] * 1000

    def line(self, concurrency: int) -> str:
        if self.note:
            return f"{self.name:<11} unavailable: {self.note}"
        err = f" (first: {self.first_error})" if self.errors else ""
        cpu = (f"  front CPU {1e6 * self.cpu_s / self.cpu_requests:.0f} us/req"
               if self.cpu_requests else "")
        return (f"{self.name:<11} {self.rps:9.1f} req/s  p50 {self.pct(50):7.2f} ms  "
                f"p99 {self.pct(99):7.2f} ms  ok {self.ok}  errors {self.errors}{err}{cpu}  "
                f"(concurrency {concurrency}, {self.elapsed:.1f}s)")


Call = Callable[[], Awaitable[None]]


async def drive(name: str, call: Call, concurrency: int, duration: float, max_requests: int,
                warmup: float) -> Result:
    """Closed-loop load: `concurrency` clients until duration or max_requests is reached."""
    warm = Result(name)
    if warmup > 0:
        await _loop(warm, call, concurrency, warmup, max_requests)
    res = Result(name, warm_ok=warm.ok)
    t0 = time.perf_counter()
    await _loop(res, call, concurrency, duration, max_requests)
    res.elapsed = time.perf_counter() - t0
    return res


async def _loop(res: Result, call: Call, concurrency: int, duration: float,
                max_requests: int) -> None:
    end = time.perf_counter() + duration
    sent = itertools.count()

    async def client() -> None:
        while time.perf_counter() < end and next(sent) < max_requests:
            t = time.perf_counter()
            try:
                await call()
            except Exception as exc:
                res.errors += 1
                res.first_error = res.first_error or f"{type(exc).__name__}: {exc}"[:200]
                continue
            res.latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(client() for _ in range(concurrency)))


def http_call(session: aiohttp.ClientSession, url: str, check: Callable[[Any], bool],
              body: dict[str, Any] | None = None) -> Call:
    body = body or {"prompt": PROMPT}

    async def call() -> None:
        async with session.post(url, json=body) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data[:120]!r}")
            if not check(json.loads(data)):
                raise RuntimeError(f"unexpected reply {data[:120]!r}")

    return call


def _omnistage_ok(reply: Any) -> bool:
    out = reply["children"][0]["outputs"]["b"]["fields"]
    return reply["status"] == "ok" and out["text"] == PROMPT


def _ray_ok(reply: Any) -> bool:
    return reply["text"] == PROMPT


# ---- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess whose stdout is scanned for a ready pattern; stopped with its tree."""

    def __init__(self, cmd: list[str], ready: str, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.log = log
        self._fh = open(log, "w")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._fh, text=True,
                                     cwd=ROOT, start_new_session=True, env=env)
        self._ready = re.compile(ready)
        self.match: re.Match[str] | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._fh.write(line)
            if self.match is None and (m := self._ready.search(line)):
                self.match = m
                self._seen.set()
        self._seen.set()

    def wait_ready(self, timeout: float) -> re.Match[str]:
        self._seen.wait(timeout)
        if self.match is None:
            self.stop()
            tail = "\n".join(self.log.read_text().splitlines()[-15:])
            raise RuntimeError(f"not ready after {timeout:.0f}s (exit {self.proc.poll()}); "
                               f"log tail:\n{tail}")
        return self.match

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server process itself has used: for the orchestrator,
        its own cost, without the stage workers'. A shared machine changes wall-clock
        throughput from second to second; CPU per request stays put."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM, then SIGKILL everything the server started (Ray workers set own groups)."""
        tree = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        for pid in [self.proc.pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self._fh.close()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# ---- systems -----------------------------------------------------------------------------
#
# Each system is an async context manager that starts it, checks one request, and yields the
# `call` the load generator drives. All of them stay up together, so the measured rounds can
# alternate between them (see measure()).

@dataclass
class Target:
    """What the load generator drives: one request, and the front process's CPU clock (None
    where the front end is the load generator itself)."""

    call: Call
    cpu: Callable[[], float] | None = None


System = Callable[[argparse.Namespace, Path], contextlib.AbstractAsyncContextManager[Target]]


class LeanHttp:
    """A keep-alive HTTP/1.1 client that costs the load generator little per request.

    Why: the load generator shares the machine's cores with the system under test. aiohttp's
    client spends several times the CPU per request that the ZMQ baseline's client does, and on
    2 cores that CPU is taken from the servers, so it would be charged to every HTTP system. This
    one sends a pre-encoded request on a pooled connection and reads the reply by
    Content-Length (or chunks): enough for JSON replies from any HTTP/1.1 server.
    """

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"{url}: only http:// URLs")
        self.host, self.port = u.hostname, u.port or 80
        data = json.dumps(body).encode()
        self.request = (
            f"POST {u.path or '/'}{'?' + u.query if u.query else ''} HTTP/1.1\r\n"
            f"Host: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self) -> tuple[int, bytes]:
        conn = self.idle.pop() if self.idle else await asyncio.open_connection(
            self.host, self.port, limit=1 << 20)
        reader, writer = conn
        try:
            writer.write(self.request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length, chunked, close = None, False, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and b"close" in value.lower():
                    close = True
            if chunked:
                parts = []
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    parts.append(await reader.readexactly(size + 2))
                await reader.readuntil(b"\r\n")
                data = b"".join(p[:-2] for p in parts)
            else:
                data = await reader.readexactly(length or 0)
        except BaseException:
            writer.close()
            raise
        if close:
            writer.close()
        else:
            self.idle.append(conn)
        return status, data

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


def lean_http_call(client: LeanHttp, check: Callable[[Any], bool]) -> Call:
    async def call() -> None:
        status, data = await client.post()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:120]!r}")
        if not check(json.loads(data)):
            raise RuntimeError(f"unexpected reply {data[:120]!r}")

    return call


@contextlib.asynccontextmanager
async def http_system(url: str, check: Callable[[Any], bool], args: argparse.Namespace,
                      server: Server, body: dict[str, Any] | None = None
                      ) -> AsyncIterator[Target]:
    if args.http_client == "lean":
        client = LeanHttp(url, body or {"prompt": PROMPT})
        try:
            call = lean_http_call(client, check)
            await call()  # fail fast with a clear error if the route is wrong
            yield Target(call, server.cpu_seconds)
        finally:
            client.close()
        return
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        call = http_call(session, url, check, body)
        await call()  # fail fast with a clear error if the route is wrong
        yield Target(call, server.cpu_seconds)


def omnistage_system(tree: Path | None = None, curve: bool = True) -> System:
    """`omnistage serve` of this tree, or of another checkout's runtime/ (--baseline-tree):
    a change to the orchestrator is then measured against the code before it, in one run.
    curve False: this tree with `--no-curve` (plain ZMQ to the workers), the price of
    CurveZMQ measured beside it."""
    tag = "" if tree is None and curve else "-base" if tree is not None else "-plain"
    extra = [] if curve else ["--no-curve"]

    @contextlib.asynccontextmanager
    async def system(args: argparse.Namespace, tmp: Path) -> AsyncIterator[Target]:
        port = free_port()
        env = None
        if tree is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(tree / "runtime"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        server = Server([sys.executable, "-m", "omnistage.cli", "serve", str(ECHO_YAML),
                         "--port", str(port), "--log-dir", str(tmp / f"omnistage{tag}-logs"),
                         *extra],
                        r"ready at (http://\S+)", tmp / f"omnistage{tag}.log", env=env)
        try:
            url = server.wait_ready(180).group(1)
            async with http_system(f"{url}/v1/pipelines/echo/requests", _omnistage_ok,
                                   args, server) as target:
                yield target
        finally:
            server.stop()

    return system


@contextlib.asynccontextmanager
async def ray_system(args: argparse.Namespace, tmp: Path) -> AsyncIterator[Target]:
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f'import ray.serve failed ({exc}); pip install "ray[serve]"') from None
    port = free_port()
    server = Server([sys.executable, str(ROOT / "bench" / "ray_echo.py"), "--port", str(port)],
                    r"READY (http://\S+)", tmp / "ray.log")
    try:
        try:
            url = server.wait_ready(300).group(1)
        except RuntimeError as exc:
            raise Unavailable(str(exc)) from None
        async with http_system(url, _ray_ok, args, server) as target:
            yield target
    finally:
        server.stop(grace=20)


@contextlib.asynccontextmanager
async def zmq_system(args: argparse.Namespace, tmp: Path) -> AsyncIterator[Target]:
    from omnistage.client import ReplicaChannel
    from omnistage.local_runtime import LocalStageRuntime
    from omnistage.spec import load_pipeline

    runtime = LocalStageRuntime(load_pipeline(ECHO_YAML), base_dir=ECHO_YAML.parent,
                                log_dir=tmp / "zmq-logs")
    runtime.start()  # on the main thread: the workers' parent-death signal follows it
    try:
        by_stage = {r.stage: r.endpoint for r in runtime.membership.replicas}
        a, b = ReplicaChannel(by_stage["a"], name="a"), ReplicaChannel(by_stage["b"], name="b")
        ids = itertools.count()

        async def call() -> None:
            rid = f"r{next(ids)}"
            _, fa = await a.request(rid, {"prompt": PROMPT})
            _, fb = await b.request(rid, {"prompt": fa.header.text})
            if fb.type != "final" or fb.header.text != PROMPT:
                raise RuntimeError(f"unexpected reply {fb.header}")

        try:
            await call()
            yield Target(call)
        finally:
            await a.close()
            await b.close()
    finally:
        runtime.shutdown()


DYNAMO_PYTHON = ROOT / "bench" / ".venv-dynamo" / "bin" / "python"
DYNAMO_INSTALL = (f"python -m venv {DYNAMO_PYTHON.parents[1]} && "
                  f"{DYNAMO_PYTHON.parent}/pip install --no-deps ai-dynamo==1.6.1 "
                  "ai-dynamo-runtime==1.6.1 && "
                  f"{DYNAMO_PYTHON.parent}/pip install aiohttp msgspec prometheus-client pyzmq "
                  "transformers pydantic uvloop kubernetes redis tqdm zstandard")
# Every Dynamo address on loopback: without these it binds 0.0.0.0 and advertises (and
# connects to) the machine's routable address.
DYNAMO_ENV = {
    "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
}


def _dynamo_model(tmp: Path) -> Path:
    """The tiny LLM's tokenizer, which the mocker loads to count tokens (it runs no
    weights), with a plain chat template, which Dynamo's chat route requires."""
    import shutil

    from omnistage.models import resolve

    src, dest = resolve("tiny-llama", "ar"), tmp / "dynamo-model"
    dest.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / name, dest / name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def _dynamo_ok(reply: Any) -> bool:
    return reply["usage"]["completion_tokens"] == DYNAMO_TOKENS and bool(reply["choices"])


DYNAMO_TOKENS = 2


@contextlib.asynccontextmanager
async def dynamo_system(args: argparse.Namespace, tmp: Path) -> AsyncIterator[Target]:
    """NVIDIA Dynamo's OpenAI frontend in front of one mocker engine (no model run, no
    simulated delay: --speedup-ratio 0), fed a chat completion of DYNAMO_TOKENS tokens."""
    python = Path(args.dynamo_python)
    if not await asyncio.to_thread(python.exists):
        raise Unavailable(f"{python} not found; install with: {DYNAMO_INSTALL}")
    model = await asyncio.to_thread(_dynamo_model, tmp)
    env = {**os.environ, **DYNAMO_ENV, "DYN_FILE_KV": str(tmp / "dynamo-kv")}
    env.pop("PYTHONPATH", None)
    port = free_port()
    mocker = Server([str(python), "-m", "dynamo.mocker", "--model-path", str(model),
                     "--model-name", "tiny", "--speedup-ratio", "0"], r".",
                    tmp / "dynamo-mocker.log", env=env)
    frontend = Server([str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                       "--http-port", str(port)], r".", tmp / "dynamo-frontend.log", env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 180
            while True:
                try:
                    async with session.get(f"{url}/v1/models") as resp:
                        if resp.status == 200 and (await resp.json())["data"]:
                            break
                except (aiohttp.ClientError, KeyError, ValueError):
                    pass
                for server in (mocker, frontend):
                    if server.proc.poll() is not None:
                        tail = "\n".join(server.log.read_text().splitlines()[-10:])
                        raise Unavailable(f"dynamo exited ({server.proc.returncode}): {tail}")
                if time.monotonic() > deadline:
                    raise Unavailable("dynamo frontend listed no model after 180 s")
                await asyncio.sleep(1.0)
        body = {"model": "tiny", "max_tokens": DYNAMO_TOKENS,
                "messages": [{"role": "user", "content": PROMPT}]}
        async with http_system(f"{url}/v1/chat/completions", _dynamo_ok, args, frontend,
                               body=body) as target:
            yield target
    finally:
        frontend.stop()
        mocker.stop()


class Unavailable(RuntimeError):
    """The system cannot run here (not installed, failed to start); its line says why."""


SYSTEMS: dict[str, tuple[str, System]] = {
    "omnistage": ("omnistage", omnistage_system()),
    "plain": ("omnistage-no-curve", omnistage_system(curve=False)),
    "ray": ("ray-serve", ray_system),
    "zmq": ("zmq-direct", zmq_system),
    "dynamo": ("dynamo", dynamo_system),
}


async def measure(targets: dict[str, Target], args: argparse.Namespace) -> dict[str, Result]:
    """Alternate the systems in --rounds short rounds, so that a change in the machine's load
    (it is shared) hits every system alike instead of whichever ran last."""
    results = {key: Result(SYSTEMS[key][0]) for key in targets}
    per_round = args.duration / args.rounds
    warm = args.warmup / args.rounds
    for _ in range(args.rounds):
        for key, target in targets.items():
            cpu0 = target.cpu() if target.cpu else 0.0
            part = await drive(key, target.call, args.concurrency, per_round, args.max_requests,
                               warm)
            res = results[key]
            if target.cpu is not None:  # includes the warm-up's requests: counted below
                res.cpu_s += target.cpu() - cpu0
                res.cpu_requests += part.ok + part.warm_ok
            res.latencies += part.latencies
            res.errors += part.errors
            res.first_error = res.first_error or part.first_error
            res.elapsed += part.elapsed
            res.rounds.append(part.rps)
    return results


async def main_async(args: argparse.Namespace) -> int:
    keys = args.systems.split(",")
    if "omnistage-base" in SYSTEMS:  # --baseline-tree or --baseline-commit
        keys.insert(1, "omnistage-base")
    unknown = [k for k in keys if k not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown system(s) {unknown}; expected {list(SYSTEMS)}")
    results: dict[str, Result] = {}
    targets: dict[str, Target] = {}
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            for key in keys:  # started one after another: startup is not measured
                label, system = SYSTEMS[key]
                try:
                    targets[key] = await stack.enter_async_context(system(args, Path(tmp)))
                except Exception as exc:
                    results[key] = Result(label, note=f"{type(exc).__name__}: {exc}")
            results.update(await measure(targets, args))
    for key in keys:
        print(results[key].line(args.concurrency), flush=True)
    line, goals = regression(results) if args.regression else summary(results)
    print(line, flush=True)
    if not all(not r.note and r.ok for r in results.values()):
        return 1
    return exit_status(goals, args.check or args.regression)


# omnistage / baseline throughput; plain: the same tree without CurveZMQ (issue 43: >= 0.9x).
GOALS = {"ray": 2.0, "zmq": 0.9, "plain": 0.9}
# --regression: this tree against the baseline tree, throughput (median of the rounds' ratios)
# at least, and front CPU per request at most, these ratios.
REGRESSION_THROUGHPUT, REGRESSION_CPU = 0.9, 1.1


def regression(results: dict[str, Result]) -> tuple[str, list[Goal]]:
    """The regression check's goals: this tree's omnistage against the baseline tree's."""
    omni, base = results.get("omnistage"), results.get("omnistage-base")
    rps = cpu = None
    spread = ""
    if omni and base and not omni.note and not base.note and base.rounds:
        each = sorted(o / b for o, b in zip(omni.rounds, base.rounds, strict=True) if b)
        rps = statistics.median(each) if each else None
        spread = f" [rounds {each[0]:.2f}-{each[-1]:.2f}]" if each else ""
        if omni.cpu_requests and base.cpu_requests and base.cpu_s:
            cpu = (omni.cpu_s / omni.cpu_requests) / (base.cpu_s / base.cpu_requests)
    goals = [Goal("regression/throughput", rps, REGRESSION_THROUGHPUT),
             Goal("regression/front_cpu_per_request", cpu, REGRESSION_CPU, at_least=False)]
    return f"summary: {goals[0]}{spread}; {goals[1]}", goals


def summary(results: dict[str, Result]) -> tuple[str, list[Goal]]:
    """Ratios of omnistage to each baseline, and whether each goal holds (a baseline that
    could not run is a MISS of its goal, shown as n/a)."""
    omni = results.get("omnistage")
    parts, goals = [], []
    for key in ("ray", "zmq", "dynamo", "plain", "omnistage-base"):
        other = results.get(key)
        if omni is None or other is None:
            continue
        label = f"omnistage/{other.name}"
        ratio = None if omni.note or other.note or not other.rps else omni.rps / other.rps
        spread = ""
        if ratio is not None and len(omni.rounds) > 1 and len(omni.rounds) == len(other.rounds):
            each = sorted(o / b for o, b in zip(omni.rounds, other.rounds, strict=True) if b)
            spread = f" [rounds {each[0]:.2f}-{each[-1]:.2f}]"
        if key in GOALS:
            goal = Goal(label, ratio, GOALS[key])
            goals.append(goal)
            parts.append(f"{goal}{spread}")
        else:
            parts.append(f"{label}={'n/a' if ratio is None else f'{ratio:.2f}x'}{spread}")
    return "summary: " + ("; ".join(parts) or "nothing to compare"), goals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=None,
                        help="measured seconds/system (default 20; --regression: 48)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="unmeasured seconds first (default 2; --regression: 4)")
    parser.add_argument("--max-requests", type=int, default=200_000,
                        help="upper bound on requests per phase")
    add_baseline_flags(parser, "`omnistage serve` (as omnistage-base)")
    parser.add_argument("--dynamo-python", default=str(DYNAMO_PYTHON),
                        help="the interpreter of a venv with ai-dynamo (see DYNAMO_INSTALL)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating rounds the duration is split into (default 5; "
                        "--regression: 8)")
    parser.add_argument("--regression", action="store_true",
                        help="the regression check: omnistage of this tree against the "
                        "baseline (--baseline-tree or --baseline-commit) only; exit 1 on a "
                        "throughput drop or CPU rise of more than 10%%")
    parser.add_argument("--systems", default="omnistage,zmq,ray,dynamo",
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--http-client", choices=("lean", "aiohttp"), default="lean",
                        help="the load generator's HTTP client for the HTTP systems (lean: a "
                        "minimal keep-alive client, see LeanHttp)")
    add_check_flag(parser)
    args = parser.parse_args()
    quick = args.regression
    args.duration = args.duration if args.duration is not None else 48.0 if quick else 20.0
    args.warmup = args.warmup if args.warmup is not None else 4.0 if quick else 2.0
    args.rounds = args.rounds if args.rounds is not None else 8 if quick else 5
    if quick:
        if not (args.baseline_tree or args.baseline_commit):
            parser.error("--regression needs --baseline-tree or --baseline-commit")
        args.systems = "omnistage"
    with baseline_tree(args, parser) as tree:
        if tree is not None:
            SYSTEMS["omnistage-base"] = ("omnistage-base", omnistage_system(tree))
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
