"""The image is part of a stage's revision (issue 37, defect 12): an upgrade of the runtime
image with an unchanged spec is a release (a new pod label, a new release order), and the
worker in that pod computes the same revision from $OMNISTAGE_IMAGE, which the operator sets.
A worker's resolved hub commit refines the label's revision, and the operator's retirement
gate counts requests pinned to any refinement of it. The worker side with real processes:
tests/integration/test_revision_image_commit.py."""

from __future__ import annotations

import pytest

from omni_operator import builders, drain, release
from omnistage import kube
from omnistage.revision import IMAGE_ENV, stage_revision, worker_revision
from omnistage.spec import Stage
from tests.unit.test_release import order, pipeline_doc, pools_of


def _with_image(doc: dict, image: str) -> dict:
    return {**doc, "spec": {**doc["spec"], "image": image}}


def test_an_image_upgrade_is_a_release_and_the_worker_agrees_with_its_label(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first = pools_of(_with_image(pipeline_doc(1), "omnistage:1.0"))
    upgraded = pools_of(_with_image(pipeline_doc(2), "omnistage:1.1"), dict(first))
    old, new = (release.pool_revision(p["a"]) for p in (first, upgraded))
    assert old != new
    assert order(upgraded["a"]) == (new, 2)  # a release of its own, ordered by generation
    upgraded["a"]["metadata"]["uid"] = "pool-a"  # as the API server gives it
    pod = builders.pool_pod(upgraded["a"], 0)
    assert pod["metadata"]["labels"][kube.LABEL_REVISION] == new
    [worker] = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env[IMAGE_ENV] == "omnistage:1.1" == worker["image"]
    # The worker in that pod: its stage as the pool stores it, its image from the env.
    monkeypatch.setenv(IMAGE_ENV, env[IMAGE_ENV])
    stage = Stage.model_validate(upgraded["a"]["spec"]["stage"])
    assert worker_revision(stage) == new
    monkeypatch.delenv(IMAGE_ENV)
    assert worker_revision(stage) == stage_revision(stage)  # `omnistage serve`: no image


def test_a_commit_refinement_counts_as_its_label_for_the_retirement_gate() -> None:
    loads = [{"revisions": {"a": {"aaaaaaaaaa+0123456789ab": {"pinned": 2},
                                  "aaaaaaaaaa": {"pinned": 1},
                                  "bbbbbbbbbb+0123456789ab": {"pinned": 5}}}},
             {"revisions": {"a": {"aaaaaaaaaa+ba9876543210": {"pinned": 3}}}}]
    assert drain.pinned_in_flight(loads, "a", "aaaaaaaaaa") == 6
    assert drain.pinned_in_flight(loads, "a", "bbbbbbbbbb") == 5
    assert drain.pinned_in_flight(loads, "a", "cccccccccc") == 0


def test_a_worker_appends_the_commit_unless_the_reference_names_it() -> None:
    stage = Stage.model_validate({"name": "a", "kind": "ar", "model": "org/m"})
    base = stage_revision(stage)
    assert worker_revision(stage, "f" * 40) == f"{base}+{'f' * 12}"
    pinned = Stage.model_validate({"name": "a", "kind": "ar", "model": f"org/m@{'f' * 40}"})
    assert worker_revision(pinned, "f" * 40) == stage_revision(pinned)
