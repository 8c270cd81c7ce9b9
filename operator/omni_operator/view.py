"""The operator's view: an in-memory copy of the objects it watches, and the indexes over it.

kopf event handlers feed `ObjectView.watched`; every change is told to the view's owner
(`ViewOwner.seen`), then the keys it calls a reconcile for are enqueued through the owner, so
the view itself holds no reconcile state and knows nothing of the work queue.

The view is primed by a list before kopf watches. An object deleted in between never gets a
DELETED event, so the view checks itself: entries no watch event has confirmed are listed
again at a resync (gone: dropped), and any write or read that answers 404 drops the entry it
was about (`forget`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from omni_operator import builders
from omnistage import kube
from omnistage.kubeapi import RESOURCES, ApiError, Fields, KubeApi, Resource, project

log = logging.getLogger("omnistage.operator")

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace, name)


@dataclass(frozen=True)
class Watched:
    """A kind the operator keeps a view of: kopf watches it, prime() lists it."""

    kind: str
    managed_only: bool  # only objects carrying our managed-by label

    @property
    def resource(self) -> Resource:
        """Where it lives in the REST API (group, version, plural): the client's table."""
        return RESOURCES[self.kind]


WATCHED = (
    Watched("OmniPipeline", False),
    Watched("StagePool", False),
    Watched("Deployment", True),
    Watched("Pod", True),
    Watched("ConfigMap", True),
    Watched("ServiceAccount", True),
    Watched("Service", True),
    Watched("Role", True),
    Watched("RoleBinding", True),
    Watched("PodDisruptionBudget", True),
    # Watched with --no-network-policy too: the chart grants list/watch either way, and a
    # policy deleted by hand while the setting is on is recreated at its DELETED event.
    Watched("NetworkPolicy", True),
)
# Owned children kept only as a view to diff against (the rest have reconcilers of their own).
CHILD_KINDS = tuple(
    w.kind for w in WATCHED if w.kind not in ("OmniPipeline", "StagePool", "Deployment", "Pod")
)
#: Objects per page when the view is primed (see ObjectView._pages).
LIST_PAGE = 500

_CONTAINER_VIEW: Fields = {"name": True, "ready": True, "state": True, "lastState": True}
#: What the controller reads of a Pod (readiness gate, drain, retirement, pool status, model
#: failures, events): its spec and managedFields, most of its size, are not kept.
POD_VIEW: Fields = {
    "apiVersion": True,
    "kind": True,
    "metadata": {k: True for k in ("name", "namespace", "uid", "resourceVersion", "labels",
                                   "annotations", "deletionTimestamp")},
    "status": {"phase": True, "podIP": True, "conditions": True,
               "containerStatuses": _CONTAINER_VIEW, "initContainerStatuses": _CONTAINER_VIEW},
}
#: The managedFields the controller asks `writes.owners` about, per kind; other kinds' are
#: dropped (the rest of those objects is kept: `ensure` compares an intent with every field it
#: sets).
OWNED_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "StagePool": (("spec", "replicas"),),
    "OmniPipeline": (("metadata", "finalizers"),),
}


def _fields_at(fields: Any, paths: tuple[tuple[str, ...], ...]) -> Obj:
    """A fieldsV1 tree cut down to the subtrees at `paths` (field names)."""
    out: Obj = {}
    for p in paths:
        node, keys = fields, [f"f:{f}" for f in p]
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        at = out
        for key in keys[:-1]:
            at = at.setdefault(key, {})
        at[keys[-1]] = node
    return out


def viewed(kind: str, obj: Obj) -> Obj:
    """The part of a watched object the view keeps: a Pod's POD_VIEW; of the other kinds
    everything but the managedFields `owners` is never asked about (an entry that owns none
    of OWNED_FIELDS goes, so does the rest of one that does). The input is not changed."""
    if kind == "Pod":
        return project(obj, POD_VIEW)  # type: ignore[no-any-return]
    meta = obj.get("metadata") or {}
    if "managedFields" not in meta:
        return obj
    kept = []
    for entry in meta["managedFields"] or []:
        fields = _fields_at(entry.get("fieldsV1") or {}, OWNED_FIELDS.get(kind, ()))
        if fields:
            kept.append({**{k: v for k, v in entry.items() if k != "fieldsV1"},
                         "fieldsV1": fields})
    meta = {k: v for k, v in meta.items() if k != "managedFields"}
    if kept:
        meta["managedFields"] = kept
    return {**obj, "metadata": meta}


