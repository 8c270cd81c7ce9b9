"""The operator's autoscaler: sizes every StagePool whose stage has `autoscaling`.

Every periodSeconds per pool it reads the pipeline's load from the orchestrator (GET /v1/load
through the API server's service proxy, one read per pipeline per period), decides with
omnistage.autoscaling.decide (the same maths `omnistage serve` uses) and, when the size
changes, writes spec.replicas through the scale subresource, as `kubectl scale` does: the pool's
reconcile then creates replicas, or drains one before deleting it. A pool at zero whose
orchestrator asks for a wake (the annotation omnistage.io/wake-requested-at) is scaled at once,
on the pool's watch event, not on the next period.

What it writes, and when (docs/architecture.md, "Autoscaling"):
- spec.replicas (field manager omnistage-autoscaler, subresource scale) and one Event, only
  when the size changes: a steady pool costs one read of its pipeline's load per period and no
  write;
- status.autoscaler, the decision explained (inputs, figure, decision, time), through the
  pool's own reconcile (Controller.patch_status writes only what changed), only when the
  desired size, the signal's availability or an external autoscaler's presence changes;
- nothing when the load cannot be read, except to bring a pool up to minReplicas or to wake
  it: an unreadable signal never scales down.

A pool that a HorizontalPodAutoscaler (or KEDA, which drives one) targets has two owners for
one count: the autoscaler refuses it (status condition Autoscaling False, reason
ExternalAutoscaler, one Warning event) and leaves the count to the HPA.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pydantic import ValidationError

from omni_operator import builders
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
from omnistage.kubeapi import ApiError, path, resource_path
from omnistage.spec import Autoscaling

__all__ = [
    "FIELD_MANAGER",
    "LOAD_URL_ENV",
    "Autoscaler",
    "LoadUnavailable",
    "StageFigures",
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
#: orchestrator (a cluster test serves a fake /v1/load).
LOAD_URL_ENV = "OMNISTAGE_AUTOSCALER_LOAD_URL"
LOAD_TIMEOUT = 2.0
#: How often the loop looks for due pools; a wake does not wait for it.
TICK_SECONDS = 1.0
#: HorizontalPodAutoscalers are listed at most this often per namespace.
HPA_REFRESH_SECONDS = 30.0
#: An RFC 3339 annotation has whole seconds: a wake within a second of a scale-down counts.
WAKE_SLACK_SECONDS = 1.0
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


def stage_figures(doc: Any, stage: str) -> StageFigures | None:
    """The figures of stage in a /v1/load document; None when it has none for it."""
    entry = ((doc or {}).get("stages") or {}).get(stage) if isinstance(doc, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        values = {f.name: _cast(f.type, entry[f.name])
                  for f in fields(StageFigures) if entry.get(f.name) is not None}
    except (TypeError, ValueError):
        return None
    return StageFigures(**values)


def _cast(kind: Any, value: Any) -> Any:
    """A JSON value as the field's declared type (the annotations are strings here)."""
    kind = str(kind)
    if kind.startswith("bool"):
        return bool(value)
    if kind.startswith("int"):
        return int(value)
    return float(value)


