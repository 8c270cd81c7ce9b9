"""Status rules as pure functions, and every status the operator can write against the CRD schema.

The cluster suites write these statuses through the real API server too (tests/cluster); here the
scenarios are enumerated exhaustively and fast.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from omni_operator.crd import omnipipeline_crd, stagepool_crd
from omni_operator.status import (
    PHASES,
    invalid_status,
    pipeline_status,
    pool_status,
    reported_invalid,
    stage_minimum,
    summary,
    terminating_status,
)
from omnistage import kube

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:01:00Z"
HASH = "h1"


def pod(ordinal: int, *, ready: bool = True, spec_hash: str = HASH, draining: bool = False,
        deleting: bool = False, unschedulable: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"p-a-{ordinal}",
        "annotations": {kube.ANNOTATION_SPEC_HASH: spec_hash},
        "labels": {kube.LABEL_ORDINAL: str(ordinal)},
    }
    if draining:
        meta["annotations"][kube.ANNOTATION_DRAINING] = "true"
    if deleting:
        meta["deletionTimestamp"] = NOW
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."})
    return {"metadata": meta, "status": {"conditions": conditions}}


def pool(replicas: int, *, max_unavailable: int = 1, generation: int = 1,
         status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
        "metadata": {"name": "p-a", "namespace": "ns", "generation": generation},
        "spec": {"pipeline": "p", "replicas": replicas,
                 "stage": {"name": "a", "kind": "echo", "maxUnavailable": max_unavailable}},
        "status": status or {},
    }


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def settle(p: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool with the status the operator would store for these pods."""
    return {**p, "status": pool_status(p, pods, HASH, NOW)}


# ---------------------------------------------------------------------------- pools


def test_minimum_is_settled_replicas_minus_max_unavailable_and_at_least_one() -> None:
    assert stage_minimum(3, 3, 1) == 2
    assert stage_minimum(3, 1, 1) == 1  # scaling up from 1: the new replicas do not count
    assert stage_minimum(1, 3, 1) == 1  # scaling down: never below one
    assert stage_minimum(5, 5, 0) == 5


def test_settled_pool_is_ready_and_not_progressing() -> None:
    st = pool_status(pool(2), [pod(0), pod(1)], HASH, NOW)
    assert (st["ready"], st["readyReplicas"], st["settledReplicas"]) == ("2/2", 2, 2)
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Ready")["reason"] == "AllReplicasReady"
    assert cond(st, "Progressing")["status"] == "False"


def test_scale_up_keeps_ready_and_is_progressing() -> None:
    before = settle(pool(1), [pod(0)])
    scaled = {**before, "spec": {**before["spec"], "replicas": 3}}
    st = pool_status(scaled, [pod(0), pod(1, ready=False)], HASH, LATER)
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Ready")["reason"] == "MinimumReplicasReady"
    assert (cond(st, "Progressing")["status"], cond(st, "Progressing")["reason"]) == (
        "True", "ScalingUp")
    assert st["settledReplicas"] == 1


def test_scale_down_never_reads_more_ready_than_desired() -> None:
    before = settle(pool(3), [pod(0), pod(1), pod(2)])
    scaled = {**before, "spec": {**before["spec"], "replicas": 1}}
    st = pool_status(scaled, [pod(0), pod(1), pod(2, draining=True)], HASH, LATER)
    assert st["ready"] == "1/1"  # not 3/1 (nor 2/1)
    assert st["readyReplicas"] == 2  # the honest count stays in readyReplicas
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Progressing")["reason"] == "ScalingDown"


def test_rollout_within_max_unavailable_keeps_ready() -> None:
    before = settle(pool(2), [pod(0), pod(1)])
    st = pool_status(before, [pod(0, spec_hash="old"), pod(1, draining=True)], HASH, LATER)
    assert cond(st, "Ready")["status"] == "True"  # 1 ready >= minimum 2 - 1
    assert cond(st, "Progressing")["reason"] == "RollingUpdate"


