"""Collectors read live state at scrape time, and each component keeps its own registry."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from omni_operator.main import OperatorCollector
from omnistage.metrics import HttpMetrics, exposition
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.membership import StaticMembership
from omnistage.spec import Stage, parse_pipeline
from omnistage.worker.config import WorkerConfig
from omnistage.worker.server import StageWorker
from tests.harness.metrics import sample, samples


def _text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def _pipeline(name: str) -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]},
    })


def test_worker_metrics_and_readiness_follow_the_worker_between_scrapes() -> None:
    w = StageWorker(WorkerConfig(Stage(name="enc", kind="echo"), replica_id="enc-0"))
    ids = {"stage": "enc", "replica": "enc-0"}
    before = _text(w.registry)
    assert sample(before, "omnistage_worker_ready", **ids) == 0
    assert sample(before, "omnistage_worker_admission_units_in_use", **ids) == 0
    assert sample(before, "omnistage_worker_replies_total", **ids) is None  # no reply yet
    assert w.readiness() == (False, "loading")

    w.loaded = True
    permit = w.admission.try_admit(3)
    assert permit is not None
    after = _text(w.registry)
    assert sample(after, "omnistage_worker_ready", **ids) == 1
    assert sample(after, "omnistage_worker_admission_units_in_use", **ids) == 3
    assert w.readiness() == (True, "ready")
    permit.release()
    assert sample(_text(w.registry), "omnistage_worker_admission_units_in_use", **ids) == 0

    w.draining = True
    assert sample(_text(w.registry), "omnistage_worker_ready", **ids) == 0
    assert w.readiness() == (False, "draining")
    w.loaded, w.draining, w.load_error = False, False, "no such model"
    assert w.readiness() == (False, "load failed: no such model")
    w.scheduler.close()


def test_each_worker_and_orchestrator_reports_only_itself() -> None:
    """Several components in one process: no shared (default) registry, no duplicate errors."""
    workers = [StageWorker(WorkerConfig(Stage(name="s", kind="echo"), replica_id=f"s-{i}"))
               for i in range(2)]
    orchs = [Orchestrator(_pipeline(name), StaticMembership()) for name in ("p1", "p2")]
    for i, w in enumerate(workers):
        replicas = {dict(labels).get("replica") for _, labels in samples(_text(w.registry))}
        assert replicas == {f"s-{i}"}
        w.scheduler.close()
    for o, name in zip(orchs, ("p1", "p2"), strict=True):
        pipelines = {dict(labels).get("pipeline") for _, labels in samples(_text(o.registry))}
        assert pipelines == {name}
        assert sample(_text(o.registry), "omnistage_orchestrator_inflight_requests") == 0


def test_orchestrator_counts_outcomes_by_status_with_latency() -> None:
    orch = Orchestrator(_pipeline("p"), StaticMembership())
    assert sample(_text(orch.registry), "omnistage_orchestrator_request_seconds_count") == 0
    orch.outcomes["ok"] = 2  # what the engine's finish path records
    orch.counters["latency_sum"] += 0.5
    text = _text(orch.registry)
    assert sample(text, "omnistage_orchestrator_requests_total", status="ok") == 2
    assert sample(text, "omnistage_orchestrator_request_seconds_count") == 2
    assert sample(text, "omnistage_orchestrator_request_seconds_sum") == 0.5


def test_operator_collector_keeps_the_names_the_bench_parses() -> None:
    api = SimpleNamespace(writes=0, writes_by_verb={})
    controller = SimpleNamespace(api=api, reconciles=0)
    registry = CollectorRegistry()
    registry.register(OperatorCollector(controller))  # type: ignore[arg-type]
    assert sample(_text(registry), "omnistage_operator_api_writes_total") == 0
    api.writes, api.writes_by_verb, controller.reconciles = 3, {"PATCH": 2, "POST": 1}, 7
    text = _text(registry)
    # bench/bench_operator_scale.py splits each sample line at its last space.
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(lines["omnistage_operator_api_writes_total"]) == 3
    assert float(lines['omnistage_operator_api_writes_by_verb_total{verb="PATCH"}']) == 2
    assert float(lines['omnistage_operator_api_writes_by_verb_total{verb="POST"}']) == 1
    assert float(lines["omnistage_operator_reconciles_total"]) == 7


def test_http_metrics_count_by_route_method_and_status() -> None:
    registry = CollectorRegistry()
    m = HttpMetrics(registry)
    m.observe("/v1/chat/completions", "POST", 200, 0.2)
    m.observe("/v1/chat/completions", "POST", 200, 40.0)
    m.observe("/v1/chat/completions", "POST", 400, 0.001)
    m.inflight.inc()
    m.disconnects.inc()
    text = _text(registry)
    route = {"route": "/v1/chat/completions"}
    assert sample(text, "omnistage_http_requests_total", method="POST", status="200", **route) == 2
    assert sample(text, "omnistage_http_requests_total", method="POST", status="400", **route) == 1
    assert sample(text, "omnistage_http_request_duration_seconds_count", **route) == 3
    # A 40 s stream still lands in a finite bucket: the buckets reach five minutes.
    assert sample(text, "omnistage_http_request_duration_seconds_bucket", le="60.0",
                  **route) == 3
    assert sample(text, "omnistage_http_request_duration_seconds_bucket", le="30.0",
                  **route) == 2
    assert sample(text, "omnistage_http_inflight_requests") == 1
    assert sample(text, "omnistage_http_client_disconnects_total") == 1
    with pytest.raises(ValueError, match="Duplicated"):
        HttpMetrics(registry)  # one HttpMetrics per registry


def test_exposition_negotiates_openmetrics() -> None:
    registry = CollectorRegistry()
    HttpMetrics(registry).observe("/x", "GET", 200, 0.01)
    text, plain = exposition(registry)
    assert plain.startswith("text/plain")
    assert sample(text.decode(), "omnistage_http_requests_total", route="/x") == 1
    body, open_metrics = exposition(registry, "application/openmetrics-text; version=1.0.0")
    assert open_metrics.startswith("application/openmetrics-text")
    assert body.decode().endswith("# EOF\n")
