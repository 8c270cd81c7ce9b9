"""StagePool reconciles: a pool's budget, readiness gates, retirements and replicas converged
to its spec, one disruption at a time, and its status written. A release (omni_operator.release)
adds one surge replica of the new revision and retires old-revision replicas while the
pipeline's release gate is open.

What the reconciler remembers between passes is about replicas: which it deleted itself, which
were evicted, which went unasked and come back under their name, which it created and awaits
the watch event of, and which scheduler messages it warned about.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial

from omni_operator import builders, drain, release, retirement
from omni_operator.autoscaler import Autoscaler
from omni_operator.events import now_iso
from omni_operator.placement import unschedulable_message
from omni_operator.readiness import gate_patch, is_draining, is_ready
from omni_operator.status import model_failure, pool_status
from omni_operator.view import Key, Obj, ObjectView, Scheduler, meta_key
from omni_operator.writes import Writes, few
from omnistage import kube
from omnistage.kubeapi import gather_all, path
from omnistage.spec import SpecError, parse_stagepool

log = logging.getLogger("omnistage.operator")

#: How long a created pod is expected before its watch event (the view lags the API server
#: under load); within it, a pool reconcile does not create that pod again. After it, the create
#: is retried (a 409 if it exists), so a lost event never leaves a replica missing.
CREATE_EXPECTED_SECONDS = 30.0


def _staying(by_ordinal: dict[int, Obj]) -> list[int]:
    """Ordinals of replicas that are not retiring (the drain mark). A replica terminating
    without it (evicted, deleted by hand, or replaced by the operator while it served nothing)
    keeps its ordinal: its replacement takes its name once it is gone. A release's surge
    replica is extra, outside the ordinals the pool keeps (see _converge_pods)."""
    return [o for o, p in by_ordinal.items()
            if not kube.marked_draining(p) and not release.is_surge(p)]


def _spec_hash(pod: Obj) -> str | None:
    """The pod template digest a replica was made from (out of date when it differs)."""
    return (pod["metadata"].get("annotations") or {}).get(kube.ANNOTATION_SPEC_HASH)


def _evicted(pod: Obj) -> bool:
    """Deleted through the Eviction API (`kubectl drain`): the API server marks it first."""
    cond = kube.condition(pod, "DisruptionTarget")
    return bool(cond and cond.get("status") == "True"
                and cond.get("reason") == "EvictionByEvictionAPI")


class PoolReconciler:
    """Converges one StagePool at a time from the view, writing through `writes`."""

    def __init__(self, view: ObjectView, writes: Writes, scheduler: Scheduler,
                 autoscaler: Autoscaler, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.writes = writes
        self.scheduler = scheduler
        self.autoscaler = autoscaler  # its decision in the status; orchestrator loads (drain)
        self.clock = clock
        self._model_warned: set[str] = set()  # pod uids whose model failure was reported
        # (ns, pool) -> the scheduler messages its InsufficientCapacity events said, while some
        # replica still shows them: one event per message per pool, not one per pod.
        self._unschedulable: dict[tuple[str, str], set[str]] = {}
        self._intended: set[str] = set()  # pod uids the operator deleted itself (retired, stale)
        self._evictions: set[str] = set()  # pod uids evicted through the Eviction API
        # (ns, pool) -> ordinals of replicas gone unasked, until they are back under their name
        self._returning: dict[tuple[str, str], set[int]] = {}
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

    # ---- what the view tells ---------------------------------------------------------------

    def pod_seen(self, pod: Obj, gone: bool) -> None:
        """A pool's or orchestrator's pod came, changed or went."""
        meta = pod["metadata"]
        if _evicted(pod):
            self._evictions.add(meta.get("uid", ""))
        self._expected.pop((meta["namespace"], meta["name"]), None)
        if gone and (meta.get("labels") or {}).get(kube.LABEL_POOL):
            self._replica_gone(pod)

    def pool_gone(self, key: tuple[str, str]) -> None:
        """A pool went: nothing to remember of its warnings and surges."""
        self._unschedulable.pop(key, None)
        self._surge_created.pop(key, None)

    def pipeline_gone(self, key: tuple[str, str]) -> None:
        """A pipeline went: its release gate goes too."""
        self._gates.pop(key, None)

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
        self._model_warned.discard(uid)
        ns, pool_name = meta["namespace"], meta["labels"][kube.LABEL_POOL]
        pool = self.view.pools.get((ns, pool_name))
        if pool is None or pool["metadata"].get("deletionTimestamp"):
            self._returning.pop((ns, pool_name), None)
            return
        owner = self.view.pipelines.get((meta["namespace"], pool["spec"].get("pipeline", "")))
        if owner is not None and owner["metadata"].get("deletionTimestamp"):
            return
        retired = kube.marked_draining(pod)
        if retired:
            return
        ordinal = retirement.ordinal_of(pod)
        returning = self._returning.setdefault((ns, pool_name), set())
        returning.add(ordinal)
        present = {retirement.ordinal_of(p): p
                   for p in self.view.pods.get((ns, pool_name), {}).values()}
        if ordinal not in retirement.wanted_ordinals(pool, self._present(pool, present)):
            returning.discard(ordinal)  # a scale-down took its place: it does not come back
            return
        name = meta["name"]
        if evicted:
            self.writes.event(pool, "Normal", "ReplicaEvicted",
                              f"replica {name} was evicted; replacing it under the same name")
        elif not intended:
            self.writes.event(pool, "Warning", "ReplicaLost",
                              f"replica {name} disappeared; replacing it under the same name")

    def _present(self, pool: Obj, by_ordinal: dict[int, Obj]) -> list[int]:
        """The ordinals that keep their place in the pool: replicas not retiring (_staying)
        nor a release's surge, and replicas gone unasked that have not come back yet, so a
        lost or evicted replica returns under its own name even when a lower ordinal is
        free."""
        meta = pool["metadata"]
        return sorted({*_staying(by_ordinal),
                       *self._returning.get((meta["namespace"], meta["name"]), ())})

    async def reconcile(self, pool: Obj) -> None:
        """Budget, readiness gates, model failures, retirements, replicas, then the status:
        each step writes only what differs from the view."""
        ns, name = meta_key(pool)
        key: Key = ("StagePool", ns, name)
        owner = self.view.pipelines.get((ns, (pool.get("spec") or {}).get("pipeline", "")))
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
            await self.writes.refuse(pool, exc)
            return
        self.writes.accepted(key)
        pods = dict(self.view.pods.get((ns, name), {}))
        _, template_hash = builders.pod_template(pool)
        now = now_iso()

        pdb = builders.pool_pdb(pool)
        current = self.view.children.get(("PodDisruptionBudget", ns, pdb["metadata"]["name"]))
        if builders.pdb_due(pdb, current, sum(1 for p in pods.values() if is_ready(p))):
            await self.writes.ensure(pdb, current)

        # Readiness gates of several replicas flip together: patch them concurrently.
        gates = [(pod["metadata"]["name"], gate_patch(pod, now))
                 for pod in pods.values()]
        await gather_all(self.writes.write("Pod", ns, pname, self.writes.api.patch(
            path("Pod", ns, pname, "status"), patch, kind="strategic",
            fieldManager=builders.FIELD_MANAGER))
            for pname, patch in gates if patch is not None)
        self._warn_unschedulable(pool, pods)
        for pod in pods.values():
            uid = pod["metadata"].get("uid", "")
            failure = model_failure(pod)
            if failure and uid not in self._model_warned:
                self._model_warned.add(uid)
                self.writes.event(pool, "Warning", *failure)

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
                    self.writes.event(pool, "Warning", "DrainTimeout",
                                      drain.timeout_message(pname, progress, pins))
                self._intended.add(pod["metadata"].get("uid", ""))
                await self.writes.delete("Pod", ns, pname)
            else:
                self.scheduler.enqueue_later(key, drain.POLL_SECONDS)

        changed, annotation = retirement.rewrite(pool)
        if changed:
            # A scale-up freed retired ordinals (one per added replica): write what is left, or
            # remove the annotation (one write, then none). It is `omnistage drain`'s (its own
            # field manager), not in the operator's intent, so an apply cannot change it: a
            # merge patch does.
            await self.writes.write("StagePool", ns, name, self.writes.api.patch(
                path("StagePool", ns, name),
                {"metadata": {"annotations": {retirement.ANNOTATION_RETIRED: annotation}}},
                fieldManager=builders.FIELD_MANAGER))

        await self._converge_pods(pool, pods, template_hash, bool(retiring))

        status = pool_status(pool, list(self.view.pods.get((ns, name), {}).values()),
                             template_hash, now, self.autoscaler.report(pool))
        await self.writes.patch_status(pool, status, coalesce=True)

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
        key = meta_key(pool)
        said = self._unschedulable.get(key, set())
        for msg, names in held.items():
            if msg not in said:
                self.writes.event(pool, "Warning", "InsufficientCapacity",
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
            self._surge_created.pop(meta_key(pool), None)
        missing = [pod for pod in wanting
                   if now - self._expected.get((ns, pod["metadata"]["name"]), -math.inf)
                   > CREATE_EXPECTED_SECONDS]
        results = await gather_all(self.writes.api.create(path("Pod", ns), pod, ignore=(409,),
                                             fieldManager=builders.FIELD_MANAGER)
                             for pod in missing)
        for pod in missing:  # created, or there already (409): its watch event is coming
            if self.view.get("Pod", ns, pod["metadata"]["name"]) is None:
                self._expected[(ns, pod["metadata"]["name"])] = now
        # If an event never comes, look again once the expectation has lapsed. Armed by every
        # reconcile that still awaits a pod, not only the one that created it: a key keeps one
        # delayed reconcile (the earliest), so a sooner one (a coalesced status write) takes
        # this one's place, and the reconcile it brings must arm it again.
        since = [self._expected[(ns, pod["metadata"]["name"])] for pod in wanting
                 if (ns, pod["metadata"]["name"]) in self._expected]
        if since:
            self.scheduler.enqueue_later(("StagePool", ns, pool["metadata"]["name"]),
                                         min(since) + CREATE_EXPECTED_SECONDS + 1.0 - now)
        created = [pod["metadata"]["name"]
                   for pod, result in zip(missing, results, strict=True) if result is not None]
        if created:
            self.writes.event(pool, "Normal", "ReplicasCreated",
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
                await self.writes.delete("Pod", ns, p["metadata"]["name"])
            self.writes.event(pool, "Normal", "RollingUpdate",
                              f"replacing {', '.join(names)} (out of date and not ready)")
        if retiring:
            return  # one retirement at a time keeps us within the disruption budget
        replacing = retirement.retired(pool).replace
        leaving = sorted((o for o in live
                          if o not in wanted and o not in replacing and o not in surges),
                         reverse=True)
        if leaving:
            victim = live[leaving[0]]
            await drain.begin(self.writes.api, victim)
            self.writes.event(pool, "Normal", "ScalingDown",
                              f"retiring {victim['metadata']['name']} (replicas -> {len(wanted)})")
            return
        all_ready = all(o in live and is_ready(live[o]) for o in wanted)
        # A surge replica no longer needed (the release is over, or reverted past it) leaves
        # once every wanted replica is Ready; at once when it serves nothing.
        done = [o for o in surges if o != surge]
        if done and (all_ready or not is_ready(live[done[0]])):
            victim = live[done[0]]
            await drain.begin(self.writes.api, victim)
            self.writes.event(pool, "Normal", "ReleaseSurgeRetired",
                              f"retiring {victim['metadata']['name']}: the release's extra replica")
            return
        replaced = sorted(o for o in live if o not in wanted and o in replacing)
        if replaced and all_ready:
            victim = live[replaced[0]]
            await drain.begin(self.writes.api, victim)
            self.writes.event(pool, "Normal", "Replaced",
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
            await drain.begin(self.writes.api, victim)
            self.writes.event(pool, "Normal", "RollingUpdate",
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
        key = meta_key(pool)
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
        ns, name = meta_key(pool)
        pipeline = pool["spec"]["pipeline"]
        members: list[release.PoolRelease] = []
        for pname in self.view.pools_of(ns, pipeline):
            sibling = self.view.pools.get((ns, pname))
            if sibling is None:
                continue
            try:
                target = release.pool_revision(sibling)
            except (ValueError, KeyError, TypeError):
                continue  # an invalid pool is refused on its own reconcile
            members.append(release.PoolRelease(
                target, list(self.view.pods.get((ns, pname), {}).values())))
        gate = release.gate_open(members)
        if self._gates.get((ns, pipeline)) != gate:
            self._gates[(ns, pipeline)] = gate
            for pname in self.view.pools_of(ns, pipeline):
                if pname != name:
                    self.scheduler.enqueue(("StagePool", ns, pname))
        return gate
