"""The autoscaler's decision: one stage's desired replicas from its load signal (pure).

Why pure and here: the operator (omni_operator.autoscaler) and `omnistage serve` size pools the
same way, and a decision that reads no clock and does no I/O can be pinned rule by rule with a
fake clock. The caller reads the load (the orchestrator's GET /v1/load), calls `decide` once a
period with the state the previous call returned, and writes the size when it changed.

The rules, in the order they apply (docs/architecture.md, "Autoscaling"):

1. **The figure.** inflightPerReplica: the larger of two counts of the concurrency the stage
   carries, over the target. (a) Little's law on the queue-free service time: arrivals/s x
   exec_s (the service time less the replica's admission queue; service_s from a signal that
   lacks it). Not service_s itself: a queue that built up while the pool was too small would
   count as work and oversize the pool long after it drained. (b) What is there now: in flight
   and held, over max(1, target), since a replica holds at least one task at a time. (b) is
   what grows a saturated pool whose arrivals are its throughput (closed loop), and it answers a
   step at once, before the window's rate has caught up; a target under 1 is a utilisation goal
   that only (a) can express, so (b) does not divide by it (one task in flight on an idle-ish
   replica is not a reason for two). (b) grows a running pool by one replica a period at
   most: a backlog drains once replicas come, and an upstream that catches up hands its queue
   on in one burst; sized on the burst, a pool overshot and the cool-down held it there (c went
   1 -> 2 -> 5 for an optimum of 3 in the bench). A pool at zero takes what is held at once.
   queueWaitSeconds and p95TimeToFirstOutputSeconds: the
   measured p95 over its target; above 1 the pool grows in proportion (ceil(current x ratio)),
   below LATENCY_HEADROOM it shrinks by one replica.
   **Dead band** (inflightPerReplica), the same TOLERANCE both ways: a pool shrinks only to
   ceil(figure x (1 + TOLERANCE)), and grows only when the figure passes its size by more than
   TOLERANCE of it (before the one-a-period limit of 1c). So a figure that sits just over a
   whole number, and moves across it as the window's arrival count moves, does not turn the
   pool once per cool-down; and one serial client (2.5/s x 0.402 s = 1.005) keeps one replica
   instead of asking for two, one of them idle.
2. **Bounds**: within [minReplicas, maxReplicas] (and the replicas that can be placed, when the
   caller knows it). A pool outside its bounds is brought back at once, whatever the cool-down.
3. **Zero** only with minReplicas 0, after idleSeconds with nothing in flight, held or
   arriving; otherwise a pool that would go to 0 keeps 1.
4. **Wake**: a pool at 0 with held requests, a pending wake or work in flight gets at least 1,
   at once (no cool-down applies).
5. **Partial signal** (`complete=False`: some orchestrator's load could not be read): the
   figures are a floor of the pipeline's load, so the pool may grow on them, never shrink
   (save back within its bounds), and an idle time does not start on them.
6. **Cool-down**: at most one change of direction per coolDownSeconds: a change against the
   direction of the last change is held until coolDownSeconds after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

from omnistage.kube import ANNOTATION_WAKE_REQUESTED, LOAD_PATH
from omnistage.spec import Autoscaling

__all__ = [
    "ANNOTATION_WAKE_REQUESTED",
    "LATENCY_HEADROOM",
    "LOAD_PATH",
    "TOLERANCE",
    "AutoscalerState",
    "Decision",
    "StageLoadLike",
    "decide",
]


#: A latency target's measured p95 below this fraction of the target lets the pool shrink by one.
LATENCY_HEADROOM = 0.5
#: inflightPerReplica's dead band, both ways: a shrink keeps this fraction of the figure spare,
#: and a figure within this fraction over the pool's size keeps the size.
TOLERANCE = 0.2


class StageLoadLike(Protocol):
    """The figures of one stage that `decide` reads: the keys of GET /v1/load's stages (the
    orchestrator's StageLoad struct, or anything with the same attributes)."""

    @property
    def inflight(self) -> int: ...
    @property
    def held(self) -> int: ...
    @property
    def arrivals_per_s(self) -> float: ...
    @property
    def service_s(self) -> float: ...
    @property
    def exec_s(self) -> float: ...
    @property
    def queue_wait_p95_s(self) -> float: ...
    @property
    def ttfo_p95_s(self) -> float: ...
    @property
    def last_request_unix(self) -> float | None: ...
    @property
    def wake_pending(self) -> bool: ...


