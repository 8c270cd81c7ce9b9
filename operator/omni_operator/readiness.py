"""The readiness gate: the operator, not the kubelet, decides when a replica is routable.

A replica is routable when its containers are ready and it is neither draining nor terminating.
Pod Ready (which the orchestrator's membership reads) is True only when the gate is True too.
"""

from __future__ import annotations

from typing import Any

from omnistage import kube
from omnistage.kube import condition_status, is_draining

Obj = dict[str, Any]


def is_ready(pod: Obj) -> bool:
    """Serving and routable: Pod Ready (gate included) and not retiring."""
    return condition_status(pod, "Ready") == "True" and not is_draining(pod)


def gate_wanted(pod: Obj) -> bool:
    return condition_status(pod, "ContainersReady") == "True" and not is_draining(pod)


def gate_patch(pod: Obj, now: str) -> Obj | None:
    """The pods/status strategic-merge patch that sets the gate, or None if it is right."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None  # terminating: routing already stops on the deletion mark
    want = "True" if gate_wanted(pod) else "False"
    if condition_status(pod, kube.READINESS_GATE) == want:
        return None
    if want == "False" and condition_status(pod, kube.READINESS_GATE) is None and not (
        pod.get("status", {}).get("podIP")
    ):
        return None  # not running yet: nothing to say until it is
    reason = "Routable" if want == "True" else ("Draining" if is_draining(pod) else "NotReady")
    return {
        "status": {
            "conditions": [
                {"type": kube.READINESS_GATE, "status": want, "reason": reason,
                 "lastTransitionTime": now}
            ]
        }
    }
