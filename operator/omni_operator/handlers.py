"""kopf registrations: thin, they only feed the controller's view and queue."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import kopf

from omni_operator.controller import LIST_PAGE, WATCHED, Controller
from omnistage import kube

log = logging.getLogger("omnistage.operator")
MANAGED = {kube.LABEL_MANAGED_BY: kube.MANAGED_BY}


def register(registry: kopf.OperatorRegistry, controller: Controller) -> None:
    def feed(kind: str) -> Any:
        async def handler(event: dict[str, Any], **_: Any) -> None:
            obj = event.get("object")
            if isinstance(obj, dict) and obj.get("metadata"):
                controller.watched(kind, event.get("type"), obj)

        handler.__name__ = f"observe_{kind.lower()}"
        return handler

    for w in WATCHED:
        labels = MANAGED if w.managed_only else None
        r = w.resource
        kopf.on.event(r.group, r.version, r.plural, labels=labels, registry=registry)(
            feed(w.kind))


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base, for an operator with event handlers only: none.

    kopf builds one on every event (a deep copy of the whole object, then of what is left
    after the progress fields go) to diff against for change handlers and daemons. The operator
    registers neither (see `register`), so nothing ever reads it, and those copies were the
    largest part of kopf's CPU per event in the profiled ramp (docs/benchmarks.md)."""

    def build(self, *, body: kopf.Body,
              extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


#: Seconds kopf keeps an object's worker after its last event. Each idle worker still holds
#: that event's whole object (a local variable across its wait), so kopf's default of 5 s kept
#: every object listed by a restarted operator alive at once: its peak memory. The handlers
#: only feed the object view (`ObjectView.observe`), so a new worker per later event costs little.
KOPF_IDLE_TIMEOUT = 0.5


def at_fleet_size(settings: kopf.OperatorSettings) -> None:
    """kopf's settings whose cost grows with the fleet: no diff base (NoDiffBase), its first
    lists in pages of LIST_PAGE like the controller's own (one answer with every pod was a
    restarted operator's peak memory), and short-lived per-object workers (KOPF_IDLE_TIMEOUT).
    No `queueing.worker_limit`: kopf queues the workers over the limit with their events, so a
    limit holds more objects, not fewer."""
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.chunk_size = LIST_PAGE
    kopf_queueing(settings).idle_timeout = KOPF_IDLE_TIMEOUT


def kopf_queueing(settings: kopf.OperatorSettings) -> Any:
    """kopf's per-object worker settings: `queueing` since kopf 1.38, `batching` before (the
    floor in pyproject.toml is 1.37)."""
    return getattr(settings, "queueing", None) or settings.batching
