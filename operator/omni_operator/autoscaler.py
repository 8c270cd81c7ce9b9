"""The operator's autoscaler: sizes every StagePool whose stage has `autoscaling`.

Every periodSeconds per pool it reads the pipeline's load from EVERY ready orchestrator pod
(GET /v1/load on the pod's admin listener, straight from each pod, once per pipeline per
period; through the API server's service proxy to the admin Service where a pod cannot be
reached; each read carries the pipeline's admin key in kube.ADMIN_KEY_HEADER, derived by
omni_operator.admin_credential and never logged), combines them (combine_loads: each orchestrator
measures only the requests it routes), decides with omnistage.autoscaling.decide (the same
maths `omnistage serve` uses) and, when the size changes, writes spec.replicas through the scale
subresource, as `kubectl scale` does: the pool's reconcile then creates replicas, or drains one
before deleting it. A pool at zero whose orchestrator asks for a wake (the annotation
omnistage.io/wake-requested-at) is scaled at once, on the pool's watch event, not on the next
period. The same reader answers the pool reconcile's question about all of a pipeline's
requests (Autoscaler.orchestrator_loads: every running orchestrator pod's load, for the pin
wait of a leaving revision's last replica, drain.py).

What it writes, and when (docs/architecture.md, "Autoscaling"):
- spec.replicas (field manager omnistage-autoscaler, subresource scale) and one Event, only
  when the size changes: a steady pool costs one read of its pipeline's load per period and no
  write;
- status.autoscaler, the decision explained (inputs, figure, decision, time), through the
  pool's own reconcile (omni_operator.writes.Writes.patch_status writes only what changed),
  only when the desired size, the signal's availability, the number of orchestrators read or
  not read (a partial read from the second in a row) or an external autoscaler's presence
  changes;
- nothing when the load cannot be read, except to bring a pool up to minReplicas or to wake
  it: an unreadable signal never scales down. When some orchestrators are read and others are
  not, the figures are a floor of the load: the pool may grow on them, never shrink (decide's
  `complete=False`). Every decision names the orchestrators it read and those it could not.

A pool that a HorizontalPodAutoscaler (or KEDA, which drives one) targets has two owners for
one count: the autoscaler refuses it (status condition Autoscaling False, reason
ExternalAutoscaler, one Warning event) and leaves the count to the HPA.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pydantic import ValidationError

from omni_operator import builders
from omni_operator.events import iso, unix
from omni_operator.loadclient import LoadClient
from omni_operator.models import desired_replicas
from omni_operator.placement import unschedulable_message
from omni_operator.readiness import is_ready
from omni_operator.status_models import AutoscalerStatus, PoolStatus
from omnistage.autoscaling import (
    ANNOTATION_WAKE_REQUESTED,
    LOAD_PATH,
    AutoscalerState,
    Decision,
    decide,
)
from omnistage.kube import ADMIN_KEY_HEADER, ADMIN_PORT_NAME
from omnistage.kubeapi import ApiError, ConfigError, gather_all, path, resource_path
from omnistage.spec import Autoscaling, OrchestratorSpec

__all__ = [
    "FIELD_MANAGER",
    "LOAD_URL_ENV",
    "Autoscaler",
    "LoadUnavailable",
    "OrchestratorLoads",
    "StageFigures",
    "combine_loads",
    "hpa_targets",
    "stage_figures",
    "status_of",
]

log = logging.getLogger("omnistage.operator.autoscaler")

Obj = dict[str, Any]
PoolKey = tuple[str, str]  # (namespace, pool name)
#: The field manager of spec.replicas once the autoscaler wrote it (`kubectl get sp
#: --show-managed-fields` names the count's owner).
FIELD_MANAGER = "omnistage-autoscaler"
#: Test hook: read the load from this URL template ({namespace}, {pipeline}) instead of the
#: orchestrator (a cluster test serves a fake /v1/load); the admin key goes there too.
LOAD_URL_ENV = "OMNISTAGE_AUTOSCALER_LOAD_URL"
#: The admin port when neither the admin Service nor the pipeline says (spec.orchestrator's
#: defaults: port 8000, adminPort port + 1).
DEFAULT_ADMIN_PORT: int = OrchestratorSpec().admin_listen_port
LOAD_TIMEOUT = 2.0
#: How often the loop looks for due pools; a wake does not wait for it.
TICK_SECONDS = 1.0
#: HorizontalPodAutoscalers are listed at most this often per namespace.
HPA_REFRESH_SECONDS = 30.0
#: A wake within a second of a scale-down counts: the orchestrator stamps milliseconds
#: (orchestrator.wake), and the second covers clock skew between its node and the operator's.
WAKE_SLACK_SECONDS = 1.0
#: Load reads in flight at once: a fleet's reads are spread over the period (due_after), and
#: this bounds a burst (a restart, many wakes) on the API server's proxy or the orchestrators.
MAX_READS_IN_FLIGHT = 32
#: Consecutive failed reads before the status says the signal is Unavailable: one lost read (a
#: timeout on a busy node) keeps the size and writes nothing.
MISSES_BEFORE_UNAVAILABLE = 2
#: Orchestrators named in a decision's reason (the rest counted), and the length of each
#: one's failure: a reason stays within the status's 1,024 characters.
NAMED_ORCHESTRATORS = 4
FAILURE_CHARS = 160
_HPA_VERSION = "autoscaling/v2"


@dataclass(frozen=True)
class StageFigures:
    """One stage's entry of GET /v1/load. The orchestrator's wire struct is
    omnistage.orchestrator.load.StageLoad (msgspec, a runtime-only package the operator image
    lacks); a unit test keeps these fields equal to its fields."""

    replicas: int = 0
    inflight: int = 0
    held: int = 0
    arrivals_per_s: float = 0.0
    service_s: float = 0.0
    exec_s: float = 0.0
    queue_wait_p95_s: float = 0.0
    ttfo_p95_s: float = 0.0
    last_request_unix: float | None = None
    wake_pending: bool = False


def _caster(kind: Any) -> Callable[[Any], Any]:
    """The cast of a JSON value to the field's declared type (the annotations are strings)."""
    kind = str(kind)
    if kind.startswith("bool"):
        return bool
    if kind.startswith("int"):
        return int
    return float


