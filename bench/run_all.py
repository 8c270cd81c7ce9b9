"""Every bench, one after another, in one run: one table of goals for docs/benchmarks.md.

Why: issue 13 asks for one table from one run, with the machine described. Ratios inside a
bench compare systems measured in that bench's own run; this script only runs the benches in
sequence on the same machine, keeps each one's output, and gathers their `summary` lines (each
goal with PASS or MISS, see bench/goals.py) into a Markdown table with the machine's
description and its load average before and after every bench.

Run from the repository root:
    python bench/run_all.py [--out bench-results.md] [--only transfer,pipeline] [--check]
        [--scale-pipelines 50] [--tenfold]

--tenfold adds the operator's growth ladder (600, 2,004 and 6,000 stage pods, each with its raw
bare-pod baseline, LWS on the 6,000; bench_operator_scale.py --tenfold); over an hour on a small
machine. Each bench's full output is kept in --logs (a directory).
--check exits 1 when any bench missed a goal or failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


@dataclass
class Bench:
    name: str
    argv: list[str]
    timeout: float


def benches(args: argparse.Namespace) -> list[Bench]:
    py = sys.executable
    out = [
        Bench("transfer", [py, str(BENCH / "bench_transfer.py")], 600),
        Bench("batching", [py, str(BENCH / "bench_batching.py")], 1200),
        Bench("pipeline", [py, str(BENCH / "bench_pipeline.py")], 1200),
        Bench("scheduler", [py, str(BENCH / "bench_scheduler.py")], 600),
        Bench("http_framework", [py, str(BENCH / "bench_http_framework.py")], 600),
        Bench("speech", [py, str(BENCH / "bench_speech.py")], 900),
        Bench("failover", [py, str(BENCH / "bench_failover.py")], 1200),
        Bench("autoscale", [py, str(BENCH / "bench_autoscale.py")], 1500),
        Bench("operator_scale", [py, str(BENCH / "bench_operator_scale.py"), "--lws",
                                 "--pipelines", str(args.scale_pipelines)], 3600),
    ]
    if args.tenfold:
        out.append(Bench("operator_tenfold", [
            py, str(BENCH / "bench_operator_scale.py"), "--tenfold", "--lws",
            "--idle-seconds", "30", "--restart-seconds", "20", "--teardown-timeout", "1800",
            "--timeout", "3000"], 9000))
    return out


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
    mem_kb = int(mem.group(1)) if mem else 0
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem_kb / 2**20:.0f} GiB memory, "
            f"Linux {platform.release()}, Python {platform.python_version()}")


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


SUMMARY = re.compile(r"^summary(\[[^\]]*\])?: (?P<goals>.*)$")
FIGURES = re.compile(r"^(operator_scale|operator_vs_lws|scheduler_dispatch|tensor_transfer"
                     r"\[\w+(,\w+)?\]|omnistage |zmq-direct|ray-serve|dynamo|ar |diffusion "
                     r"|(aiohttp|fastapi|starlette)[-\w]* +/|speech )")


def run(bench: Bench, logs: Path) -> tuple[int, list[str], list[str], float]:
    """(exit code, summary lines, figure lines, seconds); the full output goes to logs/."""
    t0 = time.monotonic()
    print(f"== {bench.name}: {' '.join(bench.argv[1:])} (load {load()})", flush=True)
    with open(logs / f"{bench.name}.log", "w") as fh:
        try:
            proc = subprocess.run(bench.argv, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=fh, text=True, timeout=bench.timeout)
            rc, stdout = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc = 124
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        fh.write(stdout)
    lines = stdout.splitlines()
    summaries = [m.group("goals") for ln in lines if (m := SUMMARY.match(ln.strip()))]
    figures = [ln.strip() for ln in lines if FIGURES.match(ln.strip())]
    took = time.monotonic() - t0
    for ln in summaries:
        print(f"   summary: {ln}", flush=True)
    print(f"   exit {rc} after {took:.0f}s", flush=True)
    return rc, summaries, figures, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results.md", help="the Markdown table")
    ap.add_argument("--logs", default="bench-logs", help="each bench's full output")
    ap.add_argument("--only", default="", help="comma-separated bench names")
    ap.add_argument("--scale-pipelines", type=int, default=50)
    ap.add_argument("--tenfold", action="store_true", help="add the 6,000-pod operator run")
    ap.add_argument("--check", action="store_true", help="exit 1 on any MISS or failure")
    args = ap.parse_args()
    todo = benches(args)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {b.name for b in todo}
        if unknown:
            ap.error(f"--only: unknown bench(es) {sorted(unknown)}; "
                     f"expected {[b.name for b in todo]}")
        todo = [b for b in todo if b.name in wanted]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()  # what is measured: at the start
    rows, failed = [], False
    for bench in todo:
        before = load()
        rc, summaries, figures, took = run(bench, logs)
        missed = any("MISS" in s for s in summaries) or not summaries
        failed = failed or missed or rc not in (0, 1)
        goals = "<br>".join(summaries) or f"no summary (exit {rc}; see {logs}/{bench.name}.log)"
        rows.append(f"| {bench.name} | {goals} | {took:.0f} s | {before} → {load()} |")
        (logs / f"{bench.name}.figures").write_text("\n".join(figures) + "\n")
    text = "\n".join([
        f"One run of bench/run_all.py, started {started}, at commit {commit}.",
        f"Machine: {machine()}.",
        "",
        "| bench | goals (PASS/MISS), as the bench printed them | wall time | load average "
        "(1/5/15 min) before → after |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
