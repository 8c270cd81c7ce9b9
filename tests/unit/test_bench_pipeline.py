"""bench/bench_pipeline.py's regression check: the verdict from two trees' results measured
side by side (the ratios it gates on), and its refusal to run without a baseline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.benches import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> Any:
    return bench_module("bench_pipeline")


def _result(bench: Any, name: str, rounds: list[float], cpu_us: float) -> Any:
    res = bench.Result(name, rounds=rounds)
    res.cpu_requests = 1000
    res.cpu_s = cpu_us * 1e-6 * res.cpu_requests
    return res


def test_the_check_gates_on_the_median_round_ratio_and_the_cpu_ratio(bench: Any) -> None:
    base = _result(bench, "omnistage-base", [1000, 1000, 1000, 1000, 1000], 400)
    # One bad round (a burst of load elsewhere) does not decide: the median ratio is 0.95.
    same = _result(bench, "omnistage", [950, 960, 500, 940, 990], 420)
    line, goals = bench.regression({"omnistage": same, "omnistage-base": base})
    assert [g.met for g in goals] == [True, True], line
    assert "regression/throughput=0.95x" in line and "regression/front_cpu_per_request=1.05x" \
        in line
    slower = _result(bench, "omnistage", [850, 880, 860, 890, 870], 400)
    line, goals = bench.regression({"omnistage": slower, "omnistage-base": base})
    assert [g.met for g in goals] == [False, True] and "MISS" in line
    costlier = _result(bench, "omnistage", [1000] * 5, 460)
    _, goals = bench.regression({"omnistage": costlier, "omnistage-base": base})
    assert [g.met for g in goals] == [True, False]
    broken = bench.Result("omnistage-base", note="not ready after 180s")
    _, goals = bench.regression({"omnistage": same, "omnistage-base": broken})
    assert [g.value for g in goals] == [None, None] and not any(g.met for g in goals)


def test_the_check_refuses_to_run_without_a_baseline() -> None:
    out = subprocess.run([sys.executable, "bench/bench_pipeline.py", "--regression"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--regression needs --baseline-tree or --baseline-commit" \
        in out.stderr
    out = subprocess.run([sys.executable, "bench/bench_pipeline.py", "--regression",
                          "--baseline-commit", "no-such-commit"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--baseline-commit no-such-commit" in out.stderr
