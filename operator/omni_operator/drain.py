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
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
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


def work_left(state: Any) -> int:
    """The requests a replica still has to answer, from its /state (protocol.WorkerState).

    `in_flight` counts every admitted request not yet answered, queued ones included; `queued`
    is the part of them not dispatched yet, so adding it would count those twice. A field the
    replica does not report counts as zero. ValueError when the state cannot be read."""
    if not isinstance(state, dict):
        raise ValueError(f"worker state is not an object: {state!r}")
    return int(state.get("in_flight", 0))


def _inflight(url: str) -> int | None:
    """Work left on the replica (work_left); None when it cannot be asked."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            state = json.loads(resp.read())
        return work_left(state)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0  # nothing listens: nothing can be in flight
        return None
    except (OSError, TypeError, ValueError):
        return None


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
    left = await asyncio.to_thread(_inflight, f"http://{ip}:{kube.WORKER_HTTP_PORT}/state")
    if left == 0:
        return Progress(True)
    since_text = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_DRAINING_SINCE)
    timeout = Stage.model_validate(pool["spec"]["stage"]).drain_timeout_seconds
    if since_text:
        since = dt.datetime.strptime(since_text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        if (_now() - since).total_seconds() >= timeout:
            return Progress(True, timed_out=True, cut=left)
    return Progress(False)
