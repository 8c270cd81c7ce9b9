"""spec.stages[].autoscaling: bounds, cross-field rules and the replicas seed, each error with the
field path a user sees from `omnistage validate` and the admission webhook (one validator)."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator.crd import omnipipeline_crd, stagepool_crd
from omnistage.spec import (
    AUTOSCALING_MIN_MAX,
    AUTOSCALING_ONE_TARGET,
    AUTOSCALING_SEED,
    MAX_REPLICAS,
    parse_pipeline,
    parse_stagepool,
)
from tests.unit.test_spec import manifest, stage
from tests.unit.test_spec_bounds import errors_of

AS = "spec.stages[0].autoscaling"


def scaled(autoscaling: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return manifest(stage("a", finalOutput=True, autoscaling=autoscaling, **extra))


def test_absent_means_a_fixed_size() -> None:
    spec = parse_pipeline(manifest(stage("a", finalOutput=True, replicas=3))).spec
    assert spec.stages[0].autoscaling is None
    assert spec.stages[0].replicas == 3


def test_defaults() -> None:
    scaling = parse_pipeline(scaled({"maxReplicas": 4})).spec.stages[0].autoscaling
    assert scaling is not None
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    assert (scaling.target.kind, scaling.target.value) == ("inflightPerReplica", 1.0)
    assert (scaling.period_seconds, scaling.window_seconds, scaling.cool_down_seconds,
            scaling.idle_seconds, scaling.hold_queue) == (15, 60, 120, 300, 64)


@pytest.mark.parametrize(("key", "value"), [
    ("inflightPerReplica", 2.5), ("queueWaitSeconds", 0.2), ("p95TimeToFirstOutputSeconds", 1.5)])
def test_each_target_kind(key: str, value: float) -> None:
    scaling = parse_pipeline(scaled({"maxReplicas": 2, "target": {key: value}})) \
        .spec.stages[0].autoscaling
    assert scaling is not None
    assert (scaling.target.kind, scaling.target.value) == (key, value)


def test_round_trip_keeps_camel_case_keys() -> None:
    doc = scaled({"minReplicas": 0, "maxReplicas": 8, "target": {"queueWaitSeconds": 0.5},
                  "coolDownSeconds": 30, "idleSeconds": 60, "holdQueue": 8})
    pipeline = parse_pipeline(doc)
    out = pipeline.to_manifest()["spec"]["stages"][0]["autoscaling"]
    assert out["minReplicas"] == 0 and out["target"] == {"queueWaitSeconds": 0.5}
    assert parse_pipeline(pipeline.to_manifest()) == pipeline


@pytest.mark.parametrize(("field", "value", "message"), [
    ("minReplicas", -1, "Input should be greater than or equal to 0 (got -1)"),
    ("minReplicas", MAX_REPLICAS + 1,
     f"Input should be less than or equal to {MAX_REPLICAS} (got {MAX_REPLICAS + 1})"),
    ("maxReplicas", 0, "Input should be greater than or equal to 1 (got 0)"),
    ("maxReplicas", MAX_REPLICAS + 1,
     f"Input should be less than or equal to {MAX_REPLICAS} (got {MAX_REPLICAS + 1})"),
    ("periodSeconds", 0.5, "Input should be greater than or equal to 1 (got 0.5)"),
    ("windowSeconds", 0, "Input should be greater than or equal to 1 (got 0)"),
    ("coolDownSeconds", -1, "Input should be greater than or equal to 0 (got -1)"),
    ("idleSeconds", 0, "Input should be greater than or equal to 1 (got 0)"),
    ("holdQueue", 0, "Input should be greater than or equal to 1 (got 0)"),
    ("periodSeconds", "15s", "must be a number (got str '15s')"),
])
def test_bounds_name_the_field(field: str, value: Any, message: str) -> None:
    doc = scaled({"minReplicas": 0, "maxReplicas": 2, field: value})
    if field in ("minReplicas", "maxReplicas"):
        doc["spec"]["stages"][0]["autoscaling"] = {"maxReplicas": MAX_REPLICAS, field: value}
    errors = errors_of(doc)
    assert (f"{AS}.{field}", message) in errors


@pytest.mark.parametrize("key", ["inflightPerReplica", "queueWaitSeconds",
                                 "p95TimeToFirstOutputSeconds"])
def test_a_target_is_positive(key: str) -> None:
    assert errors_of(scaled({"maxReplicas": 2, "target": {key: 0}})) == [
        (f"{AS}.target.{key}", "Input should be greater than 0 (got 0)")]


def test_min_above_max_is_refused_at_min_replicas() -> None:
    assert errors_of(scaled({"minReplicas": 3, "maxReplicas": 2})) == [
        (f"{AS}.minReplicas", f"{AUTOSCALING_MIN_MAX} (got 3 > 2)")]


def test_min_equal_to_max_is_a_fixed_autoscaled_size() -> None:
    scaling = parse_pipeline(scaled({"minReplicas": 2, "maxReplicas": 2})).spec.stages[0]
    assert scaling.replicas == 2


@pytest.mark.parametrize(("target", "got"), [
    ({}, "none"),
    ({"inflightPerReplica": 1, "queueWaitSeconds": 1}, "inflightPerReplica, queueWaitSeconds"),
])
def test_exactly_one_target(target: dict[str, Any], got: str) -> None:
    assert errors_of(scaled({"maxReplicas": 2, "target": target})) == [
        (f"{AS}.target", f"{AUTOSCALING_ONE_TARGET} (got {got})")]


def test_both_cross_field_errors_are_reported_at_once() -> None:
    errors = errors_of(scaled({"minReplicas": 5, "maxReplicas": 2, "target": {}}))
    assert [p for p, _ in errors] == [f"{AS}.minReplicas", f"{AS}.target"]


def test_unknown_key_is_named() -> None:
    [(path, message)] = errors_of(scaled({"maxReplicas": 2, "minReplica": 0}))
    assert path == f"{AS}.minReplica"
    assert "did you mean 'minReplicas'" in message


def test_explicit_replicas_outside_the_bounds_is_refused() -> None:
    assert errors_of(scaled({"minReplicas": 2, "maxReplicas": 4}, replicas=5)) == [
        ("spec.stages[0].replicas", f"{AUTOSCALING_SEED} (got 5, bounds [2, 4])")]
    assert errors_of(scaled({"minReplicas": 2, "maxReplicas": 4}, replicas=1)) == [
        ("spec.stages[0].replicas", f"{AUTOSCALING_SEED} (got 1, bounds [2, 4])")]


def test_explicit_replicas_within_the_bounds_seeds_the_pool() -> None:
    assert parse_pipeline(scaled({"minReplicas": 0, "maxReplicas": 4}, replicas=0)) \
        .spec.stages[0].replicas == 0
    assert parse_pipeline(scaled({"maxReplicas": 4}, replicas=3)).spec.stages[0].replicas == 3


@pytest.mark.parametrize(("low", "high", "seed"), [(0, 4, 1), (1, 4, 1), (3, 5, 3)])
def test_omitted_replicas_starts_at_one_within_the_bounds(low: int, high: int, seed: int) -> None:
    spec = parse_pipeline(scaled({"minReplicas": low, "maxReplicas": high})).spec
    assert spec.stages[0].replicas == seed


def test_a_stagepool_carries_autoscaling_and_reports_its_path() -> None:
    pool = {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
        "metadata": {"name": "demo-a"},
        "spec": {"pipeline": "demo", "image": "x/y:1", "replicas": 3,
                 "stage": stage("a", finalOutput=True,
                                autoscaling={"minReplicas": 0, "maxReplicas": 4})},
    }
    parsed = parse_stagepool(pool)
    assert parsed.spec.stage.autoscaling is not None
    assert parsed.spec.stage.autoscaling.min_replicas == 0
    pool["spec"]["stage"]["autoscaling"]["minReplicas"] = 9
    assert errors_of(pool) == [
        ("spec.stage.autoscaling.minReplicas", f"{AUTOSCALING_MIN_MAX} (got 9 > 4)")]


def _rules(node: dict[str, Any]) -> list[dict[str, Any]]:
    return node.get("x-kubernetes-validations", [])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("crd", "stage_path"), [
    (omnipipeline_crd, ("spec", "stages", "[]")), (stagepool_crd, ("spec", "stage"))])
def test_the_crd_carries_the_same_rules_at_the_same_paths(crd: Any, stage_path: tuple[str, ...]
                                                          ) -> None:
    node = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in stage_path:
        node = node["items"] if part == "[]" else node["properties"][part]
    scaling = node["properties"]["autoscaling"]
    assert {r["fieldPath"]: r["message"] for r in _rules(scaling)} == {
        ".minReplicas": AUTOSCALING_MIN_MAX, ".target": AUTOSCALING_ONE_TARGET}
    assert any(r.get("fieldPath") == ".replicas" and r["message"] == AUTOSCALING_SEED
               for r in _rules(node))
    props = scaling["properties"]
    assert (props["minReplicas"]["minimum"], props["maxReplicas"]["maximum"]) == (0, MAX_REPLICAS)
    assert props["target"]["properties"]["queueWaitSeconds"]["exclusiveMinimum"] is True
