"""omnistage.autoscaling.decide, rule by rule, on a fake clock (the `now` each call passes).

Each test pins one rule of the module docstring so that removing the rule fails it: the figure
(Little's law on the queue-free service time, what is in flight, the dead band; the latency
ratios), bounds, zero after idle, wake at zero, the cool-down.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest

from omnistage.autoscaling import AutoscalerState, Decision, decide
from omnistage.spec import Autoscaling


@dataclass(frozen=True)
class Load:
    """A StageLoad-like signal; every figure idle unless a test sets it."""

    inflight: int = 0
    held: int = 0
    arrivals_per_s: float = 0.0
    service_s: float = 0.0
    exec_s: float = 0.0
    queue_wait_p95_s: float = 0.0
    ttfo_p95_s: float = 0.0
    last_request_unix: float | None = None
    wake_pending: bool = False


def spec(**extra: Any) -> Autoscaling:
    doc: dict[str, Any] = {"maxReplicas": 8, **extra}
    return Autoscaling.model_validate(doc)


class Clock:
    """Drives decide period after period, keeping the state and the pool's size as a caller
    does, on a fake clock."""

    def __init__(self, scaling: Autoscaling, current: int) -> None:
        self.spec, self.current, self.state, self.now = scaling, current, AutoscalerState(), 0.0

    def at(self, now: float, load: Load, **kw: Any) -> Decision:
        self.now = now
        d = decide(self.spec, load, self.current, self.state, now, **kw)
        self.state, self.current = d.state, d.desired
        return d



# --------------------------------------------------------------------------- the figure


def test_littles_law_on_arrivals_and_service_time() -> None:
    d = decide(spec(target={"inflightPerReplica": 2}), Load(inflight=3, arrivals_per_s=4,
               service_s=1.5), 1, AutoscalerState(), 0.0)
    assert (d.desired, d.direction, d.figure, d.rule) == (3, 1, 3.0, "target")
    assert "Little's law" in d.reason and d.reason.startswith("scale up 1 -> 3")
    assert d.inputs["arrivalsPerSecond"] == 4 and d.inputs["serviceSeconds"] == 1.5


def test_a_fraction_of_a_replica_rounds_up_but_float_noise_does_not() -> None:
    assert decide(spec(), Load(arrivals_per_s=2.1, service_s=1.0), 1, AutoscalerState(),
                  0).desired == 3
    # 3/s x 0.1 s / 0.1 is 3.0000000000000004 in floats: 3 replicas, not 4
    assert decide(spec(target={"inflightPerReplica": 0.1}),
                  Load(arrivals_per_s=3, service_s=0.1), 1, AutoscalerState(), 0).desired == 3


def test_before_any_completion_in_flight_and_held_count() -> None:
    d = decide(spec(), Load(inflight=4, held=1, arrivals_per_s=5), 4, AutoscalerState(), 0)
    assert d.desired == 5


def test_in_flight_grows_a_running_pool_one_replica_a_period() -> None:
    """An upstream that catches up hands its backlog on in one burst: sized on it, c went
    1 -> 2 -> 5 for an optimum of 3 and the cool-down held it there. What is in flight grows a
    running pool one replica a period; the rate is not limited."""
    burst = Load(inflight=5, arrivals_per_s=0.8, service_s=1.3, exec_s=1.3)
    d = decide(spec(target={"inflightPerReplica": 0.8}), burst, 2, AutoscalerState(), 0)
    assert (d.desired, d.direction) == (3, 1) and "+1 a period" in d.reason
    fast = Load(inflight=5, arrivals_per_s=4.0, service_s=1.0, exec_s=1.0)
    assert decide(spec(), fast, 1, AutoscalerState(), 0).desired == 4  # the rate: no limit


def test_littles_law_reads_the_queue_free_service_time() -> None:
    """After a step the replicas' queues make service_s (queue included) far longer than the
    work; sizing on it held the pool at twice its optimum. exec_s, when the signal has it,
    is what counts; a signal without it (an older orchestrator) falls back to service_s."""
    queued = Load(arrivals_per_s=1.2, service_s=3.0, exec_s=1.5)
    d = decide(spec(target={"inflightPerReplica": 0.8}), queued, 5, AutoscalerState(), 0)
    assert d.figure == pytest.approx(2.25) and d.desired == 3  # not ceil(4.5) = 5
    assert d.inputs["execSeconds"] == 1.5 and "x 1.5s" in d.reason
    old = decide(spec(), Load(arrivals_per_s=2, service_s=1.5), 1, AutoscalerState(), 0)
    assert old.desired == 3


def test_in_flight_counts_so_a_saturated_pool_grows() -> None:
    """A closed loop saturates a pool of 2 (each replica carrying its target of 4 tasks): its
    arrivals are its throughput, so Little's law on the queue-free time says 2 replicas, yet 6
    more wait in the replicas' queues. What is in flight counts too, over the target."""
    saturated = Load(inflight=14, arrivals_per_s=8.0, service_s=2.75, exec_s=1.0)
    d = decide(spec(target={"inflightPerReplica": 4}), saturated, 2, AutoscalerState(), 0)
    assert (d.desired, d.direction) == (3, 1) and "14 in flight" in d.reason  # one a period


