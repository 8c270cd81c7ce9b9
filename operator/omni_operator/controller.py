"""Level-triggered reconciliation of OmniPipelines and StagePools.

kopf event handlers feed `observe`, which keeps an in-memory view of the watched objects and
marks keys dirty; a coalescing work queue reconciles each key, one at a time per key. Every
reconcile compares desired with observed state and writes only differences, so a resync of an
unchanged world makes no write calls.

The view is primed by a list before kopf watches. An object deleted in between never gets a
DELETED event, so the view checks itself: entries no watch event has confirmed are read back
once (404: dropped), and any write or read that answers 404 drops the entry it was about. Delayed
re-enqueues are coalesced per key, so a key waiting on something never piles up timers.

Children are server-side applied with one field manager; docs/architecture.md ("How the operator
writes") says what is applied, created or patched, and why.

An object whose spec is refused gets status InvalidSpec and one Warning event per generation,
and is not retried until its generation changes; so does one whose built child the API server
refuses (422), retried at most every RETRY_CAP. Other failures back off per key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from omni_operator import builders, drain, release, retirement
from omni_operator.autoscaler import Autoscaler
from omni_operator.events import EventRecorder, now_iso
from omni_operator.placement import unschedulable_message
from omni_operator.readiness import gate_patch, is_draining, is_ready
from omni_operator.status import (
    invalid_status,
    milestone,
    model_failure,
    pipeline_status,
    pool_status,
    reported_invalid,
    terminating_status,
    transition_event,
)
from omni_operator.status_models import PipelineStatus, Status
from omnistage import kube
from omnistage.backoff import Backoff
from omnistage.kubeapi import (
    RESOURCES,
    ApiError,
    Fields,
    KubeApi,
    Resource,
    gather_all,
    namespace_terminating,
    path,
    project,
)
from omnistage.spec import OmniPipeline, SpecError, parse_pipeline, parse_stagepool

log = logging.getLogger("omnistage.operator")

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace, name)
FINALIZER = "omnistage.io/ordered-shutdown"


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
)
# Owned children kept only as a view to diff against (the rest have reconcilers of their own).
CHILD_KINDS = tuple(
    w.kind for w in WATCHED if w.kind not in ("OmniPipeline", "StagePool", "Deployment", "Pod")
)


#: A pipeline's children that run pods, applied once the rest (what their pods reference) is.
WORKLOADS = ("Deployment", "StagePool")
#: Objects per page when the view is primed (see Controller._pages).
LIST_PAGE = 500


def subset(want: Any, have: Any) -> bool:
    """Whether every field we manage already has the value we want (server defaults ignored)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(subset(w, h) for w, h in zip(want, have, strict=True))
        )
    if isinstance(want, int | float) and isinstance(have, int | float):
        return want == have
    return want == have or (
        want is not None and str(want) == str(have) and not isinstance(want, bool)
    )


#: On every object the operator applies: the digest of the intent it applied last. An intent
#: that changed, a field removed included, differs from it; a restarted operator reads it back.
ANNOTATION_APPLIED = "omnistage.io/applied"


def _intent_digest(desired: Obj) -> str:
    """The digest of an intent, spec.replicas aside: whether a StagePool's intent carries
    replicas follows who owns them (see Controller._ensure_child), and their value is compared
    with the live object's anyway."""
    spec = desired.get("spec")
    if isinstance(spec, dict) and "replicas" in spec:
        desired = {**desired, "spec": {k: v for k, v in spec.items() if k != "replicas"}}
    return builders.digest(desired)


def applied_intent(desired: Obj) -> Obj:
    """What the operator server-side applies: `desired` with its digest as an annotation."""
    meta = desired["metadata"]
    annotations = {**(meta.get("annotations") or {}), ANNOTATION_APPLIED: _intent_digest(desired)}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def _compared(intent: Obj) -> Obj:
    """The fields of an intent to compare with the live object (identity and server-set
    metadata aside)."""
    out = {k: v for k, v in intent.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = intent["metadata"]
    out["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences")
                       if k in meta}
    return out


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: `new`, with a null for every
    key `old` has and `new` leaves out, at every depth. A status written as `new` alone would
    keep what it no longer says (a release's candidate revision, a revision gone from a map)
    and differ from what was computed on every reconcile."""
    if not isinstance(new, dict) or not isinstance(old, dict):
        return new
    out = {k: merge_patch(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out


def owners(obj: Obj, field: tuple[str, ...]) -> set[tuple[str, str, str]]:
    """(manager, operation, subresource) of every metadata.managedFields entry that owns
    `field`: field names, or fieldsV1 keys such as 'v:"x"' (an item of a set)."""
    keys = [f if ":" in f else f"f:{f}" for f in field]
    found = set()
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        node: Any = entry.get("fieldsV1") or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            found.add((str(entry.get("manager", "")), str(entry.get("operation", "")),
                       str(entry.get("subresource", ""))))
    return found


def owns(obj: Obj, field: tuple[str, ...]) -> bool:
    """Whether the operator's own server-side apply owns `field` of the object."""
    return (builders.FIELD_MANAGER, "Apply", "") in owners(obj, field)


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
#: The managedFields the controller asks `owners` about, per kind; other kinds' are dropped
#: (the rest of those objects is kept: `ensure` compares an intent with every field it sets).
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


def _finalizer_intent(obj: Obj, finalizers: list[str]) -> Obj:
    """The operator's whole intent for an object it does not build: its finalizers. With the
    object's uid, so the apply writes this very object: an apply to a name that is gone would
    otherwise create a new object from an intent without a spec (the API server refuses that
    with 422, which read as an invalid spec); with the uid it answers 409 instead."""
    meta = {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]}
    if obj["metadata"].get("uid"):
        meta["uid"] = obj["metadata"]["uid"]
    if finalizers:
        meta["finalizers"] = finalizers
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": meta}


def removed(answer: Any) -> bool:
    """Whether a delete's (or a finalizer release's) answer says the object is gone: a
    Success status, or the object as it was, with no finalizer left to hold it. One still
    held (a pod's grace period, a finalizer) is not."""
    if not isinstance(answer, dict):
        return False
    if answer.get("kind") == "Status":
        return answer.get("status") == "Success"
    meta = answer.get("metadata") or {}
    return bool(meta) and not meta.get("finalizers") and (
        not meta.get("deletionTimestamp") or meta.get("deletionGracePeriodSeconds") in (None, 0))


def _meta_key(obj: Obj) -> tuple[str, str]:
    return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


