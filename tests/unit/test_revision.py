"""omnistage.revision: which stage changes make a new payload revision."""

from __future__ import annotations

from typing import Any

import pytest

from omnistage.revision import ENGINE_FIELDS_NOT_IN_REVISION, REVISION_LENGTH, stage_revision
from omnistage.spec import EngineOptions, Stage


def _stage(**fields: Any) -> Stage:
    return Stage.model_validate({"name": "a", "kind": "echo", **fields})


def test_the_revision_is_short_hex_and_stable() -> None:
    rev = stage_revision(_stage())
    assert len(rev) == REVISION_LENGTH and int(rev, 16) >= 0
    assert rev == stage_revision(_stage())
    assert rev == stage_revision(_stage(name="other", replicas=5, drainTimeoutSeconds=9))


@pytest.mark.parametrize("change", [
    {"engine": {"echoChunkChars": 3}},
])
def test_what_changes_payloads_changes_the_revision(change: dict[str, Any]) -> None:
    assert stage_revision(_stage(**change)) != stage_revision(_stage())


AR = {"kind": "ar", "model": "/models/a"}


@pytest.mark.parametrize(("base", "change"), [
    (AR, {"engine": {"maxBatchSize": 2}}),
    (AR, {"engine": {"maxBatchTokens": 4096}}),
    ({}, {"engine": {"echoDelayMs": 500}}),
    ({}, {"admission": {"maxRequests": 3}}),
    ({}, {"streaming": {"enabled": False}}),
    ({}, {"dispatch": {"perReplica": 2}}),
])
def test_scheduling_and_timing_do_not_change_the_revision(base: dict[str, Any],
                                                          change: dict[str, Any]) -> None:
    assert stage_revision(_stage(**base, **change)) == stage_revision(_stage(**base))


def test_another_model_of_the_same_kind_is_another_revision() -> None:
    a = _stage(kind="ar", model="/models/a")
    assert stage_revision(a) != stage_revision(_stage(kind="ar", model="/models/b"))
    assert stage_revision(a) == stage_revision(_stage(kind="ar", model="/models/a"))
    seeded = _stage(kind="ar", model="/models/a", engine={"seed": 7})  # an ar option
    assert stage_revision(seeded) != stage_revision(a)


def test_a_pipeline_stage_and_its_pools_stage_have_one_revision() -> None:
    """A pool stores only the engine options its kind reads (an option of another kind is
    refused at validation, not carried): the pool's stage has the pipeline stage's revision."""
    from omni_operator.builders import pool_stage

    stage = _stage(engine={"echoChunkChars": 3})
    pooled = Stage.model_validate(pool_stage(stage))
    assert stage_revision(pooled) == stage_revision(stage)
    ar = _stage(**AR, engine={"seed": 7, "maxBatchSize": 4})
    assert stage_revision(Stage.model_validate(pool_stage(ar))) == stage_revision(ar)
    with pytest.raises(ValueError, match=r"engine\.seed: the echo kind does not read"):
        _stage(engine={"seed": 7, "echoChunkChars": 3})  # seed is not an echo option


def test_the_left_out_fields_are_engine_fields() -> None:
    assert ENGINE_FIELDS_NOT_IN_REVISION <= set(EngineOptions.model_fields)
