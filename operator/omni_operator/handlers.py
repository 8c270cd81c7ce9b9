"""kopf registrations: thin, they only feed the controller's view and queue."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from omni_operator.controller import WATCHED, Controller
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

    for w in WATCHED:
        labels = MANAGED if w.managed_only else None
        r = w.resource
        kopf.on.event(r.group, r.version, r.plural, labels=labels, registry=registry)(
            feed(w.kind))
