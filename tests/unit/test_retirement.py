"""Named retirement and the pool's wanted ordinals (omni_operator.retirement), the status tree
(`omnistage status`), and which spec changes roll the orchestrator (builders)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_operator import builders, retirement
from omni_operator.models import API_VERSION, StagePoolSpec, desired_replicas
from omni_operator.replicas_cli import render_status, replica_state
from omni_operator.status import pool_status
from omnistage import kube
from omnistage.orchestrator.shutdown import shutdown_seconds
from omnistage.spec import parse_pipeline

Obj = dict[str, Any]


def _pool(replicas: int, annotation: str | None = None) -> Obj:
    meta: Obj = {"name": "p-a", "namespace": "ns", "resourceVersion": "7"}
    if annotation is not None:
        meta["annotations"] = {retirement.ANNOTATION_RETIRED: annotation}
    return {"metadata": meta, "spec": {"pipeline": "p", "replicas": replicas,
                                       "stage": {"name": "a", "kind": "echo"}}}


def _pod(ordinal: int, pool: str = "p-a") -> Obj:
    return {"metadata": {"name": f"{pool}-{ordinal}", "namespace": "ns",
                         "labels": {kube.LABEL_POOL: pool, kube.LABEL_ORDINAL: str(ordinal)}}}


def _leaving(ordinal: int) -> Obj:
    pod = _pod(ordinal)
    pod["metadata"]["annotations"] = {kube.ANNOTATION_DRAINING: "true"}
    return pod


def _apply(pool: Obj, patch: Obj) -> Obj:
    meta = {**pool["metadata"], "annotations": {
        **(pool["metadata"].get("annotations") or {}), **patch["metadata"]["annotations"]}}
    return {"metadata": meta, "spec": {**pool["spec"], **patch.get("spec", {})}}


def test_wanted_ordinals_keep_existing_replicas_and_fill_the_lowest_free() -> None:
    assert retirement.wanted_ordinals(_pool(3)) == [0, 1, 2]
    assert retirement.wanted_ordinals(_pool(0), [0, 1]) == []
    assert retirement.wanted_ordinals(_pool(2), [0, 1, 2]) == [0, 1]  # scale-down: highest go
    assert retirement.wanted_ordinals(_pool(3), [0, 2]) == [0, 1, 2]  # a lost 1 comes back
    assert retirement.wanted_ordinals(_pool(3), [0, 3]) == [0, 1, 3]  # nobody moves


def test_retire_lowers_replicas_and_keeps_the_ordinal_free_until_a_scale_up() -> None:
    pool = _pool(3)
    patch = retirement.drain_patch(pool, _pod(1), "retire")
    assert patch["spec"] == {"replicas": 2}
    assert patch["metadata"]["resourceVersion"] == "7"  # a concurrent change answers 409
    after = _apply(pool, patch)
    assert retirement.wanted_ordinals(after, [0, 2]) == [0, 2]  # 1 does not come back
    assert retirement.wanted_ordinals(after, [0]) == [0, 2]
    assert retirement.rewrite(after)[0] is False
    scaled = {**after, "spec": {**after["spec"], "replicas": 3}}
    assert retirement.rewrite(scaled) == (True, None)  # the set is empty: the annotation goes
    assert retirement.wanted_ordinals(scaled, [0, 2]) == [0, 1, 2]  # the scale-up reuses it


def _scaled(pool: Obj, replicas: int) -> Obj:
    return {**pool, "spec": {**pool["spec"], "replicas": replicas}}


def _rewritten(pool: Obj) -> Obj:
    changed, value = retirement.rewrite(pool)
    assert changed
    annotations = {**(pool["metadata"].get("annotations") or {})}
    if value is None:
        annotations.pop(retirement.ANNOTATION_RETIRED, None)
    else:
        annotations[retirement.ANNOTATION_RETIRED] = value
    return {**pool, "metadata": {**pool["metadata"], "annotations": annotations}}


def test_a_scale_up_frees_retired_ordinals_one_by_one_lowest_first() -> None:
    pool = _pool(4)
    pool = _apply(pool, retirement.drain_patch(pool, _pod(1), "retire"))
    pool = _apply(pool, retirement.drain_patch(pool, _pod(2), "retire"))
    assert desired_replicas(pool) == 2
    assert retirement.retired(pool).ordinals == {1, 2}
    assert retirement.wanted_ordinals(pool, [0, 3]) == [0, 3]

    up = _scaled(pool, 3)  # one more replica: 1 comes back, 2 stays retired
    assert retirement.retired(up) == retirement.Retired(frozenset({2}), frozenset(), 3)
    assert retirement.wanted_ordinals(up, [0, 3]) == [0, 1, 3]
    up = _rewritten(up)  # the controller's one write; then none
    assert json.loads(up["metadata"]["annotations"][retirement.ANNOTATION_RETIRED]) == {
        "ordinals": [2], "replace": [], "atReplicas": 3}
    assert retirement.rewrite(up)[0] is False
    # A lost replica does not come back under the ordinal that is still retired.
    assert retirement.wanted_ordinals(up, [0, 1]) == [0, 1, 3]

    up = _rewritten(_scaled(up, 4))  # the next one frees 2, and the annotation goes
    assert retirement.ANNOTATION_RETIRED not in up["metadata"]["annotations"]
    assert retirement.wanted_ordinals(up, [0, 1, 3]) == [0, 1, 2, 3]


def test_a_scale_up_by_two_frees_two_ordinals_and_keeps_the_replace_mark_of_the_rest() -> None:
    pool = _pool(4, json.dumps({"ordinals": [1, 2, 5], "replace": [5], "atReplicas": 1}))
    up = _scaled(pool, 3)
    assert retirement.retired(up) == retirement.Retired(frozenset({5}), frozenset({5}), 3)
    assert retirement.wanted_ordinals(up, [0]) == [0, 1, 2]


def test_replace_keeps_replicas_and_moves_the_replica_to_a_new_ordinal() -> None:
    pool = _pool(3)
    patch = retirement.drain_patch(pool, _pod(1), "replace")
    assert "spec" not in patch
    after = _apply(pool, patch)
    assert retirement.wanted_ordinals(after, [0, 1, 2]) == [0, 2, 3]
    assert retirement.retired(after).replace == {1}
    # A second named retirement adds to the first.
    again = _apply(after, retirement.drain_patch(after, _pod(2), "retire"))
    assert retirement.wanted_ordinals(again, [0, 2, 3]) == [0, 3]
    assert retirement.retired(again).ordinals == {1, 2}


@pytest.mark.parametrize(("pool", "pod", "message"), [
    (_pool(2, json.dumps({"ordinals": [1], "replace": [], "atReplicas": 2})), _pod(1),
     "already being retired"),
    (_pool(2), _leaving(1), "already leaving the pool"),
    (_pool(2), _pod(0, pool="other"), "is not a replica of StagePool p-a"),
])
def test_drain_refusals_say_why(pool: Obj, pod: Obj, message: str) -> None:
    with pytest.raises(retirement.DrainRefused, match=message):
        retirement.drain_patch(pool, pod, "retire")


def test_an_unreadable_annotation_is_ignored_and_then_cleared() -> None:
    pool = _pool(2, "{not json")
    assert retirement.wanted_ordinals(pool, [0, 1]) == [0, 1]
    assert retirement.rewrite(pool) == (True, None)


def _pipeline(**stage: Any) -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"orchestrator": {"shutdownDelaySeconds": 3},
                 "stages": [{"name": "a", "kind": "echo", "finalOutput": True, **stage}]},
    })


def _orchestrator_objects(**stage: Any) -> tuple[Obj, Obj]:
    pipeline = _pipeline(**stage)
    owner = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
             "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}}
    children = builders.pipeline_children(owner, pipeline)
    config = next(c for c in children if c["kind"] == "ConfigMap")
    deployment = next(c for c in children if c["kind"] == "Deployment")
    return config, deployment


def test_stage_runtime_changes_do_not_touch_the_orchestrator() -> None:
    base = _orchestrator_objects(engine={"echoDelayMs": 10}, replicas=2)
    for change in ({"engine": {"echoDelayMs": 500}}, {"replicas": 5},
                   {"resources": {"cpu": "3"}}, {"maxUnavailable": 0},
                   {"admission": {"maxRequests": 7}}):
        assert _orchestrator_objects(**{"engine": {"echoDelayMs": 10}, "replicas": 2,
                                        **change}) == base, change


def test_what_the_orchestrator_reads_rolls_it() -> None:
    _, base = _orchestrator_objects()
    for change in ({"drainTimeoutSeconds": 7}, {"admission": {"defaultDeadlineSeconds": 9}}):
        _, deployment = _orchestrator_objects(**change)
        assert deployment["spec"]["template"] != base["spec"]["template"], change


def test_the_orchestrator_manifest_parses_and_keeps_what_it_reads() -> None:
    pipeline = _pipeline(engine={"echoDelayMs": 10}, admission={"defaultDeadlineSeconds": 9,
                                                                 "maxRequests": 3})
    config, deployment = _orchestrator_objects(engine={"echoDelayMs": 10})
    seen = parse_pipeline(json.loads(config["data"][builders.PIPELINE_KEY]), check_paths=False)
    manifest = parse_pipeline(builders.pipeline_manifest(pipeline), check_paths=False)
    assert manifest.spec.stages[0].admission.default_deadline_seconds == 9
    assert seen.spec.stages[0].engine.echo_delay_ms != 10  # left out: not the orchestrator's
    # Surge, and a grace period that covers the whole shutdown (delay, drain, close).
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxUnavailable": 0, "maxSurge": 1}
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= shutdown_seconds(pipeline) == 3 + 30 + 5


def test_stage_pods_probe_every_second() -> None:
    pool = {"metadata": {"name": "p-a", "namespace": "ns"},
            "spec": {"pipeline": "p", "image": "img:1", "replicas": 1,
                     "stage": {"name": "a", "kind": "echo"}}}
    container = builders.pod_template(pool)[0]["containers"][0]
    assert container["startupProbe"]["periodSeconds"] == 1
    assert container["startupProbe"]["failureThreshold"] == 1800  # still 30 min to load
    assert container["readinessProbe"]["periodSeconds"] == 1


def _ready_pod(name: str, ordinal: int, **extra: Any) -> Obj:
    pod = _pod(ordinal)
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"][kube.LABEL_PIPELINE] = "p"
    pod["metadata"].update(extra)
    pod["spec"] = {"nodeName": "node-1"}
    pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return pod


def test_status_tree_names_state_inflight_and_node() -> None:
    pipeline = {"metadata": {"name": "p"}, "status": {"phase": "Ready", "conditions": [
        {"type": "Ready", "status": "True", "reason": "AllStagesReady"}]}}
    pool = _pool(2, json.dumps({"ordinals": [1], "replace": [], "atReplicas": 2}))
    pool["status"] = {"ready": "2/2"}
    pending = _pod(3)
    pending["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes"}]}
    draining = _ready_pod("p-a-2", 2, annotations={kube.ANNOTATION_DRAINING: "true"})
    orch = _ready_pod("p-orchestrator-x", 0)
    orch["metadata"]["labels"] = {kube.LABEL_PIPELINE: "p", kube.LABEL_COMPONENT: "orchestrator"}
    text = render_status(pipeline, [pool], [orch, _ready_pod("p-a-0", 0), draining, pending],
                         {"p-a-0": 2, "p-a-2": 1})
    lines = text.splitlines()
    assert lines[0].startswith("pipeline p  phase=Ready  Ready=True (AllStagesReady)")
    assert "├─ orchestrator  1 pod(s)" in text and "p-orchestrator-x  Ready  node=node-1" in text
    assert "└─ pool p-a  ready=2/2" in text and "retired ordinals=1" in text
    assert "p-a-0  Ready  in-flight=2  node=node-1" in text
    assert "p-a-2  Draining  in-flight=1" in text
    assert "p-a-3  Unschedulable  in-flight=?  node=-" in text
    assert replica_state({**draining, "metadata": {**draining["metadata"],
                                                   "deletionTimestamp": "t"}}) == "Terminating"


def test_a_pool_without_spec_replicas_wants_the_documented_default_of_one_everywhere() -> None:
    """The CRD documents `replicas` as defaulting to 1 and StagePoolSpec says so, but the CRD
    itself stores no default. Kills: any reader of a stored pool falling back to 0 (the
    controller would create no pod; status, PDB and `omnistage drain` would disagree)."""
    pool = _pool(1)
    del pool["spec"]["replicas"]
    spec = {**pool["spec"], "image": "omnistage/stage:dev"}
    assert StagePoolSpec.model_validate(spec).replicas == 1 == desired_replicas(pool)
    assert retirement.wanted_ordinals(pool) == [0]
    assert retirement.drain_patch(pool, _pod(0), "retire")["spec"] == {"replicas": 0}
    owned = {**pool, "apiVersion": API_VERSION, "kind": "StagePool",
             "metadata": {**pool["metadata"], "uid": "u1"}}
    assert builders.pool_pdb(owned)["spec"]["minAvailable"] == 0  # 1 - maxUnavailable 1
    ready = {**_pod(0), "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert pool_status(pool, [ready], "h", "2026-01-01T00:00:00Z").ready == "1/1"
    assert desired_replicas({"spec": {"replicas": 0}}) == 0  # an explicit 0 stays 0
