"""A stage: its model, its pool of replicas and the options of each replica.

The kind's row of the kind table (omnistage.kinds) decides what a stage may say: which kinds
exist, which need a model, which read voices. The schema's enum and descriptions are read from
the table when the schema is generated, so a registered kind is in the CRD too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

import omnistage.kinds as stage_kinds
from omnistage.modelref import (
    HUB_ID_GRAMMAR,
    ModelRef,
    builtins_for,
    parse_model_ref,
    reference_error,
)
from omnistage.spec.engine_options import EngineOptions
from omnistage.spec.errors import field_error, path_errors, short_repr
from omnistage.spec.fields import LIST_SET, Quantity, SpecModel, StageName
from omnistage.spec.patterns import MAX_REPLICAS, MAX_STAGES, STAGE_NAME_MAX, join_words


def _kind_schema(schema: dict[str, Any]) -> None:
    """Stage.kind's JSON schema (and so the CRD's): the enum and the description come from
    the kind table when the schema is generated."""
    rows = stage_kinds.kinds()
    listed = [f"{k.name} ({k.summary})" if k.summary else k.name for k in rows]
    schema["description"] = f"Executor kind: {join_words(listed, 'or')}. Immutable once created."
    schema["enum"] = [k.name for k in rows]


def _model_schema(schema: dict[str, Any]) -> None:
    """Stage.model's description, naming each kind's built-ins and which kinds need a model."""
    rows = stage_kinds.kinds()
    builtins = "; ".join(f"{k.name}: {', '.join(k.builtin_models)}" for k in rows
                         if k.builtin_models)
    needs = join_words([k.name for k in rows if k.needs_model])
    free = join_words([k.name for k in rows if not k.needs_model])
    schema["description"] = (
        f"{HUB_ID_GRAMMAR[0].upper()}{HUB_ID_GRAMMAR[1:]} (a branch, tag or commit), a local "
        "path starting with /, ./, ../ or ~ (relative paths are relative to the pipeline file; "
        f"on a cluster, a path inside the image), or a built-in ({builtins}). Required for "
        f"{needs}" + (f"; omit (or 'none') for {free}." if free else "."))


class StageResources(SpecModel):
    """Per-replica resources; on Kubernetes these become requests and limits."""

    gpus: int = Field(
        0, ge=0, le=16, description="GPUs per replica (nvidia.com/gpu). 0 runs on CPU."
    )
    cpu: Quantity = Field("1", description="CPU per replica, a Kubernetes quantity.")
    memory: Quantity = Field("2Gi", description="Memory per replica, a Kubernetes quantity.")


class Toleration(SpecModel):
    """A Kubernetes toleration, so stages can land on tainted (for example GPU) nodes."""

    key: str | None = Field(
        None, description="Taint key to tolerate; omit with operator Exists to match every taint."
    )
    operator: Literal["Exists", "Equal"] = Field(
        "Equal", description="Equal matches key and value; Exists matches any value of key."
    )
    value: str | None = Field(None, description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; omit to match all effects."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        description="With effect NoExecute: how long the pod stays bound after the taint appears.",
    )

    @model_validator(mode="after")
    def _check(self) -> Toleration:
        """Mirror the API server's own toleration rules so errors surface before apply.

        Each error names the field it is about; the CRD's CEL rules use the same fieldPath.
        """
        errors = []
        if self.operator == "Exists" and self.value:
            errors.append(
                ("value", f"value must be empty when operator is Exists (got {self.value!r})")
            )
        if not self.key and self.operator != "Exists":
            errors.append(("key", "an empty key requires operator Exists"))
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            errors.append(
                ("tolerationSeconds", "tolerationSeconds only applies with effect NoExecute")
            )
        if errors:
            raise path_errors(errors)
        return self


class Placement(SpecModel):
    """Scheduling hints; locally they are ignored, on Kubernetes they shape the pods."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a replica's node must have."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the replicas tolerate."
    )
    colocate_with: list[StageName] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        description="Other stages whose replicas these replicas should share a node with "
        "(preferred pod affinity), for example to keep hidden states off the network.",
        json_schema_extra=LIST_SET,
    )
    spread_across_nodes: bool = Field(
        True,
        description="Spread replicas across nodes (topology spread by hostname), so losing one "
        "node does not take the whole stage down.",
    )


