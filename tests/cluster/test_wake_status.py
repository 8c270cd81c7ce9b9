"""A wake from zero on the REAL control plane is not a degradation (issue 37, defect 8).

A stage that the autoscaler took to zero serves through the hold and the wake, so its pipeline
is Ready while it sleeps; when a load wakes it 0 -> 3, the replicas it starts are a wake, not a
loss: the pipeline's Ready condition never leaves True (its lastTransitionTime stays), no Warning
is raised, and the pool says Waking meanwhile. The operator runs as a real process with its load
read from a fake (tests/cluster/test_autoscaler.py); the pods run on the kwok nodes.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest

from omni_operator.autoscaler import LOAD_URL_ENV
from omnistage import kube as k
from omnistage.kubeapi import resource_path
from tests.cluster.test_autoscaler import FakeLoad
from tests.cluster.test_operator import KWOK
from tests.harness.cluster import Cluster, pods
from tests.harness.operator import Operator, apply, get, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(300)
NAME = "sleepy"


def _ready(obj: dict[str, Any] | None) -> dict[str, Any]:
    return k.condition(obj or {}, "Ready") or {}


def test_a_wake_from_zero_keeps_the_pipeline_ready(kube: Cluster, crds: None, namespace: str,
                                                   tmp_path: Path) -> None:
    load = FakeLoad()
    load.set(arrivals_per_s=0.0)
    op = Operator(kube, tmp_path / "operator.log", webhook=False, env={LOAD_URL_ENV: load.url})
    op.start()
    stop = threading.Event()
    try:
        stage = {"name": "a", "kind": "echo", "finalOutput": True, "placement": KWOK,
                 "resources": {"cpu": "100m", "memory": "64Mi"},
                 "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "periodSeconds": 1,
                                 "idleSeconds": 1, "coolDownSeconds": 0}}
        apply(kube, namespace, pipeline_doc(NAME, [stage], orchestrator=dict(KWOK)))

        def pool() -> dict[str, Any]:
            return get(kube, namespace, "sp", f"{NAME}-a") or {}

        wait_for(lambda: ((p := pool()).get("spec", {}).get("replicas") == 0
                          and _ready(p).get("reason") == "IdleAtZero"
                          and not pods(kube.kube, namespace, k.stage_selector(NAME))),
                 120, "the pool asleep at zero", op.log_tail)
        asleep = wait_for(lambda: (p := get(kube, namespace, "omnipipe", NAME))
                          and _ready(p).get("status") == "True"
                          and p["status"].get("stages", {}).get("a", {}).get("desired") == 0
                          and p, 60, "the pipeline Ready with its stage asleep", op.log_tail)
        since = _ready(asleep)["lastTransitionTime"]

        # Every status the pipeline and the pool are given from here on.
        seen: list[tuple[str, str, str, str]] = []  # (kind, Ready status, reason, message)

        def watch(plural: str, kind: str) -> None:
            url = resource_path(k.API_VERSION, plural, namespace)
            with contextlib.suppress(Exception):  # the stream may end abruptly once we stop
                for item in kube.kube.list_watch(url, stop, timeout_seconds=120):
                    objs = getattr(item, "items", None) or [getattr(item, "object", {})]
                    for obj in objs:
                        cond = _ready(obj)
                        seen.append((kind, str(cond.get("status")), str(cond.get("reason")),
                                     str(cond.get("message"))))

        watchers = [threading.Thread(target=watch, args=args, daemon=True)
                    for args in (("omnipipelines", "pipeline"), ("stagepools", "pool"))]
        for w in watchers:
            w.start()
        wait_for(lambda: {s[0] for s in seen} == {"pipeline", "pool"}, 30, "both watches")

        load.set(arrivals_per_s=3.0)  # Little's law: 3 replicas, woken from zero at once
        wait_for(lambda: (p := pool()).get("spec", {}).get("replicas") == 3
                 and p.get("status", {}).get("readyReplicas") == 3
                 and _ready(p).get("reason") == "AllReplicasReady",
                 120, "the pool woken to 3 ready replicas", op.log_tail)
        woken = wait_for(lambda: (p := get(kube, namespace, "omnipipe", NAME))
                         and p["status"].get("stages", {}).get("a", {}).get("ready") == 3
                         and p, 60, "the pipeline to see 3 ready", op.log_tail)
        stop.set()

        # The pipeline never left Ready: no status said otherwise, the condition never moved.
        assert not [s for s in seen if s[0] == "pipeline" and s[1] != "True"], seen
        # The pool said it was waking (from its first status after the scale: 0 ready).
        assert any(s[:3] == ("pool", "False", "Waking") for s in seen), seen
        ready = _ready(woken)
        assert ready["status"] == "True" and ready["lastTransitionTime"] == since, ready
        assert woken["status"]["phase"] in ("Ready", "Progressing")
        warnings = [e for e in kube.kube.get(resource_path("v1", "events", namespace))["items"]
                    if e.get("type") == "Warning"
                    and e.get("involvedObject", {}).get("kind") == "OmniPipeline"]
        assert warnings == [], warnings
    finally:
        stop.set()
        op.stop()
        load.close()