@dataclass(frozen=True)
class AutoscalerState:
    """What one pool's decisions remember between periods (the caller keeps it, per pool)."""

    #: +1 or -1: the direction of the last change of size; 0 before the first.
    last_direction: int = 0
    #: When that change was decided (the caller's clock).
    last_change_at: float | None = None
    #: Since when the stage has been seen idle (nothing in flight, held or arriving); None: busy.
    idle_since: float | None = None


@dataclass(frozen=True)
class Decision:
    """One explained decision: what was read, the figure it gave, the size, and why."""

    desired: int
    #: One line a person reads in `kubectl get sp` and the pool's status.
    reason: str
    #: The figures read (and current), by name.
    inputs: dict[str, float]
    #: +1 grow, -1 shrink, 0 keep.
    direction: int
    #: The unbounded figure: replicas the target asks for (Little's law or the latency ratio).
    figure: float = 0.0
    #: The rule that settled it: target, dead-band, bounds, idle, wake, partial, cool-down.
    rule: str = "target"
    #: The state to pass to the next call.
    state: AutoscalerState = field(default_factory=AutoscalerState)


def _figure(spec: Autoscaling, load: StageLoadLike, current: int) -> tuple[float, str, float]:
    """The replicas the target asks for, unbounded, how it was reached, and the figure before
    the one-replica-a-period limit (what the dead band compares with the pool's size)."""
    kind, target = spec.target.kind, spec.target.value
    if kind == "inflightPerReplica":
        # 1a: Little's law on the queue-free service time (service_s from an older signal)
        service = load.exec_s if load.exec_s > 0 else load.service_s
        rate = load.arrivals_per_s * service / target
        # 1b: what is in flight and held now, each replica holding at least one
        present = load.inflight + load.held
        now_figure = present / max(1.0, target)
        if service > 0 and rate >= now_figure:
            return rate, (f"Little's law {load.arrivals_per_s:.3g}/s x {service:.3g}s "
                          f"/ {target:g} per replica"), rate
        how = f"{present} in flight or held / {max(1.0, target):g} per replica"
        # 1c: what is in flight grows a running pool one replica a period
        if current > 0 and now_figure > current + 1:
            return (max(rate, float(current + 1)), how + f"; +1 a period ({now_figure:.2f})",
                    now_figure)
        return now_figure, how, now_figure
    measured = load.queue_wait_p95_s if kind == "queueWaitSeconds" else load.ttfo_p95_s
    ratio = measured / target
    base = max(current, 1)
    if ratio > 1:
        figure = base * ratio
        return figure, f"p95 {measured:.3g}s over target {target:g}s: x{ratio:.2f}", figure
    if ratio < LATENCY_HEADROOM and current > 0:
        return (float(current - 1), f"p95 {measured:.3g}s under half of target {target:g}s: -1",
                float(current - 1))
    return float(current), f"p95 {measured:.3g}s within target {target:g}s", float(current)