def test_in_flight_is_not_divided_by_a_target_under_one() -> None:
    """With a utilisation target (0.8) one task on a mostly idle replica is no reason for a
    second replica: what is in flight counts one task per replica at most."""
    idle_ish = Load(inflight=1, arrivals_per_s=0.3, service_s=1.5, exec_s=1.5)
    d = decide(spec(target={"inflightPerReplica": 0.8}), idle_ish, 1, AutoscalerState(), 0)
    assert d.desired == 1
    # and a step shows at once, before the window's rate catches up: 2 in flight, 2 replicas
    step = Load(inflight=2, arrivals_per_s=0.5, service_s=1.5, exec_s=1.5)
    assert decide(spec(target={"inflightPerReplica": 0.8}), step, 1, AutoscalerState(),
                  0).desired == 2


def test_a_shrink_keeps_a_dead_band() -> None:
    """A figure just over a whole number moves across it as the window's arrival count moves;
    without a dead band the pool turned once per cool-down. A shrink goes only as far as
    keeps TOLERANCE of the figure spare (growth has its own side of the band: below)."""
    s = spec(target={"inflightPerReplica": 0.8})
    near = Load(arrivals_per_s=1.17, service_s=1.3, exec_s=1.3)  # 1.90: ceil says 2
    d = decide(s, near, 3, AutoscalerState(), 0)
    assert (d.desired, d.direction, d.rule) == (3, 0, "dead-band")
    assert "dead band" in d.reason
    assert decide(s, near, 1, AutoscalerState(), 0).desired == 2  # growth: no band
    low = Load(arrivals_per_s=0.9, service_s=1.3, exec_s=1.3)  # 1.46 x 1.2 = 1.76: 2
    assert decide(s, low, 3, AutoscalerState(), 0).desired == 2
    quiet = Load(arrivals_per_s=0.31, service_s=1.3, exec_s=1.3)
    assert decide(s, quiet, 3, AutoscalerState(), 0).desired == 1


def test_a_figure_within_the_tolerance_over_the_size_keeps_it() -> None:
    """The same tolerance up as down (issue 37): one serial client measured at 2.5/s x
    0.402 s = 1.005 replicas keeps its one replica instead of asking for a second that would
    sit idle. A figure past TOLERANCE over the size still grows the pool, to ceil(figure); the
    one-a-period growth of a saturated pool is not held back by it; a pool at zero is not
    banded. Kills: rounding 1.005 up to 2, and a band that stops a saturated pool growing."""
    serial = Load(inflight=1, arrivals_per_s=2.5, service_s=0.402, exec_s=0.402)
    d = decide(spec(), serial, 1, AutoscalerState(), 0)
    assert (d.desired, d.direction, d.rule) == (1, 0, "dead-band")
    assert d.reason == ("keep 1: Little's law 2.5/s x 0.402s / 1 per replica; 1.005 within "
                        "20% over 1 (dead band)")
    assert decide(spec(), Load(arrivals_per_s=1.19, service_s=1.0), 1, AutoscalerState(),
                  0).desired == 1
    assert decide(spec(), Load(arrivals_per_s=1.25, service_s=1.0), 1, AutoscalerState(),
                  0).desired == 2
    assert decide(spec(), Load(arrivals_per_s=5.9, service_s=1.0), 5, AutoscalerState(),
                  0).desired == 5
    assert decide(spec(), Load(arrivals_per_s=6.1, service_s=1.0), 5, AutoscalerState(),
                  0).desired == 7
    # saturated: 13 in flight on 10 replicas grows by one a period (11 is within 20% of 10)
    grown = decide(spec(maxReplicas=16), Load(inflight=13, arrivals_per_s=5.0, service_s=1.0),
                   10, AutoscalerState(), 0)
    assert (grown.desired, grown.rule) == (11, "target")
    assert decide(spec(minReplicas=0), Load(arrivals_per_s=0.5, service_s=1.0), 0,
                  AutoscalerState(), 0).desired == 1


