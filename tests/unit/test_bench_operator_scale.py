"""bench/bench_operator_scale.py's verdicts and its CPU accounting, without a cluster."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from omnistage.kubeapi import ApiError
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


def _sized(pods: int, ready: float, raw_ready: float, **over: Any) -> dict[str, Any]:
    return _result(pods=pods, apply_to_ready_s=ready,
                   raw_baseline={"apply_to_ready_s": raw_ready, "delete_s": 2.0}, **over)


def test_the_ladder_judges_each_size_and_the_growth_of_its_ratio(scale: Any) -> None:
    flat = [_sized(600, 12.0, 10.0), _sized(2004, 40.0, 30.0), _sized(6000, 130.0, 100.0)]
    verdicts = {g.label: g for g in scale.ladder_goals(flat)}
    assert [v.met for k, v in verdicts.items() if k.startswith("apply_to_ready/")] == [
        True, True, True]
    assert verdicts["ratio_growth_600_to_6000"].value == pytest.approx(1.3 / 1.2)
    assert verdicts["ratio_growth_600_to_6000"].met
    # The ratio doubling from 600 to 6,000 pods is what the ladder exists to catch.
    growing = [_sized(600, 12.0, 10.0), _sized(6000, 240.0, 100.0)]
    verdicts = {g.label: g for g in scale.ladder_goals(growing)}
    assert not verdicts["apply_to_ready/raw_pods@6000"].met
    assert not verdicts["ratio_growth_600_to_6000"].met
    assert verdicts["ratio_growth_600_to_6000"].value == pytest.approx(2.0)


def test_the_ladder_judges_a_teardown_against_that_sizes_bare_delete(scale: Any) -> None:
    sized = _sized(600, 12.0, 10.0, teardown={"delete_to_gone_s": 3.2})
    verdicts = {g.label: g for g in scale.ladder_goals([sized])}
    assert verdicts["delete_to_gone/raw_pods@600"].value == pytest.approx(1.6)
    assert not verdicts["delete_to_gone/raw_pods@600"].met
    assert "ratio_growth_600_to_600" not in verdicts  # one size: no growth to judge


def test_a_size_without_its_baseline_is_a_miss_not_a_pass(scale: Any) -> None:
    verdicts = {g.label: g for g in scale.ladder_goals([_result(), _sized(6000, 1.0, 1.0)])}
    assert verdicts["apply_to_ready/raw_pods@600"].value is None
    assert not verdicts["apply_to_ready/raw_pods@600"].met
    assert not verdicts["ratio_growth_600_to_6000"].met


def test_the_ladder_line_gives_each_size_per_pod(scale: Any) -> None:
    r = _sized(600, 12.0, 10.0, writes_per_pod=3.5, operator_cpu_to_ready_s=6.0,
               cpu_s_to_ready_by_process={"kube-apiserver": 30.0, "operator": 6.0})
    line = scale.ladder_line([r])
    assert line.startswith("operator_ladder: 600: apply_to_ready=12.0s raw=10.0s ratio=1.20x")
    assert "cpu_per_pod=60ms operator_cpu_per_pod=10.0ms writes_per_pod=3.50" in line


@pytest.mark.parametrize("argv, error", [
    (["--sizes", "5,10"], "--sizes: only with --tenfold"),
    (["--tenfold", "--sizes", "10,5"], "increasing pipeline counts"),
    (["--tenfold", "--sizes", "a"], "pipeline counts like 50,167,500"),
    (["--tenfold", "--keep"], "drop --keep"),
    (["--tenfold", "--kubeconfig", "k"], "drop --kubeconfig"),
])
def test_a_bad_ladder_is_refused_before_anything_starts(
        scale: Any, argv: list[str], error: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["bench_operator_scale.py", *argv])
    monkeypatch.setattr(scale, "run_one", lambda _args: pytest.fail("a cluster was started"))
    with pytest.raises(SystemExit) as exc:
        scale.main()
    assert exc.value.code == 2
    assert error in capsys.readouterr().err


def test_the_api_servers_writes_are_counted_for_everyone_and_for_controllers(
        scale: Any) -> None:
    counts = bench_module("write_counts")
    before = {"POST pods": 10, "PATCH pods/status": 4, "POST omnipipelines": 0,
              "PATCH stagepools/status": 1}
    after = {"POST pods": 22, "PATCH pods/status": 40, "POST omnipipelines": 1,
             "PATCH stagepools/status": 1, "POST pods/binding": 12}
    everyone = counts.write_delta(before, after)
    assert everyone == {"PATCH pods/status": 36, "POST pods": 12, "POST pods/binding": 12,
                        "POST omnipipelines": 1}
    assert next(iter(everyone)) == "PATCH pods/status"  # largest first; unchanged ones out
    # A controller's share leaves out kwok's statuses, the scheduler's binds and the apply.
    assert counts.controller_writes(before, after) == {"POST pods": 12}


def test_the_ladder_line_gives_everyones_writes_per_pod_on_both_sides(scale: Any) -> None:
    r = _sized(600, 12.0, 10.0, writes_per_pod=3.5, operator_cpu_to_ready_s=6.0,
               apiserver_writes_total=5400)
    r["raw_baseline"]["apiserver_writes_to_ready"] = 2400
    assert "api_writes_per_pod=9.00(raw 4.00)" in scale.ladder_line([r])
    del r["apiserver_writes_total"]  # a result from before the count: said, not guessed
    assert "api_writes_per_pod=n/a(raw 4.00)" in scale.ladder_line([r])


class _TimingOutApi:
    """Answers the first `timeouts` deletes with the API server's 504, then succeeds."""

    def __init__(self, timeouts: int, status: int = 504) -> None:
        self.timeouts, self.status, self.deletes = timeouts, status, 0

    def delete(self, url: str) -> None:
        self.deletes += 1
        if self.deletes <= self.timeouts:
            raise ApiError(self.status, {"reason": "Timeout"}, "DELETE", url)


def test_the_lws_collection_delete_is_asked_again_after_a_timeout() -> None:
    lws = bench_module("lws_baseline")
    api = _TimingOutApi(timeouts=2)
    lws.delete_collection(api, "/apis/x/v1/namespaces/n/leaderworkersets", time.monotonic() + 60)
    assert api.deletes == 3
    refused = _TimingOutApi(timeouts=1, status=403)
    with pytest.raises(Exception, match="HTTP 403"):
        lws.delete_collection(refused, "/apis/x", time.monotonic() + 60)
    assert refused.deletes == 1
    late = _TimingOutApi(timeouts=5)
    with pytest.raises(Exception, match="HTTP 504"):
        lws.delete_collection(late, "/apis/x", time.monotonic() - 1)
    assert late.deletes == 1
