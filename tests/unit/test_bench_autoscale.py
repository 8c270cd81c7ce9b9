"""bench/bench_autoscale.py without its processes: the optimum, the settle time, the count of
changes of direction, failure counts and the summary's verdicts and reasons from fake
figures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.harness.benches import bench_module


@pytest.fixture(scope="module")
def bench() -> Any:
    return bench_module("bench_autoscale")


def test_optimum_is_littles_law_within_bounds(bench: Any) -> None:
    assert bench.optimum(0.5, 1.5) == 1  # 0.75 / 0.8
    assert bench.optimum(2.0, 1.5) == 4  # 3.0 / 0.8 = 3.75
    assert bench.optimum(2.0, 0.4) == 1  # exactly 1.0, despite float noise
    assert bench.optimum(0.0, 1.5) == 1  # the lower bound
    assert bench.optimum(100.0, 1.5) == bench.MAX_REPLICAS


def test_settle_time_is_from_the_last_entry_into_the_band(bench: Any) -> None:
    series = [(0.0, 1), (10.0, 1), (11.0, 2), (12.0, 5), (13.0, 2), (14.0, 3), (20.0, 4)]
    # Optimum 4: within 1 at 14 (3), out at 12 (5 is within 1 too), out at 13 (2).
    assert bench.settle_time(series, 10.0, 20.0, 4) == pytest.approx(4.0)
    assert bench.settle_time(series, 0.0, 10.0, 1) == 0.0
    assert bench.settle_time(series, 10.0, 20.0, 8) is None  # never there
    assert bench.settle_time([], 0.0, 10.0, 1) is None
    # Left the band at the end: not settled.
    assert bench.settle_time([(0.0, 4), (5.0, 1)], 0.0, 10.0, 4) is None


def test_a_step_reaches_the_next_stage_after_its_upstream_settles_and_serves(bench: Any) -> None:
    assert bench.step_reaches(0.0, 0.5) == 0.5  # a never moved: b sees the step after a task
    assert bench.step_reaches(2.3, 1.5) == pytest.approx(3.8)


def test_direction_changes_count_turns_within_a_window(bench: Any) -> None:
    up_down = [(0.0, 1), (10.0, 2), (20.0, 4), (60.0, 2), (70.0, 1)]
    assert bench.direction_changes(up_down) == 1  # up, then down: one turn
    flappy = [(0.0, 1), (10.0, 2), (20.0, 1), (30.0, 2), (40.0, 1)]
    assert bench.direction_changes(flappy) == 3
    # The same turns spread over more than the window count per window.
    assert bench.direction_changes(flappy, window_s=15.0) == 2
    assert bench.direction_changes([(0.0, 3), (5.0, 3)]) == 0


def test_failed_and_refused_are_counted_apart(bench: Any) -> None:
    sent = [bench.Sent(0.0, 200, 1.0), bench.Sent(1.0, 503, 0.1), bench.Sent(2.0, 429, 0.1),
            bench.Sent(3.0, 500, 0.1), bench.Sent(4.0, 0, 120.0)]
    assert bench.failed(sent) == 2 and bench.refused(sent) == 2


def _good(bench: Any) -> Any:
    return bench.Figures(
        settle_worst_s=5.0, settle_bound_s=6.0, objective_pct=99.0, direction_changes=1,
        step_failed=0, step_refused=0, cold_failed=0, cold_first_s=2.0, cold_bound_s=3.0,
        warm_first_s=2.5, warm_bound_s=3.0, warm_sum_s=5.0)


def test_summary_all_pass(bench: Any) -> None:
    line, goals = bench.summary(_good(bench))
    assert line.startswith("summary: settle worst=5.0s (goal <= 6s: PASS); ")
    assert "latency objective met=99.0% (goal >= 95%: PASS)" in line
    assert "direction changes/10min=1 (goal <= 2: PASS)" in line
    assert "step failed=0 (goal <= 0: PASS); step refused=0 (goal <= 0: PASS)" in line
    assert line.endswith("warm-up first output=2.5s (goal <= 3s: PASS)")
    assert "MISS" not in line
    assert bench.exit_status(goals, check=True) == 0


def test_summary_misses_carry_their_reasons(bench: Any) -> None:
    f = _good(bench)
    f.settle_worst_s = math.inf
    f.step_refused = 1
    f.notes.append("settle MISS: stage b never within 1 of 4 in phase 2")
    line, goals = bench.summary(f)
    assert "settle worst=infs (goal <= 6s: MISS)" in line
    assert "step refused=1 (goal <= 0: MISS)" in line
    assert line.endswith("; settle MISS: stage b never within 1 of 4 in phase 2")
    assert bench.exit_status(goals, check=True) == 1
    assert bench.exit_status(goals, check=False) == 0


def test_a_figure_not_measured_is_a_miss(bench: Any) -> None:
    line, goals = bench.summary(bench.Figures())
    assert "cold first latency=n/a (goal <= 0s: MISS)" in line
    assert "latency objective met=n/a (goal >= 95%: MISS)" in line
    assert bench.exit_status(goals, check=True) == 1


@pytest.fixture(scope="module")
def fleet() -> Any:
    return bench_module("autoscale_fleet")


def test_fleet_loads_size_steady_pools_at_one_and_raised_ones_at_three(fleet: Any) -> None:
    """Part B's premise: with the fleet's autoscaling, the steady figures keep a pool at its 1
    replica (no write is due) and the raised ones ask for 3, by the operator's own decide."""
    from omni_operator.autoscaler import stage_figures
    from omnistage.autoscaling import AutoscalerState, decide
    from omnistage.spec import Autoscaling

    scaling = Autoscaling.model_validate(fleet.AUTOSCALING)
    assert scaling.period_seconds == fleet.PERIOD_S
    import json
    import urllib.request

    load = fleet.FleetLoad()
    load.raised = {"p2"}
    try:
        def read(pipeline: str) -> Any:
            url = load.url.format(namespace="ns", pipeline=pipeline)
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.loads(resp.read())

        for pipeline, stage, want in (("p1", "b", 1), ("p2", "a", 1), ("p2", "b", 3)):
            doc = read(pipeline)
            figures = stage_figures(doc, stage)
            assert figures is not None
            got = decide(scaling, figures, 1, AutoscalerState(), doc["now"],
                         load_now=doc["now"]).desired
            assert got == want, (pipeline, stage, got)
        assert load.reads == 3
    finally:
        load.stop()


