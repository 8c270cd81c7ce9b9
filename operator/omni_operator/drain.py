"""Drain-style replica retirement.

1. Mark the replica draining (annotation): the readiness gate turns False and the orchestrator's
   membership stops routing new work to it.
2. Wait until its in-flight work reaches zero (its /state), or its drain timeout passes.
3. Delete it; the worker drains again on SIGTERM within terminationGracePeriodSeconds.

A drain that times out with work still in flight is reported (a Warning event with the count);
the worker cuts what is left when its own SIGTERM drain times out, so each cut request gets a
terminal `drain_timeout` error (HTTP 503), never a client-style abort.

A revision retires when no request is left on it, not only when its last replica is idle
(issue 22, docs/architecture.md "Revisions"): the LAST live replica of a leaving revision in a
pool (one of another revision than the pool's target, in a release or a revert) is deleted only
once no request pinned to that revision is in flight at any running orchestrator, since such a
request still upstream would find no replica of its revision at this stage (the orchestrator
sends it to a draining one of its revision when nothing routable of it is left). Step 2 then
also waits for GET /v1/load's `revisions[stage][revision].pinned` to be 0 everywhere; an
orchestrator that cannot be read means wait, and the drain timeout bounds this wait too.
`pinned_revision` decides whether a replica waits (pure); the controller reads the loads.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omni_operator import builders, release
from omnistage import kube
from omnistage.kubeapi import KubeApi, path
from omnistage.revision import base_revision
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


def pinned_revision(pod: Obj, pods: Iterable[Obj], target: str,
                    stage: str) -> tuple[str, str] | None:
    """The (stage, revision) whose pinned requests must finish before the draining `pod` may
    be deleted, or None when only its own work counts: a replica of the pool's target
    revision (scale-down, `kubectl drain`, `omnistage drain --retire`), one without a
    revision, or one with another live replica of its revision in the pool that is not
    retiring (the requests pinned to it still have somewhere to go)."""
    revision = release.pod_revision(pod)
    if revision is None or revision == target:
        return None
    name = pod["metadata"]["name"]
    for other in pods:
        if (other["metadata"]["name"] != name and release.pod_revision(other) == revision
                and not kube.is_draining(other)):
            return None
    return stage, revision


def pinned_in_flight(loads: Iterable[Any], stage: str, revision: str) -> int | None:
    """Requests in flight pinned to `revision` at `stage`, summed over GET /v1/load documents
    (one per running orchestrator): `revisions[stage][revision].pinned`, 0 where the stage,
    the revision or the field is absent (an orchestrator older than the field); None when a
    document says something else (not an object, a count that is not a whole number >= 0)."""
    total = 0
    for doc in loads:
        if not isinstance(doc, dict):
            return None
        # The label's revision, and each refinement of it by a resolved hub commit
        # (revision.worker_revision: what the orchestrator pins by).
        stage_revs = (doc.get("revisions") or {}).get(stage) or {}
        if not isinstance(stage_revs, dict):
            return None
        for key, entry in stage_revs.items():
            if base_revision(str(key)) != revision:
                continue
            if not isinstance(entry, dict):
                return None
            count = entry.get("pinned", 0)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                return None
            total += count
    return total


#: Reads the pinned count a retirement waits on (pinned_in_flight over every orchestrator);
#: None: it could not be read.
PinnedRead = Callable[[], Awaitable[int | None]]


@dataclass(frozen=True)
class Progress:
    """Where a retirement stands: done (delete the pod now); timed_out with `cut` requests
    still in flight (None: the replica could not be asked) and `pinned` requests pinned to its
    revision still in flight elsewhere (None: an orchestrator could not be read)."""

    done: bool
    timed_out: bool = False
    cut: int | None = None
    pinned: int | None = 0


async def finished(pod: Obj, pool: Obj, pinned: PinnedRead | None = None) -> Progress:
    """Whether the draining `pod` may go: its own work is 0 and, when `pinned` is given (the
    last replica of a leaving revision, pinned_revision), so is the count it reads; or the
    drain timeout passed. A replica that does not run serves nothing: it goes at once."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return Progress(True)
    left = await asyncio.to_thread(kube.read_work_left, kube.worker_state_url(ip), 2.0)
    pins: int | None = 0
    if left == 0:
        if pinned is None:
            return Progress(True)
        pins = await pinned()
        if pins == 0:
            return Progress(True)
    since_text = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_DRAINING_SINCE)
    timeout = Stage.model_validate(pool["spec"]["stage"]).drain_timeout_seconds
    if since_text:
        since = dt.datetime.strptime(since_text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        if (_now() - since).total_seconds() >= timeout:
            if left != 0 and pinned is not None:
                pins = await pinned()  # for the report: the pinned requests it cuts off
            return Progress(True, timed_out=True, cut=left, pinned=pins)
    return Progress(False)


def timeout_message(name: str, progress: Progress, pins: tuple[str, str] | None) -> str:
    """The DrainTimeout event: what the timed-out retirement cuts, and, when it was the last
    replica of a leaving revision (pins, from pinned_revision), the requests pinned to it."""
    def count(n: int | None) -> str:
        return "an unknown number of" if n is None else str(n)

    pinned = "" if pins is None else (
        f"; {count(progress.pinned)} request(s) pinned to its revision {pins[1]} still in "
        "flight in the pipeline (it is the last replica of that revision)")
    return (f"{name}: drain timed out with {count(progress.cut)} request(s) in flight{pinned}; "
            "stopping it: what is still running after its SIGTERM drain is cut (each gets a "
            "terminal drain_timeout error)")
