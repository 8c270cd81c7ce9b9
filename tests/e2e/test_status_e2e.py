"""Status transitions of a real pipeline through a scale, a rollout, a scale-down and a delete.

Pods really run (echo workers and the orchestrator, under the local pod runner). A watch records
every version of the OmniPipeline and its StagePools, and the recording is checked against the
status rules (docs/crds.md):
- Progressing during a rollout or a scale while the pipeline still serves; Ready stays True
  while every stage is at or above its minimum;
- Terminating while it is deleted, never "Ready" again;
- a pool's READY never reads more ready than desired;
- intended deletions (retirement, scale-down) raise no Warning ReplicaLost;
- `kubectl describe omnipipe` shows a pipeline-level summary of what happened.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner
from tests.harness.operator import Operator, apply, get, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(600)
NAME = "life"


@dataclass
class Snapshot:
    kind: str
    name: str
    generation: int
    deleting: bool
    status: dict[str, Any]

    def condition(self, ctype: str) -> dict[str, Any]:
        return k.condition({"status": self.status}, ctype) or {}


@dataclass
class Recorder:
    """Every version of the namespace's OmniPipelines and StagePools, in watch order."""

    kube: Cluster
    namespace: str
    seen: list[Snapshot] = field(default_factory=list)
    deleted: set[tuple[str, str]] = field(default_factory=set)  # (kind, name) of DELETED events
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for plural in ("omnipipelines", "stagepools"):
            thread = threading.Thread(target=self._watch, args=(plural,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _watch(self, plural: str) -> None:
        url = f"/apis/omnistage.io/v1alpha1/namespaces/{self.namespace}/{plural}"
        with contextlib.suppress(Exception):  # the stream may end abruptly once we stop
            for etype, obj in self.kube.kube.watch(url, self.stop, timeout_seconds=600):
                if etype not in ("ADDED", "MODIFIED", "DELETED"):
                    continue  # bookmarks carry no object
                meta = obj["metadata"]
                self.seen.append(Snapshot(obj["kind"], meta["name"], meta.get("generation", 0),
                                          bool(meta.get("deletionTimestamp")),
                                          dict(obj.get("status") or {})))
                if etype == "DELETED":
                    self.deleted.add((obj["kind"], meta["name"]))

    def mark(self) -> int:
        return len(self.seen)

    def pipeline(self, since: int = 0) -> list[Snapshot]:
        return [s for s in self.seen[since:] if s.kind == "OmniPipeline" and s.name == NAME]

    def pools(self, since: int = 0) -> list[Snapshot]:
        return [s for s in self.seen[since:] if s.kind == "StagePool"]

    def close(self) -> None:
        self.stop.set()


def _stage(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": "echo", "replicas": 1, "maxUnavailable": 1,
            "drainTimeoutSeconds": 5, "resources": {"cpu": "100m", "memory": "128Mi"}, **extra}


def _doc(a_replicas: int, delay_ms: int = 0) -> dict[str, Any]:
    return pipeline_doc(NAME, [
        _stage("a", replicas=a_replicas, engine={"echoDelayMs": delay_ms}),
        _stage("b", inputs=["a"], finalOutput=True),
    ], orchestrator={"api": ["generic"], "resources": {"cpu": "100m", "memory": "128Mi"}})


def _settled(kube: Cluster, ns: str, a_ready: int) -> dict[str, Any] | None:
    obj = get(kube, ns, "omnipipe", NAME)
    st = (obj or {}).get("status") or {}
    if (obj and st.get("phase") == "Ready"
            and st.get("observedGeneration") == obj["metadata"]["generation"]
            and {k: st["stages"]["a"].get(k) for k in ("pool", "ready", "desired")}
            == {"pool": f"{NAME}-a", "ready": a_ready, "desired": a_ready}):
        return obj
    return None


def _served_throughout(rec: Recorder, since: int, what: str) -> list[str]:
    """Ready stayed True; the phases seen (Progressing at least once) were Ready/Progressing."""
    snaps = rec.pipeline(since)
    assert snaps, f"no status recorded during the {what}"
    not_ready = [(s.status.get("phase"), s.condition("Ready")) for s in snaps
                 if s.condition("Ready").get("status") != "True"]
    assert not not_ready, f"Ready went False during the {what}: {not_ready}"
    phases = [s.status.get("phase") for s in snaps]
    assert set(phases) <= {"Ready", "Progressing"}, phases
    assert "Progressing" in phases, f"the {what} was never reported as Progressing: {phases}"
    return phases


def _pool_ready_never_above_desired(rec: Recorder, since: int = 0) -> None:
    for snap in rec.pools(since):
        ready = snap.status.get("ready")
        if ready:
            have, want = (int(n) for n in ready.split("/"))
            assert have <= want, f"{snap.name} READY {ready}"


def _events(kube: Cluster, ns: str) -> list[dict[str, Any]]:
    return list(json.loads(kube.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"])


def test_status_tells_the_truth_through_scale_rollout_and_delete(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    rec = Recorder(kube, namespace)
    rec.start()
    try:
        _run(kube, namespace, operator, rec)
    finally:
        rec.close()


def _run(kube: Cluster, ns: str, operator: Operator, rec: Recorder) -> None:
    def diag() -> str:
        return f"{json.dumps(get(kube, ns, 'omnipipe', NAME), indent=1)}\n{operator.log_tail(30)}"

    apply(kube, ns, _doc(1))
    wait_for(lambda: _settled(kube, ns, 1), 300, "Ready", diag, interval=0.5)
    created = rec.pipeline()
    assert created[0].status.get("phase") in (None, "Pending")
    assert "Degraded" not in {s.status.get("phase") for s in created}

    # Scale a 1 -> 2 through the pipeline: it keeps serving, so Ready stays True.
    mark = rec.mark()
    apply(kube, ns, _doc(2))
    wait_for(lambda: _settled(kube, ns, 2), 300, "scaled to 2", diag, interval=0.5)
    _served_throughout(rec, mark, "scale-up")

    # Roll a's two replicas to a new spec, one at a time (maxUnavailable 1 of 2).
    mark = rec.mark()
    apply(kube, ns, _doc(2, delay_ms=1))
    wait_for(lambda: _settled(kube, ns, 2) and (get(kube, ns, "sp", f"{NAME}-a") or {}).get(
        "status", {}).get("updatedReplicas") == 2, 300, "rolled out", diag, interval=0.5)
    _served_throughout(rec, mark, "rollout")

    # Scale a down with kubectl scale: READY never shows more than desired.
    mark = rec.mark()
    kube.kubectl("scale", "-n", ns, f"sp/{NAME}-a", "--replicas=1")
    wait_for(lambda: _settled(kube, ns, 1), 300, "scaled to 1", diag, interval=0.5)
    _served_throughout(rec, mark, "scale-down")
    _pool_ready_never_above_desired(rec)

    # The story so far, where the user looks.
    described = kube.kubectl("describe", "omnipipe", "-n", ns, NAME).stdout
    events = described[described.index("Events:"):]
    for reason in ("Created", "Scaled", "Progressing", "Ready"):
        assert reason in events, described
    lost = [e for e in _events(kube, ns) if e.get("reason") == "ReplicaLost"]
    assert not lost, f"intended deletions raised ReplicaLost: {lost}"

    # Delete: Terminating until it is gone, never Ready again.
    mark = rec.mark()
    kube.kubectl("delete", "omnipipe", "-n", ns, NAME, "--wait=false")
    wait_for(lambda: get(kube, ns, "omnipipe", NAME) is None, 180, "deleted", diag)
    # The watch delivers the deletion last: every version before it is recorded.
    wait_for(lambda: ("OmniPipeline", NAME) in rec.deleted, 60, "the watched deletion", diag)
    deleting = [s for s in rec.pipeline(mark) if s.deleting]
    written = [s for s in deleting if s.status.get("phase") == "Terminating"]
    assert written, [s.status.get("phase") for s in deleting]
    after = deleting[deleting.index(written[0]):]
    assert all(s.status.get("phase") == "Terminating" for s in after), [
        s.status.get("phase") for s in after]
    assert all(s.condition("Ready").get("status") == "False" for s in after)
    assert "being deleted" in written[-1].condition("Ready")["message"]
    assert not [e for e in _events(kube, ns) if e.get("reason") == "ReplicaLost"]
