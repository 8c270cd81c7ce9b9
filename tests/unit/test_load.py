"""The load signal's tracker, on a fake clock: windowed rates and percentiles, bounded memory."""

from __future__ import annotations

import msgspec
import pytest

from omnistage.orchestrator.load import (
    DEFAULT_WINDOW_S,
    LoadTracker,
    PipelineLoad,
    RevisionLoad,
    StageLoad,
    p95,
    window_of,
)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tracker(window: float = 10.0, ring: int = 1024) -> tuple[LoadTracker, Clock]:
    clock = Clock()
    return LoadTracker(["a", "b"], window_s=window, ring_size=ring, clock=clock,
                       wall=lambda: clock.t + 1_700_000_000.0), clock


def figures(t: LoadTracker, stage: str = "a") -> StageLoad:
    return t.figures(stage, replicas=2, inflight=3, held=1, wake_pending=True)


def test_p95_is_the_nearest_rank() -> None:
    assert p95([]) == 0.0
    assert p95([5.0]) == 5.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0


def test_figures_over_the_window_and_engine_values_passed_through() -> None:
    t, clock = tracker(window=10.0)
    clock.t += 20  # older than the window: the rate is over the whole window
    for _ in range(20):  # 2 per second for 10 s, each waits 0.1 s, first output 0.2, ends 1 s
        needed = t.arrived("a")
        clock.t += 0.1
        sent = t.dispatched("a", needed)
        clock.t += 0.2
        t.first_output("a", sent, needed_at=needed)
        clock.t += 0.2  # 0.5 s per request in total
        t.finished("a", sent - 0.6)  # service 1.0 s
    clock.t += 0.25  # the window [now - 10, now] holds the last 19 arrivals, not the first
    f = figures(t)
    assert f.arrivals_per_s == pytest.approx(1.9)
    assert f.service_s == pytest.approx(1.0)
    assert f.queue_wait_p95_s == pytest.approx(0.1)
    assert f.ttfo_p95_s == pytest.approx(0.2)
    assert (f.replicas, f.inflight, f.held, f.wake_pending) == (2, 3, 1, True)
    # The last arrival was 0.75 s ago, in unix time.
    assert f.last_request_unix == pytest.approx(clock.t + 1_700_000_000.0 - 0.75)
    untouched = figures(t, "b")
    assert (untouched.arrivals_per_s, untouched.service_s, untouched.last_request_unix) == (
        0.0, 0.0, None)


def test_queue_wait_adds_the_replicas_admission_queue() -> None:
    """The sample is the orchestrator's wait plus what the replica reports; a replica that
    reports nothing (an older worker) adds nothing."""
    t, clock = tracker(window=10.0)
    needed = t.arrived("a")
    clock.t += 0.1
    sent = t.dispatched("a", needed)
    clock.t += 2.0
    t.first_output("a", sent, needed_at=needed, worker_queue_s=1.5)
    assert figures(t).queue_wait_p95_s == pytest.approx(1.6)
    t2, clock2 = tracker(window=10.0)
    needed = t2.arrived("a")
    clock2.t += 0.1
    sent = t2.dispatched("a", needed)
    clock2.t += 2.0
    t2.first_output("a", sent, needed_at=needed, worker_queue_s=None)
    assert figures(t2).queue_wait_p95_s == pytest.approx(0.1)


def test_exec_is_the_service_time_less_the_replicas_queue() -> None:
    """exec_s, what the autoscaler's Little's law reads, leaves out the replica's admission
    queue (service_s keeps it); a replica that reports no queue wait gives exec_s == service_s,
    and exec_s leaves the window with the other samples.

    Kills: exec_s computed from service_s alone (an oversized pool after a step), or a queue
    wait counted twice."""
    t, clock = tracker(window=10.0)
    clock.t += 20
    for queue in (1.5, 0.5, None):
        needed = t.arrived("a")
        sent = t.dispatched("a", needed)
        clock.t += 2.0
        t.first_output("a", sent, needed_at=needed, worker_queue_s=queue)
        t.finished("a", sent, worker_queue_s=queue)  # service 2.0 s each
    f = figures(t)
    assert f.service_s == pytest.approx(2.0)
    assert f.exec_s == pytest.approx(((2.0 - 1.5) + (2.0 - 0.5) + 2.0) / 3)
    clock.t += 10.5
    assert figures(t).exec_s == 0.0


