"""`omnistage serve`'s autoscaler on a fake clock: periods, the in-process wake, idle to zero."""

from __future__ import annotations

from typing import Any

from omnistage.local_runtime import LocalAutoscaler
from omnistage.orchestrator.load import PipelineLoad, StageLoad
from omnistage.spec import parse_pipeline


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeRuntime:
    """What LocalAutoscaler uses of LocalStageRuntime: the pipeline, desired sizes, scale()."""

    def __init__(self) -> None:
        self.pipeline = parse_pipeline({
            "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p"},
            "spec": {"stages": [
                {"name": "fixed", "kind": "echo"},
                {"name": "z", "kind": "echo", "inputs": ["fixed"], "finalOutput": True,
                 "replicas": 0, "autoscaling": {
                     "minReplicas": 0, "maxReplicas": 3, "periodSeconds": 5,
                     "windowSeconds": 10, "idleSeconds": 20, "coolDownSeconds": 0}},
            ]},
        })
        self.desired = {"fixed": 1, "z": 0}
        self.scaled: list[tuple[str, int]] = []
        self.notes: list[str] = []

    def scale(self, stage: str, n: int) -> None:
        self.scaled.append((stage, n))
        self.desired[stage] = n

    def progress(self, msg: str) -> None:
        self.notes.append(msg)


def load(clock: Clock, **z: Any) -> PipelineLoad:
    figures = {"replicas": 0, "inflight": 0, "held": 0, "arrivals_per_s": 0.0, "service_s": 0.0,
               "exec_s": 0.0,
               "queue_wait_p95_s": 0.0, "ttfo_p95_s": 0.0, "last_request_unix": None,
               "wake_pending": False, **z}
    return PipelineLoad(window_s=10, now=clock.t, stages={"z": StageLoad(**figures)})


def test_wake_starts_a_stage_at_zero_at_once_and_only_autoscaled_ones() -> None:
    rt, clock = FakeRuntime(), Clock()
    scaler = LocalAutoscaler(rt, clock=clock)  # type: ignore[arg-type]
    assert set(scaler.specs) == {"z"}
    scaler.wake("fixed")  # no autoscaling: nothing to wake
    scaler.wake("z")
    scaler.wake("z")  # already heading for a replica: no second change
    assert rt.scaled == [("z", 1)]


def test_steps_follow_the_period_scale_on_littles_law_and_go_to_zero_when_idle() -> None:
    rt, clock = FakeRuntime(), Clock()
    rt.desired["z"] = 1
    scaler = LocalAutoscaler(rt, clock=clock)  # type: ignore[arg-type]
    # 2/s x 1.2 s = 2.4 in flight on average: 3 replicas at 1 per replica.
    scaler.step(load(clock, replicas=1, inflight=2, arrivals_per_s=2.0, service_s=1.2))
    assert rt.scaled == [("z", 3)]
    assert "scale up 1 -> 3" in rt.notes[-1]
    clock.t += 4  # within the period: no decision
    scaler.step(load(clock, replicas=3))
    assert rt.scaled == [("z", 3)]
    clock.t += 1  # due; idle from now on, so it shrinks to one warm replica first
    scaler.step(load(clock, replicas=3))
    assert rt.scaled[-1] == ("z", 1)
    for _ in range(4):  # 20 s idle: zero
        clock.t += 5
        scaler.step(load(clock, replicas=1))
    assert rt.scaled[-1] == ("z", 0), scaler.decisions["z"]
    assert scaler.decisions["z"].rule == "idle"