def meta_key(obj: Obj) -> tuple[str, str]:
    """(namespace, name) of an object."""
    return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


class Scheduler(Protocol):
    """Where reconciles are asked for: the work queue, through its owner (so one place decides
    what an enqueue does)."""

    def enqueue(self, key: Key) -> None: ...

    def enqueue_later(self, key: Key, delay: float) -> None: ...


class ViewOwner(Scheduler, Protocol):
    """What the view tells about each change: the object as kept, and the reconciles due."""

    def seen(self, kind: str, obj: Obj, gone: bool) -> None:
        """An object the view keeps came, changed or went (told before its keys are enqueued)."""


def _store(table: dict[tuple[str, str], Obj], key: tuple[str, str], obj: Obj,
           gone: bool) -> None:
    if gone:
        table.pop(key, None)
    else:
        table[key] = obj


class ObjectView:
    """The watched objects by kind, with the indexes reconciles look them up by."""

    def __init__(self, api: KubeApi, owner: ViewOwner) -> None:
        self.api = api
        self.owner = owner
        self.pipelines: dict[tuple[str, str], Obj] = {}
        self.pools: dict[tuple[str, str], Obj] = {}
        self.deployments: dict[tuple[str, str], Obj] = {}
        # Other owned children (ConfigMap, Service, RBAC, PDB, NetworkPolicy), so resyncs
        # read no API.
        self.children: dict[tuple[str, str, str], Obj] = {}
        self.pods: dict[tuple[str, str], dict[str, Obj]] = {}  # (ns, pool or orch) -> pods
        # Indexes kept by observe, so no reconcile scans every object of a kind (at fleet size
        # a scan per reconcile made the work grow with the square of the fleet):
        self._pools_of: dict[tuple[str, str], set[str]] = {}  # (ns, pipeline) -> pool names
        self._pod_group: dict[tuple[str, str], str] = {}  # (ns, pod) -> its key in self.pods
        self._unconfirmed: set[Key] = set()  # primed objects no watch event has confirmed
        # Kinds kopf is listing again (see _listed_again) -> the (ns, name) that listing has
        # delivered so far: one delivered twice before a watch event came is the next listing.
        self._listed: dict[str, set[tuple[str, str]]] = {}

    # ---- intake ----------------------------------------------------------------------------

    def watched(self, kind: str, event_type: str | None, obj: Obj) -> None:
        """One event of kopf's watch of `kind` (type None: an object of its listing)."""
        if event_type is not None:
            self._listed.pop(kind, None)  # kopf watches a kind once its listing is over
        else:
            key = (kind, *meta_key(obj))
            if key[1:] in self._listed.get(kind, ()):
                # Delivered twice with no watch event between: kopf lists again, its watch
                # lost its place before any event came (a quiet fleet, a slow listing). What
                # was deleted since the last listing is in neither.
                del self._listed[kind]
            if (kind not in self._listed and key not in self._unconfirmed
                    and self.get(*key) is not None):
                self._listed_again(kind)
            if kind in self._listed:
                self._listed[kind].add(key[1:])
        self.observe(kind, event_type, obj)

    def observe(self, kind: str, event_type: str | None, obj: Obj, *, primed: bool = False) -> None:
        """Take one object in (or out, DELETED), tell the owner, and enqueue what it affects."""
        obj = viewed(kind, obj)  # what the controller reads of it, not the whole object
        key = meta_key(obj)
        gone = event_type == "DELETED"
        if primed:
            self._unconfirmed.add((kind, *key))
        else:
            self._unconfirmed.discard((kind, *key))
        if kind == "Pod":
            self._observe_pod(obj, gone)
            return
        wakes: list[Key] = []
        if kind == "OmniPipeline":
            _store(self.pipelines, key, obj, gone)
            wakes.append(("OmniPipeline", *key))
        elif kind == "StagePool":
            self._index_pool(key, self.pools.get(key), None if gone else obj)
            _store(self.pools, key, obj, gone)
            wakes.append(("StagePool", *key))
            pipeline = (obj.get("spec") or {}).get("pipeline")
            if pipeline:
                wakes.append(("OmniPipeline", key[0], pipeline))
        elif kind == "Deployment":
            _store(self.deployments, key, obj, gone)
            pipeline = (obj["metadata"].get("labels") or {}).get(kube.LABEL_PIPELINE)
            if pipeline:
                wakes.append(("OmniPipeline", key[0], pipeline))
        elif kind in CHILD_KINDS:
            if gone:
                self.children.pop((kind, *key), None)
            else:
                self.children[(kind, *key)] = obj
            lbls = obj["metadata"].get("labels") or {}
            if gone and lbls.get(kube.LABEL_POOL) and kind == "PodDisruptionBudget":
                wakes.append(("StagePool", key[0], lbls[kube.LABEL_POOL]))
            elif gone and lbls.get(kube.LABEL_PIPELINE):
                wakes.append(("OmniPipeline", key[0], lbls[kube.LABEL_PIPELINE]))
        self.owner.seen(kind, obj, gone)
        for wake in wakes:
            self.owner.enqueue(wake)

    def _observe_pod(self, pod: Obj, gone: bool) -> None:
        """A pod is kept under its pool (or its pipeline's orchestrator); one of neither is not
        ours to track."""
        meta = pod["metadata"]
        lbls = meta.get("labels") or {}
        ns = meta["namespace"]
        group = lbls.get(kube.LABEL_POOL) or (
            builders.orchestrator_name(lbls.get(kube.LABEL_PIPELINE, ""))
            if lbls.get(kube.LABEL_COMPONENT) == "orchestrator"
            else None
        )
        if not group:
            return
        if gone:
            pods = self.pods.get((ns, group), {})
            pods.pop(meta["name"], None)
            if not pods:  # a pool or pipeline gone leaves no empty entry behind
                self.pods.pop((ns, group), None)
            self._pod_group.pop((ns, meta["name"]), None)
        else:
            self.pods.setdefault((ns, group), {})[meta["name"]] = pod
            self._pod_group[(ns, meta["name"])] = group
        self.owner.seen("Pod", pod, gone)
        if lbls.get(kube.LABEL_POOL):
            self.owner.enqueue(("StagePool", ns, group))
            pipeline = self.pipelines.get((ns, lbls.get(kube.LABEL_PIPELINE, "")))
            if gone and (ns, group) not in self.pods and pipeline is not None and (
                    pipeline["metadata"].get("deletionTimestamp")):
                # The pool's last pod went: its deleting pipeline's shutdown goes on.
                self.owner.enqueue(("OmniPipeline", ns, pipeline["metadata"]["name"]))
        else:
            self.owner.enqueue(("OmniPipeline", ns, lbls.get(kube.LABEL_PIPELINE, "")))

    def _listed_again(self, kind: str) -> None:
        """kopf lists a kind again when its watch lost its place (410 Gone: the API server's
        event window moved past it, which a busy fleet's pods do in seconds), and an object
        deleted in between gets no DELETED event: the view kept such pods for good, and the
        pipelines waiting for them to go never shut down. A listed event (type None) for an
        object the view has, outside a priming, is that listing: every object of the kind
        awaits confirmation again. The listing confirms those that exist; the next resync's
        `confirm_primed` lists the kind and forgets the rest."""
        self._listed[kind] = set()
        keys = self._keys(kind)
        log.info("%s listed again by the watch (it lost its place): checking %d in the view "
                 "at the next resync", kind, len(keys))
        self._unconfirmed.update((kind, ns, name) for ns, name in keys)

    def _keys(self, kind: str) -> list[tuple[str, str]]:
        """(namespace, name) of every object of `kind` in the view."""
        if kind == "OmniPipeline":
            return list(self.pipelines)
        if kind == "StagePool":
            return list(self.pools)
        if kind == "Deployment":
            return list(self.deployments)
        if kind == "Pod":
            return list(self._pod_group)
        return [(ns, name) for k, ns, name in self.children if k == kind]

    def forget(self, kind: str, namespace: str, name: str, *, deleted_by_us: bool = False
               ) -> None:
        """Drop an object the API server says is gone (a 404, or the answer to our own
        delete), as its DELETED event would have."""
        obj = self.get(kind, namespace, name)
        self._unconfirmed.discard((kind, namespace, name))
        if obj is not None:
            if not deleted_by_us:
                log.info("%s %s/%s is gone; dropping it from the view", kind, namespace, name)
            self.observe(kind, "DELETED", obj)

    # ---- lookups ---------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The view's copy of an object, or None."""
        if kind == "OmniPipeline":
            return self.pipelines.get((namespace, name))
        if kind == "StagePool":
            return self.pools.get((namespace, name))
        if kind == "Deployment":
            return self.deployments.get((namespace, name))
        if kind == "Pod":
            group = self._pod_group.get((namespace, name))
            return None if group is None else self.pods.get((namespace, group), {}).get(name)
        return self.children.get((kind, namespace, name))

    def pools_of(self, namespace: str, pipeline: str) -> list[str]:
        """Names of the StagePools in the view that belong to a pipeline (by spec.pipeline),
        from the index: a copy, so a caller may delete while it iterates."""
        return sorted(self._pools_of.get((namespace, pipeline), ()))

    def _index_pool(self, key: tuple[str, str], old: Obj | None, new: Obj | None) -> None:
        """Move a pool between the (ns, pipeline) sets as it comes, changes owner or goes."""
        ns, name = key
        before = (old.get("spec") or {}).get("pipeline") if old is not None else None
        after = (new.get("spec") or {}).get("pipeline") if new is not None else None
        if before == after:
            return
        if before is not None:
            members = self._pools_of.get((ns, before))
            if members is not None:
                members.discard(name)
                if not members:
                    del self._pools_of[(ns, before)]
        if after is not None:
            self._pools_of.setdefault((ns, after), set()).add(name)

    # ---- priming and its self-check --------------------------------------------------------

    async def prime(self, namespaces: list[str] | None = None) -> None:
        """Fill the view with one list per kind before any reconcile runs.

        Without it a restarted operator reconciles pools before the Pod watch has listed their
        pods, sees every replica missing and writes (409s, status flaps) for nothing.
        """
        managed = f"{kube.LABEL_MANAGED_BY}={kube.MANAGED_BY}"
        for w in WATCHED:
            for url in [w.resource.path(ns) for ns in namespaces or [None]]:
                async for page in self._pages(url, managed if w.managed_only else None):
                    for item in page:
                        item.setdefault("kind", w.kind)
                        item.setdefault("apiVersion", w.resource.api_version)
                        self.observe(w.kind, None, item, primed=True)

    async def confirm_primed(self) -> None:
        """Drop primed objects (or, after kopf listed a kind again, objects of that kind) that
        no watch event has confirmed and a fresh list lacks.

        kopf's own first list reports every object that still exists, so normally nothing is
        left to check by the first resync. One list per kind and namespace, not a get per
        object: the operator reads through list and watch only (the chart grants no get).
        """
        groups: dict[tuple[str, str], set[str]] = {}
        for kind, ns, name in self._unconfirmed:
            groups.setdefault((kind, ns), set()).add(name)
        watched = {w.kind: w for w in WATCHED}
        managed = f"{kube.LABEL_MANAGED_BY}={kube.MANAGED_BY}"
        for (kind, ns), names in groups.items():
            w = watched[kind]
            present: set[str] = set()
            async for page in self._pages(w.resource.path(ns or None),  # no waiting: a resync
                                          managed if w.managed_only else None, timeout=0):
                present.update(item["metadata"]["name"] for item in page)
            for name in names:
                if (kind, ns, name) not in self._unconfirmed:
                    continue  # a watch event confirmed it meanwhile
                if name in present:
                    self._unconfirmed.discard((kind, ns, name))
                else:
                    self.forget(kind, ns, name)

    async def _pages(self, url: str, selector: str | None,
                     timeout: float = 120.0) -> AsyncIterator[list[Obj]]:
        """A list in pages of LIST_PAGE objects, each dropped once observed: a fleet's pods in
        one answer were hundreds of MiB decoded at once, the peak of a restarted operator.
        Waits out an API server still coming up or a CRD not served yet; a continue token
        that expired (410) starts the list again (observing an object twice changes nothing).
        """
        end = time.monotonic() + timeout
        token = ""
        while True:
            try:
                answer = await self.api.get(url, labelSelector=selector, limit=LIST_PAGE,
                                            **({"continue": token} if token else {}))
            except ApiError as exc:
                if exc.status == 410 and token:
                    token = ""
                    continue
                if exc.status not in (404, 429, 500, 503) or time.monotonic() > end:
                    raise
                log.info("waiting to list %s: %s", url, exc)
                await asyncio.sleep(1.0)
                continue
            yield list(answer.get("items") or [])
            token = str((answer.get("metadata") or {}).get("continue") or "")
            if not token:
                return
