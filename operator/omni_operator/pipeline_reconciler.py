"""OmniPipeline reconciles: its children applied in two waves, pools of removed stages pruned,
its status written; a deleting pipeline shut down in order (orchestrator, pools, finalizer).
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from omni_operator import builders, curve_rotation
from omni_operator.admin_credential import AdminCredential
from omni_operator.curve_rotation import CurveKeysState
from omni_operator.events import iso, now_iso, unix
from omni_operator.network_policy import NetworkPolicySettings
from omni_operator.status import (
    pipeline_status,
    terminating_status,
    transition_event,
    waking_for,
)
from omni_operator.status_models import CurveKeysStatus, PipelineStatus
from omni_operator.view import Key, Obj, ObjectView, Scheduler, meta_key
from omni_operator.writes import Writes, few, owners, owns, removed
from omnistage import curve_keys, kube
from omnistage.kubeapi import gather_all, path
from omnistage.spec import OmniPipeline, SpecError, parse_pipeline

log = logging.getLogger("omnistage.operator")

#: While a CurveZMQ rotation waits for the old pods to go, how often the pipeline is looked at
#: again (besides the events of its pools and Deployment).
CURVE_RECHECK_S = 5.0
#: How long after a pair is added to the Secret the pods move to it: the kubelet refreshes a
#: mounted Secret within its sync period (about a minute), unobservably (--curve-propagation).
CURVE_PROPAGATION_S = 90.0


def curve_keys_state(doc: Obj | None) -> CurveKeysState:
    """status.curveKeys as the rotation's state (absent: the first pair only)."""
    if not doc:
        return CurveKeysState()
    at = unix(doc.get("addedAt"))
    secret = tuple(int(g) for g in doc.get("secret") or [0])
    return CurveKeysState(int(doc.get("generation") or 0), secret or (0,), at)


def curve_keys_status(state: CurveKeysState) -> CurveKeysStatus | None:
    """The state as status.curveKeys; None (no field) for a pipeline never rotated."""
    if state == CurveKeysState():
        return None
    added = iso(state.added_at) if state.added_at is not None else None
    return CurveKeysStatus(generation=state.generation, secret=list(state.secret),
                           added_at=added)

FINALIZER = "omnistage.io/ordered-shutdown"
#: A pipeline's children that run pods, applied once the rest (what their pods reference) is.
WORKLOADS = ("Deployment", "StagePool")
#: A deleting pipeline's next shutdown step is looked at again after this long. Each step
#: ends in events that reconcile the pipeline (its orchestrator pod, its stage pods, its pools
#: gone), so this is the backstop, not the pace: once a second, 500 deleting pipelines were
#: 500 reconciles a second through a whole teardown.
SHUTDOWN_RECHECK_SECONDS = 5.0

def created_message(created: list[tuple[str, str]]) -> str:
    """The one `Created` event of a pipeline reconcile: counts by kind, a few names of each."""
    by_kind: dict[str, list[str]] = {}
    for kind, name in created:
        by_kind.setdefault(kind, []).append(name)
    return "created " + ", ".join(
        f"{len(names)} {kind}{'' if len(names) == 1 else 's'} ({few(sorted(names))})"
        for kind, names in sorted(by_kind.items()))