def decide(
    spec: Autoscaling,
    load: StageLoadLike,
    current: int,
    state: AutoscalerState,
    now: float,
    *,
    load_now: float | None = None,
    placeable: int | None = None,
    complete: bool = True,
) -> Decision:
    """The desired replicas of one stage now, explained (module docstring: the rules).

    current: the pool's spec.replicas. now: the caller's clock (cool-down and idle time).
    load_now: the signal's own clock (GET /v1/load's `now`), against which last_request_unix
    is measured; without it the idle time is the caller's observation alone. placeable: the
    most replicas that can be placed (GPUs), when known. complete: False when the load is
    only part of the pipeline's (an orchestrator could not be read): rule 5.
    """
    busy = load.inflight > 0 or load.held > 0 or load.arrivals_per_s > 0
    # an idle time starts only on a whole signal: an orchestrator not read may be sending
    start = now if complete else None
    idle_since = None if busy else (state.idle_since if state.idle_since is not None else start)
    inputs: dict[str, float] = {
        "current": float(current),
        "inflight": float(load.inflight),
        "held": float(load.held),
        "arrivalsPerSecond": load.arrivals_per_s,
        "serviceSeconds": load.service_s,
        "execSeconds": load.exec_s,
        "queueWaitP95Seconds": load.queue_wait_p95_s,
        "ttfoP95Seconds": load.ttfo_p95_s,
    }
    figure, how, raw = _figure(spec, load, current)
    desired = math.ceil(round(figure, 9))  # 2.0000000001 from float noise is 2, not 3
    rule = "target"
    # 1, dead band: a shrink keeps TOLERANCE of the figure spare
    if spec.target.kind == "inflightPerReplica" and desired < current:
        banded = min(current, math.ceil(round(figure * (1 + TOLERANCE), 9)))
        if banded > desired:
            rule = "dead-band"
            how += (f"; {figure:.2f} x {1 + TOLERANCE:g} needs {banded}"
                    + (" (dead band)" if banded == current else ""))
            desired = banded
    # ... and a growth needs the figure past TOLERANCE over the size
    if (spec.target.kind == "inflightPerReplica" and desired > current > 0
            and round(raw, 9) <= current * (1 + TOLERANCE)):
        rule = "dead-band"
        how += f"; {raw:.3f} within {TOLERANCE:.0%} over {current} (dead band)"
        desired = current
    high = spec.max_replicas if placeable is None else min(spec.max_replicas, placeable)
    low = spec.min_replicas

    # 3. zero only for an idle pool with minReplicas 0
    idle_for = 0.0
    if idle_since is not None:
        idle_for = now - idle_since
        if load_now is not None and load.last_request_unix is not None:
            idle_for = min(idle_for, load_now - load.last_request_unix)
        inputs["idleSeconds"] = idle_for
    if desired <= 0 and low == 0:
        if current == 0:
            desired, rule = 0, "idle"
            how = "at zero, nothing held or in flight"
        elif idle_since is not None and idle_for >= spec.idle_seconds:
            desired, rule = 0, "idle"
            how = f"idle {idle_for:.0f}s >= {spec.idle_seconds:g}s"
        else:  # not idle long enough: one replica stays warm
            desired = 1
            how += f"; zero only after {spec.idle_seconds:g}s idle"
    # 2. bounds
    bounded = max(low, min(high, desired))
    if bounded != desired:
        rule = "bounds"
        how += f"; bounded to [{low}, {high}]"
    desired = bounded
    out_of_bounds = not (low <= current <= high)
    # 4. wake: a pool at 0 that is needed
    wake = current == 0 and (load.held > 0 or load.wake_pending or load.inflight > 0)
    if wake and desired < 1:
        desired = min(max(1, low), max(1, high))
    if wake:
        rule = "wake"
        how = (f"woken: {load.held} held" + (", wake pending" if load.wake_pending else "")
               + f"; {how}")
    # 5. partial signal: a floor of the load; never down on it, save back within the bounds
    if not complete and desired < current:
        kept = min(current, high)  # over maxReplicas still comes back
        if kept != desired:
            how = (f"{how} asks {desired}, but not every orchestrator's load was read "
                   "(a partial read never scales down)")
            desired, rule = kept, "partial"
    direction = (desired > current) - (desired < current)
    # 6. cool-down: one change of direction per window (bounds and wake are not held back)
    if (
        direction != 0
        and not wake
        and not out_of_bounds
        and state.last_direction not in (0, direction)
        and state.last_change_at is not None
        and now - state.last_change_at < spec.cool_down_seconds
    ):
        left = spec.cool_down_seconds - (now - state.last_change_at)
        reason = (f"hold {current}: {how} asks {desired}, but the last change went the other "
                  f"way {now - state.last_change_at:.0f}s ago (cool-down, {left:.0f}s left)")
        return Decision(current, reason, inputs, 0, figure, "cool-down",
                        replace(state, idle_since=idle_since))
    if direction == 0:
        reason = f"keep {current}: {how}"
        next_state = replace(state, idle_since=idle_since)
    else:
        reason = f"{'scale up' if direction > 0 else 'scale down'} {current} -> {desired}: {how}"
        next_state = AutoscalerState(direction, now, idle_since)
    return Decision(desired, reason, inputs, direction, figure, rule, next_state)
