"""Orchestrator shutdown refuses nothing: `omnistage orchestrator` rolled while a second instance
serves, and `omnistage serve` stopped, each under bounded keep-alive load on loopback with every
request counted (tests/harness/load.py).

These run local processes only (no cluster): the stage workers are `omnistage stage`, the
orchestrators `omnistage orchestrator --membership static`, and a Service's endpoints are
emulated by polling each orchestrator's /readyz (`Endpoints`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage.procs import WorkerProcess, spawn_worker
from omnistage.spec import load_pipeline
from tests.harness.load import Endpoints, Load, Result, longest_gap, ready, summary
from tests.harness.local import Proc, free_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/v1/pipelines/echo/requests"
BODY = {"prompt": "hello"}
DELAY = 2.0  # the shutdown delay: 20 endpoint polls, room for a busy machine


def echo_pipeline(tmp_path: Path, delay_ms: int = 100) -> Path:
    """examples/echo.yaml with work in stage b, so requests are in flight at any moment."""
    doc = yaml.safe_load((ROOT / "examples" / "echo.yaml").read_text())
    doc["spec"]["stages"][1]["engine"]["echoDelayMs"] = delay_ms
    path = tmp_path / "echo.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.kill()


def _after(results: list[Result], t: float) -> list[Result]:
    return [r for r in results if r.sent >= t]


def _report(name: str, results: list[Result], **extra: Any) -> dict[str, Any]:
    figures = {**summary(results), "longest_gap_s": round(longest_gap(results), 3), **extra}
    print(f"\n[{name}] {figures}")
    return figures


def _wait_unready(url: str, timeout: float = 10.0) -> float:
    """Poll /readyz until it fails; returns when that was seen (time.monotonic())."""
    deadline = time.monotonic() + timeout
    while ready(url):
        assert time.monotonic() < deadline, f"{url} still ready"
        time.sleep(0.02)
    return time.monotonic()


def test_orchestrator_rollout_with_a_second_instance_refuses_nothing(
        tmp_path: Path, procs: list[Proc], workers: list[WorkerProcess]) -> None:
    """Roll two orchestrators one after the other (SIGTERM, start again), as a surge rollout
    does, under load through emulated endpoints: nothing refused, failed or reset."""
    file = echo_pipeline(tmp_path)
    pipe = load_pipeline(file)
    replicas = []
    for stage in pipe.spec.stages:
        w = spawn_worker(f"echo-{stage.name}-0", stage, log_dir=tmp_path)
        workers.append(w)
        w.wait_ready(120)
        replicas += ["--replica", f"{stage.name}=echo-{stage.name}-0@{w.zmq}"]
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]

    def orchestrator(i: int, generation: int) -> Proc:
        p = Proc(["orchestrator", "--pipeline-file", str(file), "--membership", "static",
                  "--port", str(ports[i]), "--admin-port", str(free_port()),
                  "--shutdown-delay", str(DELAY), *replicas],
                 tmp_path / f"orchestrator-{i}-{generation}.log")
        procs.append(p)
        p.wait_for(r"pipeline echo ready at")
        return p

    current = [orchestrator(0, 0), orchestrator(1, 0)]
    with Endpoints(lambda: urls) as endpoints, Load(endpoints.pick, ROUTE, BODY) as load:
        load.wait_for(20)
        closing: list[tuple[float, float]] = []  # per instance: unready seen .. exited
        for i in (0, 1):
            old = current[i]
            old.proc.send_signal(signal.SIGTERM)
            unready = _wait_unready(urls[i])
            assert old.proc.wait(60) == 0, old.output
            closing.append((unready, time.monotonic()))
            current[i] = orchestrator(i, 1)  # the replacement, at the same address
            # As a rollout does: the next old instance goes once the new one is in endpoints.
            deadline = time.monotonic() + 30
            while urls[i] not in endpoints.ready:
                assert time.monotonic() < deadline, "the replacement never became ready"
                time.sleep(0.05)
            before = load.count()
            load.wait_for(before + 20)
        results = load.snapshot()
    figures = _report("orchestrator rollout", results)
    assert figures["refused"] == figures["failed"] == figures["reset"] == 0, \
        [r for r in results if r.kind not in ("ok",)][:5]
    assert figures["hung"] == figures["unreachable"] == figures["unavailable"] == 0, figures
    # Every response an old instance sent once it was unready asked the client to reconnect.
    for i, (unready, exited) in enumerate(closing):
        late = [r for r in results if r.target == urls[i] and unready <= r.sent < exited]
        assert all(r.connection_close for r in late), late[:3]
    for p in procs[:2]:
        out = p.output
        assert out.index("/readyz fails now") < out.index("stopped admitting") < \
            out.index("HTTP listener closed")


def test_serve_shutdown_under_keepalive_load(tmp_path: Path, procs: list[Proc]) -> None:
    """`omnistage serve` stops with no resets for keep-alive clients: what it admitted is
    answered, what it refuses is a 503 with Connection: close, and after the listener closed a
    connection is refused outright (nothing sent)."""
    file = echo_pipeline(tmp_path, delay_ms=200)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = Proc(["serve", str(file), "--port", str(port), "--admin-port", str(free_port()),
                  "--log-dir", str(tmp_path / "logs"),
                  "--shutdown-delay", "1"], tmp_path / "serve.log")
    procs.append(serve)
    serve.wait_for(r"pipeline echo ready at")
    with Load(lambda: url, ROUTE, BODY, clients=6) as load:
        load.wait_for(20)
        serve.proc.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()
        unready = _wait_unready(url)
        assert serve.proc.wait(60) == 0, serve.output
        exited = time.monotonic()
        load.wait_for(6, "unreachable", timeout=10)  # clients meet the closed listener
    results = load.snapshot()
    figures = _report("serve shutdown", results, exit_s=round(exited - sigterm, 3))
    assert figures["reset"] == figures["failed"] == figures["hung"] == 0, (
        [(r, r.sent - sigterm) for r in results if r.kind in ("reset", "failed", "hung")][:5],
        unready - sigterm, exited - sigterm, serve.output)
    # Requests in flight at SIGTERM were answered; during the 1 s delay it still admitted.
    in_flight = [r for r in results if r.sent < sigterm < r.sent + r.seconds]
    assert in_flight and all(r.kind == "ok" for r in in_flight), in_flight[:3]
    delayed = [r for r in _after(results, unready) if r.sent < unready + 0.5]
    assert any(r.kind == "ok" for r in delayed), delayed[:5]
    for r in _after(results, unready):
        if r.kind in ("ok", "refused"):
            assert r.connection_close, r
        if r.kind == "refused":
            assert (r.status, r.code) == (503, "shutting_down"), r
    out = serve.output
    assert out.index("/readyz fails now") < out.index("stopped admitting") < \
        out.index("HTTP listener closed") < out.index("stopping stage replicas")