class PermanentError(Exception):
    """A reconcile that cannot succeed until its object changes (the API server refuses what
    it builds). Reported on the object, as InvalidSpec, instead of retried in a loop.
    `errors` as SpecError's: (path, message)."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{where}: {what}" for where, what in self.errors))


def _causes(exc: ApiError) -> list[Obj]:
    details = exc.body.get("details") if isinstance(exc.body, dict) else None
    return [c for c in (details or {}).get("causes") or [] if isinstance(c, dict)]


def permanent(exc: BaseException) -> PermanentError | None:
    """A failure that retrying cannot fix: a PermanentError, or the API server's 422 Invalid
    (or 400 BadRequest) for an object the operator built from the spec."""
    if isinstance(exc, PermanentError):
        return exc
    if not isinstance(exc, ApiError) or exc.status not in (400, 422):
        return None
    details = exc.body.get("details") if isinstance(exc.body, dict) else None
    what = " ".join(str(v) for v in ((details or {}).get("kind"), (details or {}).get("name"))
                    if v) or exc.path
    errors = [(f"{what}: {c.get('field') or '?'}", str(c.get("message") or exc.reason))
              for c in _causes(exc)]
    return PermanentError(errors or [(what, f"{exc.reason or exc.status}: {exc.message}")])


#: Retries of a failed reconcile, per key: 1 s doubling to 5 minutes, each stretched by up to
#: 20% so keys that failed together do not retry together. A success resets the key.
RETRY_BASE, RETRY_CAP, RETRY_JITTER = 1.0, 300.0, 0.2
#: How long a created pod is expected before its watch event (the view lags the API server
#: under load); within it, a pool reconcile does not create that pod again. After it, the create
#: is retried (a 409 if it exists), so a lost event never leaves a replica missing.
CREATE_EXPECTED_SECONDS = 30.0
#: A pool's or pipeline's status change that is no milestone (status.milestone: counts,
#: routable figures, messages) is written at most this often per object, trailing edge: held
#: back, the latest value is written by a delayed reconcile. Every write costs on a busy API
#: server, and a ramp changed a pool's counts once per pod (docs/architecture.md).
STATUS_COALESCE_SECONDS = 2.0
#: A deleting pipeline's next shutdown step is looked at again after this long. Each step
#: ends in events that reconcile the pipeline (its orchestrator pod, its stage pods, its pools
#: gone), so this is the backstop, not the pace: once a second, 500 deleting pipelines were
#: 500 reconciles a second through a whole teardown.
SHUTDOWN_RECHECK_SECONDS = 5.0
#: Names an event lists of the objects it is about (the rest are counted).
EVENT_NAMES = 3


class Controller:
    def __init__(self, api: KubeApi, *, resync_seconds: float = 30.0, workers: int = 8,
                 autoscaler: bool = True, retry: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.retry = retry or Backoff(RETRY_BASE, RETRY_CAP, RETRY_JITTER)
        self.clock = clock  # when a parked key may be tried again
        # Keys whose object the API server refuses: (uid, generation, retry due on self.clock).
        self._parked: dict[Key, tuple[str, int, float]] = {}
        self.events = EventRecorder(api)
        self.resync_seconds = resync_seconds
        self.pipelines: dict[tuple[str, str], Obj] = {}
        self.pools: dict[tuple[str, str], Obj] = {}
        self.deployments: dict[tuple[str, str], Obj] = {}
        # Other owned children (ConfigMap, Service, RBAC, PDB), so resyncs read no API.
        self.children: dict[tuple[str, str, str], Obj] = {}
        self.pods: dict[tuple[str, str], dict[str, Obj]] = {}  # (ns, pool or orch) -> pods
        # Indexes kept by observe, so no reconcile scans every object of a kind (at fleet size
        # a scan per reconcile made the work grow with the square of the fleet):
        self._pools_of: dict[tuple[str, str], set[str]] = {}  # (ns, pipeline) -> pool names
        self._pod_group: dict[tuple[str, str], str] = {}  # (ns, pod) -> its key in self.pods
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._running: set[Key] = set()
        self._dirty: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}  # at most one delayed enqueue per key
        self._unconfirmed: set[Key] = set()  # primed objects no watch event has confirmed
        # Kinds kopf is listing again (see _listed_again) -> the (ns, name) that listing has
        # delivered so far: one delivered twice before a watch event came is the next listing.
        self._listed: dict[str, set[tuple[str, str]]] = {}
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned: set[asyncio.Future[Any]] = set()  # events in flight (a set: O(1) done)
        # reported: model (uid/model), deletion (pipeline uid/terminating)
        self._warned: set[str] = set()
        # (ns, pool) -> the scheduler messages its InsufficientCapacity events said, while some
        # replica still shows them: one event per message per pool, not one per pod.
        self._unschedulable: dict[tuple[str, str], set[str]] = {}
        self._intended: set[str] = set()  # pod uids the operator deleted itself (retired, stale)
        self._evictions: set[str] = set()  # pod uids evicted through the Eviction API
        # (ns, pool) -> ordinals of replicas gone unasked, until they are back under their name
        self._returning: dict[tuple[str, str], set[int]] = {}
        self._invalid: dict[Key, tuple[str, int]] = {}  # InvalidSpec reported: (uid, generation)
        # The last status written per object, and the versions of it our view may still show
        # that are older than that write (read-your-writes, see patch_status).
        self._status_written: dict[Key, _StatusWrite] = {}
        # Pods created whose first watch event has not arrived: (ns, name) -> created at (clock).
        # Without it, with many workers a pool reconciled again before its new pods reach the
        # view created all of them again: 648 extra POSTs (409s) in 600 pods at 32 workers.
        self._expected: dict[tuple[str, str], float] = {}
        # (ns, pipeline) -> the release gate as last computed (omni_operator.release): when it
        # opens or closes, the pipeline's other pools are reconciled, since their next step
        # (retire an old-revision replica or wait) follows from it.
        self._gates: dict[tuple[str, str], bool] = {}
        # (ns, pool) -> the ordinal of the release surge it created last (see _surge_ordinal).
        self._surge_created: dict[tuple[str, str], int] = {}
        self.reconciles = 0
        self.autoscaler = Autoscaler(self)  # sizes pools with spec.stage.autoscaling
        # Off (--no-autoscaler): pools keep the size they have; HPA/KEDA may drive them.
        self.autoscaling = autoscaler

    # ---- event intake ----------------------------------------------------------------------

    def watched(self, kind: str, event_type: str | None, obj: Obj) -> None:
        """One event of kopf's watch of `kind` (type None: an object of its listing)."""
        if event_type is not None:
            self._listed.pop(kind, None)  # kopf watches a kind once its listing is over
        else:
            key = (kind, *_meta_key(obj))
            if key[1:] in self._listed.get(kind, ()):
                # Delivered twice with no watch event between: kopf lists again, its watch
                # lost its place before any event came (a quiet fleet, a slow listing). What
                # was deleted since the last listing is in neither.
                del self._listed[kind]
            if (kind not in self._listed and key not in self._unconfirmed
                    and self.view(*key) is not None):
                self._listed_again(kind)
            if kind in self._listed:
                self._listed[kind].add(key[1:])
        self.observe(kind, event_type, obj)

    def observe(self, kind: str, event_type: str | None, obj: Obj, *, primed: bool = False) -> None:
        obj = viewed(kind, obj)  # what the controller reads of it, not the whole object
        key = _meta_key(obj)
        gone = event_type == "DELETED"
        if primed:
            self._unconfirmed.add((kind, *key))
        else:
            self._unconfirmed.discard((kind, *key))
        if gone:
            self._status_written.pop((kind, *key), None)
        if kind == "OmniPipeline":
            self._store(self.pipelines, key, obj, gone)
            if gone:
                self._gates.pop(key, None)
            self.enqueue(("OmniPipeline", *key))
        elif kind == "StagePool":
            self._index_pool(key, self.pools.get(key), None if gone else obj)
            self._store(self.pools, key, obj, gone)
            if gone:
                self._unschedulable.pop(key, None)
                self._surge_created.pop(key, None)
            self.autoscaler.observe(obj, gone)
            self.enqueue(("StagePool", *key))
            pipeline = (obj.get("spec") or {}).get("pipeline")
            if pipeline:
                self.enqueue(("OmniPipeline", key[0], pipeline))
        elif kind == "Deployment":
            self._store(self.deployments, key, obj, gone)
            pipeline = (obj["metadata"].get("labels") or {}).get(kube.LABEL_PIPELINE)
            if pipeline:
                self.enqueue(("OmniPipeline", key[0], pipeline))
        elif kind == "Pod":
            self._observe_pod(obj, gone)
        elif kind in CHILD_KINDS:
            ckey = (kind, *key)
            if gone:
                self.children.pop(ckey, None)
            else:
                self.children[ckey] = obj
            lbls = obj["metadata"].get("labels") or {}
            if gone and lbls.get(kube.LABEL_POOL) and kind == "PodDisruptionBudget":
                self.enqueue(("StagePool", key[0], lbls[kube.LABEL_POOL]))
            elif gone and lbls.get(kube.LABEL_PIPELINE):
                self.enqueue(("OmniPipeline", key[0], lbls[kube.LABEL_PIPELINE]))

    def _listed_again(self, kind: str) -> None:
        """kopf lists a kind again when its watch lost its place (410 Gone: the API server's
        event window moved past it, which a busy fleet's pods do in seconds), and an object
        deleted in between gets no DELETED event: the view kept such pods for good, and the
        pipelines waiting for them to go never shut down. A listed event (type None) for an
        object the view has, outside a priming, is that listing: every object of the kind
        awaits confirmation again. The listing confirms those that exist; the next resync's
        `confirm_primed` lists the kind and forgets the rest."""
        self._listed[kind] = set()
        keys = self._view_keys(kind)
        log.info("%s listed again by the watch (it lost its place): checking %d in the view "
                 "at the next resync", kind, len(keys))
        self._unconfirmed.update((kind, ns, name) for ns, name in keys)

    def _view_keys(self, kind: str) -> list[tuple[str, str]]:
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
        obj = self.view(kind, namespace, name)
        self._unconfirmed.discard((kind, namespace, name))
        if obj is not None:
            if not deleted_by_us:
                log.info("%s %s/%s is gone; dropping it from the view", kind, namespace, name)
            self.observe(kind, "DELETED", obj)

    def view(self, kind: str, namespace: str, name: str) -> Obj | None:
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

    def _observe_pod(self, pod: Obj, gone: bool) -> None:
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
        if _evicted(pod):
            self._evictions.add(meta.get("uid", ""))
        self._expected.pop((ns, meta["name"]), None)
        if gone:
            pods = self.pods.get((ns, group), {})
            pods.pop(meta["name"], None)
            if not pods:  # a pool or pipeline gone leaves no empty entry behind
                self.pods.pop((ns, group), None)
            self._pod_group.pop((ns, meta["name"]), None)
            if lbls.get(kube.LABEL_POOL):
                self._replica_gone(pod)
        else:
            self.pods.setdefault((ns, group), {})[meta["name"]] = pod
            self._pod_group[(ns, meta["name"])] = group
        if lbls.get(kube.LABEL_POOL):
            self.enqueue(("StagePool", ns, group))
            owner = self.pipelines.get((ns, lbls.get(kube.LABEL_PIPELINE, "")))
            if gone and (ns, group) not in self.pods and owner is not None and (
                    owner["metadata"].get("deletionTimestamp")):
                # The pool's last pod went: its deleting pipeline's shutdown goes on.
                self.enqueue(("OmniPipeline", ns, owner["metadata"]["name"]))
        else:
            self.enqueue(("OmniPipeline", ns, lbls.get(kube.LABEL_PIPELINE, "")))

    def _replica_gone(self, pod: Obj) -> None:
        """A replica pod disappeared: say what happened, a Warning only when nobody meant it.

        Retirements (scale-down, rollout, named retirement) carry the drain mark and were
        announced when they began; so were the operator's own deletions of out-of-date replicas
        that serve nothing (RollingUpdate): neither says more here. Evictions (`kubectl drain`)
        carry the DisruptionTarget condition (a Normal ReplicaEvicted); a pool or pipeline
        being deleted takes its pods along. Anything else is a lost replica (a Warning). A
        replica gone without retirement comes back under its name (stable identity, like a
        StatefulSet's): its ordinal is remembered until it is back (see _present).
        """
        meta = pod["metadata"]
        uid = meta.get("uid", "")
        intended = uid in self._intended
        evicted = uid in self._evictions or _evicted(pod)
        self._intended.discard(uid)
        self._evictions.discard(uid)
        self._warned.discard(f"{uid}/model")
        ns, pool_name = meta["namespace"], meta["labels"][kube.LABEL_POOL]
        pool = self.pools.get((ns, pool_name))
        if pool is None or pool["metadata"].get("deletionTimestamp"):
            self._returning.pop((ns, pool_name), None)
            return
        owner = self.pipelines.get((meta["namespace"], pool["spec"].get("pipeline", "")))
        if owner is not None and owner["metadata"].get("deletionTimestamp"):
            return
        retired = kube.marked_draining(pod)
        if retired:
            return
        ordinal = retirement.ordinal_of(pod)
        returning = self._returning.setdefault((ns, pool_name), set())
        returning.add(ordinal)
        present = {retirement.ordinal_of(p): p for p in self.pods.get((ns, pool_name), {}).values()}
        if ordinal not in retirement.wanted_ordinals(pool, self._present(pool, present)):
            returning.discard(ordinal)  # a scale-down took its place: it does not come back
            return
        name = meta["name"]
        if evicted:
            self._event(pool, "Normal", "ReplicaEvicted",
                        f"replica {name} was evicted; replacing it under the same name")
        elif not intended:
            self._event(pool, "Warning", "ReplicaLost",
                        f"replica {name} disappeared; replacing it under the same name")

    def _present(self, pool: Obj, by_ordinal: dict[int, Obj]) -> list[int]:
        """The ordinals that keep their place in the pool: replicas not retiring (_staying)
        nor a release's surge, and replicas gone unasked that have not come back yet, so a
        lost or evicted replica returns under its own name even when a lower ordinal is
        free."""
        meta = pool["metadata"]
        return sorted({*_staying(by_ordinal),
                       *self._returning.get((meta["namespace"], meta["name"]), ())})

    @staticmethod
    def _store(
        table: dict[tuple[str, str], Obj], key: tuple[str, str], obj: Obj, gone: bool
    ) -> None:
        if gone:
            table.pop(key, None)
        else:
            table[key] = obj

    # ---- work queue ------------------------------------------------------------------------

    def enqueue(self, key: Key) -> None:
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def enqueue_later(self, key: Key, delay: float) -> None:
        """Reconcile key after delay; one pending timer per key (the earliest wins)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending.when() <= due:
                return
            pending.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key)

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    def pending_timers(self) -> int:
        """Delayed re-enqueues waiting (for tests and /metrics)."""
        return len(self._timers)

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

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self._workers)]
        self._tasks.append(asyncio.create_task(self._resync()))
        if self.autoscaling:
            self._tasks.append(asyncio.create_task(self.autoscaler.run()))

    async def stop(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        tasks = [*self._tasks, *self._spawned]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.autoscaler.close()
        await self.api.close()

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            if self._is_parked(key):
                await asyncio.sleep(0)
                continue
            self._running.add(key)
            try:
                await self.reconcile(key)
            except Exception as exc:
                try:
                    await self._failed(key, exc)
                except Exception:  # reporting must never end the worker
                    log.exception("reporting the failure of %s failed", key)
                    self.enqueue_later(key, RETRY_CAP)
            else:
                self.retry.reset(key)
                self._parked.pop(key, None)
            finally:
                self._running.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)
            # A converged reconcile makes no API call, so it never suspends, and get() on a
            # full queue does not either: without this a resync of thousands of objects held
            # the event loop for seconds (watches, /metrics and /healthz starved).
            await asyncio.sleep(0)

    async def _failed(self, key: Key, exc: Exception) -> None:
        """Back off, with the traceback logged once per run of failures; a terminating
        namespace is not retried; a permanent error is reported on the object and parked."""
        if namespace_terminating(exc):
            log.info("namespace of %s is terminating: not reconciling", key)
            self.retry.reset(key)
            return
        refused = permanent(exc)
        if refused is not None:
            await self._park(key, refused)
            return
        delay = self.retry.failed(key)
        count = self.retry.failures(key)
        if count == 1:
            log.warning("reconcile %s failed; retrying in %.1fs", key, delay, exc_info=exc)
        else:
            log.warning("reconcile %s failed again (%d in a row): %s: %s; retrying in %.1fs",
                        key, count, type(exc).__name__, exc, delay)
        self.enqueue_later(key, delay)

    async def _park(self, key: Key, exc: PermanentError) -> None:
        """InvalidSpec on the object (one Warning event per generation), then no reconcile of
        the key until its generation changes, or once per RETRY_CAP."""
        obj = self.view(*key)
        if obj is None:
            return
        stamp = (obj["metadata"].get("uid", ""), int(obj["metadata"].get("generation", 0)))
        again = self._parked.get(key, ("", -1, 0.0))[:2] == stamp
        # Due a little before the timer fires (a timer may run a hair early), and the resync
        # lets it through after that even when an earlier timer took the key's slot.
        self._parked[key] = (*stamp, self.clock() + 0.9 * RETRY_CAP)
        self.retry.reset(key)
        if again:
            log.warning("reconcile %s still refused: %s; next try in %.0fs", key, exc, RETRY_CAP)
        else:  # _refused logs the errors themselves
            log.debug("reconcile %s refused; parked until its generation changes", key,
                      exc_info=exc)
        await self._refused(obj, SpecError(exc.errors))
        self.enqueue_later(key, RETRY_CAP)

    def _is_parked(self, key: Key) -> bool:
        """A parked key stays parked while its object has the refused generation and is not
        being deleted, until its retry is due."""
        parked = self._parked.get(key)
        if parked is None:
            return False
        obj = self.view(*key)
        meta = (obj or {}).get("metadata") or {}
        if (obj is None or meta.get("deletionTimestamp")
                or (meta.get("uid", ""), int(meta.get("generation", 0))) != parked[:2]):
            self._parked.pop(key, None)
            return False
        return self.clock() < parked[2]

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            try:
                await self.confirm_primed()
            except ApiError as exc:
                log.warning("checking primed objects failed: %s", exc)
            # A key backing off after a failure has its retry timer: a resync must not turn
            # the backoff into a retry every resync period.
            for ns, name in list(self.pipelines):
                if not self.retry.failures(("OmniPipeline", ns, name)):
                    self.enqueue(("OmniPipeline", ns, name))
            for ns, name in list(self.pools):
                if not self.retry.failures(("StagePool", ns, name)):
                    self.enqueue(("StagePool", ns, name))

    async def reconcile(self, key: Key) -> None:
        self.reconciles += 1
        kind, ns, name = key
        if kind == "OmniPipeline":
            obj = self.pipelines.get((ns, name))
            if obj is not None:
                await self.reconcile_pipeline(obj)
        else:
            obj = self.pools.get((ns, name))
            if obj is not None:
                await self.reconcile_pool(obj)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    def _event(self, obj: Obj, etype: str, reason: str, message: str) -> None:
        """Record an event in the background (aggregated; see omni_operator.events)."""
        self._spawn(self.events.record(obj, etype, reason, message))

    # ---- apply helpers ---------------------------------------------------------------------

    async def _write(self, kind: str, ns: str, name: str, call: Awaitable[Any]) -> Any:
        """A write (or read) about one object; 404 drops it from the view and returns None."""
        try:
            return await call
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.forget(kind, ns, name)
            return None

    async def _apply_finalizers(self, obj: Obj, finalizers: list[str]) -> Obj | None:
        """Apply our finalizer intent to this object (by its uid). A 409 is either a conflict
        on a live object (raised) or the object gone since our view saw it (a stale reconcile
        after its deletion): a list by name tells which (the chart grants list and watch, no
        get: a get here was refused with 403), and a gone object is dropped from the view,
        like a 404."""
        ns, name = _meta_key(obj)
        url = path("OmniPipeline", ns, name)
        try:
            applied = await self._write("OmniPipeline", ns, name, self.api.apply(
                url, _finalizer_intent(obj, finalizers), field_manager=builders.FIELD_MANAGER))
            return None if applied is None else applied.object
        except ApiError as exc:
            if exc.status != 409:
                raise
            found = await self.api.get(path("OmniPipeline", ns),
                                       fieldSelector=f"metadata.name={name}")
            current = next(iter(found.get("items") or []), None)
            if current is None:
                self.forget("OmniPipeline", ns, name)
            elif current["metadata"].get("uid") == obj["metadata"].get("uid"):
                raise
            log.info("OmniPipeline %s/%s is gone (uid %s): nothing to apply", ns, name,
                     obj["metadata"].get("uid"))
            return None

    async def ensure(
        self,
        desired: Obj,
        current: Obj | None,
        on_create: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Server-side apply `desired`, the operator's whole intent for the object, when the
        object is missing, the intent differs from the one last applied (its digest is on the
        object), or the live object differs from it in a field the intent sets; else nothing.

        The apply removes whatever the operator applied before and the intent now leaves out,
        so no field is ever nulled by hand. Conflicts are forced: every field in an intent is
        the operator's (what another writer owns, like a `kubectl scale`d StagePool's
        replicas, is left out of the intent instead; see _ensure_child).
        """
        intent = applied_intent(desired)
        # The intent carries its digest as an annotation: a changed intent differs here too.
        if current is not None and subset(_compared(intent), current):
            return
        meta = desired["metadata"]
        kind, ns, name = desired["kind"], meta["namespace"], meta["name"]
        applied = await self._write(kind, ns, name, self.api.apply(
            path(kind, ns, name), intent, field_manager=builders.FIELD_MANAGER, force=True))
        if applied is not None and applied.created and on_create is not None:
            await on_create()

    async def patch_status(self, obj: Obj, typed: Status, *, coalesce: bool = False) -> bool:
        """Write status (its wire form) if it differs from the stored one; True when it wrote.

        Read-your-writes: until the watch delivers our own write, the view still holds an older
        status, and a reconcile in that window (a 1 s re-check on a loaded machine) would write
        the same status again. Two writes in a row against one stale version (shutdown steps)
        make the first write's result stale too, when the watch delivers it. So a status equal
        to our last one is not written again while the view shows a version older than it.

        coalesce: a change that is no milestone (status.milestone) within
        STATUS_COALESCE_SECONDS of our last write to the object is held back, and the object
        reconciled again when that time is up, which writes what is true then.
        """
        status = typed.wire()
        if subset(status, obj.get("status") or {}) and subset(obj.get("status") or {}, status):
            return False
        ns, name = _meta_key(obj)
        key: Key = (obj["kind"], ns, name)
        version = obj["metadata"].get("resourceVersion", "")
        last = self._status_written.get(key)
        if last is not None and version in last.stale and _timeless(last.status) == _timeless(
                status):
            return False
        if coalesce and last is not None:
            wait = last.at + STATUS_COALESCE_SECONDS - self.clock()
            shown = last.status if version in last.stale else obj.get("status") or {}
            if wait > 0 and not milestone(shown, status):
                self.enqueue_later(key, wait)
                return False
        patched = await self._write(
            obj["kind"], ns, name,
            self.api.patch(path(obj["kind"], ns, name, "status"),
                           {"status": merge_patch(obj.get("status") or {}, status)}))
        if patched is not None:
            stale = {version}
            if last is not None and version in last.stale | {last.result}:
                stale |= last.stale | {last.result}
            result = ((patched.get("metadata") or {}).get("resourceVersion", "")
                      if isinstance(patched, dict) else "")
            self._status_written[key] = _StatusWrite(frozenset(stale), status, result,
                                                     self.clock())
        return patched is not None

    async def _refused(self, obj: Obj, exc: SpecError) -> None:
        """InvalidSpec: every field error in the status, one Warning per generation, no retry."""
        ns, name = _meta_key(obj)
        key: Key = (obj["kind"], ns, name)
        generation = int(obj["metadata"].get("generation", 0))
        stamp = (obj["metadata"].get("uid", ""), generation)
        already = self._invalid.get(key) == stamp or reported_invalid(obj)
        await self.patch_status(obj, invalid_status(obj, exc.errors, now_iso()))
        if not already:
            log.warning("%s %s/%s generation %d is invalid:\n%s", obj["kind"], ns, name,
                        generation, exc)
            self._event(obj, "Warning", "InvalidSpec", str(exc).replace("\n", "; "))
        self._invalid[key] = stamp

    # ---- OmniPipeline ----------------------------------------------------------------------

    async def reconcile_pipeline(self, obj: Obj) -> None:
        ns, name = _meta_key(obj)
        if obj["metadata"].get("deletionTimestamp"):
            await self.shutdown_pipeline(obj)
            return
        try:
            pipeline = parse_pipeline(obj)
        except SpecError as exc:
            await self._refused(obj, exc)
            return
        self._invalid.pop(("OmniPipeline", ns, name), None)
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if FINALIZER not in finalizers:
            # Our finalizer only: finalizers are a set to server-side apply, so the others
            # (and a concurrent writer's) stay; nobody else can own ours, so no force.
            await self._apply_finalizers(obj, [FINALIZER])
        # Children that differ are applied together, in two waves (each apply waits on the API
        # server; a first reconcile made nine in a row, and the pools' pods waited on them):
        # what the workloads reference (config, account, RBAC, Service), then the workloads.
        children = builders.pipeline_children(obj, pipeline, {
            s.name: self.pools.get((ns, kube.pool_name(name, s.name)))
            for s in pipeline.spec.stages})
        created: list[tuple[str, str]] = []  # (kind, name) of the workloads this pass created
        try:
            for wave in (False, True):
                await gather_all(self._ensure_child(obj, child, created) for child in children
                                 if (child["kind"] in WORKLOADS) == wave)
        finally:  # one event for the pass, also when an apply after the creates failed
            if created:
                self._event(obj, "Normal", "Created", created_message(created))
        await self._prune_pools(pipeline, ns)
        pools = {
            s.name: self.pools.get((ns, kube.pool_name(name, s.name))) for s in pipeline.spec.stages
        }
        deployment = self.deployments.get((ns, builders.orchestrator_name(name)))
        status = pipeline_status(
            obj,
            [s.name for s in pipeline.spec.stages],
            pools,
            deployment,
            pipeline.spec.orchestrator.replicas,
            builders.endpoint(pipeline, ns),
            now_iso(),
        )
        await self._pipeline_status(obj, status)

    async def _pipeline_status(self, obj: Obj, status: PipelineStatus) -> None:
        """Write the status; when the phase or the Ready reason changed, say so in one event on
        the pipeline, so `kubectl describe omnipipe` tells the story without the pools'."""
        before = PipelineStatus.stored(obj)
        if await self.patch_status(obj, status, coalesce=True) and (
                event := transition_event(before, status)):
            self._event(obj, *event)

    async def _ensure_child(self, owner: Obj, child: Obj,
                            created: list[tuple[str, str]] | None = None) -> None:
        """Apply one child of a pipeline; a workload it creates is added to `created` (the
        caller says so in one event per reconcile, not one per child)."""
        kind, meta = child["kind"], child["metadata"]
        key = (meta["namespace"], meta["name"])
        if kind == "StagePool":
            current = self.pools.get(key)
            if current is not None:
                seed = (current["metadata"].get("annotations") or {}).get(
                    builders.ANNOTATION_SEED_REPLICAS
                )
                # With autoscaling the count is the autoscaler's once it wrote it: the
                # manifest's replicas only seeds a new pool (docs/architecture.md).
                scaled = "autoscaling" in child["spec"]["stage"] and not owns(
                    current, ("spec", "replicas"))
                if seed == str(child["spec"]["replicas"]) or scaled:
                    # The pipeline did not change this stage's replicas. While the operator's
                    # apply still owns them, they stay in the intent (left out, the apply would
                    # remove them); once `kubectl scale` (or any other writer) took them over,
                    # they are left out, so that manager keeps them.
                    if not owns(current, ("spec", "replicas")):
                        child = {
                            **child,
                            "spec": {k: v for k, v in child["spec"].items() if k != "replicas"},
                        }
                elif current["spec"].get("replicas") != child["spec"]["replicas"]:
                    self._event(
                        owner,
                        "Normal",
                        "Scaled",
                        f"stage {child['spec']['stage']['name']}: replicas "
                        f"{current['spec'].get('replicas')} -> {child['spec']['replicas']}",
                    )
        elif kind == "Deployment":
            current = self.deployments.get(key)
        else:
            current = self.children.get((kind, *key))

        async def on_create() -> None:
            if kind in WORKLOADS and created is not None:
                created.append((kind, meta["name"]))

        await self.ensure(child, current, on_create)

    async def _prune_pools(self, pipeline: OmniPipeline, ns: str) -> None:
        name = pipeline.metadata.name
        wanted = {kube.pool_name(name, s.name) for s in pipeline.spec.stages}
        for pname in self.pools_of(ns, name):
            if pname not in wanted:
                await self._delete("StagePool", ns, pname)

    async def _delete(self, kind: str, ns: str, name: str, body: Obj | None = None) -> None:
        """Delete; 404 means it is gone already (dropped from the view), 409 is a race. An
        answer that says the object is gone drops it from the view at once, as its DELETED
        event will: a step re-checked before that event came deleted it again (a 404 each)."""
        try:
            answer = await self._write(kind, ns, name, self.api.delete(path(kind, ns, name), body))
        except ApiError as exc:
            if exc.status != 409:
                raise
            return
        if kind != "Pod" and removed(answer):
            self.forget(kind, ns, name, deleted_by_us=True)

    async def shutdown_pipeline(self, obj: Obj) -> None:
        """Ordered shutdown: orchestrator drains first, then the stage pools, then release."""
        ns, name = _meta_key(obj)
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if FINALIZER not in finalizers:
            return
        key: Key = ("OmniPipeline", ns, name)
        self._announce_terminating(obj)
        oname = builders.orchestrator_name(name)
        dep = self.deployments.get((ns, oname))
        if dep is not None and dep["spec"].get("replicas", 0) != 0:
            await self._write("Deployment", ns, oname, self.api.patch(
                path("Deployment", ns, oname), {"spec": {"replicas": 0}},
                fieldManager=builders.FIELD_MANAGER))
        if self.pods.get((ns, oname)):
            await self.patch_status(obj, terminating_status(obj, "draining the orchestrator",
                                                            now_iso()))
            self.enqueue_later(key, SHUTDOWN_RECHECK_SECONDS)
            return
        if await self._stop_pools(ns, name):
            await self.patch_status(obj, terminating_status(obj, "stopping the stage pools",
                                                            now_iso()))
            self.enqueue_later(key, SHUTDOWN_RECHECK_SECONDS)
            return
        if owners(obj, ("metadata", "finalizers", f"v:{json.dumps(FINALIZER)}")) == {
                (builders.FIELD_MANAGER, "Apply", "")}:
            # Applying an intent without it releases our finalizer, and nobody else holds it:
            # the API server removes it, and leaves every other finalizer alone.
            released = await self._apply_finalizers(obj, [])
        else:
            # Added by an operator from before server-side apply (an update owns it): a release
            # would leave it, so the list is written without it.
            remaining = [f for f in finalizers if f != FINALIZER]
            released = await self._write("OmniPipeline", ns, name, self.api.patch(
                path("OmniPipeline", ns, name), {"metadata": {"finalizers": remaining or None}},
                fieldManager=builders.FIELD_MANAGER))
        if removed(released):  # the last finalizer: the API server removed it (no 2nd release)
            self.forget("OmniPipeline", ns, name, deleted_by_us=True)
        self._warned.discard(f"{obj['metadata'].get('uid', '')}/terminating")
        log.info("pipeline %s/%s shut down in order", ns, name)

    async def _stop_pools(self, ns: str, pipeline: str) -> bool:
        """A deleting pipeline's second step, once its orchestrator is gone: its pools'
        budgets, then its stage pods (one delete-collection, each with its grace period), then,
        when no pod is left, its pools. True while any of them is still there.

        The operator deletes the pods itself rather than through the pools' cascade: the
        garbage collector reads each dependent and its owner back from the API server before
        deleting it (five reads per stage pod in a 2,004-pod teardown), and a budget still
        there is counted again by the disruption controller at every event of its pods
        (docs/benchmarks.md, the teardown). Nothing routes to a pool once its orchestrator is
        gone, so neither budget nor order among its pods protects anything."""
        pools = self.pools_of(ns, pipeline)
        for pn in pools:
            if ("PodDisruptionBudget", ns, pn) in self.children:
                await self._delete("PodDisruptionBudget", ns, pn)
        pods = [p for pn in pools for p in self.pods.get((ns, pn), {}).values()]
        if any(not p["metadata"].get("deletionTimestamp") for p in pods):
            await self.api.delete(path("Pod", ns), labelSelector=kube.stage_selector(pipeline),
                                  ignore=(404,))
        if pods:
            return True  # the pools stay until their pods are gone: no cascade to run
        for pn in pools:
            pool = self.pools.get((ns, pn))
            if pool is not None and not pool["metadata"].get("deletionTimestamp"):
                await self._delete("StagePool", ns, pn)
        return any((ns, pn) in self.pools for pn in pools)

    def _announce_terminating(self, obj: Obj) -> None:
        """One Normal `Terminating` event when a pipeline's deletion starts (docs/crds.md):
        not per reconcile (remembered by uid), and not again after an operator restart once
        the status says Terminating."""
        mark = f"{obj['metadata'].get('uid', '')}/terminating"
        if mark in self._warned or (obj.get("status") or {}).get("phase") == "Terminating":
            return
        self._warned.add(mark)
        self._event(obj, "Normal", "Terminating",
                    "pipeline is being deleted: the orchestrator drains first, then the stage "
                    "pools stop, then the finalizer is released")

    # ---- StagePool -------------------------------------------------------------------------

    async def reconcile_pool(self, pool: Obj) -> None:
        ns, name = _meta_key(pool)
        key: Key = ("StagePool", ns, name)
        owner = self.pipelines.get((ns, (pool.get("spec") or {}).get("pipeline", "")))
        if pool["metadata"].get("deletionTimestamp") or (
                owner and owner["metadata"].get("deletionTimestamp")):
            # Going away, and its pods with it (its pipeline's shutdown deletes them, or the
            # garbage collector does): nothing to converge or report. A teardown reconciles a
            # pool at each event of its pods; building its pod template each time was most of
            # the operator's CPU there.
            return
        try:
            parse_stagepool(pool)
        except SpecError as exc:
            await self._refused(pool, exc)
            return
        self._invalid.pop(key, None)
        pods = dict(self.pods.get((ns, name), {}))
        _, template_hash = builders.pod_template(pool)
        now = now_iso()

        pdb = builders.pool_pdb(pool)
        current = self.children.get(("PodDisruptionBudget", ns, pdb["metadata"]["name"]))
        if builders.pdb_due(pdb, current, sum(1 for p in pods.values() if is_ready(p))):
            await self.ensure(pdb, current)

        # Readiness gates of several replicas flip together: patch them concurrently.
        gates = [(pod["metadata"]["name"], gate_patch(pod, now))
                 for pod in pods.values()]
        await gather_all(self._write("Pod", ns, pname, self.api.patch(
            path("Pod", ns, pname, "status"), patch, kind="strategic",
            fieldManager=builders.FIELD_MANAGER))
            for pname, patch in gates if patch is not None)
        self._warn_unschedulable(pool, pods)
        for pod in pods.values():
            uid = pod["metadata"].get("uid", "")
            failure = model_failure(pod)
            if failure and f"{uid}/model" not in self._warned:
                self._warned.add(f"{uid}/model")
                self._event(pool, "Warning", *failure)

        # Retirements in progress: delete once drained (or the drain timeout passed); the last
        # replica of a leaving revision also once no request is pinned to it (drain.py).
        retiring = [
            p
            for p in pods.values()
            if is_draining(p) and not p["metadata"].get("deletionTimestamp")
        ]
        for pod in retiring:
            pins = drain.pinned_revision(
                pod, pods.values(), release.pool_revision(pool), pool["spec"]["stage"]["name"])
            progress = await drain.finished(pod, pool, None if pins is None else partial(
                self._pinned, ns, pool["spec"]["pipeline"], *pins))
            if progress.done:
                pname = pod["metadata"]["name"]
                if progress.timed_out:
                    self._event(pool, "Warning", "DrainTimeout",
                                drain.timeout_message(pname, progress, pins))
                self._intended.add(pod["metadata"].get("uid", ""))
                await self._delete("Pod", ns, pname)
            else:
                self.enqueue_later(key, drain.POLL_SECONDS)

        changed, annotation = retirement.rewrite(pool)
        if changed:
            # A scale-up freed retired ordinals (one per added replica): write what is left, or
            # remove the annotation (one write, then none). It is `omnistage drain`'s (its own
            # field manager), not in the operator's intent, so an apply cannot change it: a
            # merge patch does.
            await self._write("StagePool", ns, name, self.api.patch(
                path("StagePool", ns, name),
                {"metadata": {"annotations": {retirement.ANNOTATION_RETIRED: annotation}}},
                fieldManager=builders.FIELD_MANAGER))

        await self._converge_pods(pool, pods, template_hash, bool(retiring))

        status = pool_status(pool, list(self.pods.get((ns, name), {}).values()), template_hash, now,
                             self.autoscaler.report(pool))
        await self.patch_status(pool, status, coalesce=True)

    def _warn_unschedulable(self, pool: Obj, pods: dict[str, Obj]) -> None:
        """One Warning `InsufficientCapacity` per distinct scheduler message per pool, naming
        a few of the replicas it holds back: a shape no node fits left every replica of a big
        pool pending, one event (one write) each. A message is said again only after no
        replica of the pool showed it for a reconcile."""
        held: dict[str, list[str]] = {}
        for pod in pods.values():
            if not pod["metadata"].get("deletionTimestamp") and (
                    msg := unschedulable_message(pod)):
                held.setdefault(msg, []).append(pod["metadata"]["name"])
        key = _meta_key(pool)
        said = self._unschedulable.get(key, set())
        for msg, names in held.items():
            if msg not in said:
                self._event(pool, "Warning", "InsufficientCapacity",
                            f"{few(sorted(names, key=lambda n: (len(n), n)))}: {msg}")
        if held:
            self._unschedulable[key] = set(held)
        else:
            self._unschedulable.pop(key, None)

    async def _pinned(self, ns: str, pipeline: str, stage: str, revision: str) -> int | None:
        """Requests pinned to `revision` at `stage` in flight at the pipeline's running
        orchestrators (drain.pinned_in_flight); None when one cannot be read."""
        try:
            loads = await self.autoscaler.orchestrator_loads(ns, pipeline)
        except Exception as exc:  # unreadable: the retirement waits (the drain timeout bounds it)
            log.info("pinned requests of %s/%s unknown: %s", ns, pipeline, exc)
            return None
        return drain.pinned_in_flight(loads, stage, revision)

    async def _converge_pods(
        self, pool: Obj, pods: dict[str, Obj], template_hash: str, retiring: bool
    ) -> None:
        """Create what is missing, then at most one drain at a time, in this order:
        out-of-date replicas that serve nothing are replaced at once (a fixed spec converges
        from any state); replicas leaving the pool (scale-down, `--retire`) drain; a
        `--replace`d replica drains once every wanted replica is Ready; then the rollout drains
        one out-of-date replica while all are Ready.

        A release (replicas of another revision than the spec's, omni_operator.release) adds
        one surge replica of the new revision, and retires an old-revision replica only while
        the pipeline's release gate is open and the surge is Ready; the surge leaves once no
        old-revision replica is left and every wanted replica is Ready."""
        ns = pool["metadata"]["namespace"]
        by_ordinal = {retirement.ordinal_of(p): p for p in pods.values()}
        wanted = retirement.wanted_ordinals(pool, self._present(pool, by_ordinal))
        returning = self._returning.get((ns, pool["metadata"]["name"]))
        if returning:  # back (or no longer wanted): nothing left to remember
            returning.difference_update({o for o in returning
                                         if o in by_ordinal or o not in wanted})
        live = {o: p for o, p in by_ordinal.items() if not p["metadata"].get("deletionTimestamp")}
        target = release.pool_revision(pool)
        old = sorted((o for o in wanted if o in live and release.outdated(target, live[o])),
                     reverse=True)
        surges = sorted(o for o, p in live.items()
                        if o not in wanted and release.is_surge(p) and not is_draining(p))
        surge = next((o for o in surges if release.pod_revision(live[o]) == target),
                     None) if old else None
        gate = self._release_gate(pool) if old else True
        # Create missing replicas (a lost replica returns under its name), all at once: each
        # create waits on the API server, and a pool's replicas do not depend on each other.
        # In a release without a surge replica of the new revision, it is created with them
        # (_surge_ordinal says where); not while a surge of another revision (a reverted
        # release's) still serves: at most one extra.
        now = self.clock()
        wanting = [builders.pool_pod(pool, o) for o in wanted if o not in by_ordinal]
        if old and surge is None and not surges:
            wanting.append(builders.pool_pod(
                pool, self._surge_ordinal(pool, by_ordinal, wanted, returning), surge=True))
        elif not old:
            self._surge_created.pop(_meta_key(pool), None)
        missing = [pod for pod in wanting
                   if now - self._expected.get((ns, pod["metadata"]["name"]), -math.inf)
                   > CREATE_EXPECTED_SECONDS]
        results = await gather_all(self.api.create(path("Pod", ns), pod, ignore=(409,),
                                             fieldManager=builders.FIELD_MANAGER)
                             for pod in missing)
        for pod in missing:  # created, or there already (409): its watch event is coming
            if (ns, pod["metadata"]["name"]) not in self._pod_group:
                self._expected[(ns, pod["metadata"]["name"])] = now
        # If an event never comes, look again once the expectation has lapsed. Armed by every
        # reconcile that still awaits a pod, not only the one that created it: a key keeps one
        # delayed reconcile (the earliest), so a sooner one (a coalesced status write) takes
        # this one's place, and the reconcile it brings must arm it again.
        since = [self._expected[(ns, pod["metadata"]["name"])] for pod in wanting
                 if (ns, pod["metadata"]["name"]) in self._expected]
        if since:
            self.enqueue_later(("StagePool", ns, pool["metadata"]["name"]),
                               min(since) + CREATE_EXPECTED_SECONDS + 1.0 - now)
        created = [pod["metadata"]["name"]
                   for pod, result in zip(missing, results, strict=True) if result is not None]
        if created:
            self._event(pool, "Normal", "ReplicasCreated",
                        f"created {', '.join(created)} (replicas {len(wanted)})")
        # The release's surge too: one made from a template since fixed (say unschedulable)
        # would otherwise hold the release forever. Not an old-revision replica while the
        # release gate is closed: one that blinked unready under load (or restarts) would be
        # replaced by a new-revision replica the pipeline cannot yet serve with, capacity
        # lost to a release that is held; it is replaced at once when the gate opens.
        stale_idle = [
            p for o, p in sorted(live.items())
            if (o in wanted or o == surge) and not is_draining(p) and not is_ready(p)
            and _spec_hash(p) != template_hash and (gate or not release.outdated(target, p))
        ]
        if stale_idle:
            names = [p["metadata"]["name"] for p in stale_idle]
            for p in stale_idle:
                self._intended.add(p["metadata"].get("uid", ""))
                await self._delete("Pod", ns, p["metadata"]["name"])
            self._event(pool, "Normal", "RollingUpdate",
                        f"replacing {', '.join(names)} (out of date and not ready)")
        if retiring:
            return  # one retirement at a time keeps us within the disruption budget
        replacing = retirement.retired(pool).replace
        leaving = sorted((o for o in live
                          if o not in wanted and o not in replacing and o not in surges),
                         reverse=True)
        if leaving:
            victim = live[leaving[0]]
            await drain.begin(self.api, victim)
            self._event(pool, "Normal", "ScalingDown",
                        f"retiring {victim['metadata']['name']} (replicas -> {len(wanted)})")
            return
        all_ready = all(o in live and is_ready(live[o]) for o in wanted)
        # A surge replica no longer needed (the release is over, or reverted past it) leaves
        # once every wanted replica is Ready; at once when it serves nothing.
        done = [o for o in surges if o != surge]
        if done and (all_ready or not is_ready(live[done[0]])):
            victim = live[done[0]]
            await drain.begin(self.api, victim)
            self._event(pool, "Normal", "ReleaseSurgeRetired",
                        f"retiring {victim['metadata']['name']}: the release's extra replica")
            return
        replaced = sorted(o for o in live if o not in wanted and o in replacing)
        if replaced and all_ready:
            victim = live[replaced[0]]
            await drain.begin(self.api, victim)
            self._event(pool, "Normal", "Replaced",
                        f"retiring {victim['metadata']['name']}: its replacement is Ready")
            return
        stale = sorted((o for o in wanted if o in live and _spec_hash(live[o]) != template_hash),
                       reverse=True)
        if old:
            # A release: old-revision replicas first, and only once every changed pool of the
            # pipeline serves the new revision (the gate) and this pool's surge is Ready.
            if not (gate and surge is not None and is_ready(live[surge])):
                return
            stale = old
        if stale and all_ready and not replaced:
            victim = live[stale[0]]
            await drain.begin(self.api, victim)
            self._event(pool, "Normal", "RollingUpdate",
                        f"replacing {victim['metadata']['name']} with the new spec"
                        + (f" (revision {target})" if old else ""))

    def _surge_ordinal(self, pool: Obj, by_ordinal: dict[int, Obj], wanted: list[int],
                       returning: set[int] | None) -> int:
        """Where a release's surge replica goes: the ordinal of the one this pool created
        last while its first watch event has not arrived, else the lowest ordinal nobody
        holds. Why not always the lowest: the view changes in between. A surge replaced while
        the old one still terminates is created above it; when the old one is gone before the
        new one's event arrives, the lowest free ordinal is a different name, and a second
        surge would be created (seen under load: 4 replicas of a 2-replica stage serving)."""
        key = _meta_key(pool)
        ns, name = key
        last = self._surge_created.get(key)
        if (last is not None and last not in wanted
                and (ns, kube.replica_name(name, last)) in self._expected):
            return last
        taken = {*by_ordinal, *wanted, *retirement.retired(pool).ordinals, *(returning or ())}
        ordinal = min(o for o in range(len(taken) + 1) if o not in taken)
        self._surge_created[key] = ordinal
        return ordinal

    def _release_gate(self, pool: Obj) -> bool:
        """The pipeline's release gate (release.gate_open) over its pools in the view. When it
        opens or closes, the pipeline's other pools are reconciled: a pool waiting on it has
        no event of its own to wake it."""
        ns, name = _meta_key(pool)
        pipeline = pool["spec"]["pipeline"]
        members: list[release.PoolRelease] = []
        for pname in self.pools_of(ns, pipeline):
            sibling = self.pools.get((ns, pname))
            if sibling is None:
                continue
            try:
                target = release.pool_revision(sibling)
            except (ValueError, KeyError, TypeError):
                continue  # an invalid pool is refused on its own reconcile
            members.append(release.PoolRelease(
                target, list(self.pods.get((ns, pname), {}).values())))
        gate = release.gate_open(members)
        if self._gates.get((ns, pipeline)) != gate:
            self._gates[(ns, pipeline)] = gate
            for pname in self.pools_of(ns, pipeline):
                if pname != name:
                    self.enqueue(("StagePool", ns, pname))
        return gate