def test_a_partial_signal_grows_but_never_shrinks() -> None:
    """complete=False (an orchestrator's load could not be read): the figures are a floor of
    the load. Up is safe, down is not: no shrink, no zero, and no idle time starts on it; a
    pool over maxReplicas still comes back to it."""
    s = spec(minReplicas=0, idleSeconds=10, coolDownSeconds=0)
    quiet = Load(arrivals_per_s=1.0, service_s=1.0)
    d = decide(s, quiet, 4, AutoscalerState(), 0, complete=False)
    assert (d.desired, d.direction, d.rule) == (4, 0, "partial")
    assert d.reason.startswith("keep 4: Little's law") and "partial read" in d.reason
    assert decide(s, quiet, 4, AutoscalerState(), 0).desired == 2  # whole: down
    busy = Load(arrivals_per_s=6.0, service_s=1.0)
    assert decide(s, busy, 4, AutoscalerState(), 0, complete=False).desired == 6
    c = Clock(s, current=1)
    for at in (0, 20, 40):  # idle as far as the orchestrators read can tell
        d = c.at(at, Load(), complete=False)
        assert (d.desired, d.state.idle_since) == (1, None)
    assert c.at(50, Load()).desired == 1  # the idle time starts on the first whole read
    assert c.at(60, Load()).desired == 0
    over = decide(spec(maxReplicas=4), quiet, 6, AutoscalerState(), 0, complete=False)
    assert (over.desired, over.direction) == (4, -1)


def test_queue_wait_over_target_grows_in_proportion() -> None:
    d = decide(spec(target={"queueWaitSeconds": 0.5}), Load(inflight=2, queue_wait_p95_s=1.0,
               ttfo_p95_s=0.1), 2, AutoscalerState(), 0)
    assert (d.desired, d.figure) == (4, 4.0)


def test_latency_well_under_target_shrinks_by_one_and_within_keeps() -> None:
    s = spec(target={"p95TimeToFirstOutputSeconds": 1.0})
    down = decide(s, Load(inflight=1, ttfo_p95_s=0.2, queue_wait_p95_s=9), 3, AutoscalerState(), 0)
    keep = decide(s, Load(inflight=1, ttfo_p95_s=0.8), 3, AutoscalerState(), 0)
    up = decide(s, Load(inflight=1, ttfo_p95_s=1.5), 3, AutoscalerState(), 0)
    assert (down.desired, keep.desired, up.desired) == (2, 3, 5)  # ttfo, not the queue wait


# --------------------------------------------------------------------------- bounds


def test_bounded_by_max_min_and_the_placeable_replicas() -> None:
    s = spec(minReplicas=2, maxReplicas=4)
    assert decide(s, Load(arrivals_per_s=100, service_s=1), 3, AutoscalerState(), 0).desired == 4
    low = decide(s, Load(), 3, AutoscalerState(), 0)
    assert (low.desired, low.rule) == (2, "bounds")
    assert decide(s, Load(arrivals_per_s=100, service_s=1), 2, AutoscalerState(), 0,
                  placeable=3).desired == 3


def test_a_pool_outside_its_bounds_comes_back_despite_the_cool_down() -> None:
    s = spec(maxReplicas=4, coolDownSeconds=120)
    just_grew = AutoscalerState(last_direction=1, last_change_at=0.0)
    load = Load(inflight=6, arrivals_per_s=6, service_s=1)  # asks 6: bounded to 4
    d = decide(s, load, 10, just_grew, 5.0)  # someone ran kubectl scale --replicas=10
    assert (d.desired, d.direction) == (4, -1)


# --------------------------------------------------------------------------- zero


def test_idle_goes_to_zero_only_after_idle_seconds() -> None:
    c = Clock(spec(minReplicas=0, idleSeconds=300, coolDownSeconds=0), current=1)
    assert c.at(0, Load()).desired == 1
    assert c.at(299, Load()).desired == 1
    d = c.at(300, Load())
    assert (d.desired, d.rule, d.direction) == (0, "idle", -1)
    assert "idle 300s" in d.reason


def test_any_work_restarts_the_idle_time() -> None:
    c = Clock(spec(minReplicas=0, idleSeconds=300, coolDownSeconds=0), current=1)
    c.at(0, Load())
    c.at(200, Load(arrivals_per_s=0.01))  # one arrival in the window
    assert c.at(450, Load()).desired == 1  # idle since 450 only... (reset at 200)
    assert c.at(749, Load()).desired == 1
    assert c.at(750, Load()).desired == 0