class AdmissionOptions(SpecModel):
    """Worker admission budgets; beyond them a replica refuses work instead of queueing forever."""

    max_requests: int = Field(
        64, ge=1, le=65_536, description="Outstanding requests admitted per replica."
    )
    max_cost: int | None = Field(
        None,
        ge=1,
        description="Optional cost budget per replica: tokens for ar, pixels x steps for "
        "diffusion. A request costing more than the whole budget is refused, never clamped.",
    )
    max_queue: int = Field(
        256, ge=1, le=1_000_000, description="Requests allowed to wait in the scheduler queue."
    )
    default_deadline_seconds: float = Field(
        60.0, gt=0, le=86_400, description="Deadline for requests that do not carry their own."
    )


class StreamingOptions(SpecModel):
    """Streaming between stages (docs/architecture.md): a downstream stage starts on the first
    chunk of this stage's output instead of waiting for its end."""

    enabled: bool = Field(
        True,
        description="Stream between this stage and its neighbours where both kinds can (the kind "
        "table's chunked output and input); false: every edge of this stage hands over whole "
        "outputs.",
    )
    window: int = Field(
        8,
        ge=1,
        le=1024,  # protocol.MAX_CHUNK_WINDOW
        description="Chunks this stage may send ahead of its downstream stage's consumption; a "
        "slower downstream holds it back there (back-pressure).",
    )


class DispatchOptions(SpecModel):
    """How the orchestrator hands this stage's tasks to its replicas (docs/architecture.md,
    "Failover"): all at once (the default), or through a window per replica."""

    per_replica: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Most tasks the orchestrator keeps on each replica of this stage (running "
        "and queued there); more wait in the orchestrator, in order, and go to the first replica "
        "with room. Why: a task queued on a replica that dies is retried at the tail of another "
        "replica's queue; one waiting in the orchestrator loses no place, and a retried task "
        "goes first. Set it to what the worker runs at once plus 1 (2 for a serial stage). "
        "Null: every task goes to a replica at once and waits in its admission queue, whose "
        "limits answer 429 (back-pressure). Tasks of a session ignore it.",
    )


AUTOSCALING_TARGETS = ("inflightPerReplica", "queueWaitSeconds", "p95TimeToFirstOutputSeconds")
AUTOSCALING_ONE_TARGET = "set exactly one of " + ", ".join(AUTOSCALING_TARGETS)
AUTOSCALING_MIN_MAX = "minReplicas must be at most maxReplicas"
AUTOSCALING_SEED = (
    "with autoscaling, replicas only seeds the pool and must be within "
    "[minReplicas, maxReplicas]"
)


class AutoscalingTarget(SpecModel):
    """What the autoscaler holds steady; exactly one of the three (docs/architecture.md)."""

    inflight_per_replica: float | None = Field(
        None,
        gt=0,
        le=65_536,
        description="Requests in flight per replica (Little's law: arrivals x service time / "
        "this). The default target, at 1.",
    )
    queue_wait_seconds: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="p95 time a request waits in the stage's queue before it is served.",
    )
    p95_time_to_first_output_seconds: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="p95 time from a request's admission to the stage to its first output.",
    )

    @property
    def kind(self) -> str:
        """The camelCase name of the target that is set (inflightPerReplica when none is)."""
        for name, info in type(self).model_fields.items():
            if getattr(self, name) is not None:
                return info.alias or name
        return AUTOSCALING_TARGETS[0]

    @property
    def value(self) -> float:
        """The target's figure (1 request per replica when none is set)."""
        for name in type(self).model_fields:
            if getattr(self, name) is not None:
                return float(getattr(self, name))
        return 1.0


