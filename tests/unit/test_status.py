"""Status rules as pure functions, and every status the operator can write against the CRD schema.

The cluster suites write these statuses through the real API server too (tests/cluster); here the
scenarios are enumerated exhaustively and fast.

The status functions return typed statuses (omni_operator.status_models); the tests below assert
their wire form, the document the controller writes and `kubectl get -o yaml` shows, through the
thin wrappers that follow (each also checks that the wire form reads back as the same status).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import jsonschema
import pytest
from pydantic import BaseModel

from omni_operator import release
from omni_operator import status as typed
from omni_operator.controller import STATUS_COALESCE_SECONDS, Controller
from omni_operator.crd import omnipipeline_crd, stagepool_crd
from omni_operator.status import PHASES, model_failure, reported_invalid, stage_minimum
from omni_operator.status_models import (
    Condition,
    CurveKeysStatus,
    PipelineRevisions,
    PipelineStatus,
    PoolStatus,
    RevisionReplicas,
    StageStatus,
    Status,
    field_table,
    status_model,
)
from omnistage import kube

DOCS = Path(__file__).resolve().parents[2] / "docs" / "crds.md"


def wire(status: Status) -> dict[str, Any]:
    """The wire form of a typed status; parsing it back gives the same status."""
    doc = status.wire()
    assert type(status).model_validate(doc).wire() == doc
    return doc


def pool_status(pool: dict[str, Any], pods: list[dict[str, Any]], template_hash: str,
                now: str, autoscaler: Any = None) -> dict[str, Any]:
    return wire(typed.pool_status(pool, pods, template_hash, now, autoscaler))


def pipeline_status(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return wire(typed.pipeline_status(*args, **kwargs))


def invalid_status(obj: dict[str, Any], errors: list[tuple[str, str]], now: str) -> dict[str, Any]:
    return wire(typed.invalid_status(obj, errors, now))


def terminating_status(obj: dict[str, Any], step: str, now: str) -> dict[str, Any]:
    return wire(typed.terminating_status(obj, step, now))


def summary(status: dict[str, Any]) -> tuple[str, str, str]:
    return typed.summary(PipelineStatus.model_validate(status))

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:01:00Z"
HASH = "h1"


def pod(ordinal: int, *, ready: bool = True, spec_hash: str = HASH, draining: bool = False,
        deleting: bool = False, unschedulable: bool = False, stage: str = "a") -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"p-{stage}-{ordinal}",
        "annotations": {kube.ANNOTATION_SPEC_HASH: spec_hash},
        "labels": {kube.LABEL_ORDINAL: str(ordinal), kube.LABEL_STAGE: stage},
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


def pool(replicas: int, *, max_unavailable: int | None = 1, generation: int = 1,
         status: dict[str, Any] | None = None, stage: str = "a") -> dict[str, Any]:
    """A StagePool; max_unavailable None leaves the field out (a hand-written pool may)."""
    stage_doc: dict[str, Any] = {"name": stage, "kind": "echo"}
    if max_unavailable is not None:
        stage_doc["maxUnavailable"] = max_unavailable
    return {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
        "metadata": {"name": f"p-{stage}", "namespace": "ns", "generation": generation},
        "spec": {"pipeline": "p", "replicas": replicas, "stage": stage_doc},
        "status": status or {},
    }


#: The stage revision of every pool() above (the stage's name is not part of it).
REV = release.pool_revision(pool(1))
#: The pipeline revision of pipelines whose stages all run REV (a, b, s, z...).
PREV = {n: release.pipeline_revision(dict.fromkeys(n, REV)) for n in ("a", "ab", "asz")}


def revised(p: dict[str, Any], revision: str, order: int, *, surge: bool = False
            ) -> dict[str, Any]:
    """The pod labelled with a stage revision and its release order, as the operator makes it."""
    p["metadata"]["labels"][kube.LABEL_REVISION] = revision
    p["metadata"]["annotations"][kube.ANNOTATION_REVISION_ORDER] = str(order)
    if surge:
        p["metadata"]["annotations"][release.ANNOTATION_SURGE] = "true"
    return p


def in_release() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A pool of 2 in a release: one old-revision replica left, one new, the surge (new)."""
    return pool(2), [revised(pod(0, spec_hash="old"), "0000000000", 1), revised(pod(1), REV, 2),
                     revised(pod(2), REV, 2, surge=True)]


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
                           "http://p-orchestrator.ns.svc:8000", NOW,
                           api_key_secret="p-api-keys-u1",
                           curve_keys=CurveKeysStatus(generation=1, secret=[0, 1],
                                                      added_at=NOW))


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
    assert st["stages"]["a"] == {"pool": "p-a", "ready": 1, "desired": 1, "revision": REV}


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


def autoscaled_statuses() -> list[tuple[str, dict[str, Any]]]:
    """A pool with spec.stage.autoscaling, as the autoscaler explains it: a change with the
    signal read, and one without it (omni_operator.autoscaler.status_of)."""
    from omni_operator.autoscaler import status_of
    from omnistage.autoscaling import AutoscalerState, Decision
    from omnistage.spec import Autoscaling

    scaling = Autoscaling(max_replicas=4)
    p = pool(3)
    p["spec"]["stage"]["autoscaling"] = {"maxReplicas": 4}
    up = Decision(3, "scale up 1 -> 3: Little's law", {"current": 1.0, "inflight": 3.0}, 1, 2.5,
                  "target", AutoscalerState(1, 1_700_000_000.0))
    blind = Decision(3, "no signal: keep 3 (refused)", {"current": 3.0}, 0, 0.0, "signal",
                     AutoscalerState(1, 1_700_000_000.0))
    return [
        ("pool-autoscaled", pool_status(p, [pod(0)], HASH, NOW,
                                        status_of(up, scaling, 1_700_000_010.0, "Available",
                                                  None))),
        ("pool-autoscaled-blind", pool_status(p, [pod(0)], HASH, NOW,
                                              status_of(blind, scaling, 1_700_000_020.0,
                                                        "Unavailable", "refused"))),
    ]


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
        "release": in_release(),
    }
    for name, (p, pods) in cases.items():
        out.append((f"pool-{name}", pool_status(p, pods, HASH, NOW)))
    out.extend(autoscaled_statuses())
    ready_pool = settle(pool(1), [pod(0)])
    for name, pools, dep, prev, want in (
        ("pending", {"a": None}, None, None, 1),
        ("ready", {"a": ready_pool}, deployment(1), None, 1),
        ("degraded", {"a": settle(pool(1), [pod(0, ready=False)])}, deployment(1),
         {"phase": "Ready"}, 1),
        ("no-orchestrator", {"a": ready_pool}, deployment(0, 0), None, 0),
        ("release", {"a": settle(*in_release())}, deployment(1), None, 1),
    ):
        out.append((f"pipeline-{name}", run(pools, dep, prev, want=want)))
    out.append(("pipeline-invalid", invalid_status(pipeline(), [("spec", "x" * 5000)], NOW)))
    out.append(("pool-invalid", invalid_status(pool(1), [("spec.image", "bad")], NOW)))
    out.append(("pipeline-terminating", terminating_status(pipeline(), "going", NOW)))
    return out