def test_losing_serving_replicas_below_the_minimum_is_not_ready() -> None:
    before = settle(pool(3), [pod(0), pod(1), pod(2)])
    st = pool_status(before, [pod(0), pod(1, ready=False), pod(2, ready=False)], HASH, LATER)
    assert cond(st, "Ready")["status"] == "False"
    assert cond(st, "Ready")["reason"] == "ReplicasNotReady"
    assert cond(st, "Ready")["lastTransitionTime"] == LATER


def test_capacity_problem_is_named() -> None:
    st = pool_status(pool(1), [pod(0, ready=False, unschedulable=True)], HASH, NOW)
    assert cond(st, "Ready")["reason"] == "InsufficientCapacity"
    assert "nvidia.com/gpu" in cond(st, "Ready")["message"]


def test_zero_replicas_cannot_serve() -> None:
    st = pool_status(pool(0), [], HASH, NOW)
    assert cond(st, "Ready")["reason"] == "ScaledToZero" and st["ready"] == "0/0"


def test_unchanged_world_gives_an_identical_status() -> None:
    settled = settle(pool(2), [pod(0), pod(1)])
    assert pool_status(settled, [pod(0), pod(1)], HASH, LATER) == settled["status"]


# ---------------------------------------------------------------------------- pipelines


def pipeline(status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "generation": 1, "uid": "u"},
            "status": status or {}}


def deployment(ready: int, want: int = 1) -> dict[str, Any]:
    return {"metadata": {"generation": 1},
            "status": {"observedGeneration": 1, "readyReplicas": ready, "replicas": want,
                       "updatedReplicas": want}}


def run(pools: dict[str, Any], dep: dict[str, Any] | None, previous: dict[str, Any] | None = None,
        want: int = 1) -> dict[str, Any]:
    return pipeline_status(pipeline(previous), list(pools), pools, dep, want,
                           "http://p-orchestrator.ns.svc:8000", NOW)


def test_phases_follow_the_rules() -> None:
    ready_pool = settle(pool(2), [pod(0), pod(1)])
    new = run({"a": None}, None)
    assert new["phase"] == "Pending" and cond(new, "Ready")["reason"] == "StagesPending"
    ready = run({"a": ready_pool}, deployment(1))
    assert ready["phase"] == "Ready" and cond(ready, "Ready")["status"] == "True"
    assert cond(ready, "Progressing")["status"] == "False"
    # A scale in progress while serving: still Ready, and Progressing.
    scaling = settle(pool(1), [pod(0)])
    scaling = {**scaling, "spec": {**scaling["spec"], "replicas": 2}}
    scaling = settle(scaling, [pod(0), pod(1, ready=False)])
    moving = run({"a": scaling}, deployment(1), ready)
    assert moving["phase"] == "Progressing" and cond(moving, "Ready")["status"] == "True"
    # A spec change not yet seen by the pool keeps Ready (and says it is progressing).
    stale = {**ready_pool, "metadata": {**ready_pool["metadata"], "generation": 2}}
    assert run({"a": stale}, deployment(1), ready)["phase"] == "Progressing"
    # Below the minimum after having served: Degraded; before ever serving: Pending.
    down = settle(ready_pool, [pod(0, ready=False), pod(1, ready=False)])
    assert run({"a": down}, deployment(1), ready)["phase"] == "Degraded"
    assert run({"a": down}, deployment(1), new)["phase"] == "Pending"
    assert run({"a": ready_pool}, deployment(0), ready)["phase"] == "Degraded"


def test_pipeline_stage_counts_are_capped_at_desired() -> None:
    p = settle(pool(3), [pod(0), pod(1), pod(2)])
    p = settle({**p, "spec": {**p["spec"], "replicas": 1}}, [pod(0), pod(1), pod(2)])
    st = run({"a": p}, deployment(1))
    assert st["stages"]["a"] == {"pool": "p-a", "ready": 1, "desired": 1}


