"""bench/bench_operator_scale.py's verdicts and its CPU accounting, without a cluster."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.harness.benches import bench_module


@pytest.fixture(scope="module")
def scale() -> Any:
    return bench_module("bench_operator_scale")


def _result(**over: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"pods": 600, "writes_per_pod": 3.9, "apply_to_ready_s": 30.0,
                              "idle": {"writes": 0}, "operator_memory_mib": {"peak": 100.0}}
    result.update(over)
    return result


def _verdicts(scale: Any, result: dict[str, Any]) -> dict[str, bool]:
    return {g.label: g.met for g in scale.scale_goals(result, 60)}


def test_writes_per_pod_is_a_goal_of_every_run(scale: Any) -> None:
    assert _verdicts(scale, _result())["writes_per_pod"]
    assert not _verdicts(scale, _result(writes_per_pod=4.01))["writes_per_pod"]


def test_the_fleets_delete_is_judged_against_the_bare_pods_delete_when_both_ran(
        scale: Any) -> None:
    raw = {"apply_to_ready_s": 10.0, "delete_s": 4.0}
    assert "delete_to_gone/raw_pods" not in _verdicts(scale, _result(raw_baseline=raw))
    assert "delete_to_gone/raw_pods" not in _verdicts(
        scale, _result(teardown={"delete_to_gone_s": 5.0}))
    verdicts = _verdicts(scale, _result(raw_baseline=raw, teardown={"delete_to_gone_s": 6.0}))
    assert verdicts["delete_to_gone/raw_pods"]  # 1.5x: at the bound
    verdicts = _verdicts(scale, _result(raw_baseline=raw, teardown={"delete_to_gone_s": 6.4}))
    assert not verdicts["delete_to_gone/raw_pods"]
    assert not verdicts["apply_to_ready/raw_pods"]  # 3x the bare pods


def test_cpu_by_process_is_a_difference_largest_first(scale: Any) -> None:
    before = {"kube-apiserver": 10.0, "operator": 1.0, "bench": 0.5}
    after = {"kube-apiserver": 14.25, "operator": 9.0, "bench": 0.5, "kwok": 2.0}
    delta = scale.cpu_delta(before, after)
    assert list(delta) == ["operator", "kube-apiserver", "kwok", "bench"]
    assert delta == {"operator": 8.0, "kube-apiserver": 4.2, "kwok": 2.0, "bench": 0.0}


def test_cpu_is_read_for_each_pid_file_of_the_cluster(scale: Any, tmp_path: Path) -> None:
    bench = scale.Bench.__new__(scale.Bench)  # only the pid files and the operator are read
    bench.cluster_dir, bench.op = tmp_path, None
    (tmp_path / "pids").mkdir()
    (tmp_path / "pids" / "kube-apiserver.pid").write_text(f"{os.getpid()}\n")
    (tmp_path / "pids" / "kwok.pid").write_text("not a pid\n")
    for _ in range(200_000):  # some CPU of our own to read back
        pass
    cpu = bench.component_cpu()
    assert set(cpu) == {"kube-apiserver", "bench"}  # the unreadable pid file left out
    assert cpu["kube-apiserver"] > 0.0
    assert cpu["kube-apiserver"] == pytest.approx(cpu["bench"], abs=0.1)  # the same process


def test_a_collection_is_counted_from_one_item_and_the_remaining_count(scale: Any) -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    class Api:
        def get(self, url_path: str, **params: Any) -> dict[str, Any]:
            asked.append((url_path, params))
            if url_path.endswith("/pods"):
                return {"items": [{}], "metadata": {"remainingItemCount": 5999}}
            if url_path.endswith("/stagepools"):
                return {"items": [{}], "metadata": {}}  # the last page: no remaining count
            return {"items": [], "metadata": {}}

    bench = scale.Bench.__new__(scale.Bench)
    bench.kube = Api()
    assert bench.count("/api/v1/namespaces/n/pods") == 6000
    assert bench.count("/apis/omnistage.io/v1alpha1/namespaces/n/stagepools") == 1
    assert bench.count("/apis/omnistage.io/v1alpha1/namespaces/n/omnipipelines") == 0
    assert all(params == {"limit": 1} for _, params in asked)
