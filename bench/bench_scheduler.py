"""Per-call dispatch overhead of SerialScheduler.run(noop) versus bare asyncio.to_thread(noop).

Why: every model step of a stage worker goes through SerialScheduler, so its uncontended fast
path must cost about what a plain thread hop costs (goal: <= 1.5x asyncio.to_thread).

Calls are awaited one after another (no contention), so the numbers are pure dispatch
overhead: loop -> worker thread -> loop. Both sides are measured alternately, several
repetitions each, and the best repetition is reported (the least disturbed by noise).

Run from the repository root: `python bench/bench_scheduler.py [--calls N] [--reps N] [-v]`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

try:
    from omnistage.admission import SerialScheduler
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from omnistage.admission import SerialScheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import Goal, add_check_flag, exit_status


def noop() -> None:
    """The work: nothing, so only dispatch is measured."""


async def _time_calls(call: Callable[[], Awaitable[None]], calls: int) -> float:
    """Seconds per call for `calls` sequential awaits."""
    start = time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.perf_counter() - start) / calls


async def _bench(calls: int, reps: int) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    # to_thread uses the loop's default pool; give it an explicit one so both sides are alike.
    default_pool = concurrent.futures.ThreadPoolExecutor()
    loop.set_default_executor(default_pool)
    serial = SerialScheduler()  # the production configuration: private 1-thread pool
    shared = SerialScheduler(executor=default_pool)  # same pool as to_thread, for fairness

    def to_thread() -> Awaitable[None]:
        return asyncio.to_thread(noop)

    def serial_run() -> Awaitable[None]:
        return serial.run(noop)

    def shared_run() -> Awaitable[None]:
        return shared.run(noop)

    variants = {"to_thread": to_thread, "serial": serial_run, "serial_shared_pool": shared_run}
    warmup = max(1, calls // 10)
    for call in variants.values():
        await _time_calls(call, warmup)
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, call in variants.items():
            results[name].append(await _time_calls(call, calls))
    serial.close()
    shared.close()
    default_pool.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every variant")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    results = asyncio.run(_bench(args.calls, args.reps))
    best = {name: min(vals) * 1e6 for name, vals in results.items()}
    goal = Goal("serial/to_thread", best["serial"] / best["to_thread"], 1.5, at_least=False)
    print(
        f"scheduler_dispatch: serial={best['serial']:.1f}us/call "
        f"to_thread={best['to_thread']:.1f}us/call"
    )
    print(f"summary: {goal}")
    if args.verbose:
        for name, vals in results.items():
            us = [v * 1e6 for v in vals]
            print(
                f"  {name}: best={min(us):.1f}us median={statistics.median(us):.1f}us "
                f"ratio_vs_to_thread={min(us) / best['to_thread']:.2f}x",
                file=sys.stderr,
            )
    return exit_status([goal], args.check)


if __name__ == "__main__":
    raise SystemExit(main())
