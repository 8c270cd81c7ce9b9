"""Kubernetes Events for the operator's objects, aggregated the way kubectl shows them.

An event's name is derived from what it says (object uid, type, reason, message), so a repeat is
found without a list: the first occurrence is created, each repeat patches count and
lastTimestamp on the same object, which `kubectl describe` shows as "(x5 over 3m)". A restarted
operator finds the event by name (409 on create) and goes on counting from what it stored.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from omnistage import kube
from omnistage.kubeapi import ApiError, KubeApi, namespace_terminating, path

log = logging.getLogger("omnistage.operator")
Obj = dict[str, Any]
MESSAGE_MAX = 1024
_REMEMBERED = 4096  # event names whose count is known without a read


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso(t: float) -> str:
    """Epoch seconds as an RFC 3339 time, as statuses and conditions carry it."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unix(text: str | None) -> float | None:
    """An RFC 3339 time in epoch seconds; None for none or one that does not parse."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (AttributeError, ValueError):
        return None


def event_name(obj: Obj, etype: str, reason: str, message: str) -> str:
    """Deterministic: the same thing said about the same object is the same Event."""
    meta = obj["metadata"]
    key = "\0".join((meta.get("uid") or meta["name"], etype, reason, message))
    return f"{meta['name']}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class EventRecorder:
    """Records events through the operator's one client; every call is one write."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self._counts: OrderedDict[str, int] = OrderedDict()

    def _remember(self, name: str, count: int) -> None:
        self._counts[name] = count
        self._counts.move_to_end(name)
        while len(self._counts) > _REMEMBERED:
            self._counts.popitem(last=False)

    async def record(self, obj: Obj, etype: str, reason: str, message: str) -> None:
        """Create the event, or count one more occurrence of it. Failures are logged only:
        an event is never worth a retry loop."""
        message = message[:MESSAGE_MAX]
        meta = obj["metadata"]
        ns = meta["namespace"]
        name = event_name(obj, etype, reason, message)
        try:
            count = self._counts.get(name)
            if count is None:
                count = await self._create(obj, name, etype, reason, message)
            else:
                count = await self._repeat(obj, name, etype, reason, message, count + 1)
            self._remember(name, count)
        except ApiError as exc:
            if namespace_terminating(exc):  # nothing can be written there any more
                log.debug("event %s on %s/%s dropped: its namespace is terminating", reason, ns,
                          meta["name"])
                return
            log.warning("event %s on %s/%s not recorded: %s", reason, ns, meta["name"], exc)

    async def _create(self, obj: Obj, name: str, etype: str, reason: str, message: str) -> int:
        meta = obj["metadata"]
        ts = now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj["apiVersion"],
                "kind": obj["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": etype,
            "reason": reason,
            "message": message,
            "source": {"component": kube.MANAGED_BY},
            "reportingComponent": kube.MANAGED_BY,
            "reportingInstance": kube.MANAGED_BY,
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }
        created = await self.api.create(path("Event", meta["namespace"]), body, ignore=(409,))
        if created is not None:
            return 1
        # Recorded before a restart: read its count once, then count on from memory.
        current = await self.api.get(path("Event", meta["namespace"], name), ignore=(404,))
        if current is None:  # expired in between
            await self.api.create(path("Event", meta["namespace"]), body)
            return 1
        return await self._repeat(obj, name, etype, reason, message,
                                  int(current.get("count") or 1) + 1)

    async def _repeat(self, obj: Obj, name: str, etype: str, reason: str, message: str,
                      count: int) -> int:
        ns = obj["metadata"]["namespace"]
        patched = await self.api.patch(
            path("Event", ns, name), {"count": count, "lastTimestamp": now_iso()}, ignore=(404,)
        )
        if patched is None:  # the event expired (--event-ttl): start a new series
            self._counts.pop(name, None)
            return await self._create(obj, name, etype, reason, message)
        return count