def test_fleet_writes_are_told_apart_by_pipeline(fleet: Any) -> None:
    ns = "/apis/omnistage.io/v1alpha1/namespaces/autoscale-fleet"
    assert fleet._pipeline_of(f"{ns}/stagepools/fleet-007-b/scale") == "fleet-007"
    assert fleet._pipeline_of(f"{ns}/stagepools/fleet-007-b/status") == "fleet-007"
    assert fleet._pipeline_of(f"{ns}/omnipipelines/fleet-007/status") == "fleet-007"
    assert fleet._pipeline_of("/api/v1/namespaces/autoscale-fleet/pods/fleet-007-b-2") == \
        "fleet-007"
    assert fleet._pipeline_of("/api/v1/namespaces/autoscale-fleet/pods") is None  # a create
    assert fleet._pipeline_of("/api/v1/namespaces/autoscale-fleet/events") is None
    # Events (named <object>.<hash>) are counted from the API, by their involvedObject.
    assert fleet._pipeline_of("/api/v1/namespaces/autoscale-fleet/events/fleet-001.cef9") is None
    assert fleet._owner("StagePool", "fleet-001-b") == "fleet-001"
    assert fleet._owner("OmniPipeline", "fleet-001") == "fleet-001"
    assert fleet._owner("Pod", "fleet-001-b-3") == "fleet-001"


def test_fleet_goals(fleet: Any) -> None:
    f = fleet.FleetFigures(pipelines=500, cpu_off_s=10.0, cpu_on_s=10.8, steady_writes=0,
                           other_writes=0)
    cpu, writes = f.goals()
    assert cpu.met and round(cpu.value, 1) == 8.0 and writes.met
    f.cpu_on_s = 11.5
    assert not f.goals()[0].met
    f.other_writes = 2
    assert not f.goals()[1].met
    assert not fleet.FleetFigures(pipelines=500).goals()[0].met  # not measured: a MISS


def test_fleet_writes_are_read_from_the_operators_log_since_an_offset(
        fleet: Any, tmp_path: Path) -> None:
    import bench_operator_scale as scale

    bench = scale.Bench.__new__(scale.Bench)  # only its log is read
    bench.op_log = tmp_path / "operator.log"
    before = "x INFO omnistage.kubeapi.writes: PATCH /apis/omnistage.io/v1alpha1/namespaces/f/" \
             "stagepools/fleet-009-a/status\n"
    after = ("x INFO omnistage.kubeapi.writes: PATCH /apis/omnistage.io/v1alpha1/namespaces/f/"
             "stagepools/fleet-001-b/scale\n"
             "x INFO omnistage.kubeapi.writes: POST /api/v1/namespaces/f/pods\n"
             "x INFO omnistage.kubeapi.writes: PATCH /api/v1/namespaces/f/pods/fleet-001-b-2\n")
    bench.op_log.write_text(before + after)
    assert fleet._writes_by_pipeline(bench, len(before)) == {"fleet-001": 2}
    assert bench.write_log(len(before)) == {"PATCH stagepools/scale": 1, "POST pods": 1,
                                            "PATCH pods": 1}
    assert bench.log_since(10**6) == ""
