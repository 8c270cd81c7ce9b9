"""Kubernetes membership: the orchestrator learns its stage replicas by watching their Pods.

Why Pods and not EndpointSlices: the API server rejects loopback endpoint addresses, and the test
cluster's pods have loopback IPs. A Pod also carries everything routing needs in one object: the
IP, the Ready condition (which already folds in the operator's `omnistage.io/routable` readiness
gate), the deletionTimestamp of a terminating pod and the operator's drain annotation.

An asyncio task runs `KubeApi.list_watch` on the event loop the orchestrator already has: it
lists, then watches from the list's resourceVersion, resumes from the last resourceVersion after a
dropped connection or a restarted API server, and lists again after 410 Gone. The task keeps a
cache keyed by pod name and reports only what changed; a relist is diffed against that cache, so
replicas that vanished while the watch was down are reported gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from omnistage import kube
from omnistage.backoff import Backoff
from omnistage.kubeapi import KubeApi, KubeConfig, Listed, default_namespace, path
from omnistage.orchestrator.membership import Membership, OnChange, ReplicaInfo

if TYPE_CHECKING:
    from omnistage.spec import OmniPipeline

log = logging.getLogger(__name__)


# ---- pure parts (unit-tested with plain dicts) ----------------------------------------------


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def replica_from_pod(
    pod: Mapping[str, Any], zmq_port: int = kube.WORKER_ZMQ_PORT, *, deleted: bool = False
) -> ReplicaInfo | None:
    """What one Pod (as the API server's JSON) means for routing; None if it is not a replica yet.

    gone: deleted, or the pod finished (Succeeded/Failed) and will never serve again.
    draining: terminating (deletionTimestamp) or marked by the operator; it finishes bound work
    but takes no new requests. ready: the Ready condition is True. Anything else with an IP is
    joining. A pod without an IP cannot be reached, so it is not reported at all. The pod's
    revision label and revision-order annotation (the operator's) come along.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    stage = labels.get(kube.LABEL_STAGE)
    name = meta.get("name")
    if not stage or not name:
        return None
    ip = status.get("podIP") or ""
    endpoint = _endpoint(ip, zmq_port) if ip else ""
    revision = labels.get(kube.LABEL_REVISION) or None
    order = revision_order(pod)
    generation = curve_generation(pod)
    if deleted or status.get("phase") in ("Succeeded", "Failed"):
        return ReplicaInfo(stage, name, endpoint, "gone", revision, order, generation)
    if not ip:
        return None
    if kube.is_draining(pod):
        return ReplicaInfo(stage, name, endpoint, "draining", revision, order, generation)
    ready = kube.condition_status(pod, "Ready") == "True"
    return ReplicaInfo(stage, name, endpoint, "ready" if ready else "joining", revision, order,
                       generation)


def revision_order(pod: Mapping[str, Any]) -> int:
    """The pod's release order (annotation ANNOTATION_REVISION_ORDER, a non-negative integer);
    0 when absent or not one, so a pod of an older operator sorts as the oldest."""
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(
        kube.ANNOTATION_REVISION_ORDER)
    try:
        order = int(str(value))
    except ValueError:
        if value is not None:
            log.warning("pod %s: annotation %s=%r is not an integer; order 0",
                        (pod.get("metadata") or {}).get("name"), kube.ANNOTATION_REVISION_ORDER,
                        value)
        return 0
    return max(0, order)


_said_generation: set[tuple[str, str]] = set()  # (pod, value): a bad annotation, warned once


def curve_generation(pod: Mapping[str, Any]) -> int | None:
    """The generation of the CurveZMQ pair the pod holds (annotation
    ANNOTATION_CURVE_GENERATION, an integer >= 0); None when absent, or not one (warned once
    per pod and value): the orchestrator then names its own generation's key."""
    meta = pod.get("metadata") or {}
    value = (meta.get("annotations") or {}).get(kube.ANNOTATION_CURVE_GENERATION)
    if value is None:
        return None
    text = str(value).strip()
    if text.isascii() and text.isdigit():
        return int(text)
    said = (str(meta.get("name")), text)
    if said not in _said_generation:
        if len(_said_generation) >= 1024:  # bounded: a long-lived orchestrator sees many pods
            _said_generation.clear()
        _said_generation.add(said)
        log.warning("pod %s: annotation %s=%r is not a key generation (an integer >= 0); "
                    "connecting with our own generation's key", said[0],
                    kube.ANNOTATION_CURVE_GENERATION, value)
    return None


@dataclass(frozen=True)
class Tracked:
    """What the cache remembers per pod name: the instance (uid) and what was last reported."""

    uid: str
    info: ReplicaInfo


def _gone(info: ReplicaInfo) -> ReplicaInfo:
    return replace(info, state="gone")


def apply_pod(
    known: dict[str, Tracked], pod: Mapping[str, Any], zmq_port: int, *, deleted: bool = False
) -> list[ReplicaInfo]:
    """Fold one pod into the cache; returns the changes to report, in order.

    A new instance under a known name (a replacement pod: different uid) first reports the old
    one gone, so work bound to it fails over even if the new pod reuses the same IP.
    """
    meta = pod.get("metadata") or {}
    name = meta.get("name") or ""
    uid = meta.get("uid") or ""
    info = replica_from_pod(pod, zmq_port, deleted=deleted)
    prev = known.get(name)
    if info is None or info.state == "gone":
        if prev is None or (deleted and uid and prev.uid and uid != prev.uid):
            return []  # never reported, or the delete of an instance we no longer track
        del known[name]
        return [_gone(prev.info)]
    known[name] = Tracked(uid, info)
    if prev is None:
        return [info]
    if prev.uid != uid:
        return [_gone(prev.info), info]
    return [] if prev.info == info else [info]


def relist_changes(
    known: dict[str, Tracked], pods: Iterable[Mapping[str, Any]], zmq_port: int
) -> list[ReplicaInfo]:
    """Diff a fresh list against the cache: changed or new replicas, then gone for vanished ones."""
    changes: list[ReplicaInfo] = []
    seen: set[str] = set()
    for pod in pods:
        changes += apply_pod(known, pod, zmq_port)
        name = (pod.get("metadata") or {}).get("name")
        if name in known:
            seen.add(name)
    for name in [n for n in known if n not in seen]:
        changes.append(_gone(known.pop(name).info))
    return changes


# ---- the watcher -----------------------------------------------------------------------------


class KubernetesMembership(Membership):
    """Replicas of one pipeline's stages, from a list+watch of their Pods in one namespace."""

    def __init__(
        self,
        namespace: str | None,
        pipeline: str | OmniPipeline,
        *,
        zmq_port: int = kube.WORKER_ZMQ_PORT,
        api: KubeApi | None = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.5, 15.0),
        start_timeout: float = 30.0,
    ) -> None:
        name = pipeline if isinstance(pipeline, str) else pipeline.metadata.name
        self.namespace = namespace or default_namespace()
        self.pipeline = name
        self.selector = kube.stage_selector(name)
        self.zmq_port = zmq_port
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.start_timeout = start_timeout
        self.relists = 0  # how many lists were made (the first included)
        self._api = api
        self._own_api = api is None  # built from the environment at start: closed at stop
        self._path = path("Pod", self.namespace)
        self._known: dict[str, Tracked] = {}
        self._task: asyncio.Task[None] | None = None
        self._on_change: OnChange | None = None

    # -- Membership --

    async def start(self, on_change: OnChange) -> None:
        """List (retrying up to start_timeout), report every replica, then watch in a task."""
        self._on_change = on_change
        self._known.clear()  # a (re)start reports everything, not a diff
        if self._api is None:
            self._api = KubeApi(await asyncio.to_thread(KubeConfig.load))
        rv = await self._initial_list()
        self._task = asyncio.create_task(self._run(rv), name=f"k8s-membership-{self.pipeline}")

    async def stop(self) -> None:
        """Cancel the watch task: its stream closes now, not at the watch timeout."""
        self._on_change = None
        await self._cancel()
        if self._own_api and self._api is not None:
            await self._api.close()
            self._api = None

    # -- extras --

    @property
    def api(self) -> KubeApi | None:
        """The client (built at start when none was given); the StagePool waker shares it."""
        return self._api

    def resync(self) -> None:
        """Drop the current watch and relist, as after 410 Gone (tests; manual recovery)."""
        if self._task is None:
            return
        self._task.cancel()
        self._task = asyncio.get_running_loop().create_task(
            self._run(""), name=f"k8s-membership-{self.pipeline}")

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """The replicas currently known (not gone)."""
        return [t.info for t in self._known.values()]

    # -- the task --

    async def _cancel(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _initial_list(self) -> str:
        assert self._api is not None
        retries, deadline = Backoff(*self.backoff), time.monotonic() + self.start_timeout
        while True:
            try:
                listing = await self._api.get(self._path, labelSelector=self.selector)
                break
            except Exception as exc:  # any failure is retried, then raised
                if time.monotonic() >= deadline:
                    raise
                delay = retries.failed()
                log.warning("listing pods (%s) failed: %s; retrying in %.1fs",
                            self.selector, exc, delay)
                await asyncio.sleep(delay)
        rv = str((listing.get("metadata") or {}).get("resourceVersion") or "")
        self._listed(Listed(list(listing.get("items") or []), rv))
        return rv

    async def _run(self, rv: str) -> None:
        assert self._api is not None
        async for item in self._api.list_watch(
            self._path, resource_version=rv, timeout_seconds=self.watch_timeout,
            backoff=self.backoff, labelSelector=self.selector,
        ):
            if isinstance(item, Listed):
                self._listed(item)
            elif item.type in ("ADDED", "MODIFIED", "DELETED"):
                self._emit(apply_pod(self._known, item.object, self.zmq_port,
                                     deleted=item.type == "DELETED"))

    def _listed(self, listing: Listed) -> None:
        self.relists += 1
        changes = relist_changes(self._known, listing.items, self.zmq_port)
        log.debug("listed %d pods at rv %s: %d changes", len(listing.items),
                  listing.resource_version, len(changes))
        self._emit(changes)

    def _emit(self, changes: list[ReplicaInfo]) -> None:
        on_change = self._on_change
        if on_change is None:
            return
        for info in changes:
            log.info("replica %s of stage %s: %s (%s)", info.name, info.stage, info.state,
                     info.endpoint or "no endpoint")
            on_change(info)
