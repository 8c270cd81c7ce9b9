"""Placement: a stage's hints become pod scheduling fields; scheduler verdicts become status.

Pure functions only: spec in, Kubernetes fields out.
"""

from __future__ import annotations

from typing import Any

from omnistage import kube
from omnistage.spec import Stage, Toleration

HOSTNAME = "kubernetes.io/hostname"


def tolerations(items: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in items]


def pod_scheduling(pipeline: str, stage: Stage) -> dict[str, Any]:
    """nodeSelector, tolerations, affinity and topology spread for one stage's pods."""
    out: dict[str, Any] = {}
    pl = stage.placement
    if pl.node_selector:
        out["nodeSelector"] = dict(sorted(pl.node_selector.items()))
    if pl.tolerations:
        out["tolerations"] = tolerations(pl.tolerations)
    if pl.colocate_with:
        # Preferred, not required: a full node must not make the whole stage unschedulable.
        out["affinity"] = {
            "podAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": HOSTNAME,
                            "labelSelector": {
                                "matchLabels": {
                                    kube.LABEL_PIPELINE: pipeline,
                                    kube.LABEL_STAGE: other,
                                }
                            },
                        },
                    }
                    for other in pl.colocate_with
                ]
            }
        }
    if pl.spread_across_nodes:
        out["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": HOSTNAME,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {
                    "matchLabels": {kube.LABEL_PIPELINE: pipeline, kube.LABEL_STAGE: stage.name}
                },
            }
        ]
    return out


def unschedulable_message(pod: dict[str, Any]) -> str | None:
    """The scheduler's message when it could not place the pod, else None."""
    cond = kube.condition(pod, "PodScheduled") or {}
    if cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
        return str(cond.get("message") or "pod is unschedulable")
    return None