def few(names: list[str], limit: int = EVENT_NAMES) -> str:
    """Up to `limit` names, the rest counted: an event about many objects stays short."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def created_message(created: list[tuple[str, str]]) -> str:
    """The one `Created` event of a pipeline reconcile: counts by kind, a few names of each."""
    by_kind: dict[str, list[str]] = {}
    for kind, name in created:
        by_kind.setdefault(kind, []).append(name)
    return "created " + ", ".join(
        f"{len(names)} {kind}{'' if len(names) == 1 else 's'} ({few(sorted(names))})"
        for kind, names in sorted(by_kind.items()))


def _staying(by_ordinal: dict[int, Obj]) -> list[int]:
    """Ordinals of replicas that are not retiring (the drain mark). A replica terminating
    without it (evicted, deleted by hand, or replaced by the operator while it served nothing)
    keeps its ordinal: its replacement takes its name once it is gone. A release's surge
    replica is extra, outside the ordinals the pool keeps (see _converge_pods)."""
    return [o for o, p in by_ordinal.items()
            if not kube.marked_draining(p) and not release.is_surge(p)]


def _spec_hash(pod: Obj) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(kube.ANNOTATION_SPEC_HASH)


def _evicted(pod: Obj) -> bool:
    """Deleted through the Eviction API (`kubectl drain`): the API server marks it first."""
    cond = kube.condition(pod, "DisruptionTarget")
    return bool(cond and cond.get("status") == "True"
                and cond.get("reason") == "EvictionByEvictionAPI")


@dataclass(frozen=True)
class _StatusWrite:
    """Our last status write to one object: the versions older than it that the view may still
    show (the one it was written against, earlier writes' results), and what it wrote."""

    stale: frozenset[str]
    status: Obj
    result: str
    at: float  # when (Controller.clock): coalesced changes wait STATUS_COALESCE_SECONDS from it


def _timeless(status: Obj) -> Obj:
    """A status without its conditions' transition times (a re-derived condition gets a new one)."""
    conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                  for c in status.get("conditions") or []]
    return {**status, "conditions": conditions}
