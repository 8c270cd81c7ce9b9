"""The autoscaler on the REAL control plane: a fake orchestrator load drives a pool 1 -> 3 -> 1.

The operator runs as a real process with its load hook (omni_operator.autoscaler.LOAD_URL_ENV)
pointed at a tiny HTTP server on loopback that serves GET /v1/load with figures the test sets:
reaching a real orchestrator's load needs its pod, which the decision and the writes under test
do not. What is real: the API server, the CRDs (the spec's CEL rules), the scale subresource,
the pool's reconcile (pods created, and removed on scale-down), the status and the Events.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from omni_operator.autoscaler import FIELD_MANAGER, LOAD_URL_ENV
from omnistage import kube as k
from omnistage.kubeapi import resource_path
from tests.harness.cluster import Cluster, pods
from tests.harness.operator import Operator, apply, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(300)
NAME = "auto"


class FakeLoad:
    """Serves /<namespace>/<pipeline>/v1/load from `figures`; counts the reads."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.reads = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.reads += 1
                body = json.dumps({"window_s": 60.0, "now": 0.0,
                                   "stages": {"a": outer.figures}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{{namespace}}/{{pipeline}}" \
                   "/v1/load"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, arrivals_per_s: float, service_s: float = 1.0) -> None:
        self.figures = {"replicas": 1, "inflight": round(arrivals_per_s * service_s), "held": 0,
                        "arrivals_per_s": arrivals_per_s, "service_s": service_s,
                        "queue_wait_p95_s": 0.0, "ttfo_p95_s": 0.0, "last_request_unix": None,
                        "wake_pending": False}


@pytest.fixture(scope="module")
def load() -> Iterator[FakeLoad]:
    fake = FakeLoad()
    yield fake
    fake.server.shutdown()


@pytest.fixture(scope="module")
def operator(kube: Cluster, crds: None, load: FakeLoad,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """This module's own operator, its load read from the fake."""
    op = Operator(kube, tmp_path_factory.mktemp("operator") / "operator.log", webhook=False,
                  env={LOAD_URL_ENV: load.url})
    op.start()
    yield op
    op.stop()


def _pool(kube: Cluster, namespace: str) -> dict[str, Any]:
    """The pool as the API returns it (managedFields included)."""
    return kube.kube.get(resource_path(k.API_VERSION, "stagepools", namespace, f"{NAME}-a"),
                         ignore=(404,)) or {}


def _replicas(kube: Cluster, namespace: str) -> tuple[int | None, int]:
    """(spec.replicas, live pods) of the pool."""
    live = [p for p in pods(kube.kube, namespace, k.stage_selector(NAME))
            if not p["metadata"].get("deletionTimestamp")]
    return _pool(kube, namespace).get("spec", {}).get("replicas"), len(live)


def _events(kube: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    items = kube.kube.get(resource_path("v1", "events", namespace))["items"]
    return [e for e in items if e.get("reason") == reason]


def test_a_pool_follows_its_load_1_3_1(kube: Cluster, namespace: str, operator: Operator,
                                       load: FakeLoad) -> None:
    load.set(arrivals_per_s=0.5)
    stage = {"name": "a", "kind": "echo", "finalOutput": True,
             "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "periodSeconds": 1,
                             "coolDownSeconds": 0}}
    apply(kube, namespace, pipeline_doc(NAME, [stage]))
    wait_for(lambda: _pool(kube, namespace).get("status", {}).get("autoscaler"), 60,
             "the autoscaler's first decision", operator.log_tail)
    assert _replicas(kube, namespace)[0] == 1

    load.set(arrivals_per_s=3.0)  # Little's law: 3/s x 1 s / 1 per replica = 3
    wait_for(lambda: _replicas(kube, namespace) == (3, 3), 60, "3 replicas", operator.log_tail)
    pool = _pool(kube, namespace)
    scaler = pool["status"]["autoscaler"]
    assert scaler["decision"] == "scale up 1 -> 3" and scaler["lastDirection"] == "Up"
    assert scaler["inputs"]["arrivalsPerSecond"] == 3.0
    assert any(m["manager"] == FIELD_MANAGER and m.get("subresource") == "scale"
               for m in pool["metadata"]["managedFields"])
    cond = next(c for c in pool["status"]["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("True", "Active")

    # Steady: periods pass, the load is read, nothing is written.
    start, reads = operator.log_offset(), load.reads
    wait_for(lambda: load.reads >= reads + 3, 30, "3 more periods")
    assert [w for w in operator.write_lines(start) if "/scale" in w] == []
    [up] = _events(kube, namespace, "Autoscaled")
    assert up["message"].startswith("scale up 1 -> 3") and up.get("count", 1) == 1

    columns = kube.kubectl("get", "-n", namespace, "sp", f"{NAME}-a").stdout.splitlines()
    assert columns[0].split()[:8] == ["NAME", "PIPELINE", "STAGE", "DESIRED", "CURRENT",
                                      "READY", "DRAINING", "AUTOSCALER"]
    assert "scale up 1 -> 3" in columns[1]

    load.set(arrivals_per_s=0.5)
    wait_for(lambda: _replicas(kube, namespace) == (1, 1), 90, "back to 1 replica",
             operator.log_tail)
    assert sorted(e["message"].split(":")[0] for e in _events(kube, namespace, "Autoscaled")) \
        == ["scale down 3 -> 1", "scale up 1 -> 3"]
    assert _pool(kube, namespace)["status"]["autoscaler"]["lastDirection"] == "Down"


def test_the_crd_refuses_what_the_validator_refuses(kube: Cluster, namespace: str,
                                                    operator: Operator) -> None:
    """The CEL rules (the webhook is off here) carry the cross-field checks, at the same paths."""
    stage = {"name": "a", "kind": "echo", "finalOutput": True, "replicas": 5,
             "autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": {}}}
    doc = pipeline_doc("bad", [stage])
    proc = kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0
    for path, text in (("spec.stages[0].autoscaling.minReplicas",
                        "minReplicas must be at most maxReplicas (got 3 > 2)"),
                       ("spec.stages[0].autoscaling.target", "set exactly one of"),
                       ("spec.stages[0].replicas",
                        "must be within [minReplicas, maxReplicas] (got 5, bounds [3, 2])")):
        assert path in proc.stderr and text in proc.stderr, proc.stderr