def _status_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused. The API server prunes them instead, silently: a
    field the operator writes but the schema lacks would vanish, and the status would differ
    from the stored one on every reconcile (a write each time)."""
    out = copy.deepcopy(schema)
    nodes = [out]
    while nodes:
        node = nodes.pop()
        if "properties" in node:
            node.setdefault("additionalProperties", False)
            nodes.extend(node["properties"].values())
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                nodes.append(node[key])
    return out


def _crd_for(name: str) -> dict[str, Any]:
    return stagepool_crd() if name.startswith("pool") else omnipipeline_crd()


@pytest.mark.parametrize(("name", "status"), every_status(), ids=lambda v: v if isinstance(
    v, str) else "")
def test_every_status_validates_against_the_crd_schema(name: str, status: dict[str, Any]) -> None:
    # OpenAPI v3.0 schemas are draft-4 JSON Schema plus x- extensions, which validators ignore.
    jsonschema.Draft4Validator(_strict(_status_schema(_crd_for(name)))).validate(status)
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
    typo = {"replicas": 1, "readyReplica": 1}  # pruned by the API server; refused here
    jsonschema.Draft4Validator(_status_schema(stagepool_crd())).validate(typo)
    with pytest.raises(jsonschema.ValidationError, match="readyReplica"):
        jsonschema.Draft4Validator(_strict(_status_schema(stagepool_crd()))).validate(typo)


def _schema_paths(node: dict[str, Any], path: str = "") -> set[str]:
    """Every field path a schema allows: .a.b, [] for list items, {} for map values."""
    out: set[str] = set()
    for name, sub in node.get("properties", {}).items():
        out |= {f"{path}.{name}"} | _schema_paths(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out |= _schema_paths(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out |= _schema_paths(node["additionalProperties"], f"{path}{{}}")
    return out


def _type_paths(annotation: Any, path: str) -> set[str]:
    """The field paths inside one annotation (models, lists and maps of them, optionals)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model_paths(annotation, path)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list:
        return _type_paths(args[0], f"{path}[]")
    if origin is dict:
        return _type_paths(args[1], f"{path}{{}}")
    if origin in (Union, UnionType):
        return set().union(*(_type_paths(a, path) for a in args))
    return set()


def _model_paths(model: type[BaseModel], path: str = "") -> set[str]:
    """Every field path of a model, by wire name."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        here = f"{path}.{field.alias or name}"
        out |= {here} | _type_paths(field.annotation, here)
    return out


def _written_paths(doc: Any, schema: dict[str, Any], path: str = "") -> set[str]:
    """The field paths a status document uses, map keys read as {}."""
    out: set[str] = set()
    if isinstance(doc, dict) and "properties" in schema:
        for key, value in doc.items():
            out |= {f"{path}.{key}"} | _written_paths(
                value, schema["properties"].get(key, {}), f"{path}.{key}")
    elif isinstance(doc, dict) and isinstance(schema.get("additionalProperties"), dict):
        for value in doc.values():
            out |= _written_paths(value, schema["additionalProperties"], f"{path}{{}}")
    elif isinstance(doc, list):
        for value in doc:
            out |= _written_paths(value, schema.get("items", {}), f"{path}[]")
    return out


@pytest.mark.parametrize(("kind", "model", "crd"), [
    ("pipeline", PipelineStatus, omnipipeline_crd), ("pool", PoolStatus, stagepool_crd)])
def test_the_status_schema_the_model_and_what_the_operator_writes_have_the_same_fields(
        kind: str, model: type[BaseModel], crd: Any) -> None:
    """A field in the model but not the schema (or the reverse) fails, and so does one that
    neither the operator writes (a dead field) nor the schema should carry."""
    schema = _status_schema(crd())
    assert _model_paths(model) == _schema_paths(schema)
    assert status_model("OmniPipeline" if kind == "pipeline" else "StagePool") is model
    written = set().union(*(_written_paths(st, schema) for name, st in every_status()
                            if name.startswith(kind)))
    assert written == _schema_paths(schema)


def test_the_field_comparison_is_not_vacuous() -> None:
    """A field added to a model alone is seen (the CRD is generated from the model, so only a
    hand edit of the schema, or a model the CRD does not use, could get there)."""

    class Wider(PoolStatus):
        lost_replicas: int | None = None

    schema = _status_schema(stagepool_crd())
    assert _model_paths(Wider) - _schema_paths(schema) == {".lostReplicas"}
    narrower = copy.deepcopy(schema)
    del narrower["properties"]["conditions"]["items"]["properties"]["message"]
    assert _model_paths(PoolStatus) - _schema_paths(narrower) == {".conditions[].message"}


def test_a_stored_status_reads_back_and_writes_back_unchanged() -> None:
    """What the API server returns parses into the model and serialises to the same document:
    no field is added (None fields stay out), renamed or lost; unknown fields are ignored."""
    for name, doc in every_status():
        model = status_model("StagePool" if name.startswith("pool") else "OmniPipeline")
        assert model.stored({"status": doc}).wire() == doc
        assert model.stored({"status": {**doc, "fromANewerOperator": 1}}).wire() == doc
    assert PoolStatus.stored({}).wire() == {} == PipelineStatus.stored({"status": None}).wire()
    with pytest.raises(ValueError, match="no status model for kind 'Deployment'"):
        status_model("Deployment")


def test_docs_carry_the_generated_field_tables() -> None:
    """docs/crds.md shows each status field with its type and the schema's description."""
    text = DOCS.read_text(encoding="utf-8")
    for model in (PipelineStatus, PoolStatus, StageStatus, Condition, PipelineRevisions,
                  RevisionReplicas):
        table = field_table(model)
        assert table in text, (
            f"docs/crds.md lacks the {model.__name__} table; paste field_table("
            f"{model.__name__}) from omni_operator.status_models:\n{table}")


# ---- the controller writes the wire form, only on change, one event per transition