def test_the_signals_last_request_shortens_the_idle_time() -> None:
    """The operator may have watched for long (or restarted); the orchestrator's own clock says
    a request came 10 s ago."""
    s = spec(minReplicas=0, idleSeconds=300)
    old = AutoscalerState(idle_since=-1000.0)
    assert decide(s, Load(last_request_unix=5_000.0), 1, old, 0.0, load_now=5_010.0).desired == 1
    assert decide(s, Load(last_request_unix=4_000.0), 1, old, 0.0, load_now=5_010.0).desired == 0


def test_without_min_zero_an_idle_pool_keeps_min() -> None:
    c = Clock(spec(minReplicas=1, idleSeconds=1), current=2)
    c.at(0, Load())
    assert c.at(10_000, Load()).desired == 1


def test_a_busy_pool_never_shrinks_below_one_before_idle() -> None:
    """A figure under one replica with minReplicas 0 keeps one warm, not zero."""
    d = decide(spec(minReplicas=0), Load(arrivals_per_s=0.001, service_s=0.1), 3,
               AutoscalerState(), 0)
    assert d.desired == 1


# --------------------------------------------------------------------------- wake


def test_at_zero_without_demand_stays_at_zero() -> None:
    d = decide(spec(minReplicas=0), Load(), 0, AutoscalerState(), 0)
    assert (d.desired, d.direction) == (0, 0)


@pytest.mark.parametrize("load", [Load(held=1), Load(wake_pending=True), Load(inflight=1)])
def test_held_or_a_wake_at_zero_gets_one_at_once_despite_the_cool_down(load: Load) -> None:
    just_shrank = AutoscalerState(last_direction=-1, last_change_at=0.0)
    d = decide(spec(minReplicas=0, coolDownSeconds=600), load, 0, just_shrank, 1.0)
    assert (d.desired, d.rule, d.direction) == (1, "wake", 1)
    assert d.reason.startswith("scale up 0 -> 1: woken")


def test_a_wake_sizes_to_what_is_held() -> None:
    d = decide(spec(minReplicas=0), Load(held=5), 0, AutoscalerState(), 0)
    assert d.desired == 5


# --------------------------------------------------------------------------- cool-down


def test_one_change_of_direction_per_cool_down() -> None:
    c = Clock(spec(coolDownSeconds=120), current=1)
    assert c.at(0, Load(arrivals_per_s=3, service_s=1)).desired == 3
    held = c.at(60, Load(arrivals_per_s=0.5, service_s=1))
    assert (held.desired, held.rule, held.direction) == (3, "cool-down", 0)
    assert "cool-down, 60s left" in held.reason
    assert c.at(119, Load(arrivals_per_s=0.5, service_s=1)).desired == 3
    d = c.at(120, Load(arrivals_per_s=0.5, service_s=1))
    assert (d.desired, d.direction) == (1, -1)
    # and back up within the cool-down of that change: held again
    assert c.at(130, Load(arrivals_per_s=3, service_s=1)).desired == 1


def test_the_same_direction_is_not_held_back() -> None:
    c = Clock(spec(coolDownSeconds=120), current=1)
    c.at(0, Load(arrivals_per_s=2, service_s=1))
    assert c.at(15, Load(arrivals_per_s=5, service_s=1)).desired == 5


def test_keeping_the_size_leaves_the_cool_down_clock_alone() -> None:
    c = Clock(spec(coolDownSeconds=120), current=1)
    c.at(0, Load(arrivals_per_s=3, service_s=1))
    c.at(100, Load(arrivals_per_s=3, service_s=1))  # keep: not a change
    assert c.state.last_change_at == 0
    assert c.at(121, Load(arrivals_per_s=0.5, service_s=1)).desired == 1


# --------------------------------------------------------------------------- the explanation


def test_a_decision_is_explained() -> None:
    d = decide(spec(), Load(inflight=2, arrivals_per_s=2, service_s=1), 2, AutoscalerState(), 0)
    assert d.direction == 0 and d.reason.startswith("keep 2: Little's law 2/s x 1s / 1")
    assert set(d.inputs) >= {"current", "inflight", "held", "arrivalsPerSecond",
                             "serviceSeconds", "queueWaitP95Seconds", "ttfoP95Seconds"}


def test_decide_is_pure() -> None:
    state = AutoscalerState(last_direction=1, last_change_at=0.0)
    s, load = spec(), Load(arrivals_per_s=3, service_s=1)
    first = decide(s, load, 1, state, 10)
    assert decide(s, load, 1, state, 10) == first
    assert state == AutoscalerState(last_direction=1, last_change_at=0.0)
    assert replace(first.state) == first.state
