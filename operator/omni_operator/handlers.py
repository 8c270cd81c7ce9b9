"""kopf registrations: thin, they only feed the controller's view and queue."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from omni_operator.controller import Controller
from omnistage import kube

log = logging.getLogger("omnistage.operator")
MANAGED = {kube.LABEL_MANAGED_BY: kube.MANAGED_BY}


def register(registry: kopf.OperatorRegistry, controller: Controller) -> None:
    def feed(kind: str) -> Any:
        async def handler(event: dict[str, Any], **_: Any) -> None:
            obj = event.get("object")
            if isinstance(obj, dict) and obj.get("metadata"):
                controller.observe(kind, event.get("type"), obj)

        handler.__name__ = f"observe_{kind.lower()}"
        return handler

    kopf.on.event("omnistage.io", "v1alpha1", "omnipipelines", registry=registry)(
        feed("OmniPipeline"))
    kopf.on.event("omnistage.io", "v1alpha1", "stagepools", registry=registry)(
        feed("StagePool"))
    kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry)(feed("Pod"))
    kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry)(
        feed("Deployment"))
    for group, version, plural, kind in (
        ("", "v1", "configmaps", "ConfigMap"),
        ("", "v1", "serviceaccounts", "ServiceAccount"),
        ("", "v1", "services", "Service"),
        ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
        ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
        ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    ):
        kopf.on.event(group, version, plural, labels=MANAGED, registry=registry)(feed(kind))