def test_samples_leave_the_window() -> None:
    t, clock = tracker(window=10.0)
    clock.t += 100
    needed = t.arrived("a")
    t.finished("a", t.dispatched("a", needed) - 3.0)
    assert figures(t).service_s == pytest.approx(3.0)
    clock.t += 10.5
    f = figures(t)
    assert (f.arrivals_per_s, f.service_s, f.queue_wait_p95_s) == (0.0, 0.0, 0.0)
    assert f.last_request_unix is not None  # idle time stays known after the window


def test_a_young_tracker_rates_over_its_age_not_the_whole_window() -> None:
    t, clock = tracker(window=60.0)
    for _ in range(10):
        t.arrived("a")
        clock.t += 0.5
    assert figures(t).arrivals_per_s == pytest.approx(10 / 5.0)


def test_rings_are_bounded_and_rate_covers_what_they_hold() -> None:
    t, clock = tracker(window=10.0, ring=8)
    clock.t += 50
    for _ in range(100):  # 10 per second: more than the ring holds in the window
        needed = t.arrived("a")
        t.first_output("a", t.dispatched("a", needed), needed_at=needed)
        clock.t += 0.1
    stage = t.stages["a"]
    assert len(stage.arrivals) == 8 and len(stage.queue_waits) == 8
    assert figures(t).arrivals_per_s == pytest.approx(8 / 0.8)


def test_window_comes_from_the_stages_autoscaling() -> None:
    class A:
        def __init__(self, w: float) -> None:
            self.window_seconds = w

    class S:
        def __init__(self, a: A | None) -> None:
            self.autoscaling = a

    class Spec:
        stages = [S(None), S(A(30)), S(A(90))]

    assert window_of(Spec()) == 90.0
    assert window_of(type("E", (), {"stages": [S(None)]})()) == DEFAULT_WINDOW_S
    with pytest.raises(ValueError, match="window_s"):
        LoadTracker(["a"], window_s=0)


def test_the_json_shape_is_the_contract() -> None:
    t, _ = tracker()
    load = PipelineLoad(window_s=10.0, now=1.0, stages={"a": figures(t)})
    doc = msgspec.json.decode(msgspec.json.encode(load))
    assert set(doc) == {"window_s", "now", "stages", "revisions", "held_by_cause"}
    assert set(doc["stages"]["a"]) == {
        "replicas", "inflight", "held", "arrivals_per_s", "service_s", "exec_s", "queue_wait_p95_s",
        "ttfo_p95_s", "last_request_unix", "wake_pending"}
    assert msgspec.json.decode(msgspec.json.encode(load), type=PipelineLoad) == load
    del doc["held_by_cause"]  # an orchestrator older than the field: read as none held
    assert msgspec.json.decode(msgspec.json.encode(doc), type=PipelineLoad).held_by_cause == {}


def test_a_revision_says_how_many_requests_are_pinned_to_it_and_old_readers_get_0() -> None:
    """`pinned` is in every revision's JSON (the operator retires a leaving revision's last
    replica on it); a document from an orchestrator older than the field reads as 0."""
    rev = RevisionLoad(order=2, newest=False, replicas=1, routable=0, pinned=3)
    doc = msgspec.json.decode(msgspec.json.encode(rev))
    assert doc == {"order": 2, "newest": False, "replicas": 1, "routable": 0, "pinned": 3}
    del doc["pinned"]
    assert msgspec.json.decode(msgspec.json.encode(doc), type=RevisionLoad).pinned == 0