class _RecordingApi:
    """Records status patches; answers each with the patched object."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []

    async def patch(self, url: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.patches.append((url, body))
        return body


async def test_the_controller_writes_only_changes_and_one_event_per_transition() -> None:
    """Kills: patch_status writing the model instead of its wire form, writing an unchanged
    status (stored, or written against the same resourceVersion before the watch delivered
    it), and an event for a write whose phase and Ready reason did not change. Changes that
    flip no condition are coalesced (tests/unit/test_status_coalescing.py): the clock moves
    past STATUS_COALESCE_SECONDS before each."""
    api = _RecordingApi()
    clock = [100.0]
    ctl = Controller(api=api, clock=lambda: clock[0])  # type: ignore[arg-type]
    events: list[tuple[str, ...]] = []
    ctl.writes.event = lambda obj, *event: events.append(event)  # type: ignore[method-assign]
    url = "/apis/omnistage.io/v1alpha1/namespaces/ns/omnipipelines/p/status"
    obj = pipeline()
    obj["metadata"]["resourceVersion"] = "1"

    def compute(o: dict[str, Any], pools: dict[str, Any], dep_: Any, now: str) -> PipelineStatus:
        return typed.pipeline_status(o, ["a"], pools, dep_, 1, ENDPOINT, now)

    pending = compute(obj, {"a": None}, None, NOW)
    await ctl.pipeline_reconciler.write_status(obj, pending)
    assert api.patches == [(url, {"status": pending.wire()})]
    assert events == [("Normal", "Pending", "stage a: pool not reconciled yet")]
    # the watch has not delivered our write yet
    await ctl.pipeline_reconciler.write_status(obj, pending)
    stored = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "2"},
              "status": pending.wire()}
    await ctl.pipeline_reconciler.write_status(stored, compute(stored, {"a": None}, None, LATER))
    assert len(api.patches) == 1 and len(events) == 1
    # The pool appears, starting: a new Ready reason, one event.
    starting = compute(stored, {"a": settle(pool(1), [pod(0, ready=False)])}, None, LATER)
    clock[0] += STATUS_COALESCE_SECONDS
    await ctl.pipeline_reconciler.write_status(stored, starting)
    assert len(api.patches) == 2
    assert events[1:] == [("Normal", "Pending", "stage a: 0/1 replicas ready (minimum 1)")]
    # Scaled up while starting: a new message, the same phase and reason: a write, no event.
    stored = {**stored, "status": starting.wire()}
    moved = compute(stored, {"a": settle(pool(2), [pod(0, ready=False)])}, None, LATER)
    clock[0] += STATUS_COALESCE_SECONDS
    await ctl.pipeline_reconciler.write_status(stored, moved)
    assert len(api.patches) == 3 and len(events) == 2
    assert typed.transition_event(PipelineStatus.stored(stored), moved) is None
    # Serving: one write, one event.
    stored = {**stored, "status": moved.wire()}
    serving = compute(stored, {"a": serving_pool()}, converged(1), LATER)
    await ctl.pipeline_reconciler.write_status(stored, serving)
    assert api.patches[-1] == (url, {"status": serving.wire()}) and len(api.patches) == 4
    assert events[2:] == [("Normal", "Ready", "pipeline is serving (1/1 stages)")]
    # A pool's status: its wire form, no phase.
    refused = typed.invalid_status(pool(1), [("spec.image", "bad")], NOW)
    assert await ctl.writes.patch_status(pool(1), refused)
    assert api.patches[-1][1] == {"status": refused.wire()} and "phase" not in refused.wire()
    assert not ctl.queue._timers


class _VersioningApi(_RecordingApi):
    """Answers each status patch with the object at a new resourceVersion, as the server does."""

    async def patch(self, url: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        await super().patch(url, body)
        return {**body, "metadata": {"resourceVersion": str(100 + len(self.patches))}}


async def test_a_status_is_not_rewritten_when_the_watch_delivers_an_older_write_of_ours() -> None:
    """Two shutdown steps written against one stale version (v1 -> v101, v1 -> v102); the watch
    then delivers v101, which still shows the first step: the second is not written again. It
    is written again once someone else's version (v7) shows a different status.

    Kills: a read-your-writes guard that remembers only the version the last write was made
    against (the CI failure: three Terminating writes for two steps)."""
    api = _VersioningApi()
    ctl = Controller(api=api)  # type: ignore[arg-type]
    obj = pipeline()
    obj["metadata"].update(resourceVersion="1", deletionTimestamp=NOW)
    draining = typed.terminating_status(obj, "draining the orchestrator", NOW)
    stopping = typed.terminating_status(obj, "stopping the stage pools", LATER)
    assert await ctl.writes.patch_status(obj, draining)
    assert await ctl.writes.patch_status(obj, stopping)
    delivered = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "101"},
                 "status": draining.wire()}
    assert not await ctl.writes.patch_status(delivered, stopping)
    assert len(api.patches) == 2
    current = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "102"},
               "status": stopping.wire()}
    assert not await ctl.writes.patch_status(current, stopping)  # stored: nothing to write
    reverted = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "7"},
                "status": draining.wire()}
    assert await ctl.writes.patch_status(reverted, stopping)
    assert [body["status"] for _, body in api.patches] == [draining.wire(), stopping.wire(),
                                                           stopping.wire()]


# ---------------------------------------------------------------------------- the full contract
# What `kubectl get sp/omnipipe -o yaml` shows, field by field: every condition whole (type,
# status, reason, message, lastTransitionTime, observedGeneration), every count, every phase.


def c(ctype: str, status: bool, reason: str, message: str, *, since: str = NOW,
      gen: int = 1) -> dict[str, Any]:
    """One condition exactly as the operator writes it."""
    return {"type": ctype, "status": "True" if status else "False", "reason": reason,
            "message": message, "lastTransitionTime": since, "observedGeneration": gen}


def failed_worker(p: dict[str, Any], exit_code: int = kube.MODEL_FAILED_EXIT,
                  message: str = "model load failed: OSError: bad weights") -> dict[str, Any]:
    """The pod with its worker container exited (not ready)."""
    p["status"]["containerStatuses"] = [{
        "name": "worker", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "message": message}}}]
    return p


def _pool_scenarios() -> list[tuple[str, dict[str, Any], list[dict[str, Any]], dict[str, Any],
                                    dict[str, Any], dict[str, Any]]]:
    """(id, pool, pods, counts, Ready, Progressing) for every branch of pool_status."""
    gpu = "p-a-0: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    return [
        ("settled", pool(2), [pod(0), pod(1)],
         {"replicas": 2, "readyReplicas": 2, "drainingReplicas": 0, "updatedReplicas": 2,
          "settledReplicas": 2, "ready": "2/2"},
         c("Ready", True, "AllReplicasReady", "2/2 replicas ready (minimum 1)"),
         c("Progressing", False, "UpToDate", "2 replicas updated and ready")),
        ("scale-up", pool(3, status={"settledReplicas": 1}), [pod(0), pod(1, ready=False)],
         {"replicas": 2, "readyReplicas": 1, "drainingReplicas": 0, "updatedReplicas": 2,
          "settledReplicas": 1, "ready": "1/3"},
         c("Ready", True, "MinimumReplicasReady", "1/3 replicas ready (minimum 1)"),
         c("Progressing", True, "ScalingUp", "2/3 replicas created")),
        # Three live replicas, one draining, for one wanted: two to retire; settledReplicas
        # keeps 3 (the pool is not at its new size yet, although ready >= desired).
        ("scale-down", pool(1, status={"settledReplicas": 3}),
         [pod(0), pod(1), pod(2, draining=True)],
         {"replicas": 3, "readyReplicas": 2, "drainingReplicas": 1, "updatedReplicas": 3,
          "settledReplicas": 3, "ready": "1/1"},
         c("Ready", True, "AllReplicasReady", "1/1 replicas ready (minimum 1)"),
         c("Progressing", True, "ScalingDown", "retiring 2 replica(s)")),
        ("rollout", pool(2, status={"settledReplicas": 2}), [pod(0, spec_hash="old"), pod(1)],
         {"replicas": 2, "readyReplicas": 2, "drainingReplicas": 0, "updatedReplicas": 1,
          "settledReplicas": 2, "ready": "2/2"},
         c("Ready", True, "AllReplicasReady", "2/2 replicas ready (minimum 1)"),
         c("Progressing", True, "RollingUpdate", "1/2 replicas updated")),
        # Every replica exists and is ready, but one runs the old spec: the pool has not
        # reached 2 "with every replica updated and ready", so settledReplicas stays 1.
        ("rollout-after-scale-up", pool(2, status={"settledReplicas": 1}),
         [pod(0, spec_hash="old"), pod(1)],
         {"replicas": 2, "readyReplicas": 2, "drainingReplicas": 0, "updatedReplicas": 1,
          "settledReplicas": 1, "ready": "2/2"},
         c("Ready", True, "AllReplicasReady", "2/2 replicas ready (minimum 1)"),
         c("Progressing", True, "RollingUpdate", "1/2 replicas updated")),
        # A new pool has settled nothing yet: settledReplicas 0, minimum 1.
        ("starting", pool(2), [pod(0), pod(1, ready=False)],
         {"replicas": 2, "readyReplicas": 1, "drainingReplicas": 0, "updatedReplicas": 2,
          "settledReplicas": 0, "ready": "1/2"},
         c("Ready", True, "MinimumReplicasReady", "1/2 replicas ready (minimum 1)"),
         c("Progressing", True, "ReplicasStarting", "1/2 replicas ready")),
        ("capacity", pool(1), [pod(0, ready=False, unschedulable=True)],
         {"replicas": 1, "readyReplicas": 0, "drainingReplicas": 0, "updatedReplicas": 1,
          "settledReplicas": 0, "ready": "0/1"},
         c("Ready", False, "InsufficientCapacity", gpu),
         c("Progressing", True, "InsufficientCapacity", gpu)),
        ("zero", pool(0, status={"settledReplicas": 2}), [],
         {"replicas": 0, "readyReplicas": 0, "drainingReplicas": 0, "updatedReplicas": 0,
          "settledReplicas": 0, "ready": "0/0"},
         c("Ready", False, "ScaledToZero", "replicas is 0: the stage cannot serve"),
         c("Progressing", False, "UpToDate", "0 replicas updated and ready")),
        ("below-minimum", pool(3, status={"settledReplicas": 3}),
         [pod(0), pod(1, ready=False), pod(2, ready=False)],
         {"replicas": 3, "readyReplicas": 1, "drainingReplicas": 0, "updatedReplicas": 3,
          "settledReplicas": 3, "ready": "1/3"},
         c("Ready", False, "ReplicasNotReady", "1/3 replicas ready (minimum 2)"),
         c("Progressing", True, "ReplicasStarting", "1/3 replicas ready")),
        # Exactly at the minimum is serving.
        ("at-minimum", pool(3, status={"settledReplicas": 3}),
         [pod(0), pod(1), pod(2, ready=False)],
         {"replicas": 3, "readyReplicas": 2, "drainingReplicas": 0, "updatedReplicas": 3,
          "settledReplicas": 3, "ready": "2/3"},
         c("Ready", True, "MinimumReplicasReady", "2/3 replicas ready (minimum 2)"),
         c("Progressing", True, "ReplicasStarting", "2/3 replicas ready")),
        # maxUnavailable 0: losing any replica is below the minimum.
        ("max-unavailable-0", pool(3, max_unavailable=0, status={"settledReplicas": 3}),
         [pod(0), pod(1), pod(2, ready=False)],
         {"replicas": 3, "readyReplicas": 2, "drainingReplicas": 0, "updatedReplicas": 3,
          "settledReplicas": 3, "ready": "2/3"},
         c("Ready", False, "ReplicasNotReady", "2/3 replicas ready (minimum 3)"),
         c("Progressing", True, "ReplicasStarting", "2/3 replicas ready")),
        # A pool that leaves maxUnavailable out gets the Stage default, 1.
        ("max-unavailable-absent", pool(3, max_unavailable=None, status={"settledReplicas": 3}),
         [pod(0), pod(1), pod(2, ready=False)],
         {"replicas": 3, "readyReplicas": 2, "drainingReplicas": 0, "updatedReplicas": 3,
          "settledReplicas": 3, "ready": "2/3"},
         c("Ready", True, "MinimumReplicasReady", "2/3 replicas ready (minimum 2)"),
         c("Progressing", True, "ReplicasStarting", "2/3 replicas ready")),
        # A pod being deleted is not a replica of the pool any more (but it is draining).
        ("terminating-pod", pool(1), [pod(0), pod(1, deleting=True)],
         {"replicas": 1, "readyReplicas": 1, "drainingReplicas": 1, "updatedReplicas": 1,
          "settledReplicas": 1, "ready": "1/1"},
         c("Ready", True, "AllReplicasReady", "1/1 replicas ready (minimum 1)"),
         c("Progressing", False, "UpToDate", "1 replicas updated and ready")),
        ("model-load-failed", pool(1), [failed_worker(pod(0, ready=False))],
         {"replicas": 1, "readyReplicas": 0, "drainingReplicas": 0, "updatedReplicas": 1,
          "settledReplicas": 0, "ready": "0/1"},
         c("Ready", False, "ModelLoadFailed",
           "stage 'a': the model could not be loaded on p-a-0: model load failed: OSError: bad "
           "weights"),
         c("Progressing", True, "ReplicasStarting", "0/1 replicas ready")),
        # A replica the scheduler cannot place is named before one whose model failed.
        ("capacity-before-model", pool(2),
         [failed_worker(pod(0, ready=False)), pod(1, ready=False, unschedulable=True)],
         {"replicas": 2, "readyReplicas": 0, "drainingReplicas": 0, "updatedReplicas": 2,
          "settledReplicas": 0, "ready": "0/2"},
         c("Ready", False, "InsufficientCapacity", gpu.replace("p-a-0", "p-a-1")),
         c("Progressing", True, "InsufficientCapacity", gpu.replace("p-a-0", "p-a-1"))),
        # The failure of a replica on its way out is not the pool's.
        ("terminating-pod-failed", pool(1),
         [pod(0, ready=False), failed_worker(pod(1, ready=False, deleting=True))],
         {"replicas": 1, "readyReplicas": 0, "drainingReplicas": 1, "updatedReplicas": 1,
          "settledReplicas": 0, "ready": "0/1"},
         c("Ready", False, "ReplicasNotReady", "0/1 replicas ready (minimum 1)"),
         c("Progressing", True, "ReplicasStarting", "0/1 replicas ready")),
    ]


@pytest.mark.parametrize(("name", "p", "pods", "counts", "ready", "progressing"),
                         _pool_scenarios(), ids=lambda v: v if isinstance(v, str) else "")
def test_pool_status_is_exactly_what_kubectl_shows(
    name: str, p: dict[str, Any], pods: list[dict[str, Any]], counts: dict[str, Any],
    ready: dict[str, Any], progressing: dict[str, Any],
) -> None:
    """The whole StagePool status, for every branch: counts, selector, both conditions whole.

    Kills: every reason/message text mutation of pool_status (ScaledToZero,
    InsufficientCapacity in both conditions, ScalingDown/ScalingUp/RollingUpdate/
    ReplicasStarting/UpToDate and their counts, `len(live) - desired` -> `+`), the status keys
    (replicas, drainingReplicas, updatedReplicas, selector), `draining = None`/`sum(2 ...)`,
    `counts = None`, ok/moving True<->False flips, gen/message/now -> None in either condition,
    the maxUnavailable lookup (key, `or` -> `and`, default 1 -> 2/None), the deletionTimestamp
    key of `live`, `settled_now` `and` -> `or` (scale-down, rollout-after-scale-up), the
    settledReplicas default 0 -> 1, and `ready >= minimum` -> `>` (at-minimum).
    """
    st = pool_status(p, pods, HASH, NOW)
    assert st == {**counts, "selector": "omnistage.io/pool=p-a", "observedGeneration": 1,
                  "revision": REV, "conditions": [ready, progressing]}


def test_pool_conditions_keep_their_transition_time_until_their_status_flips() -> None:
    """A recomputed pool keeps each condition's lastTransitionTime while its status holds and
    takes the new time on a flip; observedGeneration follows the pool's generation.

    Kills: `previous` lookup mutations (key, default), `now` -> None in the Progressing
    condition, generation -> None in either condition.
    """
    before = settle(pool(2, generation=4), [pod(0), pod(1)])
    later = pool_status(before, [pod(0), pod(1, ready=False)], HASH, LATER)
    assert later["conditions"] == [
        c("Ready", True, "MinimumReplicasReady", "1/2 replicas ready (minimum 1)", gen=4),
        c("Progressing", True, "ReplicasStarting", "1/2 replicas ready", since=LATER, gen=4),
    ]
    assert later["observedGeneration"] == 4


# ---- pipelines, whole

ENDPOINT = "http://p-orchestrator.ns.svc:8000"


def dep(*, want: int = 1, generation: int = 1, **status: int) -> dict[str, Any]:
    """An orchestrator Deployment. Kubernetes leaves zero counts (and, before the deployment
    controller has seen it, observedGeneration) out of the status: so do the callers."""
    return {"metadata": {"generation": generation}, "spec": {"replicas": want}, "status": status}


def converged(want: int) -> dict[str, Any]:
    counts = {"replicas": want, "updatedReplicas": want, "readyReplicas": want} if want else {}
    return dep(want=want, observedGeneration=1, **counts)


def serving_pool(stage: str = "a", replicas: int = 2) -> dict[str, Any]:
    return settle(pool(replicas, stage=stage), [pod(i, stage=stage) for i in range(replicas)])


def pstatus(pools: dict[str, Any], deployment: dict[str, Any] | None, *, want: int = 1,
            previous: dict[str, Any] | None = None, now: str = NOW,
            generation: int = 1) -> dict[str, Any]:
    pipe = pipeline(previous)
    pipe["metadata"]["generation"] = generation
    return pipeline_status(pipe, list(pools), pools, deployment, want, ENDPOINT, now)


def pconds(ready: tuple[bool, str, str], progressing: tuple[bool, str, str],
           stages: tuple[bool, str, str], orch: tuple[bool, str, str], *, since: str = NOW,
           gen: int = 1) -> list[dict[str, Any]]:
    return [c(t, *v, since=since, gen=gen) for t, v in (
        ("Ready", ready), ("Progressing", progressing), ("StagesReady", stages),
        ("OrchestratorReady", orch))]


SERVING = (True, "Serving", "pipeline is serving")
UP_TO_DATE = (False, "UpToDate", "every stage is updated and ready")
ORCH_1 = (True, "OrchestratorAvailable", "1/1 orchestrator replicas ready")


def test_a_serving_pipeline_status_is_exactly_what_kubectl_shows() -> None:
    """Kills: the Serving/UpToDate/AllStagesServing/OrchestratorAvailable texts, the
    observedGeneration/endpoint/stagesReady keys, `gen = None`, `ready_n = None`/`sum(2 ...)`,
    `moving[0] if moving and False` (UpToDate would always show), and None for the message,
    generation or time of any of the four conditions."""
    st = pstatus({"a": serving_pool()}, converged(1), generation=3)
    assert st == {
        "observedGeneration": 3, "phase": "Ready", "endpoint": ENDPOINT, "stagesReady": "1/1",
        "stages": {"a": {"pool": "p-a", "ready": 2, "desired": 2, "revision": REV}},
        "revisions": {"stable": PREV["a"]},
        "conditions": pconds(SERVING, UP_TO_DATE,
                             (True, "AllStagesServing", "1/1 stages at or above their minimum"),
                             ORCH_1, gen=3),
    }


def test_a_new_pipeline_is_pending_on_pools_not_reconciled_yet() -> None:
    """No pool yet, and a pool whose status is still empty: both 'pool not reconciled yet'.

    Kills: `pool is None or ready is None` -> `and` (the empty status would crash), the
    'pool not reconciled yet' text, the stage's `replicas` default 0 -> 1 (no pool: 0 desired),
    the pool's `readyReplicas` default 0 -> 1 (reconciled never: 0 ready), `bool(moving)` ->
    None, and the OrchestratorNotReady texts.
    """
    unreconciled = pool(2)
    st = pstatus({"a": None, "b": unreconciled}, None)
    pending_a = "stage a: pool not reconciled yet"
    assert st == {
        "observedGeneration": 1, "phase": "Pending", "endpoint": ENDPOINT, "stagesReady": "0/2",
        "stages": {"a": {"pool": "p-a", "ready": 0, "desired": 0},
                   "b": {"pool": "p-b", "ready": 0, "desired": 2}},
        "conditions": pconds((False, "StagesPending", pending_a),
                             (True, "StagesPending", pending_a),
                             (False, "StagesPending", pending_a),
                             (False, "OrchestratorNotReady", "0/1 orchestrator replicas ready")),
    }


def test_a_scaling_stage_keeps_the_pipeline_ready_and_names_what_moves() -> None:
    """Kills: `why_moving[0]` -> `[1]` (the reason would be the message), the pool Progressing
    reason/message lookups (`get(None)`, key case, `get("Progressing")`), and the
    `stage <name>: ` prefix."""
    scaling = settle(pool(3, status={"settledReplicas": 1}), [pod(0), pod(1, ready=False)])
    st = pstatus({"a": scaling}, converged(1))
    assert st["phase"] == "Progressing"
    assert st["conditions"] == pconds(
        SERVING, (True, "ScalingUp", "stage a: 2/3 replicas created"),
        (True, "AllStagesServing", "1/1 stages at or above their minimum"), ORCH_1)


def test_a_pool_that_has_not_seen_its_new_spec_is_progressing() -> None:
    """Kills: the 'Progressing' / 'applying the new spec' texts of a stale pool."""
    stale = serving_pool()
    stale["metadata"]["generation"] = 2
    st = pstatus({"a": stale}, converged(1))
    assert st["phase"] == "Progressing"
    assert st["conditions"][1] == c("Progressing", True, "Progressing",
                                    "stage a: applying the new spec")


def test_pool_conditions_with_only_type_and_status_still_read_well() -> None:
    """The CRD requires only type and status of a condition: a pool whose conditions carry
    no reason or message (written by hand, or by another client) reads as ReplicasNotReady /
    Progressing with an empty detail, never as None.

    Kills: the defaults of the pool's Ready and Progressing reason/message lookups
    (`get("reason", None)`, `get("reason")`, "XXProgressingXX", "XXReplicasNotReadyXX",
    `get("message", None)`, "XXXX" ...).
    """
    bare = pool(1, status={"observedGeneration": 1, "conditions": [
        {"type": "Ready", "status": "False"}, {"type": "Progressing", "status": "True"}]})
    st = pstatus({"a": bare}, converged(1))
    assert st["conditions"][:3] == pconds(
        (False, "ReplicasNotReady", "stage a: "), (True, "Progressing", "stage a: "),
        (False, "ReplicasNotReady", "stage a: "), ORCH_1)[:3]


def test_insufficient_capacity_is_named_before_other_stages_that_are_down() -> None:
    """Capacity is the one thing a user must act on: it wins over an earlier stage that is
    only starting.

    Kills: `capacity = None`, `d[0]` -> `d[1]`, `==` -> `!=` and the InsufficientCapacity text
    in the capacity filter; the StagesReady type/status/reason/message/generation/time.
    """
    starting = settle(pool(1), [pod(0, ready=False)])
    full = settle(pool(1, stage="b"), [pod(0, ready=False, unschedulable=True, stage="b")])
    st = pstatus({"a": starting, "b": full}, converged(1))
    gpu = "stage b: p-b-0: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    assert st["phase"] == "Pending" and st["stagesReady"] == "0/2"
    assert st["conditions"] == pconds(
        (False, "InsufficientCapacity", gpu),
        (True, "ReplicasStarting", "stage a: 0/1 replicas ready"),
        (False, "InsufficientCapacity", gpu), ORCH_1)


def test_stages_ready_counts_stages_at_or_above_their_desired_replicas() -> None:
    """stagesReady: a stage at exactly its desired count counts; one scaled to zero does not
    (it cannot serve); one short of its count does not.

    Kills: `s["desired"] and` -> `or` (zero stage), `>=` -> `>` (exactly desired).
    """
    zero = settle(pool(0, stage="z"), [])
    short = settle(pool(2, stage="s"), [pod(0, stage="s"), pod(1, ready=False, stage="s")])
    st = pstatus({"a": serving_pool(), "z": zero, "s": short}, converged(1))
    assert st["stagesReady"] == "1/3"
    assert st["stages"] == {"a": {"pool": "p-a", "ready": 2, "desired": 2, "revision": REV},
                            "z": {"pool": "p-z", "ready": 0, "desired": 0, "revision": REV},
                            "s": {"pool": "p-s", "ready": 1, "desired": 2, "revision": REV}}
    assert st["revisions"] == {"stable": PREV["asz"]}
    assert st["conditions"][0] == c("Ready", False, "ScaledToZero",
                                    "stage z: replicas is 0: the stage cannot serve")


def test_pipeline_conditions_keep_their_transition_time_until_their_status_flips() -> None:
    """Kills: the `previous` lookup mutations of pipeline_status (key, default), and `now` ->
    None in any of its conditions."""
    first = pstatus({"a": serving_pool()}, converged(1))
    again = pstatus({"a": serving_pool()}, converged(1), previous=first, now=LATER)
    assert again == first
    # The orchestrator's replicas are all lost (Kubernetes leaves the zero counts out).
    lost = pstatus({"a": serving_pool()}, dep(observedGeneration=1), previous=first, now=LATER)
    assert lost["phase"] == "Degraded"
    assert lost["conditions"] == [
        c("Ready", False, "OrchestratorNotReady", "0/1 orchestrator replicas ready", since=LATER),
        c("Progressing", True, "OrchestratorRollout", "0/1 orchestrator replicas ready",
          since=LATER),
        c("StagesReady", True, "AllStagesServing", "1/1 stages at or above their minimum"),
        c("OrchestratorReady", False, "OrchestratorNotReady", "0/1 orchestrator replicas ready",
          since=LATER),
    ]


@pytest.mark.parametrize(("old_phase", "phase"), [
    (None, "Pending"), ("Pending", "Pending"), ("Invalid", "Pending"), ("Terminating", "Pending"),
    ("Ready", "Degraded"), ("Progressing", "Degraded"), ("Degraded", "Degraded"),
])
def test_below_the_minimum_is_degraded_only_after_having_served(old_phase: str | None,
                                                                 phase: str) -> None:
    """Kills: every text mutation of the phases in _HAS_SERVED, and the Degraded/Pending
    choice."""
    down = settle(pool(1), [pod(0, ready=False)])
    previous = {"phase": old_phase} if old_phase else None
    assert pstatus({"a": down}, converged(1), previous=previous)["phase"] == phase


# ---- the orchestrator Deployment

NOT_MOVING = None


@pytest.mark.parametrize(("deployment", "want", "orch", "moving"), [
    pytest.param(None, 1, (False, "OrchestratorNotReady", "0/1 orchestrator replicas ready"),
                 "0/1 orchestrator replicas ready", id="no-deployment"),
    # Just created: the deployment controller has written nothing yet.
    pytest.param(dep(), 1, (False, "OrchestratorNotReady", "0/1 orchestrator replicas ready"),
                 "0/1 orchestrator replicas ready", id="fresh"),
    pytest.param(converged(1), 1, ORCH_1, NOT_MOVING, id="converged"),
    pytest.param(converged(2), 2,
                 (True, "OrchestratorAvailable", "2/2 orchestrator replicas ready"), NOT_MOVING,
                 id="converged-2"),
    # One ready replica of two serves the whole pipeline, but the rollout is not done.
    pytest.param(dep(want=2, observedGeneration=1, replicas=2, updatedReplicas=2,
                     readyReplicas=1), 2,
                 (True, "OrchestratorAvailable", "1/2 orchestrator replicas ready"),
                 "1/2 orchestrator replicas ready", id="one-of-two-ready"),
    # Each rollout signal alone makes it Progressing.
    pytest.param(dep(want=2, generation=2, observedGeneration=1, replicas=2, updatedReplicas=2,
                     readyReplicas=2), 2,
                 (True, "OrchestratorAvailable", "2/2 orchestrator replicas ready"),
                 "2/2 orchestrator replicas ready", id="spec-not-observed"),
    pytest.param(dep(want=2, observedGeneration=1, replicas=2, updatedReplicas=1,
                     readyReplicas=2), 2,
                 (True, "OrchestratorAvailable", "2/2 orchestrator replicas ready"),
                 "2/2 orchestrator replicas ready", id="not-all-updated"),
    # Surging: an extra replica exists (and is ready); ready never reads above wanted.
    pytest.param(dep(want=2, observedGeneration=1, replicas=3, updatedReplicas=2,
                     readyReplicas=3), 2,
                 (True, "OrchestratorAvailable", "2/2 orchestrator replicas ready"),
                 "2/2 orchestrator replicas ready", id="surge"),
    pytest.param(dep(want=1, observedGeneration=1, replicas=2, updatedReplicas=1,
                     readyReplicas=1), 1, ORCH_1, "1/1 orchestrator replicas ready",
                 id="surge-only-replicas"),
    # Zero wanted: no orchestrator, and converged once the Deployment says so (zero counts
    # absent); until the deployment controller has seen it, it is still rolling out.
    pytest.param(converged(0), 0, (False, "NoOrchestrator", "0/0 orchestrator replicas ready"),
                 NOT_MOVING, id="zero"),
    pytest.param(dep(want=0), 0, (False, "NoOrchestrator", "0/0 orchestrator replicas ready"),
                 "0/0 orchestrator replicas ready", id="zero-not-observed"),
    # Scaled to zero while a replica still runs: not an orchestrator to count on.
    pytest.param(dep(want=0, observedGeneration=2, generation=2, replicas=1, updatedReplicas=1,
                     readyReplicas=1), 0,
                 (False, "NoOrchestrator", "0/0 orchestrator replicas ready"),
                 "0/0 orchestrator replicas ready", id="scaling-to-zero"),
    pytest.param(dep(want=2, observedGeneration=1, replicas=2, updatedReplicas=2), 2,
                 (False, "OrchestratorNotReady", "0/2 orchestrator replicas ready"),
                 "0/2 orchestrator replicas ready", id="none-of-two-ready"),
])
def test_orchestrator_readiness_and_rollout(deployment: dict[str, Any] | None, want: int,
                                            orch: tuple[bool, str, str],
                                            moving: str | None) -> None:
    """OrchestratorReady whole, and OrchestratorRollout in Progressing exactly while the
    Deployment is not converged on `want` replicas.

    Kills: the OrchestratorAvailable/NoOrchestrator/OrchestratorNotReady/OrchestratorRollout
    texts, `o_reason = None`, `orch_ok and False`/`or True`, `want == 0` -> `!= 0`/`== 1`,
    `want > 0` -> `>= 0` (scaling-to-zero), `o_msg = None`, the readyReplicas default 0 -> 1
    (fresh), each `or` of the rollout test -> `and` (spec-not-observed, not-all-updated,
    surge-only-replicas, one-of-two-ready), the generation lookups (key, `or {}` -> `and {}`),
    and the observedGeneration/updatedReplicas/replicas defaults 0 -> 1 and `or 0` -> `or 1`
    (zero, zero-not-observed), the OrchestratorReady condition's type/status/reason/message.
    """
    st = pstatus({"a": serving_pool()}, deployment, want=want)
    ok = orch[0]
    assert st["conditions"][3] == c("OrchestratorReady", *orch)
    assert st["conditions"][0] == c("Ready", *(SERVING if ok else orch))
    if moving is None:
        assert st["conditions"][1] == c("Progressing", *UP_TO_DATE)
        assert st["phase"] == ("Ready" if ok else "Pending")
    else:
        assert st["conditions"][1] == c("Progressing", True, "OrchestratorRollout", moving)
        assert st["phase"] == ("Progressing" if ok else "Pending")


# ---- refused specs and deletion

ERRORS = [("spec.image", "an image is required"), ("spec.stages[0].replicas", "must be <= 64")]
REFUSED = "spec.image: an image is required; spec.stages[0].replicas: must be <= 64"


def test_a_pipeline_refused_from_the_start_is_invalid() -> None:
    """Kills: `kind == "OmniPipeline"` -> `!=` (no phase on a pipeline without one before),
    `now` -> None and `ok` -> None/True of the Ready condition, the observedGeneration key."""
    st = invalid_status(pipeline(), ERRORS, NOW)
    assert st == {"observedGeneration": 1, "phase": "Invalid",
                  "conditions": [c("Ready", False, "InvalidSpec", REFUSED)]}


def test_a_refused_pool_spec_keeps_the_pool_status_and_gets_no_phase() -> None:
    """A StagePool has no phase (its CRD has none); its counts and other conditions stay, since
    the replicas of the earlier generation keep running.

    Kills: a phase on a pool (PoolStatus has none), the observedGeneration key, the filter
    that drops the old Ready condition.
    """
    served = settle(pool(2), [pod(0), pod(1)])
    served["metadata"]["generation"] = 2
    st = invalid_status(served, [("spec.image", "bad")], LATER)
    old = served["status"]
    assert "phase" not in st
    assert st == {**old, "observedGeneration": 2, "conditions": [
        c("Ready", False, "InvalidSpec", "spec.image: bad", since=LATER, gen=2),
        old["conditions"][1]]}


def test_a_serving_pipeline_refused_keeps_its_status_but_says_invalid() -> None:
    """Kills: the same mutations, on a pipeline that had a phase."""
    before = pstatus({"a": serving_pool()}, converged(1))
    obj = pipeline(before)
    obj["metadata"]["generation"] = 2
    st = invalid_status(obj, ERRORS, LATER)
    assert st == {**before, "observedGeneration": 2, "phase": "Invalid", "conditions": [
        c("Ready", False, "InvalidSpec", REFUSED, since=LATER, gen=2), *before["conditions"][1:]]}


def test_a_pipeline_being_deleted_says_so_and_keeps_the_rest() -> None:
    """Ready turns False with the deletion step; the other conditions and fields stay; a later
    step updates the message but not the transition time.

    Kills: every mutation of terminating_status: `gen = None` and the generation lookup,
    `obj.get("status") or {}` -> `and {}`/other keys (the old fields would vanish), the
    `previous` lookup, ok -> True, message/generation/now -> None, the Ready filter (`!=` ->
    `==`, key, text: a second Ready would appear), the observedGeneration key.
    """
    before = pstatus({"a": serving_pool()}, converged(1))
    obj = pipeline(before)
    obj["metadata"]["generation"] = 2
    gone = terminating_status(obj, "draining the orchestrator", LATER)
    assert gone == {**before, "observedGeneration": 2, "phase": "Terminating", "conditions": [
        c("Ready", False, "Terminating", "pipeline is being deleted: draining the orchestrator",
          since=LATER, gen=2),
        *before["conditions"][1:]]}
    later = terminating_status({**obj, "status": gone}, "stopping the stage pools",
                               "2026-01-01T00:02:00Z")
    assert later["conditions"][0] == c(
        "Ready", False, "Terminating", "pipeline is being deleted: stopping the stage pools",
        since=LATER, gen=2)
    assert terminating_status(pipeline(), "x", NOW) == {
        "observedGeneration": 1, "phase": "Terminating",
        "conditions": [c("Ready", False, "Terminating", "pipeline is being deleted: x")]}


# ---- the event that sums a pipeline up (`kubectl describe omnipipe`)


def _with_ready(reason: str, message: str, phase: str = "Pending") -> dict[str, Any]:
    return {"phase": phase, "conditions": [
        {"type": "Progressing", "status": "True", "reason": "ScalingUp", "message": "moving"},
        {"type": "Ready", "status": "False", "reason": reason, "message": message}]}


def test_summary_of_every_phase() -> None:
    """Event type, reason and message for each phase: Warning only for a refused spec, a
    pipeline that lost its minimum, or a stage that cannot get capacity or its model.

    Kills: every text mutation of summary ("Normal", "Warning", the phase names, the
    'pipeline is serving (...)' message and its stagesReady key), the Ready/Progressing
    condition lookups (key, type text, `==` -> `!=`: the message would come from the other
    condition), the warn expression (`None`, `and`, `!=`, "Degraded", the reason key and
    "InsufficientCapacity"), and `"Warning" if warn and False`/`or True`.
    """
    scaling = settle(pool(3, status={"settledReplicas": 1}), [pod(0), pod(1, ready=False)])
    assert summary(pstatus({"a": scaling}, converged(1))) == (
        "Normal", "Progressing", "stage a: 2/3 replicas created")
    assert summary(pstatus({"a": serving_pool(), "b": serving_pool("b")}, converged(1))) == (
        "Normal", "Ready", "pipeline is serving (2/2 stages)")
    assert summary(invalid_status(pipeline(), ERRORS, NOW)) == ("Warning", "InvalidSpec",
                                                                 REFUSED)
    assert summary(terminating_status(pipeline(), "stopping the stage pools", NOW)) == (
        "Normal", "Terminating", "pipeline is being deleted: stopping the stage pools")
    assert summary(_with_ready("ReplicasNotReady", "stage a: 0/1", "Degraded")) == (
        "Warning", "Degraded", "stage a: 0/1")
    assert summary(_with_ready("ReplicasNotReady", "stage a: 0/1")) == (
        "Normal", "Pending", "stage a: 0/1")
    for reason in ("InsufficientCapacity", "ModelFetchFailed", "ModelLoadFailed"):
        assert summary(_with_ready(reason, "stage a: why")) == ("Warning", "Pending",
                                                                "stage a: why")


def test_summary_of_a_status_without_conditions() -> None:
    """The status schema requires no field: a pipeline with no status yet sums up as Pending
    with no message (the controller compares it with the new summary), and a stored phase
    without conditions gives an empty message rather than failing.

    Kills: the phase default "Pending" (None, case, XX), the conditions defaults (None, `get()`
    with no default) and the `{}` defaults of both condition lookups, and the message defaults
    "" -> None/"XXXX" in the Invalid, Progressing and other branches.
    """
    assert summary({}) == ("Normal", "Pending", "")
    assert summary({"phase": "Progressing"}) == ("Normal", "Progressing", "")
    assert summary({"phase": "Invalid"}) == ("Warning", "InvalidSpec", "")
    assert summary({"phase": "Degraded"}) == ("Warning", "Degraded", "")


# ---- a model that cannot be fetched or loaded

WORKER_WAITING = {"name": "worker", "ready": False, "restartCount": 0,
                  "state": {"waiting": {"reason": "PodInitializing"}}}


def replica(*, init: list[dict[str, Any]] | None = None,
            containers: list[dict[str, Any]] | None = None,
            labels: dict[str, str] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending"}
    if init is not None:
        status["initContainerStatuses"] = init
    if containers is not None:
        status["containerStatuses"] = containers
    return {"metadata": {"name": "p-llm-0", "labels": {kube.LABEL_STAGE: "llm"}
                         if labels is None else labels}, "status": status}


def fetch(state: dict[str, Any], last: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": kube.MODEL_FETCH_CONTAINER, "ready": False, "restartCount": 1,
            "state": state, **({"lastState": last} if last is not None else {})}


def worker(state: dict[str, Any], last: dict[str, Any] | None = None,
           ready: bool = False) -> dict[str, Any]:
    return {"name": "worker", "ready": ready, "restartCount": 1, "state": state,
            **({"lastState": last} if last is not None else {})}


def terminated(code: int, message: str | None = None) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, **({"message": message} if message else {})}}


LOAD = kube.MODEL_FAILED_EXIT


def test_a_failed_fetch_is_named_with_the_last_line_of_its_message() -> None:
    """The fetch init container crash-loops (its failure is in lastState) while the worker
    waits: the reason is ModelFetchFailed and the message ends with the last non-blank line.

    Kills: `checks +=` -> `checks =` (the fetch check would be dropped), the fetch container
    name, the 'could not be fetched' text and reason, the line split/strip/last-line choice,
    the lastState lookup (key, `or {}`), and the message format.
    """
    failing = fetch({"waiting": {"reason": "CrashLoopBackOff"}},
                    terminated(1, "Fetching acme/x...\nerror: model 'acme/x': gone  \n\n  \n"))
    assert model_failure(replica(init=[failing], containers=[WORKER_WAITING])) == (
        "ModelFetchFailed", "stage 'llm': the model could not be fetched on p-llm-0: "
                            "error: model 'acme/x': gone")


def test_a_fetch_that_failed_in_its_current_run_counts_whatever_its_exit_code() -> None:
    """Kills: the current-state lookup (`state.get("terminated")`), the `exitCode != 0`
    test, and the 'exit code N' fallback when the container left no message."""
    assert model_failure(replica(init=[fetch(terminated(7))])) == (
        "ModelFetchFailed", "stage 'llm': the model could not be fetched on p-llm-0: exit code 7")


def test_a_worker_that_exits_model_failed_is_a_load_failure() -> None:
    """The model was fetched (the init container completed), then the worker exited
    MODEL_FAILED_EXIT.

    Kills: `continue` -> `break` (the completed fetch would end the search), the worker
    container name, MODEL_FAILED_EXIT, the 'could not be loaded' text and ModelLoadFailed.
    """
    pod_ = replica(init=[fetch(terminated(0))],
                   containers=[worker(terminated(LOAD, "model load failed: OSError: bad"))])
    assert model_failure(pod_) == (
        "ModelLoadFailed",
        "stage 'llm': the model could not be loaded on p-llm-0: model load failed: OSError: bad")


def test_a_worker_restarted_after_a_load_failure_reports_it_until_ready() -> None:
    """Running again but not ready (reloading after the failure): the last failure still
    explains why; once the worker is ready it is not a failure any more.

    Kills: `"running" in state and ready` -> `or`, `not in`, the "running"/"ready" keys.
    """
    last = terminated(LOAD, "model load failed: OOM")
    reloading = replica(containers=[worker({"running": {}}, last)])
    assert model_failure(reloading) == (
        "ModelLoadFailed", "stage 'llm': the model could not be loaded on p-llm-0: "
                           "model load failed: OOM")
    assert model_failure(replica(containers=[worker({"running": {}}, last, ready=True)])) is None


def test_what_is_not_a_model_failure() -> None:
    """Another crash of the worker, a fetch that succeeded after a failed try, other
    containers, and a pod with no status yet are not blamed on the model.

    Kills: `exitCode != code` -> `==`, `code is not None and` -> `or`, the exitCode key and
    `!= 0` in _failed_run (a completed fetch whose previous run failed), the container name
    filters, `pod.get("status") or {}`.
    """
    assert model_failure(replica(containers=[worker(terminated(1, "Traceback: boom"))])) is None
    assert model_failure(replica(containers=[worker(terminated(0))])) is None
    completed = fetch(terminated(0), terminated(1, "error: timeout"))
    assert model_failure(replica(init=[completed], containers=[worker({"running": {}})])) is None
    other = {**fetch(terminated(1, "x")), "name": "setup"}
    sidecar = {**worker(terminated(LOAD, "x")), "name": "proxy"}
    assert model_failure(replica(init=[other], containers=[sidecar])) is None
    assert model_failure({"metadata": {"name": "p-llm-0"}}) is None
    assert model_failure({"metadata": {"name": "p-llm-0"}, "status": None}) is None


def test_a_failure_on_a_pod_without_a_stage_label_still_reads() -> None:
    """Kills: the stage label lookup (`or {}`, key, the "?" default)."""
    for labels in ({}, {"app": "x"}):
        pod_ = replica(containers=[worker(terminated(LOAD))], labels=labels)
        assert model_failure(pod_) == (
            "ModelLoadFailed",
            f"stage '?': the model could not be loaded on p-llm-0: exit code {LOAD}")
    unlabelled = replica(containers=[worker(terminated(LOAD))])
    unlabelled["metadata"]["labels"] = None
    assert model_failure(unlabelled)[1].startswith("stage '?'")  # type: ignore[index]
