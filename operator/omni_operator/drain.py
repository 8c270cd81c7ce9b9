"""Drain-style replica retirement.

1. Mark the replica draining (annotation): the readiness gate turns False and the orchestrator's
   membership stops routing new work to it.
2. Wait until its in-flight work reaches zero (its /state), or its drain timeout passes.
3. Delete it; the worker drains again on SIGTERM within terminationGracePeriodSeconds.

A drain that times out with work still in flight is reported (a Warning event with the count);
the worker cuts what is left when its own SIGTERM drain times out, so each cut request gets a
terminal `drain_timeout` error (HTTP 503), never a client-style abort.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass
from typing import Any

from omni_operator import builders
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
    }, ignore=(404,), fieldManager=builders.FIELD_MANAGER)


@dataclass(frozen=True)
class Progress:
    """Where a retirement stands: done (delete the pod now); timed_out with `cut` requests
    still in flight (None: the replica could not be asked)."""

    done: bool
    timed_out: bool = False
    cut: int | None = None


async def finished(pod: Obj, pool: Obj) -> Progress:
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return Progress(True)
    left = await asyncio.to_thread(kube.read_work_left, kube.worker_state_url(ip), 2.0)
    if left == 0:
        return Progress(True)
    since_text = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_DRAINING_SINCE)
    timeout = Stage.model_validate(pool["spec"]["stage"]).drain_timeout_seconds
    if since_text:
        since = dt.datetime.strptime(since_text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        if (_now() - since).total_seconds() >= timeout:
            return Progress(True, timed_out=True, cut=left)
    return Progress(False)