def hpa_targets(hpas: list[Obj]) -> dict[str, str]:
    """Pool name -> the HorizontalPodAutoscaler that scales it (scaleTargetRef kind StagePool)."""
    out: dict[str, str] = {}
    for hpa in hpas:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if ref.get("kind") == "StagePool" and ref.get("name"):
            out.setdefault(str(ref["name"]), str(hpa["metadata"]["name"]))
    return out


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unix(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _get_json(url: str, timeout: float) -> Any:
    """GET url straight (never through an http_proxy of the environment) and parse JSON."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


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

    # ---- hooks the controller calls --------------------------------------------------------

    def observe(self, pool: Obj, gone: bool) -> None:
        """A StagePool watch event: a pool at zero with a new wake request is scaled at once."""
        meta = pool.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if gone:
            self._tracked.pop(key, None)
            self._wakes.discard(key)
            return
        if not ((pool.get("spec") or {}).get("stage") or {}).get("autoscaling"):
            return
        wake = (meta.get("annotations") or {}).get(ANNOTATION_WAKE_REQUESTED)
        if not wake or desired_replicas(pool) != 0:
            return
        tracked = self._tracked.get(key) or self._restore(pool)
        self._tracked[key] = tracked
        at = _unix(wake)
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
            except Exception:
                log.exception("autoscaler step failed")

    async def step(self) -> None:
        """Decide for every autoscaled pool that is due (or woken): one load read per
        pipeline, concurrently."""
        now = self.clock()
        wakes, self._wakes = self._wakes, set()
        groups: dict[tuple[str, str], list[tuple[Obj, Autoscaling, bool]]] = {}
        seen: set[PoolKey] = set()
        for key, pool in list(self.controller.pools.items()):
            doc = ((pool.get("spec") or {}).get("stage") or {}).get("autoscaling")
            if not doc or self._deleting(pool):
                continue
            seen.add(key)
            tracked = self._tracked.get(key)
            woken = key in wakes
            if not woken and tracked is not None and tracked.due > now:
                continue
            try:
                scaling = Autoscaling.model_validate(doc)
            except ValidationError:
                continue  # the pool's reconcile reports it (InvalidSpec)
            groups.setdefault((key[0], pool["spec"]["pipeline"]), []).append(
                (pool, scaling, woken))
        for key in set(self._tracked) - seen:
            del self._tracked[key]
        if not groups:
            return
        items = list(groups.items())
        loads = await asyncio.gather(*(self._load(ns, pipe) for (ns, pipe), _ in items))
        for ((ns, _), members), (doc, error) in zip(items, loads, strict=True):
            targets = await self._external(ns)
            for pool, scaling, woken in members:
                try:
                    await self._settle(pool, scaling, doc, error, now, woken,
                                       targets.get(pool["metadata"]["name"]))
                except Exception:
                    log.exception("autoscaling %s/%s failed", ns, pool["metadata"]["name"])

    # ---- one pool --------------------------------------------------------------------------

    async def _settle(self, pool: Obj, scaling: Autoscaling, doc: Any, error: str | None,
                      now: float, woken: bool, hpa: str | None) -> None:
        meta = pool["metadata"]
        key = (meta["namespace"], meta["name"])
        tracked = self._tracked.get(key) or self._restore(pool)
        self._tracked[key] = tracked
        tracked.due = now + scaling.period_seconds
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
            decision = decide(scaling, figures, current, tracked.state, now,
                              load_now=float(load_now) if load_now is not None else None,
                              placeable=self._placeable(pool, current))
            if woken and decision.desired < 1:
                decision = _woken(scaling, decision, current, now)
        if decision.desired != current:
            if not await self._scale(pool, decision.desired):
                return  # not written: decided again next period
            tracked.written = (decision.desired, str(meta.get("resourceVersion", "")))
            reason = "Woken" if decision.rule == "wake" else "Autoscaled"
            self.controller._event(pool, "Normal", reason, decision.reason)
        tracked.state = decision.state
        signal = "Available" if figures is not None else "Unavailable"
        last = tracked.report
        if (last is None or decision.desired != current or last.signal != signal
                or last.rule == "external"):
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
            at = _unix(stored.last_change_time)
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

    async def _load(self, ns: str, pipeline: str) -> tuple[Any, str | None]:
        """(the /v1/load document, None) or (None, why it could not be read)."""
        self.reads += 1
        try:
            return await self.read_load(ns, pipeline), None
        except Exception as exc:  # any failure means no signal, never a crash of the loop
            log.info("load of %s/%s unavailable: %s", ns, pipeline, exc)
            return None, f"{type(exc).__name__}: {exc}"[:512]

    async def _read_load(self, ns: str, pipeline: str) -> Any:
        """GET /v1/load of the pipeline's orchestrator Service through the API server's
        service proxy; where the proxy cannot reach it (it refuses loopback endpoints, as
        with the local pod runner), from a ready orchestrator pod straight."""
        template = os.environ.get(LOAD_URL_ENV)
        if template:
            return await asyncio.to_thread(
                _get_json, template.format(namespace=ns, pipeline=pipeline), LOAD_TIMEOUT)
        oname = builders.orchestrator_name(pipeline)
        proxy = f"{path('Service', ns, oname)}:http/proxy{LOAD_PATH}"
        try:
            text = await self.controller.api.request("GET", proxy, raw=True,
                                                     timeout=LOAD_TIMEOUT)
            return json.loads(text)
        except Exception as exc:
            failure: Exception = exc
        service = self.controller.children.get(("Service", ns, oname)) or {}
        ports = (service.get("spec") or {}).get("ports") or []
        port = ports[0].get("port") if ports else None
        for pod in (self.controller.pods.get((ns, oname)) or {}).values():
            ip = (pod.get("status") or {}).get("podIP")
            if ip and port and is_ready(pod):
                host = f"[{ip}]" if ":" in ip else ip
                try:
                    return await asyncio.to_thread(_get_json, f"http://{host}:{port}{LOAD_PATH}",
                                                   LOAD_TIMEOUT)
                except Exception as exc:
                    failure = exc
        raise LoadUnavailable(f"GET {LOAD_PATH} of {oname}: {failure}")

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
        decision_time=_iso(now),
        last_change_time=_iso(state.last_change_at) if state.last_change_at is not None else None,
        last_direction={1: "Up", -1: "Down"}.get(state.last_direction),  # type: ignore[arg-type]
    )
