"""bench/bench_release.py without its processes: surge and routable counts per stage from fake
pod and status samples, the midway and reverted predicates, and the summary's verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator import release
from omnistage import kube as k
from tests.harness.benches import bench_module

OLD, NEW = "aaaaaaaaaa", "bbbbbbbbbb"


@pytest.fixture(scope="module")
def bench() -> Any:
    return bench_module("bench_release")


def pod(stage: str, n: int, revision: str = OLD, *, ready: bool = True, draining: bool = False,
        deleted: bool = False, surge: bool = False) -> dict[str, Any]:
    annotations = {}
    if draining:
        annotations[k.ANNOTATION_DRAINING] = "true"
    if surge:
        annotations[release.ANNOTATION_SURGE] = "true"
    meta: dict[str, Any] = {"name": f"t2i-{stage}-{n}", "uid": f"{stage}-{n}-{revision}",
                            "labels": {k.LABEL_STAGE: stage, k.LABEL_REVISION: revision},
                            "annotations": annotations}
    if deleted:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def steady(revision: str = OLD) -> list[dict[str, Any]]:
    return [pod(s, n, revision) for s in ("encoder", "denoiser") for n in (0, 1)]


def test_a_surge_replica_counts_and_retiring_ones_do_not(bench: Any) -> None:
    samples = [
        steady(),
        # the surge of each stage is up, not Ready yet: +1, routable still 2
        [*steady(), pod("encoder", 2, NEW, ready=False, surge=True),
         pod("denoiser", 2, NEW, ready=False, surge=True)],
        # encoder-0 drains (retiring): 4 pods, 3 not retiring, 2 routable
        [pod("encoder", 0, draining=True), pod("encoder", 1),
         pod("encoder", 2, NEW, surge=True), pod("encoder", 3, NEW, ready=False),
         *[p for p in steady() if p["metadata"]["labels"][k.LABEL_STAGE] == "denoiser"]],
    ]
    figures = bench.stage_figures(samples, [], 2)
    enc, den = figures["encoder"], figures["denoiser"]
    assert (enc.surge_max, enc.pods_peak, enc.routable_min) == (1, 4, 2)
    assert (den.surge_max, den.pods_peak, den.routable_min) == (1, 3, 2)
    assert enc.status_routable_min is None  # no status sample: not measured


def test_two_extra_replicas_and_a_dip_are_seen(bench: Any) -> None:
    samples = [
        [*steady(), pod("encoder", 2, NEW, surge=True), pod("encoder", 3, NEW)],
        [pod("denoiser", 0, deleted=True), pod("denoiser", 1, ready=False),
         *[p for p in steady() if p["metadata"]["labels"][k.LABEL_STAGE] == "encoder"]],
    ]
    figures = bench.stage_figures(samples, [], 2)
    assert figures["encoder"].surge_max == 2
    assert figures["denoiser"].routable_min == 0
    assert figures["denoiser"].worst == (f"t2i-denoiser-0:{OLD}:deleted "
                                         f"t2i-denoiser-1:{OLD}:not-ready")
    assert figures["encoder"].worst == f"t2i-encoder-0:{OLD}:ready t2i-encoder-1:{OLD}:ready"
    first = bench.stage_figures(samples[:1], [], 2)["encoder"].worst.split()
    assert first[2:] == [f"t2i-encoder-2:{NEW}:ready+surge", f"t2i-encoder-3:{NEW}:ready"]


def test_status_routable_sums_the_revisions(bench: Any) -> None:
    statuses = [
        {"stages": {"encoder": {"routable": {OLD: 2}}, "denoiser": {"routable": {OLD: 2}}}},
        {"stages": {"encoder": {"routable": {OLD: 1, NEW: 2}},
                    "denoiser": {"routable": {OLD: 1}}}},
        {},  # a pipeline without a status yet reads as 0 routable
    ]
    figures = bench.stage_figures([steady()], statuses[:2], 2)
    assert figures["encoder"].status_routable_min == 2
    assert figures["denoiser"].status_routable_min == 1
    assert bench.stage_figures([steady()], statuses, 2)["encoder"].status_routable_min == 0


def test_midway_needs_a_new_replica_that_is_not_the_surge(bench: Any) -> None:
    new = {"encoder": NEW, "denoiser": NEW}
    assert not bench.midway([*steady(), pod("encoder", 2, NEW, surge=True)], new)
    assert not bench.midway([*steady(), pod("encoder", 0, NEW, ready=False)], new)
    assert bench.midway([*steady()[1:], pod("encoder", 0, NEW)], new)


def test_back_needs_every_replica_on_its_first_revision_and_no_surge(bench: Any) -> None:
    first = {"encoder": OLD, "denoiser": OLD}
    assert bench.back(steady(), first, 2)
    assert not bench.back([*steady(), pod("denoiser", 2, NEW, surge=True)], first, 2)
    assert not bench.back([*steady()[1:], pod("encoder", 0, NEW)], first, 2)
    assert not bench.back([*steady()[1:], pod("encoder", 0, ready=False)], first, 2)


def readings(bench: Any, last: dict[str, float], unread: int = 0) -> Any:
    seen = {uid: f"pod-{uid}" for uid in [*last, *(f"x{i}" for i in range(unread))]}
    return bench.Readings(seen=seen, last=dict(last))


def figures(bench: Any, **over: Any) -> Any:
    stages = {s: bench.StageFigures(surge_max=1, pods_peak=3, routable_min=2,
                                    status_routable_min=2) for s in ("encoder", "denoiser")}
    base = {"load": {"total": 50, "ok": 50, "refused": 0, "failed": 0, "reset": 0,
                     "ok_p50_s": 0.3, "ok_max_s": 2.5},
            "stages": stages, "count": 2, "workers": readings(bench, {"u1": 0.0, "u2": 0.0}),
            "orchestrators": readings(bench, {"o1": 0.0}), "midway_seen": True,
            "reverted": True}
    return bench.Figures(**{**base, **over})


def verdict(bench: Any, f: Any, label: str) -> bool:
    return next(g for g in bench.goals(f) if g.label == label).met


def test_a_clean_run_passes_every_goal(bench: Any) -> None:
    f = figures(bench)
    assert all(g.met for g in bench.goals(f))
    line = bench.report(f)[-1]
    assert line.startswith("summary: ") and "MISS" not in line and line.count("PASS") == 11
    assert bench.exit_status(bench.goals(f), True) == 0


@pytest.mark.parametrize("over,label", [
    ({"load": {"total": 50, "ok": 49, "reset": 1}}, "failed"),
    ({"load": {"total": 50, "ok": 49, "aborted": 1}}, "failed"),
    ({"load": {"total": 50, "ok": 49, "refused": 1}}, "refused"),
    ({"load": {}}, "failed"),  # no load measured is a miss, never a pass
    ({"workers": {"u1": 0.0, "u2": 1.0}}, "cross_revision_hops"),
    ({"workers": ({"u1": 0.0}, 1)}, "cross_revision_hops"),  # one never read: not measured
    ({"workers": {}}, "cross_revision_hops"),  # no worker seen: not measured
    ({"orchestrators": ({}, 1)}, "orchestrator_revision_refusals"),
    ({"orchestrators": {"o1": 0.0, "o2": 2.0}}, "orchestrator_revision_refusals"),
    ({"reverted": False}, "release_midway_then_reverted"),
    ({"midway_seen": False}, "release_midway_then_reverted"),
])
def test_each_miss_is_reported(bench: Any, over: dict[str, Any], label: str) -> None:
    for key in ("workers", "orchestrators"):  # (last readings, pods never read)
        if key in over:
            value = over[key]
            over = {**over, key: readings(bench, *(value if isinstance(value, tuple)
                                                   else (value,)))}
    f = figures(bench, **over)
    assert not verdict(bench, f, label)
    assert f"{label}=" in bench.report(f)[-1] and "MISS" in bench.report(f)[-1]
    assert bench.exit_status(bench.goals(f), True) == 1
    assert bench.exit_status(bench.goals(f), False) == 0


def test_failed_counts_every_outcome_but_ok_and_refused(bench: Any) -> None:
    load = {"total": 9, "ok": 2, "refused": 1, "failed": 1, "reset": 1, "unreachable": 1,
            "hung": 1, "unavailable": 1, "aborted": 1, "ok_p50_s": 0.5, "ok_max_s": 3.0}
    assert bench.failed_count(load) == 6


def test_not_ok_names_kind_code_and_phase(bench: Any) -> None:
    from tests.harness.load import Result
    results = [Result("ok", 1.0, 0.1), Result("refused", 5.0, 0.1, status=503,
                                              code="shutting_down"),
               Result("refused", 6.0, 0.1, status=503, code="shutting_down"),
               Result("failed", 0.5, 0.1, status=502, code="replica_lost")]
    results[1].detail, results[2].detail = "first", "second"
    marks = [(2.0, "release"), (5.5, "revert")]
    assert bench.not_ok(results, marks) == {"failed/502/replica_lost@before": 1,
                                            "refused/503/shutting_down@release": 1,
                                            "refused/503/shutting_down@revert": 1}
    assert bench.first_details(results) == {"refused/503/shutting_down": "first",
                                            "failed/502/replica_lost": ""}


def test_stage_goals_miss_on_surge_and_on_a_dip(bench: Any) -> None:
    f = figures(bench)
    f.stages["encoder"] = bench.StageFigures(surge_max=2, pods_peak=4, routable_min=2,
                                             status_routable_min=2)
    f.stages["denoiser"] = bench.StageFigures(surge_max=1, pods_peak=3, routable_min=1,
                                              status_routable_min=None)
    missed = {g.label for g in bench.goals(f) if not g.met}
    assert missed == {"encoder_surge", "denoiser_routable_min", "denoiser_status_routable_min"}
