"""A wake from zero in the status rules (issue 37, defect 8; pure functions): the pool says
Waking from the moment it leaves zero, the pipeline counts it as serving for up to the bound it
is given (the pipeline's requestTimeoutSeconds), and Degraded past it. A model that cannot load
is a failure at once. tests/cluster/test_wake_status.py shows the first part on a real control
plane."""

from __future__ import annotations

from typing import Any

from omni_operator import status as typed
from omnistage import kube
from tests.unit.test_status import HASH, NOW, converged, pipeline, pod, pool

AT_ZERO = "2026-01-01T00:00:00Z"
WOKEN = "2026-01-01T00:00:10Z"
T_200S = "2026-01-01T00:03:20Z"
T_301S = "2026-01-01T00:05:11Z"


def _autoscaled(replicas: int, status: dict[str, Any] | None = None) -> dict[str, Any]:
    p = pool(replicas, status=status)
    p["spec"]["stage"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 3}
    return p


def _pool_status(p: dict[str, Any], pods: list[dict[str, Any]], now: str) -> dict[str, Any]:
    return typed.pool_status(p, pods, HASH, now).wire()


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def _pipeline(p: dict[str, Any], previous: dict[str, Any], now: str, bound: float = 300.0
              ) -> dict[str, Any]:
    return typed.pipeline_status(pipeline(previous), ["a"], {"a": p}, converged(1), 1, "e", now,
                                 wake_bound_s=bound).wire()


def test_a_pool_woken_from_zero_is_waking_and_its_pipeline_stays_ready() -> None:
    asleep = _autoscaled(0)
    asleep["status"] = _pool_status(asleep, [], AT_ZERO)
    assert _ready(asleep["status"])["reason"] == "IdleAtZero"
    serving = _pipeline(asleep, {}, AT_ZERO)
    assert serving["phase"] == "Ready"

    woken = _autoscaled(3, asleep["status"])
    starting = [pod(i, ready=False) for i in range(3)]
    woken["status"] = _pool_status(woken, starting, WOKEN)
    ready = _ready(woken["status"])
    assert (ready["status"], ready["reason"]) == ("False", "Waking")
    assert ready["lastTransitionTime"] == WOKEN and "0/3 replicas ready" in ready["message"]
    # Still waking at the next reconcile: the wake's start stays where it was.
    woken["status"] = _pool_status(woken, starting, T_200S)
    assert _ready(woken["status"])["lastTransitionTime"] == WOKEN
    assert typed.waking_for(woken, T_200S) == 190.0

    during = _pipeline(woken, serving, T_200S)
    p_ready = _ready(during)
    assert (p_ready["status"], p_ready["lastTransitionTime"]) == ("True", AT_ZERO)
    assert "waking from zero: a" in p_ready["message"]
    progressing = next(c for c in during["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Waking")
    assert during["phase"] == "Progressing"
    assert typed.transition_event(typed.PipelineStatus.model_validate(serving),
                                  typed.PipelineStatus.model_validate(during))[0] == "Normal"

    # Past the bound a held request has timed out: the stage is down, the pipeline Degraded.
    late = _pipeline(woken, during, T_301S)
    assert late["phase"] == "Degraded"
    assert (_ready(late)["status"], _ready(late)["reason"]) == ("False", "WakeTimeout")
    assert "requestTimeoutSeconds (300s)" in _ready(late)["message"]
    assert _pipeline(woken, during, T_200S, bound=100.0)["phase"] == "Degraded"

    # Once the minimum is met the wake is over: a later loss is a loss.
    up = [pod(0), pod(1, ready=False), pod(2, ready=False)]
    woken["status"] = _pool_status(woken, up, T_200S)
    assert _ready(woken["status"])["reason"] == "MinimumReplicasReady"
    woken["status"] = _pool_status(woken, starting, T_200S)
    assert _ready(woken["status"])["reason"] == "ReplicasNotReady"


def test_a_model_that_cannot_load_during_a_wake_is_a_failure_not_a_wake() -> None:
    asleep = _autoscaled(0)
    asleep["status"] = _pool_status(asleep, [], AT_ZERO)
    failed = pod(0, ready=False)
    failed["status"]["containerStatuses"] = [{
        "name": "worker", "ready": False,
        "state": {"terminated": {"exitCode": kube.MODEL_FAILED_EXIT, "message": "no weights"}}}]
    woken = _autoscaled(1, asleep["status"])
    ready = _ready(_pool_status(woken, [failed], WOKEN))
    assert (ready["status"], ready["reason"]) == ("False", "ModelLoadFailed")


def test_a_fixed_pool_that_was_never_at_zero_is_not_waking() -> None:
    p = pool(2)
    p["status"] = _pool_status(p, [pod(0), pod(1)], NOW)
    ready = _ready(_pool_status(p, [pod(0, ready=False), pod(1, ready=False)], NOW))
    assert ready["reason"] == "ReplicasNotReady"
