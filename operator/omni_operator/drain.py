"""Drain-style replica retirement.

1. Mark the replica draining (annotation): the readiness gate turns False and the orchestrator's
   membership stops routing new work to it.
2. Wait until its in-flight work reaches zero (its /state), or its drain timeout passes.
3. Delete it; the worker drains again on SIGTERM within terminationGracePeriodSeconds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import urllib.error
import urllib.request
from typing import Any

from omnistage import kube
from omnistage.kubeapi import KubeApi, path
from omnistage.spec import Stage

Obj = dict[str, Any]
ANNOTATION_DRAINING_SINCE = "omnistage.io/draining-since"
POLL_SECONDS = 1.0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def begin(api: KubeApi, pod: Obj) -> None:
    meta = pod["metadata"]
    await api.patch(path("Pod", meta["namespace"], meta["name"]), {
        "metadata": {"annotations": {
            kube.ANNOTATION_DRAINING: "true",
            ANNOTATION_DRAINING_SINCE: _now().strftime("%Y-%m-%dT%H:%M:%SZ"),
        }}
    }, ignore=(404,))


def _inflight(url: str) -> int | None:
    """In-flight plus queued work on the replica; None when it cannot be asked."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            state = json.loads(resp.read())
        return int(state.get("in_flight", 0)) + int(state.get("queued", 0))
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0  # nothing listens: nothing can be in flight
        return None
    except (OSError, ValueError):
        return None


async def finished(pod: Obj, pool: Obj) -> bool:
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return True
    since_text = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_DRAINING_SINCE)
    timeout = Stage.model_validate(pool["spec"]["stage"]).drain_timeout_seconds
    if since_text:
        since = dt.datetime.strptime(since_text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        if (_now() - since).total_seconds() >= timeout:
            return True
    left = await asyncio.to_thread(_inflight, f"http://{ip}:{kube.WORKER_HTTP_PORT}/state")
    return left == 0