class PipelineReconciler:
    """Converges one OmniPipeline at a time from the view, writing through `writes`."""

    def __init__(self, view: ObjectView, writes: Writes, scheduler: Scheduler,
                 network_policy: NetworkPolicySettings | None = None,
                 admin: AdminCredential | None = None) -> None:
        self.view = view
        self.writes = writes
        self.scheduler = scheduler  # the next shutdown step's re-check
        # The operator's --network-policy setting (None: off), passed to every build.
        self.network_policy = network_policy
        # The root of every pipeline's admin key (--admin-key-file; `omnistage operator` sets
        # it). Each orchestrator pod is built with its pipeline's key digest; the autoscaler
        # presents the key (admin_key). None given: one made for this reconciler's life.
        self.admin = admin or AdminCredential.generate()
        self._terminating: set[str] = set()  # uids of pipelines whose deletion was announced
        self.curve_made: set[str] = set()  # uids of pipelines whose CurveZMQ Secret exists
        self.api_keys_made: set[str] = set()  # uids of pipelines whose API-key Secret exists
        # --curve-propagation: how long after a pair is added the pods move to it.
        self.curve_propagation_s = CURVE_PROPAGATION_S

    async def reconcile(self, obj: Obj) -> None:
        """Finalizer, children (two waves), pruned pools, status; a deleting pipeline shuts
        down instead."""
        ns, name = meta_key(obj)
        if obj["metadata"].get("deletionTimestamp"):
            await self.shutdown(obj)
            return
        try:
            pipeline = parse_pipeline(obj)
        except SpecError as exc:
            await self.writes.refuse(obj, exc)
            return
        self.writes.accepted(("OmniPipeline", ns, name))
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if FINALIZER not in finalizers:
            # Our finalizer only: finalizers are a set to server-side apply, so the others
            # (and a concurrent writer's) stay; nobody else can own ours, so no force.
            await self.writes.apply_finalizers(obj, [FINALIZER])
        await self.ensure_curve_secret(obj, pipeline)
        await self.ensure_api_key_secret(obj, pipeline)
        curve = await self.rotate_curve_keys(obj, pipeline)
        # Children that differ are applied together, in two waves (each apply waits on the API
        # server; a first reconcile made nine in a row, and the pools' pods waited on them):
        # what the workloads reference (config, account, RBAC, Service) and the network
        # policies that must be in force when their pods start, then the workloads.
        pools = self.view.pools
        # The orchestrator pods admit the digest of the key the autoscaler presents.
        digest = self.admin.digest(ns, name, obj["metadata"].get("uid", ""))
        children = builders.pipeline_children(obj, pipeline, {
            s.name: pools.get((ns, kube.pool_name(name, s.name)))
            for s in pipeline.spec.stages}, network_policy=self.network_policy,
            admin_key_digests=(digest,), curve_generation=curve.generation)
        created: list[tuple[str, str]] = []  # (kind, name) of the workloads this pass created
        try:
            for wave in (False, True):
                await gather_all(self.ensure_child(obj, child, created) for child in children
                                 if (child["kind"] in WORKLOADS) == wave)
        finally:  # one event for the pass, also when an apply after the creates failed
            if created:
                self.writes.event(obj, "Normal", "Created", created_message(created))
        await self.prune_pools(pipeline, ns)
        stages = {
            s.name: self.view.pools.get((ns, kube.pool_name(name, s.name)))
            for s in pipeline.spec.stages
        }
        deployment = self.view.deployments.get((ns, builders.orchestrator_name(name)))
        now = now_iso()
        # A stage waking from zero serves while its held requests can still wait: up to the
        # request timeout (status.py, "Waking").
        bound = float(pipeline.spec.orchestrator.request_timeout_seconds)
        status = pipeline_status(
            obj,
            [s.name for s in pipeline.spec.stages],
            stages,
            deployment,
            pipeline.spec.orchestrator.replicas,
            builders.endpoint(pipeline, ns),
            now,
            wake_bound_s=bound,
            api_key_secret=builders.api_key_secret_of(pipeline, obj["metadata"].get("uid", "")),
            curve_keys=curve_keys_status(curve),
        )
        await self.write_status(obj, status)
        # No pool event may come when the bound passes: look again then.
        waking = [w for pool in stages.values() if (w := waking_for(pool, now)) is not None
                  and w < bound]
        if waking:
            self.scheduler.enqueue_later(("OmniPipeline", ns, name), bound - max(waking) + 1.0)

    def admin_key(self, namespace: str, name: str) -> str | None:
        """The admin key of the pipeline the view has by that name (its uid is part of it), or
        None when the view has no such pipeline."""
        obj = self.view.pipelines.get((namespace, name))
        if obj is None:
            return None
        return self.admin.key(namespace, name, obj["metadata"].get("uid", ""))

    async def ensure_curve_secret(self, obj: Obj, pipeline: OmniPipeline) -> None:
        """Create the pipeline's CurveZMQ Secret (a pair made now) once, before its pods that
        mount it. Never read back: the operator may create Secrets, not read them, so a 409
        means it is there already. A restarted operator that finds a pool naming it (made after
        it) writes nothing."""
        uid = obj["metadata"].get("uid", "")
        if uid in self.curve_made:
            return
        ns, name = meta_key(obj)
        secret = builders.curve_secret_name(name, uid)
        if any((self.view.pools.get((ns, kube.pool_name(name, s.name))) or {}).get(
                "metadata", {}).get("annotations", {}).get(kube.ANNOTATION_CURVE_SECRET)
               == secret for s in pipeline.spec.stages):
            # A pool naming it was made after it (a restarted operator): no write to know.
            self.curve_made.add(uid)
            return
        await self.writes.create_once(builders.curve_secret(obj, pipeline, curve_keys.generate()))
        self.curve_made.add(uid)

    async def rotate_curve_keys(self, obj: Obj, pipeline: OmniPipeline) -> CurveKeysState:
        """One step of a CurveZMQ key rotation (omni_operator.curve_rotation), from the state
        the status recorded: the Secret patched first, the status written by the pass, the
        pods built with the generation returned."""
        ns, name = meta_key(obj)
        state = curve_keys_state((obj.get("status") or {}).get("curveKeys"))
        desired, problem = curve_rotation.desired_generation(
            obj["metadata"].get("annotations"), state)
        if problem is not None:
            self.writes.event(obj, "Warning", "CurveKeysRefused", problem)
        oname = builders.orchestrator_name(name)
        groups = [(ns, kube.pool_name(name, s.name)) for s in pipeline.spec.stages]
        generations = {curve_rotation.pod_generation(pod["metadata"].get("annotations"))
                       for group in (*groups, (ns, oname))
                       for pod in (self.view.pods.get(group) or {}).values()}
        step = curve_rotation.step(state, desired, generations, time.time(),
                                   self.curve_propagation_s)
        secret = path("Secret", ns, builders.curve_secret_name(name, obj["metadata"].get(
            "uid", "")))
        if step.add is not None:
            await self.writes.write("Secret", ns, secret, self.writes.api.patch(
                secret, builders.curve_secret_add(step.add, curve_keys.generate())))
        if step.drop:
            await self.writes.write("Secret", ns, secret, self.writes.api.patch(
                secret, builders.curve_secret_drop(step.drop)))
        if step.event is not None:
            self.writes.event(obj, "Normal", *step.event)
        if step.again_in is not None:
            self.scheduler.enqueue_later(("OmniPipeline", ns, name), step.again_in + 0.5)
        elif len(step.state.secret) > 1:  # waiting for the old pods to go: look again
            self.scheduler.enqueue_later(("OmniPipeline", ns, name), CURVE_RECHECK_S)
        return step.state

    async def ensure_api_key_secret(self, obj: Obj, pipeline: OmniPipeline) -> None:
        """Keys on by default: a pipeline that names no apiKeySecret (and does not say
        auth.disabled) gets a Secret with one random key, created once before the orchestrator
        pods that mount it, never read back or changed (the user reads it, and rotates it by
        editing it). A restarted operator that finds the orchestrator Deployment mounting it
        (made after it) writes nothing."""
        uid = obj["metadata"].get("uid", "")
        auth = pipeline.spec.orchestrator.auth
        if auth.disabled or auth.api_key_secret or uid in self.api_keys_made:
            return
        ns, name = meta_key(obj)
        secret = builders.api_key_secret_name(name, uid)
        deployment = self.view.deployments.get((ns, builders.orchestrator_name(name))) or {}
        volumes = (((deployment.get("spec") or {}).get("template") or {}).get("spec")
                   or {}).get("volumes") or []
        if any((v.get("secret") or {}).get("secretName") == secret for v in volumes):
            self.api_keys_made.add(uid)
            return
        await self.writes.create_once(
            builders.api_key_secret(obj, pipeline, "sk-" + secrets.token_urlsafe(32)))
        self.api_keys_made.add(uid)

    async def write_status(self, obj: Obj, status: PipelineStatus) -> None:
        """Write the status; when the phase or the Ready reason changed, say so in one event on
        the pipeline, so `kubectl describe omnipipe` tells the story without the pools'."""
        before = PipelineStatus.stored(obj)
        if await self.writes.patch_status(obj, status, coalesce=True) and (
                event := transition_event(before, status)):
            self.writes.event(obj, *event)

    async def ensure_child(self, owner: Obj, child: Obj,
                           created: list[tuple[str, str]] | None = None) -> None:
        """Apply one child of a pipeline; a workload it creates is added to `created` (the
        caller says so in one event per reconcile, not one per child)."""
        kind, meta = child["kind"], child["metadata"]
        key = (meta["namespace"], meta["name"])
        if kind == "StagePool":
            current = self.view.pools.get(key)
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
                    self.writes.event(
                        owner,
                        "Normal",
                        "Scaled",
                        f"stage {child['spec']['stage']['name']}: replicas "
                        f"{current['spec'].get('replicas')} -> {child['spec']['replicas']}",
                    )
        elif kind == "Deployment":
            current = self.view.deployments.get(key)
        else:
            current = self.view.children.get((kind, *key))

        async def on_create() -> None:
            if kind in WORKLOADS and created is not None:
                created.append((kind, meta["name"]))

        await self.writes.ensure(child, current, on_create)

    async def prune_pools(self, pipeline: OmniPipeline, ns: str) -> None:
        """Delete the pools of stages the pipeline no longer has (from the index: no scan)."""
        name = pipeline.metadata.name
        wanted = {kube.pool_name(name, s.name) for s in pipeline.spec.stages}
        for pname in self.view.pools_of(ns, name):
            if pname not in wanted:
                await self.writes.delete("StagePool", ns, pname)

    # ---- ordered shutdown ------------------------------------------------------------------

    async def shutdown(self, obj: Obj) -> None:
        """Ordered shutdown: orchestrator drains first, then the stage pools, then release."""
        ns, name = meta_key(obj)
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if FINALIZER not in finalizers:
            return
        key: Key = ("OmniPipeline", ns, name)
        self._announce_terminating(obj)
        oname = builders.orchestrator_name(name)
        dep = self.view.deployments.get((ns, oname))
        api = self.writes.api
        if dep is not None and dep["spec"].get("replicas", 0) != 0:
            await self.writes.write("Deployment", ns, oname, api.patch(
                path("Deployment", ns, oname), {"spec": {"replicas": 0}},
                fieldManager=builders.FIELD_MANAGER))
        if self.view.pods.get((ns, oname)):
            await self.writes.patch_status(obj, terminating_status(
                obj, "draining the orchestrator", now_iso()))
            self.scheduler.enqueue_later(key, SHUTDOWN_RECHECK_SECONDS)
            return
        if await self._stop_pools(ns, name):
            await self.writes.patch_status(obj, terminating_status(
                obj, "stopping the stage pools", now_iso()))
            self.scheduler.enqueue_later(key, SHUTDOWN_RECHECK_SECONDS)
            return
        if owners(obj, ("metadata", "finalizers", f"v:{json.dumps(FINALIZER)}")) == {
                (builders.FIELD_MANAGER, "Apply", "")}:
            # Applying an intent without it releases our finalizer, and nobody else holds it:
            # the API server removes it, and leaves every other finalizer alone.
            released = await self.writes.apply_finalizers(obj, [])
        else:
            # Added by an operator from before server-side apply (an update owns it): a release
            # would leave it, so the list is written without it.
            remaining = [f for f in finalizers if f != FINALIZER]
            released = await self.writes.write("OmniPipeline", ns, name, api.patch(
                path("OmniPipeline", ns, name), {"metadata": {"finalizers": remaining or None}},
                fieldManager=builders.FIELD_MANAGER))
        if removed(released):  # the last finalizer: the API server removed it (no 2nd release)
            self.view.forget("OmniPipeline", ns, name, deleted_by_us=True)
        self._terminating.discard(obj["metadata"].get("uid", ""))
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
        pools = self.view.pools_of(ns, pipeline)
        for pn in pools:
            if ("PodDisruptionBudget", ns, pn) in self.view.children:
                await self.writes.delete("PodDisruptionBudget", ns, pn)
        pods = [p for pn in pools for p in self.view.pods.get((ns, pn), {}).values()]
        if any(not p["metadata"].get("deletionTimestamp") for p in pods):
            await self.writes.api.delete(path("Pod", ns),
                                         labelSelector=kube.stage_selector(pipeline),
                                         ignore=(404,))
        if pods:
            return True  # the pools stay until their pods are gone: no cascade to run
        for pn in pools:
            pool = self.view.pools.get((ns, pn))
            if pool is not None and not pool["metadata"].get("deletionTimestamp"):
                await self.writes.delete("StagePool", ns, pn)
        return any((ns, pn) in self.view.pools for pn in pools)

    def _announce_terminating(self, obj: Obj) -> None:
        """One Normal `Terminating` event when a pipeline's deletion starts (docs/crds.md):
        not per reconcile (remembered by uid), and not again after an operator restart once
        the status says Terminating."""
        uid = obj["metadata"].get("uid", "")
        if uid in self._terminating or (obj.get("status") or {}).get("phase") == "Terminating":
            return
        self._terminating.add(uid)
        self.writes.event(obj, "Normal", "Terminating",
                          "pipeline is being deleted: the orchestrator drains first, then the "
                          "stage pools stop, then the finalizer is released")
