"""What every object the operator builds carries: its name, labels and owner reference.

A module of its own so that each builder module (omni_operator.builders,
omni_operator.network_policy) labels and owns its objects the same way without importing the
other: builders.pipeline_children includes the network policies, and the policies select pods
by the labels the builders put on them.
"""

from __future__ import annotations

from typing import Any

from omnistage import kube

Obj = dict[str, Any]


def owner_ref(owner: Obj) -> Obj:
    """A controller reference, so garbage collection removes children with their owner."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(pipeline: str, component: str, stage: str | None = None) -> dict[str, str]:
    """The labels of a pipeline's object: its pipeline, its component ("stage" or
    "orchestrator"), the operator's managed-by (the view watches only those), and for a stage's
    objects the stage and its pool."""
    out = {
        kube.LABEL_PIPELINE: pipeline,
        kube.LABEL_COMPONENT: component,
        kube.LABEL_MANAGED_BY: kube.MANAGED_BY,
    }
    if stage is not None:
        out[kube.LABEL_STAGE] = stage
        out[kube.LABEL_POOL] = kube.pool_name(pipeline, stage)
    return out


def orchestrator_name(pipeline: str) -> str:
    """The name of a pipeline's orchestrator Deployment, Service, ServiceAccount and Role."""
    return f"{pipeline}-orchestrator"


def component_selector(pipeline: str, component: str) -> dict[str, str]:
    """The matchLabels of a pipeline's pods of one component: what the orchestrator Deployment
    selects its pods by, and what the network policies select and admit (kube.stage_selector is
    the same for stage pods)."""
    return {kube.LABEL_PIPELINE: pipeline, kube.LABEL_COMPONENT: component}


def object_meta(name: str, namespace: str, lbls: dict[str, str], owner: Obj) -> Obj:
    """metadata of a child of `owner`: name, namespace, labels and the controller reference."""
    return {"name": name, "namespace": namespace, "labels": lbls,
            "ownerReferences": [owner_ref(owner)]}
