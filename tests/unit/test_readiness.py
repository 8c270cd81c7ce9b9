"""The readiness gate's rules, case by case (pure functions; tests/unit/test_drain.py and the
cluster suites drive them through drains and the real API server)."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator.readiness import gate_patch, gate_wanted, is_draining, is_ready
from omnistage import kube

NOW = "2026-01-01T00:00:00Z"


def pod(*, containers: str | None = "True", ready: str | None = "True",
        gate: str | None = None, draining: bool = False, deleting: bool = False,
        ip: str | None = "127.0.0.5") -> dict[str, Any]:
    conds = [{"type": t, "status": s} for t, s in (
        ("ContainersReady", containers), ("Ready", ready), (kube.READINESS_GATE, gate))
        if s is not None]
    meta: dict[str, Any] = {"name": "p-a-0", "annotations": {}}
    if draining:
        meta["annotations"][kube.ANNOTATION_DRAINING] = "true"
    if deleting:
        meta["deletionTimestamp"] = NOW
    status: dict[str, Any] = {"conditions": conds}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_draining_means_the_annotation_is_true_or_the_pod_is_terminating() -> None:
    """Kills: any annotation value counting as draining, and a terminating pod as routable."""
    assert not is_draining(pod())
    assert is_draining(pod(draining=True))
    assert is_draining(pod(deleting=True))
    other = pod()
    other["metadata"]["annotations"][kube.ANNOTATION_DRAINING] = "false"
    assert not is_draining(other)
    assert not is_draining({})  # no metadata at all is not a crash


def test_ready_needs_pod_ready_and_no_retirement() -> None:
    """Kills: `is_ready` reading ContainersReady (which ignores the gate) instead of Ready, and
    forgetting the draining check."""
    assert is_ready(pod())
    assert not is_ready(pod(ready="False"))
    assert is_ready(pod(containers="False"))  # Pod Ready decides, not ContainersReady
    assert not is_ready(pod(draining=True))
    assert not is_ready(pod(deleting=True))


def test_gate_wanted_follows_containers_not_pod_ready() -> None:
    """Kills: the gate waiting on Pod Ready (which waits on the gate: it would never open)."""
    assert gate_wanted(pod(ready="False", containers="True"))
    assert not gate_wanted(pod(containers="False"))
    assert not gate_wanted(pod(draining=True))


@pytest.mark.parametrize(("kw", "want", "reason"), [
    ({"gate": None}, "True", "Routable"),
    ({"gate": "False"}, "True", "Routable"),
    ({"gate": "True", "draining": True}, "False", "Draining"),
    ({"gate": "True", "containers": "False"}, "False", "NotReady"),
])
def test_gate_patch_sets_the_condition_with_its_reason(kw: dict[str, Any], want: str,
                                                       reason: str) -> None:
    """Kills: a wrong status, a swapped reason, or a patch without the transition time."""
    patch = gate_patch(pod(**kw), NOW)
    assert patch == {"status": {"conditions": [{
        "type": kube.READINESS_GATE, "status": want, "reason": reason,
        "lastTransitionTime": NOW}]}}


def test_gate_patch_writes_nothing_when_nothing_changes() -> None:
    """Kills: rewriting a gate that is already right (a write on every resync)."""
    assert gate_patch(pod(gate="True"), NOW) is None
    assert gate_patch(pod(gate="False", containers="False"), NOW) is None
    assert gate_patch(pod(gate="False", draining=True), NOW) is None


def test_gate_patch_says_nothing_before_the_pod_runs_or_once_it_terminates() -> None:
    """Kills: a False gate written for a pod that has no IP yet (a write per pod at creation),
    and a patch for a terminating pod (routing already stops on the deletion mark)."""
    assert gate_patch(pod(containers="False", ip=None), NOW) is None
    # Once it has an IP, a not-ready replica gets an explicit False.
    assert gate_patch(pod(containers="False"), NOW) is not None
    # With a gate already set, a change is written even without an IP.
    assert gate_patch(pod(gate="True", containers="False", ip=None), NOW) is not None
    assert gate_patch(pod(gate="True", deleting=True), NOW) is None
    assert gate_patch(pod(gate="False", deleting=True), NOW) is None