#: (field, cast) of StageFigures, worked out once: a fleet decodes thousands a period.
_FIGURE_FIELDS: tuple[tuple[str, Callable[[Any], Any]], ...] = tuple(
    (f.name, _caster(f.type)) for f in fields(StageFigures))


def stage_figures(doc: Any, stage: str) -> StageFigures | None:
    """The figures of stage in a /v1/load document; None when it has none for it."""
    entry = ((doc or {}).get("stages") or {}).get(stage) if isinstance(doc, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        values = {name: cast(entry[name]) for name, cast in _FIGURE_FIELDS
                  if entry.get(name) is not None}
    except (TypeError, ValueError):
        return None
    return StageFigures(**values)


def _weighted_mean(pairs: Sequence[tuple[float, float]]) -> float:
    """The mean of the positive values, weighted (equal weights when every weight is 0)."""
    present = [(v, w) for v, w in pairs if v > 0]
    if not present:
        return 0.0
    total = sum(w for _, w in present)
    if total <= 0:
        return sum(v for v, _ in present) / len(present)
    return sum(v * w for v, w in present) / total


def _combine_stage(parts: Sequence[tuple[StageFigures, float]]) -> StageFigures:
    """One stage's figures from several orchestrators' ((figures, shift onto the common
    clock) each): combine_loads says how and why."""
    figs = [f for f, _ in parts]
    exec_s = 0.0
    if any(f.exec_s > 0 for f in figs):  # an older orchestrator's service_s stands for its own
        exec_s = _weighted_mean([(f.exec_s or f.service_s, f.arrivals_per_s) for f in figs])
    lasts = [f.last_request_unix + shift for f, shift in parts
             if f.last_request_unix is not None]
    return StageFigures(
        replicas=max(f.replicas for f in figs),
        inflight=sum(f.inflight for f in figs),
        held=sum(f.held for f in figs),
        arrivals_per_s=sum(f.arrivals_per_s for f in figs),
        service_s=_weighted_mean([(f.service_s, f.arrivals_per_s) for f in figs]),
        exec_s=exec_s,
        queue_wait_p95_s=max(f.queue_wait_p95_s for f in figs),
        ttfo_p95_s=max(f.ttfo_p95_s for f in figs),
        last_request_unix=max(lasts, default=None),
        wake_pending=any(f.wake_pending for f in figs),
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def combine_loads(docs: Sequence[Any]) -> Any:
    """One GET /v1/load document from every orchestrator's (pure; one document is returned as
    it is). Why: each orchestrator measures only the requests it routes, and a pipeline runs up
    to 16; sized on one of two, a pool sees half its load, and a stage the other still sends to
    looks idle.

    Per stage, over the orchestrators that report it:
    - inflight, held and arrivals_per_s add up; replicas is the most any one routes to;
    - service_s and exec_s are means weighted by each one's arrivals_per_s. That makes Little's
      law add up (arrivals x service of the whole is the sum of each one's), and over a window
      arrivals stand for completions, of which the document has no count;
    - queue_wait_p95_s and ttfo_p95_s are the largest: an upper bound of the pooled p95 (95%
      of every orchestrator's samples lie under it), so a latency target errs towards growth;
    - last_request_unix is the latest, each moved onto the latest `now` by the difference of
      the two `now`s, so clock skew between nodes does not shorten an idle time (the idle time
      is the shortest any orchestrator reports);
    - wake_pending if any asks; a stage is in use when ANY orchestrator sends to it.
    `now` is the latest, `window_s` the longest; `revisions` are left out (a question about
    pinned requests reads each orchestrator's own: drain.pinned_in_flight)."""
    parsed = [d for d in docs if isinstance(d, dict)]
    if len(parsed) == 1:
        return parsed[0]
    nows = [_number(d.get("now")) for d in parsed]
    known = [n for n in nows if n is not None]
    now = max(known) if known else None
    names: dict[str, None] = {}
    for d in parsed:
        if isinstance(d.get("stages"), dict):
            names.update(dict.fromkeys(d["stages"]))
    stages: dict[str, Obj] = {}
    for name in names:
        parts = []
        for d, own in zip(parsed, nows, strict=True):
            figures = stage_figures(d, name)
            if figures is not None:
                shift = now - own if now is not None and own is not None else 0.0
                parts.append((figures, shift))
        if parts:
            stages[name] = asdict(_combine_stage(parts))
    windows = [w for w in (_number(d.get("window_s")) for d in parsed) if w is not None]
    return {"window_s": max(windows, default=0.0), "now": now, "stages": stages}


@dataclass(frozen=True)
class OrchestratorLoads:
    """One period's read of a pipeline's orchestrators: each ready one's /v1/load by pod name,
    and those that could not be read, with why. Not complete: the load is a floor."""

    docs: dict[str, Any]
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.failed

    def note(self) -> str:
        """Which orchestrators the decision read and which it could not, for its reason."""
        read = sorted(self.docs)
        out = f"read {len(read)} orchestrator{'' if len(read) == 1 else 's'} ({_few(read)})"
        if self.failed:
            failed = sorted(self.failed.items())
            named = [f"{name} ({why[:FAILURE_CHARS]})" for name, why in
                     failed[:NAMED_ORCHESTRATORS]]
            more = len(failed) - len(named)
            out += (f"; not read: {len(failed)} (" + ", ".join(named)
                    + (f" and {more} more" if more > 0 else "") + ")")
        return out


def _few(names: list[str]) -> str:
    more = len(names) - NAMED_ORCHESTRATORS
    return ", ".join(names[:NAMED_ORCHESTRATORS]) + (f" and {more} more" if more > 0 else "")


def hpa_targets(hpas: list[Obj]) -> dict[str, str]:
    """Pool name -> the HorizontalPodAutoscaler that scales it (scaleTargetRef kind StagePool)."""
    out: dict[str, str] = {}
    for hpa in hpas:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if ref.get("kind") == "StagePool" and ref.get("name"):
            out.setdefault(str(ref["name"]), str(hpa["metadata"]["name"]))
    return out


class LoadUnavailable(Exception):
    """The pipeline's load could not be read (orchestrator down, proxy refused, bad body)."""


@dataclass
class _Tracked:
    """What the autoscaler remembers of one pool."""

    state: AutoscalerState = field(default_factory=AutoscalerState)
    due: float = 0.0
    report: AutoscalerStatus | None = None
    woken: str | None = None  # the wake annotation already acted on
    # A size written and the pool's resourceVersion before it, until the view shows the write.
    written: tuple[int, str] | None = None
    refused_by: str | None = None  # the HPA this pool was refused for (one Warning each)
    # The pool's autoscaling, parsed, and the metadata.generation it was parsed at.
    scaling: tuple[int, Autoscaling] | None = None
    misses: int = 0  # consecutive reads that gave no figures for this pool
    partials: int = 0  # consecutive reads that missed some orchestrator


#: (namespace, pipeline) -> its OrchestratorLoads, or one document (one orchestrator's: the
#: tests' and benches' hook).
ReadLoad = Callable[[str, str], Awaitable[Any]]


class Autoscaler:
    """One per operator (its controller's): a loop over the controller's view of pools."""

    def __init__(self, controller: Any, *, clock: Callable[[], float] = time.time,
                 read_load: ReadLoad | None = None, tick: float = TICK_SECONDS) -> None:
        self.controller = controller
        self.clock = clock  # wall time: wake annotations and status times are wall times
        self.read_load = read_load or self._read_load
        self.tick = tick
        self._tracked: dict[PoolKey, _Tracked] = {}
        self._wakes: set[PoolKey] = set()
        self._kick = asyncio.Event()
        self._hpas: dict[str, tuple[float, dict[str, str]]] = {}  # ns -> (read at, targets)
        self.reads = 0  # load reads, for tests and the bench
        # (due time, pool) of every tracked pool; stale entries are skipped when they come up.
        self._due: list[tuple[float, PoolKey]] = []
        self._new_pools = True  # an autoscaled pool not tracked yet was seen: scan once
        self._reading = asyncio.Semaphore(MAX_READS_IN_FLIGHT)
        # Reads straight from an orchestrator pod (or the test hook): kept-alive connections,
        # no thread per read (500 pipelines are 33 reads a second at the default period).
        self._client = LoadClient(LOAD_TIMEOUT)
        # Pipelines whose orchestrator the operator cannot reach straight (another network,
        # a policy): read through the API server's service proxy first.
        self._proxied: set[tuple[str, str]] = set()

    async def close(self) -> None:
        await self._client.close()

    # ---- hooks the controller calls --------------------------------------------------------

    def observe(self, pool: Obj, gone: bool) -> None:
        """A StagePool watch event: a pool at zero with a new wake request is scaled at once."""
        meta = pool.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if gone:
            self._tracked.pop(key, None)
            self._wakes.discard(key)
            return
        if not _autoscaling(pool):
            return
        if key not in self._tracked:
            self._new_pools = True
        wake = (meta.get("annotations") or {}).get(ANNOTATION_WAKE_REQUESTED)
        if not wake or desired_replicas(pool) != 0:
            return
        tracked = self._tracked.get(key) or self._restore(pool)
        self._tracked[key] = tracked
        at = unix(wake)
        if tracked.woken == wake or at is None:
            return
        down = tracked.state.last_change_at if tracked.state.last_direction == -1 else None
        if down is not None and at + WAKE_SLACK_SECONDS <= down:
            return  # asked before the pool went to zero: not a new request
        self._wakes.add(key)
        self._kick.set()

    def report(self, pool: Obj) -> AutoscalerStatus | None:
        """The decision to show in the pool's status (None: keep the stored one)."""
        meta = pool["metadata"]
        tracked = self._tracked.get((meta["namespace"], meta["name"]))
        return tracked.report if tracked is not None else None

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Step every tick, or at once on a wake; a failed step is logged, never fatal."""
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), self.tick)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                await self.step()
            except ConfigError as exc:  # credentials (an exec plugin failed): one line
                log.warning("autoscaler step failed: %s", exc)
            except Exception:
                log.exception("autoscaler step failed")

    async def step(self) -> None:
        """Decide for every autoscaled pool that is due (or woken): one load read per
        pipeline, concurrently. Due pools come off a heap of due times, so a step costs what
        is due, not a scan of every pool (1,500 at 500 pipelines, some due every second once
        their reads are spread over the period); a scan runs only when a pool not yet tracked
        was seen."""
        now = self.clock()
        wakes, self._wakes = self._wakes, set()
        keys = set(wakes)
        while self._due and self._due[0][0] <= now:
            keys.add(heapq.heappop(self._due)[1])
        if self._new_pools:
            self._new_pools = False
            keys.update(k for k, pool in self.controller.pools.items()
                        if k not in self._tracked and _autoscaling(pool))
        groups: dict[tuple[str, str], list[tuple[Obj, Autoscaling, bool]]] = {}
        for key in keys:
            pool = self.controller.pools.get(key)
            doc = _autoscaling(pool) if pool is not None else None
            if pool is None or not doc or self._deleting(pool):
                self._tracked.pop(key, None)
                continue
            tracked = self._tracked.get(key)
            woken = key in wakes
            if not woken and tracked is not None and tracked.due > now:
                continue  # an older entry of the heap: the pool is due later
            scaling = self._scaling(pool, doc, tracked)
            if scaling is None:
                continue  # the pool's reconcile reports it (InvalidSpec); a fix is seen anew
            groups.setdefault((key[0], pool["spec"]["pipeline"]), []).append(
                (pool, scaling, woken))
        if not groups:
            return
        items = list(groups.items())
        loads = await asyncio.gather(*(self._load(ns, pipe) for (ns, pipe), _ in items))
        for ((ns, _), members), (reads, error) in zip(items, loads, strict=True):
            targets = await self._external(ns)
            doc = None if reads is None else combine_loads(list(reads.docs.values()))
            for pool, scaling, woken in members:
                key = _key(pool)
                try:
                    await self._settle(pool, scaling, doc, reads, error, now, woken,
                                       targets.get(pool["metadata"]["name"]))
                except ConfigError as exc:  # credentials (an exec plugin failed): one line
                    log.warning("autoscaling %s/%s failed: %s", ns, pool["metadata"]["name"],
                                exc)
                except Exception:
                    log.exception("autoscaling %s/%s failed", ns, pool["metadata"]["name"])
                tracked = self._tracked.get(key)
                if tracked is not None:
                    if tracked.due <= now:  # it failed before it set its next time
                        tracked.due = now + scaling.period_seconds
                    heapq.heappush(self._due, (tracked.due, key))

    def _scaling(self, pool: Obj, doc: Any, tracked: _Tracked | None) -> Autoscaling | None:
        """The pool's autoscaling, parsed once per generation of the pool."""
        generation = int(pool["metadata"].get("generation") or 0)
        if tracked is not None and tracked.scaling is not None and generation \
                and tracked.scaling[0] == generation:
            return tracked.scaling[1]
        try:
            scaling = Autoscaling.model_validate(doc)
        except ValidationError:
            return None
        if tracked is not None and generation:
            tracked.scaling = (generation, scaling)
        return scaling

    # ---- one pool --------------------------------------------------------------------------

    async def _settle(self, pool: Obj, scaling: Autoscaling, doc: Any,
                      reads: OrchestratorLoads | None, error: str | None, now: float,
                      woken: bool, hpa: str | None) -> None:
        meta = pool["metadata"]
        key = (meta["namespace"], meta["name"])
        tracked = self._tracked.get(key) or self._restore(pool)
        self._tracked[key] = tracked
        tracked.due = due_after(now, scaling.period_seconds, key[0], pool["spec"]["pipeline"])
        current = desired_replicas(pool)
        if tracked.written is not None:
            size, version = tracked.written
            if meta.get("resourceVersion") == version:
                current = size  # the view has not shown our write yet
            else:
                tracked.written = None
        if woken:
            tracked.woken = (meta.get("annotations") or {}).get(ANNOTATION_WAKE_REQUESTED)
        if hpa is not None:
            self._refuse(pool, tracked, scaling, current, hpa, now)
            return
        tracked.refused_by = None
        figures = None if doc is None else stage_figures(doc, pool["spec"]["stage"]["name"])
        if doc is not None and figures is None:
            error = f"the load has no stage {pool['spec']['stage']['name']!r}"
        if figures is None:
            decision = _blind(scaling, current, tracked.state, now, woken, error or "")
        else:
            load_now = doc.get("now") if isinstance(doc, dict) else None
            complete = reads is None or reads.complete
            decision = decide(scaling, figures, current, tracked.state, now,
                              load_now=float(load_now) if load_now is not None else None,
                              placeable=self._placeable(pool, current), complete=complete)
            if woken and decision.desired < 1:
                decision = _woken(scaling, decision, current, now)
            if reads is not None:
                decision = replace(decision, reason=f"{decision.reason}; {reads.note()}",
                                   inputs={**decision.inputs,
                                           "orchestratorsRead": float(len(reads.docs)),
                                           "orchestratorsUnread": float(len(reads.failed))})
        if decision.desired != current:
            if not await self._scale(pool, decision.desired):
                return  # not written: decided again next period
            tracked.written = (decision.desired, str(meta.get("resourceVersion", "")))
            reason = "Woken" if decision.rule == "wake" else "Autoscaled"
            self.controller._event(pool, "Normal", reason, decision.reason)
        tracked.state = decision.state
        tracked.misses = 0 if figures is not None else tracked.misses + 1
        partial = reads is not None and not reads.complete
        tracked.partials = tracked.partials + 1 if partial else 0
        signal = "Available" if figures is not None else "Unavailable"
        last = tracked.report
        if (signal == "Unavailable" and last is not None and last.signal == "Available"
                and tracked.misses < MISSES_BEFORE_UNAVAILABLE and decision.desired == current):
            return  # one lost read: nothing changed, nothing to say yet
        # how many orchestrators were read, or not, changed (a lost read of one of them, as
        # of all, is told from the second in a row)
        shown = (last.inputs or {}) if last is not None else {}
        sources = (decision.inputs.get("orchestratorsRead"),
                   decision.inputs.get("orchestratorsUnread"))
        recount = (figures is not None and sources != (shown.get("orchestratorsRead"),
                                                       shown.get("orchestratorsUnread"))
                   and (not partial or tracked.partials >= MISSES_BEFORE_UNAVAILABLE))
        if (last is None or decision.desired != current or last.signal != signal
                or last.rule == "external" or recount):
            tracked.report = status_of(decision, scaling, now, signal, error)
            self.controller.enqueue(("StagePool", *key))

    def _refuse(self, pool: Obj, tracked: _Tracked, scaling: Autoscaling, current: int,
                hpa: str, now: float) -> None:
        """Two owners for one count: leave it to the HPA, say so once."""
        if tracked.refused_by == hpa:
            return
        tracked.refused_by = hpa
        reason = (f"refused: HorizontalPodAutoscaler {hpa} scales this pool; remove it or "
                  "spec.stage.autoscaling (one owner per count)")
        self.controller._event(pool, "Warning", "ExternalAutoscaler", reason)
        decision = Decision(current, reason, {"current": float(current)}, 0, 0.0, "external",
                            tracked.state)
        tracked.report = status_of(decision, scaling, now, None, None)
        self.controller.enqueue(("StagePool", *_key(pool)))

    async def _scale(self, pool: Obj, replicas: int) -> bool:
        """Write spec.replicas through the scale subresource, as `kubectl scale` does."""
        ns, name = _key(pool)
        try:
            await self.controller.api.patch(path("StagePool", ns, name, "scale"),
                                            {"spec": {"replicas": replicas}},
                                            fieldManager=FIELD_MANAGER)
        except ApiError as exc:
            if exc.status == 404:
                self.controller.forget("StagePool", ns, name)
            else:
                log.warning("scaling %s/%s to %d failed: %s", ns, name, replicas, exc)
            return False
        return True

    def _placeable(self, pool: Obj, current: int) -> int | None:
        """The most replicas worth asking for: while a replica cannot be scheduled (no node
        has room, InsufficientCapacity), not more than the pool has now; else no bound."""
        live = [p for p in (self.controller.pods.get(_key(pool)) or {}).values()
                if not p["metadata"].get("deletionTimestamp")]
        return current if any(unschedulable_message(p) for p in live) else None

    def _restore(self, pool: Obj) -> _Tracked:
        """After a restart: the cool-down clock and the last decision from the stored status."""
        try:
            stored = PoolStatus.stored(pool).autoscaler
        except ValidationError:
            stored = None
        state = AutoscalerState()
        if stored is not None and stored.last_direction and stored.last_change_time:
            at = unix(stored.last_change_time)
            if at is not None:
                state = AutoscalerState(1 if stored.last_direction == "Up" else -1, at)
        return _Tracked(state=state, report=stored)

    def _deleting(self, pool: Obj) -> bool:
        if pool["metadata"].get("deletionTimestamp"):
            return True
        owner = self.controller.pipelines.get(
            (pool["metadata"]["namespace"], (pool.get("spec") or {}).get("pipeline", "")))
        return bool(owner and owner["metadata"].get("deletionTimestamp"))

    # ---- reading ---------------------------------------------------------------------------

    async def _load(self, ns: str, pipeline: str) -> tuple[OrchestratorLoads | None, str | None]:
        """(what was read of the pipeline's orchestrators, None) or (None, why none could be)."""
        self.reads += 1
        try:
            async with self._reading:
                got = await self.read_load(ns, pipeline)
        except Exception as exc:  # any failure means no signal, never a crash of the loop
            why = f"{type(exc).__name__}: {exc}"[:512]
            log.info("load of %s/%s unavailable: %s", ns, pipeline, why)
            return None, why
        if not isinstance(got, OrchestratorLoads):  # the hook's one document
            got = OrchestratorLoads({builders.orchestrator_name(pipeline): got})
        if got.failed:
            log.info("load of %s/%s partial: %s", ns, pipeline, got.note())
        return got, None

    def _admin_headers(self, ns: str, pipeline: str, *, required: bool = True
                       ) -> dict[str, str]:
        """The header that carries the pipeline's admin key (the pipeline reconciler's
        credential: the one its orchestrator pods admit the digest of). Raises LoadUnavailable
        when the view has no such pipeline (no uid, no key); not `required` (the test hook):
        no header then."""
        key = self.controller.pipeline_reconciler.admin_key(ns, pipeline)
        if key is None:
            if not required:
                return {}
            raise LoadUnavailable(f"GET {LOAD_PATH} of {builders.orchestrator_name(pipeline)}: "
                                  f"no pipeline {ns}/{pipeline} in the view, so no admin key")
        return {ADMIN_KEY_HEADER: key}

    async def _read_load(self, ns: str, pipeline: str) -> OrchestratorLoads:
        """GET /v1/load of EVERY ready orchestrator pod of the pipeline, straight (no load on
        the API server), at once, at their admin port with the pipeline's admin key. Where a
        pod cannot be read straight: through the API server's service proxy to the admin
        Service only while it is the one ready pod (the proxy answers for a ready pod of its
        choosing), in the order that worked last for the pipeline. With several ready and
        none read straight, one read through the proxy stands for one of them: a partial
        read. No ready pod in the view: the proxy (the view may lag). Raises
        LoadUnavailable, naming each pod and why, when nothing could be read."""
        oname = builders.orchestrator_name(pipeline)
        template = os.environ.get(LOAD_URL_ENV)
        if template:  # the test hook stands for the pipeline's one orchestrator
            url = template.format(namespace=ns, pipeline=pipeline)
            return OrchestratorLoads({oname: await self._client.get_json(
                url, self._admin_headers(ns, pipeline, required=False))})
        headers = self._admin_headers(ns, pipeline)
        port = self._admin_port(ns, pipeline)
        ready = sorted(((pod["metadata"]["name"], pod)
                        for pod in (self.controller.pods.get((ns, oname)) or {}).values()
                        if (pod.get("status") or {}).get("podIP") and is_ready(pod)),
                       key=lambda item: item[0])
        if not ready:
            try:
                return OrchestratorLoads({oname: await self._proxy(ns, pipeline, headers)})
            except Exception as exc:
                raise LoadUnavailable(f"GET {LOAD_PATH} of {oname}: straight: no ready "
                                      f"orchestrator pod; proxy: {type(exc).__name__}: "
                                      f"{exc}") from exc
        alone = len(ready) == 1
        results = await asyncio.gather(
            *(self._pod_load(ns, pipeline, pod, port, headers, alone=alone)
              for _, pod in ready),
            return_exceptions=True)
        docs: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for (name, _), result in zip(ready, results, strict=True):
            if isinstance(result, Exception):
                failed[name] = str(result).removeprefix(f"GET {LOAD_PATH} of {name}: ")
            elif isinstance(result, BaseException):
                raise result
            else:
                docs[name] = result
        if not docs and not alone:  # none straight: the proxy's one pod, a floor of the load
            try:
                docs[f"{oname} (service proxy: one of {len(ready)})"] = await self._proxy(
                    ns, pipeline, headers)
            except Exception as exc:
                failed[oname] = f"service proxy: {type(exc).__name__}: {exc}"
        if not docs:
            raise LoadUnavailable(f"GET {LOAD_PATH} of " + "; of ".join(
                f"{name}: {why}" for name, why in sorted(failed.items())))
        return OrchestratorLoads(docs, failed)

    def _admin_port(self, ns: str, pipeline: str) -> int:
        """The orchestrators' admin port: the admin Service's port `admin` (port ==
        targetPort == the containerPort named admin, builders), else the pipeline's
        (spec.orchestrator.adminPort, or port + 1), else the spec's default. Not the pod's own
        containerPort: the view keeps no pod spec (memory at fleet size), and the Service
        follows the spec."""
        service = self.controller.children.get(
            ("Service", ns, builders.admin_service_name(pipeline))) or {}
        for entry in (service.get("spec") or {}).get("ports") or []:
            port = entry.get("port")
            if entry.get("name") == ADMIN_PORT_NAME and isinstance(port, int):
                return port
        owner = self.controller.pipelines.get((ns, pipeline)) or {}
        doc = (owner.get("spec") or {}).get("orchestrator") or {}
        try:  # rare: only until the view has the admin Service
            return OrchestratorSpec.model_validate(doc).admin_listen_port
        except ValidationError:
            return DEFAULT_ADMIN_PORT

    async def orchestrator_loads(self, ns: str, pipeline: str) -> list[Any]:
        """GET /v1/load of EVERY running orchestrator pod of the pipeline (podIP, phase
        Running: two during an orchestrator rollout, a terminating one still finishing its
        requests included), for a question about all of the pipeline's requests in flight
        (drain.pinned_in_flight). Each pod straight; where that fails, through the service
        proxy only while that pod is the one running (the proxy answers for a Ready pod of its
        choosing; the operator's RBAC has no pod proxy). Raises LoadUnavailable, naming the
        pod, when one cannot be read; no running orchestrator pod: no document (nothing is in
        flight)."""
        template = os.environ.get(LOAD_URL_ENV)
        if template:  # the test hook stands for the pipeline's one orchestrator
            return [await self._client.get_json(
                template.format(namespace=ns, pipeline=pipeline),
                self._admin_headers(ns, pipeline, required=False))]
        oname = builders.orchestrator_name(pipeline)
        running = [pod for pod in (self.controller.pods.get((ns, oname)) or {}).values()
                   if (pod.get("status") or {}).get("podIP")
                   and (pod.get("status") or {}).get("phase") == "Running"]
        if not running:
            return []
        headers = self._admin_headers(ns, pipeline)
        port = self._admin_port(ns, pipeline)
        return await gather_all(self._pod_load(ns, pipeline, pod, port, headers,
                                               alone=len(running) == 1)
                                for pod in running)

    async def _pod_load(self, ns: str, pipeline: str, pod: Obj, port: int,
                        headers: dict[str, str], *, alone: bool) -> Any:
        """One orchestrator pod's /v1/load at its admin port: straight, else (`alone`: the
        one running or ready) through the service proxy, in the order that worked last for
        the pipeline, which a read of the one pod then remembers."""
        name = pod["metadata"]["name"]
        key = (ns, pipeline)

        async def straight() -> Any:
            return await self._client.get_json(_load_url(pod["status"]["podIP"], port),
                                               headers)

        async def proxy() -> Any:
            return await self._proxy(ns, pipeline, headers)

        ways = [straight, proxy] if alone else [straight]
        if alone and key in self._proxied:
            ways.reverse()
        failures: list[str] = []
        for way in ways:
            try:
                doc = await way()
            except Exception as exc:
                failures.append(f"{way.__name__}: {type(exc).__name__}: {exc}")
                continue
            if alone and way is proxy:
                self._proxied.add(key)
            elif alone:
                self._proxied.discard(key)
            return doc
        if not alone:
            failures.append("proxy: not tried (the service proxy may answer for another pod)")
        raise LoadUnavailable(f"GET {LOAD_PATH} of {name}: " + "; ".join(failures))

    async def _proxy(self, ns: str, pipeline: str, headers: dict[str, str]) -> Any:
        """GET /v1/load through the API server's service proxy to the admin Service, the key
        in ADMIN_KEY_HEADER (the proxy drops Authorization, not this header)."""
        admin = builders.admin_service_name(pipeline)
        proxy = f"{path('Service', ns, admin)}:{ADMIN_PORT_NAME}/proxy{LOAD_PATH}"
        text = await self.controller.api.request("GET", proxy, raw=True, timeout=LOAD_TIMEOUT,
                                                 headers=headers)
        return json.loads(text)

    async def _external(self, ns: str) -> dict[str, str]:
        """Pools of ns that a HorizontalPodAutoscaler targets (listed at most every
        HPA_REFRESH_SECONDS; none when the list is refused or the API is absent)."""
        now = time.monotonic()
        cached = self._hpas.get(ns)
        if cached is not None and now - cached[0] < HPA_REFRESH_SECONDS:
            return cached[1]
        try:
            targets = hpa_targets(await self.controller.api.list(
                resource_path(_HPA_VERSION, "horizontalpodautoscalers", ns)))
        except (ApiError, KeyError, TypeError) as exc:
            log.debug("listing HorizontalPodAutoscalers in %s failed: %s", ns, exc)
            targets = {}
        self._hpas[ns] = (now, targets)
        return targets


def _load_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{LOAD_PATH}"


def due_after(now: float, period: float, namespace: str, pipeline: str) -> float:
    """When a pipeline's pools are decided next: on the pipeline's own phase of the period
    (a hash of its name), between half a period and one and a half from now the first time,
    then every period. Why: pools decided in one step (a fleet created at once, an operator
    restart) would otherwise read their loads in one burst every period, forever."""
    phase = zlib.crc32(f"{namespace}/{pipeline}".encode()) % 10_000 / 10_000 * period
    due = now + (phase - now) % period
    return due + period if due - now < period / 2 else due


def _autoscaling(pool: Obj) -> Any:
    """The pool's spec.stage.autoscaling document, or None."""
    return ((pool.get("spec") or {}).get("stage") or {}).get("autoscaling")


def _key(pool: Obj) -> PoolKey:
    return pool["metadata"]["namespace"], pool["metadata"]["name"]


def _blind(scaling: Autoscaling, current: int, state: AutoscalerState, now: float, woken: bool,
           error: str) -> Decision:
    """No signal: never down; only up to minReplicas, or to 1 for a wake."""
    floor = max(scaling.min_replicas, 1 if woken else 0)
    desired = max(current, min(floor, scaling.max_replicas))
    inputs = {"current": float(current)}
    if desired == current:
        return Decision(current, f"no signal: keep {current} ({error})", inputs, 0, 0.0,
                        "signal", state)
    rule = "wake" if woken and current == 0 else "bounds"
    return Decision(desired, f"scale up {current} -> {desired}: no signal, "
                    f"{'woken' if rule == 'wake' else 'below minReplicas'} ({error})", inputs,
                    1, float(desired), rule, AutoscalerState(1, now, state.idle_since))


def _woken(scaling: Autoscaling, decision: Decision, current: int, now: float) -> Decision:
    """A wake request for a pool at zero: at least one replica, whatever the figures say."""
    desired = max(1, min(scaling.min_replicas or 1, scaling.max_replicas))
    return replace(decision, desired=desired, direction=1, rule="wake",
                   reason=f"scale up {current} -> {desired}: woken by the orchestrator "
                   f"({decision.reason})", state=AutoscalerState(1, now, None))


def status_of(decision: Decision, scaling: Autoscaling, now: float, signal: str | None,
              error: str | None) -> AutoscalerStatus:
    """The decision as the pool's status.autoscaler shows it."""
    state = decision.state
    if decision.rule == "external":
        short = "refused: external autoscaler"
    elif decision.rule == "signal":
        short = decision.reason.split(" (", 1)[0]
    else:
        short = decision.reason.split(":", 1)[0]
    return AutoscalerStatus(
        desired_replicas=decision.desired,
        decision=short[:256],
        reason=decision.reason[:1024],
        rule=decision.rule,
        target=f"{scaling.target.kind}={scaling.target.value:g}",
        figure=round(decision.figure, 3),
        inputs={k: round(v, 3) for k, v in decision.inputs.items()},
        signal=signal,  # type: ignore[arg-type]
        signal_message=error if signal == "Unavailable" else None,
        decision_time=iso(now),
        last_change_time=iso(state.last_change_at) if state.last_change_at is not None else None,
        last_direction={1: "Up", -1: "Down"}.get(state.last_direction),  # type: ignore[arg-type]
    )