def test_invalid_and_terminating_statuses() -> None:
    errors = [("spec.stages[1].inputs[1]", "cycle detected: a -> b -> a"),
              ("spec.image", "an image is required")]
    before = run({"a": settle(pool(1), [pod(0)])}, deployment(1))
    obj = pipeline(before)
    st = invalid_status(obj, errors, LATER)
    assert st["phase"] == "Invalid"
    ready = cond(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == ("spec.stages[1].inputs[1]: cycle detected: a -> b -> a; "
                                "spec.image: an image is required")
    assert reported_invalid({**obj, "status": st})
    assert not reported_invalid({**obj, "status": st, "metadata": {**obj["metadata"],
                                                                    "generation": 2}})
    assert invalid_status({**obj, "status": st}, errors, "2027-01-01T00:00:00Z") == st
    gone = terminating_status(obj, "draining the orchestrator", LATER)
    assert gone["phase"] == "Terminating" and cond(gone, "Ready")["reason"] == "Terminating"
    assert summary(gone)[1] == "Terminating" and summary(st)[:2] == ("Warning", "InvalidSpec")


# ---------------------------------------------------------------------------- schema


def every_status() -> list[tuple[str, dict[str, Any]]]:
    """Every kind of status the status module writes, with every reason it can pick."""
    out: list[tuple[str, dict[str, Any]]] = []
    cases = {
        "settled": (pool(2), [pod(0), pod(1)]),
        "scale-up": (pool(3), [pod(0)]),
        "scale-down": (pool(1), [pod(0), pod(1, draining=True)]),
        "rollout": (pool(2), [pod(0, spec_hash="old"), pod(1)]),
        "starting": (pool(2), [pod(0), pod(1, ready=False)]),
        "capacity": (pool(1), [pod(0, ready=False, unschedulable=True)]),
        "zero": (pool(0), []),
        "down": (pool(2, status={"settledReplicas": 2}), [pod(0, ready=False)]),
    }
    for name, (p, pods) in cases.items():
        out.append((f"pool-{name}", pool_status(p, pods, HASH, NOW)))
    ready_pool = settle(pool(1), [pod(0)])
    for name, pools, dep, prev, want in (
        ("pending", {"a": None}, None, None, 1),
        ("ready", {"a": ready_pool}, deployment(1), None, 1),
        ("degraded", {"a": settle(pool(1), [pod(0, ready=False)])}, deployment(1),
         {"phase": "Ready"}, 1),
        ("no-orchestrator", {"a": ready_pool}, deployment(0, 0), None, 0),
    ):
        out.append((f"pipeline-{name}", run(pools, dep, prev, want=want)))
    out.append(("pipeline-invalid", invalid_status(pipeline(), [("spec", "x" * 5000)], NOW)))
    out.append(("pool-invalid", invalid_status(pool(1), [("spec.image", "bad")], NOW)))
    out.append(("pipeline-terminating", terminating_status(pipeline(), "going", NOW)))
    return out


def _status_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


@pytest.mark.parametrize(("name", "status"), every_status(), ids=lambda v: v if isinstance(
    v, str) else "")
def test_every_status_validates_against_the_crd_schema(name: str, status: dict[str, Any]) -> None:
    crd = stagepool_crd() if name.startswith("pool") else omnipipeline_crd()
    # OpenAPI v3.0 schemas are draft-4 JSON Schema plus x- extensions, which validators ignore.
    jsonschema.Draft4Validator(_status_schema(crd)).validate(status)
    if "phase" in status:
        assert status["phase"] in PHASES


def test_every_phase_is_reachable_and_in_the_enum() -> None:
    written = {s.get("phase") for _, s in every_status()} - {None}
    assert written | {"Progressing"} == set(PHASES)
    enum = _status_schema(omnipipeline_crd())["properties"]["phase"]["enum"]
    assert enum == list(PHASES)


def test_the_schema_check_is_not_vacuous() -> None:
    bad = {"phase": "Failed"}  # what the operator used to write, and the API server refused
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_status_schema(omnipipeline_crd())).validate(bad)
