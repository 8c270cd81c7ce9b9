"""The status of OmniPipelines and StagePools as pydantic models: what the operator writes and
reads, and what the CRDs' status schemas are generated from (omni_operator.crd).

Why here and not beside the spec models in omnistage.spec: the spec is what people write, and
`omnistage serve` and `omnistage validate` parse it, so it belongs to the runtime. Status is the
operator's view of the cluster: only the operator writes it, and only the operator and its CLI
(`omnistage status`) read it (the orchestrator watches pods, never a pipeline's status). The
runtime never imports the operator, so models that only the operator needs live in the operator.

The wire form (`wire()`) is camelCase and leaves out every field that is None, so a status
parsed from the API server and written back is the same document. Every field is optional, as
in the CRD: a status written by an older operator may lack some. Unknown fields are ignored when
parsing (the API server prunes them anyway; a newer CRD next to an older operator must not stop
its reconciles).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "PHASES",
    "AutoscalerStatus",
    "Condition",
    "ConditionStatus",
    "Phase",
    "PipelineRevisions",
    "PipelineStatus",
    "PoolStatus",
    "RevisionReplicas",
    "StageStatus",
    "Status",
    "field_table",
    "status_model",
]

Obj = Mapping[str, Any]

#: Every phase the operator writes, in the order docs/crds.md explains them.
Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Terminating", "Invalid"]
PHASES: tuple[str, ...] = get_args(Phase)
ConditionStatus = Literal["True", "False", "Unknown"]
#: Most conditions one object can carry (metav1.Condition lists, kept small for CEL costs).
MAX_CONDITIONS = 16


def _count(description: str) -> Any:
    """A replica count: never negative, int32 as Kubernetes counts are."""
    return Field(None, ge=0, description=description, json_schema_extra={"format": "int32"})


def _generation(description: str) -> Any:
    """A metadata.generation: int64, as Kubernetes writes it."""
    return Field(None, ge=0, description=description, json_schema_extra={"format": "int64"})


class _Model(BaseModel):
    """Shared config: camelCase on the wire, immutable values, unknown stored fields ignored."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    def wire(self) -> dict[str, Any]:
        """The JSON document the API server stores: camelCase keys, None fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Condition(_Model):
    """One metav1.Condition, so `kubectl wait --for=condition=Ready` and generic tooling work."""

    type: str = Field(max_length=316, description="Condition type, for example Ready.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str | None = Field(
        None, max_length=1024,
        description="Machine-readable CamelCase reason for the last transition.")
    message: str | None = Field(None, max_length=32768, description="Human-readable details.")
    last_transition_time: str | None = Field(
        None, description="When the status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"})
    observed_generation: int | None = _generation(
        "metadata.generation this condition was computed from.")


class _WithConditions(_Model):
    """What both statuses share: the generation acted on and the conditions."""

    observed_generation: int | None = _generation(
        "The metadata.generation the operator last acted on.")
    conditions: list[Condition] | None = Field(
        None, max_length=MAX_CONDITIONS,
        description="Current conditions (Kubernetes convention), one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    @classmethod
    def stored(cls, obj: Obj | None) -> Self:
        """The status stored on obj (an object as the API server returns it); empty if none."""
        return cls.model_validate((obj or {}).get("status") or {})

    def condition(self, ctype: str) -> Condition | None:
        """The condition of type ctype, or None when there is none."""
        return next((c for c in self.conditions or [] if c.type == ctype), None)


def _revision(description: str) -> Any:
    """A payload revision (omnistage.revision.stage_revision, or a pipeline's digest of them)."""
    return Field(None, max_length=64, description=description)


class StageStatus(_Model):
    """Replica counts of one stage."""

    pool: str | None = Field(None, description="Name of the stage's StagePool.")
    desired: int | None = _count("Desired replicas.")
    ready: int | None = _count("Replicas that are ready and routable; never above desired.")
    revision: str | None = _revision("The stage revision its spec asks for.")
    routable: dict[str, int] | None = Field(
        None, description="Routable replicas per stage revision; two revisions during a "
        "release.")


class PipelineRevisions(_Model):
    """The pipeline revisions that serve: each a digest of every stage's revision."""

    stable: str | None = _revision(
        "The revision that served before the release in progress (the current one when none "
        "is).")
    candidate: str | None = _revision(
        "The revision a release in progress moves to; absent when no release is in progress.")


class CurveKeysStatus(_Model):
    """The pipeline's CurveZMQ keypairs (omni_operator.curve_rotation): which generation the
    pods are built with and which the Secret holds. More than one: a rotation is under way."""

    generation: int | None = _count("The generation of the pair the pods are built with (their "
                                    "annotation omnistage.io/curve-generation).")
    secret: list[int] | None = Field(
        None, description="The generations whose pair the Secret holds; every worker admits "
        "each of them.")
    added_at: str | None = Field(
        None, description="When the Secret last gained a pair (RFC 3339); the pods move to it "
        "once the kubelets had time to refresh their mounts.")


class PipelineStatus(_WithConditions):
    """Observed state of the pipeline, written by the operator."""

    phase: Phase | None = Field(
        None, description="Coarse summary of the conditions: " + ", ".join(PHASES[:-1])
        + f" or {PHASES[-1]}; the Ready condition says why.")
    endpoint: str | None = Field(
        None, description="Orchestrator HTTP endpoint in the cluster "
        "(http://<service>.<namespace>.svc:<port>).")
    api_key_secret: str | None = Field(
        None, description="The Secret holding the API keys the endpoint needs (Authorization: "
        "Bearer KEY): spec.orchestrator.auth.apiKeySecret or the one the operator made; absent "
        "with auth.disabled.")
    stages_ready: str | None = Field(
        None, description='Stages with all desired replicas ready over stages, such as "2/2" '
        "(column Stages).")
    stages: dict[str, StageStatus] | None = Field(
        None, description="Per-stage replica counts, keyed by stage name.")
    revisions: PipelineRevisions | None = Field(
        None, description="The stable and the candidate pipeline revision (a release across "
        "stages, docs/architecture.md).")
    curve_keys: CurveKeysStatus | None = Field(
        None, description="The CurveZMQ keypairs in use and in the Secret (a rotation: "
        "docs/security.md).")


class AutoscalerStatus(_Model):
    """The autoscaler's last decision that changed something (omni_operator.autoscaler): what
    it read, the figure, the size it chose and why. Rewritten only when the desired size or
    the signal's availability changes, so a steady pool costs no status write per period."""

    desired_replicas: int | None = _count("The replicas the autoscaler chose (column Desired "
                                          "shows spec.replicas, which it writes).")
    decision: str | None = Field(
        None, max_length=256, description='The decision in short, such as "scale up 1 -> 3", '
        '"keep 2" or "no signal: keep 2" (column Autoscaler).')
    reason: str | None = Field(None, max_length=1024,
                               description="The decision in one line: the figure and the rule.")
    rule: str | None = Field(
        None, max_length=64, description="The rule that settled it: target, dead-band, bounds, "
        "idle, wake, partial (not every orchestrator could be read), cool-down or signal.")
    target: str | None = Field(None, max_length=128,
                               description="The target, such as inflightPerReplica=1.")
    figure: float | None = Field(
        None, description="Replicas the target asked for before bounds (Little's law or the "
        "latency ratio).")
    inputs: dict[str, float] | None = Field(
        None, description="The load figures read from the orchestrator's GET /v1/load, and "
        "current (spec.replicas).")
    signal: Literal["Available", "Unavailable"] | None = Field(
        None, description="Whether the load could be read; Unavailable never scales down.")
    signal_message: str | None = Field(
        None, max_length=1024, description="Why the load could not be read.")
    decision_time: str | None = Field(
        None, description="When this decision was made (RFC 3339).",
        json_schema_extra={"format": "date-time"})
    last_change_time: str | None = Field(
        None, description="When the autoscaler last changed the size (RFC 3339); the "
        "cool-down counts from it.", json_schema_extra={"format": "date-time"})
    last_direction: Literal["Up", "Down"] | None = Field(
        None, description="The direction of that change.")


class RevisionReplicas(_Model):
    """The replicas of one stage revision."""

    revision: str | None = _revision("The stage revision (label omnistage.io/revision).")
    order: int | None = _generation(
        "Its release order (annotation omnistage.io/revision-order): the pipeline generation "
        "that released it (a revert keeps it); the highest is the newest.")
    replicas: int | None = _count("Replica pods of this revision that are not retiring.")
    ready: int | None = _count("Those of them ready and routable.")


class PoolStatus(_WithConditions):
    """Observed state of the pool, written by the operator."""

    replicas: int | None = _count("Replica pods that exist (the scale subresource reads this).")
    ready_replicas: int | None = _count("Replica pods that are ready and routable.")
    updated_replicas: int | None = _count("Replica pods that run the current spec.")
    draining_replicas: int | None = _count(
        "Replica pods being retired: finishing in-flight work (column Draining).")
    settled_replicas: int | None = _count(
        "Replicas the pool last reached with every replica updated and ready; the stage's "
        "minimum (Ready) is min(replicas, settledReplicas) - maxUnavailable, at least 1.")
    ready: str | None = Field(
        None, description='Ready over desired replicas, such as "2/3" (column Ready); never '
        "above desired.")
    selector: str | None = Field(
        None, description="Label selector of the replica pods, in string form (for the scale "
        "subresource and HorizontalPodAutoscalers).")
    autoscaler: AutoscalerStatus | None = Field(
        None, description="With spec.stage.autoscaling: the autoscaler's last decision.")
    revision: str | None = _revision(
        "The stage revision the spec asks for.")
    revisions: list[RevisionReplicas] | None = Field(
        None, max_length=16, description="Replicas per revision, newest first; more than one "
        "while a release is in progress.")


Status = PipelineStatus | PoolStatus
_BY_KIND: dict[str, type[PipelineStatus] | type[PoolStatus]] = {
    "OmniPipeline": PipelineStatus, "StagePool": PoolStatus}


def status_model(kind: str | None) -> type[PipelineStatus] | type[PoolStatus]:
    """The status model of a kind the operator owns."""
    try:
        return _BY_KIND[str(kind)]
    except KeyError:
        raise ValueError(f"no status model for kind {kind!r} (expected one of "
                         f"{', '.join(_BY_KIND)})") from None


# ---------------------------------------------------------------------------- docs


def _type_name(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    """A field's type in words, for the tables in docs/crds.md."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        return "{" + ", ".join(target["properties"]) + "}"
    branches = [b for b in schema.get("anyOf", []) if b != {"type": "null"}]
    if branches:
        return _type_name(branches[0], defs)
    if "enum" in schema:
        return ", ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"list of {_type_name(schema['items'], defs)}"
    if kind == "object":
        return f"map of name to {_type_name(schema['additionalProperties'], defs)}"
    return {"integer": "int", "string": "string", "number": "number"}.get(
        str(kind), json.dumps(kind))


def field_table(model: type[BaseModel]) -> str:
    """A markdown table of the model's fields (wire name, type, description), for docs/crds.md;
    tests/unit/test_status.py checks that the doc carries it verbatim."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.get("$defs", {})
    rows = ["| field | type | meaning |", "|---|---|---|"]
    for name, prop in schema["properties"].items():
        # "\<": markdown renderers would take <service> for an HTML tag and drop it.
        text = prop["description"].replace("<", "\\<")
        rows.append(f"| `{name}` | {_type_name(prop, defs)} | {text} |")
    return "\n".join(rows)
