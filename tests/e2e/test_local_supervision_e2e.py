"""`kill -9` of a replica under `omnistage serve`, under bounded loopback load: it comes back
under the same name, the stage returns to full capacity, and a crash loop shows in /readyz,
/metrics and the log. Local processes only (no cluster)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import yaml

from tests.harness.load import Load, longest_gap, summary
from tests.harness.local import ROOT, Proc, alive, free_port
from tests.harness.metrics import sample

pytestmark = pytest.mark.timeout(300)

ROUTE = "/v1/pipelines/echo/requests"
T = TypeVar("T")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Proc]:
    doc = yaml.safe_load((ROOT / "examples" / "echo.yaml").read_text())
    doc["spec"]["stages"][0]["replicas"] = 2
    doc["spec"]["stages"][0]["engine"]["echoDelayMs"] = 100  # requests in flight in stage a
    file = tmp_path / "echo.yaml"
    file.write_text(yaml.safe_dump(doc))
    proc = Proc(["serve", str(file), "--port", str(free_port()), "--admin-port",
                 str(free_port()), "--log-dir", str(tmp_path / "logs")], tmp_path / "serve.log")
    try:
        yield proc
    finally:
        pids = _pids(tmp_path / "logs")
        proc.stop()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pids(log_dir: Path) -> dict[str, int]:
    return {f.name.removesuffix(".ports.json"): json.loads(f.read_text())["pid"]
            for f in log_dir.glob("*.ports.json")}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _poll(what: str, check: Callable[[], T], timeout: float = 60.0) -> T:
    """Wait until check() returns something truthy, and return it."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def test_kill_9_of_a_replica_under_serve(serve: Proc, tmp_path: Path) -> None:
    url = serve.wait_for(r"pipeline echo ready at (\S+)").group(1)
    admin = serve.wait_for(r"admin listener at (\S+)").group(1)
    logs = tmp_path / "logs"
    victim = "echo-a-1"
    with Load(lambda: url, ROUTE, {"prompt": "x"}, clients=4) as load:
        load.wait_for(20)
        old_pid = _pids(logs)[victim]
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        # Meanwhile the pipeline stays ready on echo-a-0, and /readyz says what is missing.
        status, reason = _poll("the restart in /readyz",
                               lambda: (r := _get(url + "/readyz"))[1].startswith(
                                   f"ready; replica {victim} restarting") and r)
        assert status == 200, reason
        serve.wait_for(rf"replica {victim} is back \(restart 1")
        back = time.monotonic()
        new_pid = _pids(logs)[victim]
        assert new_pid != old_pid
        ports = json.loads((logs / f"{victim}.ports.json").read_text())
        # Full capacity again: the orchestrator routes to both replicas of stage a.
        _poll("the restarted replica to take work", lambda: (sample(
            _get(ports["http"] + "/metrics")[1], "omnistage_worker_admitted_total") or 0) > 0)
        before = load.count()
        load.wait_for(before + 20)
        metrics = _get(admin + "/metrics")[1]
        assert sample(metrics, "omnistage_orchestrator_replicas", stage="a", state="ready") == 2
        assert sample(metrics, "omnistage_runtime_replica_restarts_total", replica=victim) == 1
        assert _get(url + "/readyz") == (200, "ready")
        results = load.snapshot()
    figures = {**summary(results), "longest_gap_s": round(longest_gap(results), 3),
               "back_after_s": round(back - killed, 3)}
    print(f"\n[kill -9 of a replica under serve] {figures}")
    # What the design makes unavoidable: requests in flight on the killed replica, each failed
    # at once with replica_lost. Nothing hangs, nothing is refused or reset.
    failed = [r for r in results if r.kind == "failed"]
    assert all(r.code == "replica_lost" for r in failed), failed[:3]
    # Far inside the stage's 60 s default deadline a lost request would otherwise wait out
    # (a far guard; tests/integration/test_orchestrator.py pins the socket monitor's speed).
    assert all(r.sent + r.seconds - killed < 30 for r in failed), failed[:3]
    assert figures["refused"] == figures["reset"] == figures["hung"] == 0, figures
    assert figures["unreachable"] == 0, figures


def test_a_crash_loop_shows_and_serve_leaves_no_process(serve: Proc, tmp_path: Path) -> None:
    url = serve.wait_for(r"pipeline echo ready at (\S+)").group(1)
    admin = serve.wait_for(r"admin listener at (\S+)").group(1)
    logs = tmp_path / "logs"
    victim = "echo-a-1"
    for restart in (1, 2):
        os.kill(_pids(logs)[victim], signal.SIGKILL)
        if restart == 2:  # crashed again right after its restart: a crash loop, backing off
            status, reason = _poll("the crash loop in /readyz", lambda: (
                r := _get(url + "/readyz"))[1].startswith(f"ready; replica {victim} crash-"
                                                          "looping") and r)
            assert status == 200 and "2 crash(es) in a row" in reason, reason
            metrics = _get(admin + "/metrics")[1]
            assert sample(metrics, "omnistage_runtime_replica_crash_looping",
                          replica=victim) == 1
            assert sample(metrics, "omnistage_runtime_replica_up", replica=victim) == 0
            assert "restarting in 2.0s; crash-looping (2 crashes in a row)" in serve.output
        serve.wait_for(rf"replica {victim} is back \(restart {restart}")
    pids = _pids(logs)
    assert len(pids) == 3 and all(alive(pid) for pid in pids.values())
    serve.proc.kill()  # kill -9 of serve itself: the restarted replica dies with it too
    serve.proc.wait()
    _poll("every worker gone", lambda: not any(alive(pid) for pid in pids.values()), 10)