class Autoscaling(SpecModel):
    """Elastic pool: the operator (or `omnistage serve`) sizes the stage to its measured load.

    Bounds live here (Field constraints) and nowhere else; the cross-field rules are checked by
    Autoscaling._check and mirrored as CEL rules in the CRD with the same field paths.
    """

    min_replicas: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Fewest replicas; 0 lets an idle pool go to zero after idleSeconds (a "
        "request that needs it is held by the orchestrator and wakes it).",
    )
    max_replicas: int = Field(
        ge=1, le=MAX_REPLICAS, description="Most replicas; at least minReplicas."
    )
    target: AutoscalingTarget = Field(
        default_factory=lambda: AutoscalingTarget(inflight_per_replica=1.0),
        description="What to hold steady: exactly one of inflightPerReplica, queueWaitSeconds, "
        "p95TimeToFirstOutputSeconds. Defaults to inflightPerReplica: 1.",
    )
    period_seconds: float = Field(
        15, ge=1, le=3600, description="How often the load is read and a decision made."
    )
    window_seconds: float = Field(
        60, ge=1, le=3600, description="The window the load signal is averaged over."
    )
    cool_down_seconds: float = Field(
        120,
        ge=0,
        le=86_400,
        description="At most one change of direction (up after down, or down after up) per "
        "cool-down, so the pool does not flap.",
    )
    idle_seconds: float = Field(
        300,
        ge=1,
        le=86_400,
        description="With minReplicas 0: time with nothing in flight or held before the pool "
        "goes to zero.",
    )
    hold_queue: int = Field(
        64,
        ge=1,
        le=65_536,
        description="Requests the orchestrator holds for this stage, whatever holds them (the "
        "stage at zero, no replica of the request's revision yet, no room in the dispatch "
        "window); beyond them it answers 503 with Retry-After, naming the cause.",
    )

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        """Cross-field rules, each at the field it is about (the CRD's CEL rules say the same)."""
        errors = []
        if self.min_replicas > self.max_replicas:
            errors.append(("minReplicas", f"{AUTOSCALING_MIN_MAX} (got {self.min_replicas} > "
                                          f"{self.max_replicas})"))
        chosen = [n for n in self.target.model_fields_set
                  if getattr(self.target, n) is not None]
        if len(chosen) != 1:
            got = ", ".join(sorted(to_camel(n) for n in chosen)) or "none"
            errors.append(("target", f"{AUTOSCALING_ONE_TARGET} (got {got})"))
        if errors:
            raise path_errors(errors)
        return self

    def seed(self, replicas: int) -> int:
        """A stage's replicas brought within [minReplicas, maxReplicas]."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


GPUS_PER_MODEL_REPLICA = (
    "replicas of kind '{kind}' load their model onto one GPU (got {gpus}); spreading a model "
    "over several GPUs is not supported: request 1 and scale with replicas"
)


class Stage(SpecModel):
    """One logical stage: a model, its engine options and its pool of replicas."""

    name: StageName = Field(
        description="Stage name, unique in the pipeline; a DNS-1123 label of at most "
        f"{STAGE_NAME_MAX} characters because it becomes part of pod names."
    )
    kind: str = Field(
        description="Executor kind (the kind table, omnistage.kinds). Immutable once "
        "created.",
        json_schema_extra=lambda schema: _kind_schema(schema),
    )
    model: str | None = Field(
        None,
        max_length=1024,  # bounds the CRD's CEL cost estimate for the model rules
        validate_default=True,
        description="A Hugging Face id org/name[@revision] (a branch, tag or commit), a local "
        "path starting with /, ./, ../ or ~ (relative paths are relative to the pipeline file; "
        "on a cluster, a path inside the image), or a built-in of the kind. Required or "
        "refused by kind.",
        json_schema_extra=lambda schema: _model_schema(schema),
    )
    engine: EngineOptions = Field(
        default_factory=EngineOptions, description="Executor options for this stage."
    )
    inputs: list[StageName] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        description="Upstream stages whose outputs this stage consumes; it runs once all of them "
        "have produced output. Entry stages have none and receive the request itself.",
        json_schema_extra=LIST_SET,
    )
    final_output: bool = Field(
        False, description="Whether this stage's output is returned to the client."
    )
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="Number of replicas of this stage.")
    resources: StageResources = Field(
        default_factory=StageResources, description="Resources of each replica."
    )
    placement: Placement = Field(
        default_factory=Placement, description="Scheduling hints for the replicas."
    )
    admission: AdmissionOptions = Field(
        default_factory=AdmissionOptions, description="Admission budgets of each replica."
    )
    streaming: StreamingOptions = Field(
        default_factory=StreamingOptions, description="Streaming between stages."
    )
    dispatch: DispatchOptions = Field(
        default_factory=DispatchOptions,
        description="How the orchestrator hands tasks to the replicas (a window per replica).",
    )
    drain_timeout_seconds: int = Field(
        30,
        ge=0,
        le=3600,
        description="How long a retiring replica may finish in-flight work before it is stopped.",
    )
    max_unavailable: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Replicas that may be down at once for voluntary disruptions (kubectl drain, "
        "rollouts); the pool's PodDisruptionBudget gets minAvailable = replicas - maxUnavailable.",
    )
    autoscaling: Autoscaling | None = Field(
        None,
        description="Size the pool to its load between minReplicas and maxReplicas (absent: a "
        "fixed size of replicas). With it, replicas only seeds the pool: omitted, the pool "
        "starts at 1 brought within the bounds; given, it must lie within them.",
    )

    @field_validator("kind")
    @classmethod
    def _check_kind(cls, value: str) -> str:
        """Only kinds in the table (omnistage.kinds); worded as an enum's error."""
        known = stage_kinds.names()
        if value not in known:
            expected = " or ".join(
                filter(None, [", ".join(repr(k) for k in known[:-1]), repr(known[-1])]))
            raise field_error(f"invalid value {short_repr(value)} (expected {expected})")
        return value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Resolve the model against the kind, so a wrong name fails at load, not at start."""
        kind = info.data.get("kind")
        if kind is None:  # the kind itself was invalid and is reported on its own
            return value
        if not stage_kinds.get(kind).needs_model:
            if value is None or value.strip().lower() in ("", "none"):
                return None
            raise field_error(
                f"{kind} stages take no model; omit it or set it to none (got {value!r})"
            )
        if value is None or value.strip().lower() in ("", "none"):
            raise field_error(
                f"a model is required for kind {kind!r} (built-ins: {builtins_for(kind)}, "
                f"{HUB_ID_GRAMMAR}, or a local path starting with / or ./)"
            )
        problem = reference_error(value, kind)
        if problem is not None:
            raise field_error(problem)
        return value

    @model_validator(mode="after")
    def _engine_options_its_kind_reads(self) -> Stage:
        """An engine option the kind does not read would be silently ignored (a thinker's
        maxBatchSize once was): refused, naming it and what the kind does read."""
        reads = stage_kinds.get(self.kind).engine_options
        fields = EngineOptions.model_fields
        # Set to something other than its default: a manifest written back (every field, at
        # its default for the other kinds) still loads.
        unread = [f.alias for n, f in fields.items()
                  if n in self.engine.model_fields_set and n not in reads
                  and getattr(self.engine, n) != f.get_default(call_default_factory=True)]
        if unread:
            takes = ", ".join(str(fields[o].alias) for o in reads) or "none"
            raise path_errors([(f"engine.{alias}", f"the {self.kind} kind does not read this "
                                f"option (its engine options: {takes})") for alias in unread])
        return self

    @model_validator(mode="after")
    def _one_gpu_per_model(self) -> Stage:
        """A replica loads its model onto one device: spreading one model over several GPUs
        (device_map) is not supported, so asking for it is refused rather than half-used."""
        if stage_kinds.get(self.kind).needs_model and self.resources.gpus > 1:
            raise path_errors([("resources.gpus", GPUS_PER_MODEL_REPLICA.format(
                kind=self.kind, gpus=self.resources.gpus))])
        return self

    @model_validator(mode="after")
    def _seed_within_bounds(self) -> Stage:
        """With autoscaling the autoscaler owns the count: an explicit replicas outside its
        bounds is a contradiction (refused); an omitted one is brought within them."""
        scaling = self.autoscaling
        if scaling is None:
            return self
        if "replicas" in self.model_fields_set:
            if scaling.seed(self.replicas) != self.replicas:
                raise path_errors([("replicas", f"{AUTOSCALING_SEED} (got {self.replicas}, "
                                     f"bounds [{scaling.min_replicas}, "
                                     f"{scaling.max_replicas}])")])
        else:
            self.replicas = scaling.seed(1)
            self.__pydantic_fields_set__.discard("replicas")
        return self

    def model_ref(self) -> ModelRef | None:
        """The parsed model reference (omnistage.modelref), None for a stage without one."""
        return None if self.model is None else parse_model_ref(self.model)

    def model_path(self, base_dir: Path | None = None) -> Path | None:
        """Absolute path of a local model (relative ones resolve against base_dir), else None."""
        ref = self.model_ref()
        if ref is None or ref.kind != "path":
            return None
        path = Path(ref.source).expanduser()
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        return path


#: The voices a speech stage offers when engine.voices is unset: the built-in tiny talker's one
#: speaker. A hub model's speakers are listed in engine.voices (the spec cannot open its files).
DEFAULT_VOICES: tuple[str, ...] = ("default",)


def stage_voices(stage: Stage) -> list[str]:
    """The voices a stage offers, first = the default one when a request names none (after
    engine.voice): engine.voices if set, else DEFAULT_VOICES. [] for a stage whose kind reads no
    voices (it makes no speech). The HTTP API's /v1/models and its voice checks read this."""
    if "voices" not in stage_kinds.get(stage.kind).engine_options:
        return []
    voices = list(stage.engine.voices or DEFAULT_VOICES)
    if stage.engine.voice is not None and stage.engine.voice in voices:
        voices.remove(stage.engine.voice)
        voices.insert(0, stage.engine.voice)
    return voices
