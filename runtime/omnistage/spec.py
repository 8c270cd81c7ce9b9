"""Pipeline spec: the OmniPipeline manifest as pydantic models.

One document describes a pipeline. ``omnistage serve FILE`` runs it locally and
``kubectl apply -f FILE`` runs it on a cluster, so these models are the single source of truth:
the runtime parses them here and the CRD OpenAPI schema is generated from them. That is why every
field has a description, uses a camelCase alias, forbids unknown keys (typos are errors) and keeps
to JSON-schema friendly types (Literals for enums, explicit bounds, optional values instead of
unions).

`validate_manifest` is the one validator: `omnistage validate`, `omnistage serve` and the
operator's admission webhook all call it. Documents are parsed strictly, the way the API server
types JSON: no string is coerced to a number or a boolean, keys are camelCase only, and unknown
keys are errors (under metadata too, except the fields the API server sets).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

import omnistage.kinds as stage_kinds
from omnistage import __version__
from omnistage.kube import ANNOTATION_SHARED_MEMORY, API_VERSION
from omnistage.modelref import (
    HUB_ID_GRAMMAR,
    HUB_ID_PATTERN,
    LOCAL_PATH_PREFIXES,
    ModelRef,
    builtins_for,
    parse_model_ref,
    reference_error,
)

__all__ = [
    "API_VERSION",
    "DEFAULT_IMAGE",
    "HUB_ID_GRAMMAR",
    "HUB_ID_PATTERN",
    "KIND",
    "LOCAL_PATH_PREFIXES",
    "MAX_REPLICAS",
    "MAX_STAGES",
    "AdmissionOptions",
    "Autoscaling",
    "AutoscalingTarget",
    "DispatchOptions",
    "EngineOptions",
    "Metadata",
    "ModelCache",
    "OmniPipeline",
    "OrchestratorResources",
    "OrchestratorSpec",
    "PerRequest",
    "PipelineSpec",
    "Placement",
    "SecretKeyRef",
    "SpecError",
    "Stage",
    "StagePool",
    "StagePoolSpec",
    "StageResources",
    "StreamingOptions",
    "Toleration",
    "image_error",
    "load_manifests",
    "load_pipeline",
    "parse_pipeline",
    "parse_stagepool",
    "stage_voices",
    "validate_manifest",
]

KIND = "OmniPipeline"
POOL_KIND = "StagePool"
#: The runtime image (runtime/Dockerfile). Its tag is the package version, the one version
#: source that the chart's appVersion and the image tags share (tests/unit/test_versions.py).
IMAGE_REPOSITORY = "ghcr.io/omnistage/omnistage"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
#: Upper bounds shared with the CRD's CEL rules, so the API server and the runtime agree.
MAX_STAGES = 16
MAX_REPLICAS = 64

ApiSurface = Literal["chat", "images", "speech", "generic"]

# A stage name becomes part of pod names (<pipeline>-<stage>-<ordinal>), hence the short limits.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# The pipeline name prefixes Service names, which must be DNS-1035 labels (leading letter).
DNS1035_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
#: A voice (speaker) name, as OpenAI's `voice` field and Qwen-Omni's speaker names spell them.
VOICE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Names of Secrets and PersistentVolumeClaims.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PIPELINE_NAME_MAX = 40
# Pod names are <pipeline>-<stage>-<ordinal>; keep them within one 63-character DNS label.
POD_NAME_MAX = 63
STAGE_NAME_MAX = 20
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
# A pool's name is <pipeline>-<stage>, and its pods add -<ordinal>.
POOL_NAME_MAX = POD_NAME_MAX - 1 - len(str(MAX_REPLICAS - 1))

# The container image reference grammar (github.com/distribution/reference):
# [registry[:port]/]path[:tag][@digest]. Written for both regex engines that apply it (Rust's in
# pydantic-core is not used: the check is a validator; Go's RE2 runs it in the CRD's CEL rule),
# so it uses explicit classes instead of \w.
_IMAGE_DOMAIN = (
    r"(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
    r"(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
)
_IMAGE_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_PATTERN = (
    rf"^(?:{_IMAGE_DOMAIN}/)?{_IMAGE_COMPONENT}(?:/{_IMAGE_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
IMAGE_MAX = 512
IMAGE_GRAMMAR = "[registry[:port]/]name[:tag][@digest]"

_PATTERN_HELP = {
    DNS_LABEL_PATTERN: "must be a DNS-1123 label: lowercase letters, digits and '-', "
    "starting and ending with a letter or digit",
    DNS1035_LABEL_PATTERN: "must be a DNS-1035 label: lowercase letters, digits and '-', "
    "starting with a letter and ending with a letter or digit",
    QUANTITY_PATTERN: "must be a Kubernetes quantity such as '500m', '2', '1.5' or '4Gi'",
    URL_PATTERN: "must be an http:// or https:// URL",
    DNS_SUBDOMAIN_PATTERN: "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and "
    "'.', starting and ending with a letter or digit",
}


def _collapse_nullable(schema: dict[str, Any], _cls: Any = None) -> None:
    """Turn ``anyOf: [X, null]`` into plain X so the CRD schema stays structural.

    Optional fields are simply omitted in manifests; a null default carries no information.
    """
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf")
        if branches and len(branches) == 2 and {"type": "null"} in branches:
            other = next(b for b in branches if b != {"type": "null"})
            del prop["anyOf"]
            prop.update(other)
        if "default" in prop and prop["default"] is None:
            del prop["default"]


class _Model(BaseModel):
    """Shared config: camelCase keys, unknown keys rejected, CRD-friendly schema."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_collapse_nullable,
    )


def _number_to_str(value: Any) -> Any:
    """YAML reads ``cpu: 1`` as an int; Kubernetes quantities are int-or-string.

    Floats are left to fail: the API server refuses ``cpu: 0.5`` too, so write "500m" or "0.5".
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN), BeforeValidator(_number_to_str)]
StageName = Annotated[
    str, Field(pattern=DNS_LABEL_PATTERN, min_length=1, max_length=STAGE_NAME_MAX)
]
_SET = {"x-kubernetes-list-type": "set"}


def image_error(value: str) -> str | None:
    """Why value is not a container image reference, or None when it is one.

    The CRD's CEL rule for images (omni_operator.crd) words its messageExpression the same way,
    so `kubectl apply` and `omnistage validate` print the same sentence.
    """
    if value == "":
        return f"an image is required: {IMAGE_GRAMMAR}, such as {DEFAULT_IMAGE!r}"
    if re.fullmatch(IMAGE_PATTERN, value):
        return None
    if "://" in value:
        bare = value[value.index("://") + 3 :]
        return f"an image reference has no scheme: write {bare!r} instead of {value!r}"
    return (
        f"not a container image reference (got {value!r}): expected {IMAGE_GRAMMAR} "
        f"in lowercase, such as {DEFAULT_IMAGE!r}"
    )


def _check_image(value: str) -> str:
    problem = image_error(value)
    if problem is not None:
        raise _field_error(problem)
    return value


# The CRD carries the grammar as a CEL rule with a readable message, not as a schema pattern.
ImageRef = Annotated[str, Field(max_length=IMAGE_MAX), AfterValidator(_check_image)]


# --------------------------------------------------------------------------- stage parts


@dataclasses.dataclass(frozen=True)
class PerRequest:
    """Marks an EngineOptions field that a request may override, in the stage kinds whose row
    of the kind table (omnistage.kinds) lists it among their engine options.

    `key` is the request parameter's name when it differs from the field's. Executors and the
    HTTP API derive their request models from these marks (omnistage.params), so a knob's bounds
    are written once, here.
    """

    key: str | None = None


# The one bounds table of every engine knob: the spec, the HTTP API and the executors all read
# these fields (omnistage.params derives the request models), so no range is written twice.
class EngineOptions(_Model):
    """Executor options; each kind reads the ones that apply to it and ignores the rest.

    A request may override the per-request ones within the same bounds.
    """

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Weight and activation dtype; auto is bfloat16 on a GPU and float32 on "
        "the CPU.",
    )
    max_tokens: Annotated[int, PerRequest()] = Field(
        16,
        ge=0,
        le=2**20,
        description="ar: number of new tokens when a request omits it; the worker also refuses "
        "prompt + max_tokens beyond its model's context.",
    )
    temperature: Annotated[float, PerRequest()] = Field(
        0.0, ge=0.0, le=2.0, description="ar: sampling temperature; 0 is greedy."
    )
    return_hidden_states: Annotated[bool, PerRequest()] = Field(
        False,
        description="ar: also emit last-layer hidden states so downstream stages can condition "
        "on them (an AR encoder feeding a diffusion stage).",
    )
    height: Annotated[int, PerRequest()] = Field(
        32,
        ge=8,
        le=2048,
        multiple_of=8,
        description="diffusion: image height in pixels; the model may need a larger multiple.",
    )
    width: Annotated[int, PerRequest()] = Field(
        32,
        ge=8,
        le=2048,
        multiple_of=8,
        description="diffusion: image width in pixels; the model may need a larger multiple.",
    )
    num_inference_steps: Annotated[int, PerRequest()] = Field(
        4, ge=1, le=1000, description="diffusion: number of denoising steps."
    )
    guidance_scale: Annotated[float, PerRequest()] = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="diffusion: classifier-free guidance scale; above 1 enables guidance, which "
        "runs a negative-prompt companion request.",
    )
    # 2^53 - 1: the largest integer every JSON parser keeps exact. The API server stores
    # schema bounds as float64 and refuses an integer maximum that does not convert back.
    seed: Annotated[int, PerRequest()] = Field(
        0,
        ge=0,
        le=2**53 - 1,
        description="Random seed, so tiny models are reproducible; sample i of a request with "
        "n > 1 uses seed + i.",
    )
    echo_delay_ms: Annotated[int, PerRequest(key="delay_ms")] = Field(
        0, ge=0, le=60_000, description="echo: artificial latency added to every request."
    )
    echo_chunk_chars: Annotated[int, PerRequest(key="chunk_chars")] = Field(
        0,
        ge=0,
        le=1_000_000,
        description="echo: split the text into pieces of this many characters (0: one piece), "
        "each a chunk for a downstream stage that streams and a delta for a streaming client.",
    )
    echo_chunk_delay_ms: Annotated[int, PerRequest(key="chunk_delay_ms")] = Field(
        0, ge=0, le=60_000, description="echo: artificial latency before every piece."
    )
    voices: list[Annotated[str, StringConstraints(pattern=VOICE_PATTERN)]] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="speech stages: the voices this stage offers (speaker names of its model); "
        "unset: every voice the model knows. /v1/models lists them.",
    )
    voice: Annotated[str | None, PerRequest()] = Field(
        None,
        pattern=VOICE_PATTERN,
        description="speech stages: the voice of a request that names none; unset: the first "
        "of voices (or the model's first).",
    )
    max_frames: Annotated[int, PerRequest()] = Field(
        256,
        ge=1,
        le=65_536,
        description="talker: most codec frames a request may generate (Qwen3-Omni makes 12.5 "
        "frames a second of speech); the talker also stops at its codec's end code.",
    )
    chunk_frames: Annotated[int, PerRequest()] = Field(
        8,
        ge=1,
        le=4096,
        description="talker: codec frames per chunk it streams to its vocoder; vocoder: frames "
        "it decodes at a time (each with the model's left context), streamed or not, so the "
        "audio is the same either way. Small: earlier first audio; large: less re-decoded "
        "context.",
    )
    max_batch_size: int = Field(
        16,
        ge=1,
        le=1024,
        description="ar, diffusion, talker, vocoder: most requests that share one forward step "
        "(ar, talker: continuous batching; diffusion: requests of the same size and guidance; "
        "vocoder: windows of the same length). 1 runs requests one at a time.",
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=2**24,
        description="ar: most tokens (prompt + max_tokens of each sequence) a running batch may "
        "hold; a request above it is refused. Unset: only maxBatchSize limits the batch.",
    )


def _check_engine_options(kind: stage_kinds.StageKind) -> None:
    """A kind table row may only name EngineOptions fields (where their bounds live)."""
    unknown = [o for o in kind.engine_options if o not in EngineOptions.model_fields]
    if unknown:
        raise stage_kinds.KindError(
            f"stage kind {kind.name!r}: engine option(s) {unknown} are not EngineOptions fields "
            f"(known: {', '.join(EngineOptions.model_fields)})")


stage_kinds.on_register(_check_engine_options)


def engine_kinds(field: str) -> tuple[str, ...]:
    """The stage kinds an EngineOptions field applies to: those whose row of the kind table
    lists it."""
    if field not in EngineOptions.model_fields:
        raise KeyError(f"{field!r} is not an EngineOptions field")
    return tuple(k.name for k in stage_kinds.kinds() if field in k.engine_options)


def engine_for_kind(engine: EngineOptions, kind: str) -> dict[str, Any]:
    """The options that apply to kind, JSON-ready with camelCase keys: what a StagePool stores,
    so `kubectl get sp -o yaml` shows no diffusion knobs on an ar pool."""
    dumped = engine.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {
        (info.alias or name): dumped[info.alias or name]
        for name, info in EngineOptions.model_fields.items()
        if kind in engine_kinds(name) and (info.alias or name) in dumped
    }


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


def join_words(items: list[str], last: str = "and") -> str:
    """'a', 'a and b', 'a, b, and c': how descriptions and messages list kinds."""
    if len(items) <= 2:
        return f" {last} ".join(items)
    return ", ".join(items[:-1]) + f", {last} " + items[-1]


def chat_stage_rule() -> str:
    """Why a stage cannot be the chat stage; the CRD's CEL rule words it the same way."""
    chat = [f"'{k}'" for k in stage_kinds.chat_kinds()]
    if len(chat) == 1:
        return f"the chat stage must be an {chat[0]} stage"
    return f"the chat stage must be a stage of kind {join_words(chat, 'or')}"


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


def __getattr__(name: str) -> Any:
    """Views of the kind table, computed when read so registered kinds are included."""
    if name == "STAGE_KINDS":
        return stage_kinds.names()
    if name == "BUILTIN_MODELS":
        return stage_kinds.builtin_models()
    if name == "MODEL_KINDS":
        return tuple(k.name for k in stage_kinds.kinds() if k.needs_model)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StageResources(_Model):
    """Per-replica resources; on Kubernetes these become requests and limits."""

    gpus: int = Field(
        0, ge=0, le=16, description="GPUs per replica (nvidia.com/gpu). 0 runs on CPU."
    )
    cpu: Quantity = Field("1", description="CPU per replica, a Kubernetes quantity.")
    memory: Quantity = Field("2Gi", description="Memory per replica, a Kubernetes quantity.")


class OrchestratorResources(_Model):
    """Resources of one orchestrator replica; it never needs a GPU."""

    cpu: Quantity = Field("1", description="CPU per orchestrator replica, a Kubernetes quantity.")
    memory: Quantity = Field(
        "1Gi", description="Memory per orchestrator replica, a Kubernetes quantity."
    )


class Toleration(_Model):
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
            raise _path_errors(errors)
        return self


class Placement(_Model):
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
        json_schema_extra=_SET,
    )
    spread_across_nodes: bool = Field(
        True,
        description="Spread replicas across nodes (topology spread by hostname), so losing one "
        "node does not take the whole stage down.",
    )


class AdmissionOptions(_Model):
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


class StreamingOptions(_Model):
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


class DispatchOptions(_Model):
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


class AutoscalingTarget(_Model):
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


class Autoscaling(_Model):
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
        description="Requests the orchestrator holds for this stage while it is at zero; beyond "
        "them it answers 503 with Retry-After.",
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
            raise _path_errors(errors)
        return self

    def seed(self, replicas: int) -> int:
        """A stage's replicas brought within [minReplicas, maxReplicas]."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


class Stage(_Model):
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
        json_schema_extra=_SET,
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
            raise _field_error(f"invalid value {_short(value)} (expected {expected})")
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
            raise _field_error(
                f"{kind} stages take no model; omit it or set it to none (got {value!r})"
            )
        if value is None or value.strip().lower() in ("", "none"):
            raise _field_error(
                f"a model is required for kind {kind!r} (built-ins: {builtins_for(kind)}, "
                f"{HUB_ID_GRAMMAR}, or a local path starting with / or ./)"
            )
        problem = reference_error(value, kind)
        if problem is not None:
            raise _field_error(problem)
        return value

    @model_validator(mode="after")
    def _one_gpu_per_model(self) -> Stage:
        """A replica loads its model onto one device: spreading one model over several GPUs
        (device_map) is not supported, so asking for it is refused rather than half-used."""
        if stage_kinds.get(self.kind).needs_model and self.resources.gpus > 1:
            raise _path_errors([("resources.gpus", GPUS_PER_MODEL_REPLICA.format(
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
                raise _path_errors([("replicas", f"{AUTOSCALING_SEED} (got {self.replicas}, "
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


def _path_errors(errors: list[tuple[str, str]], *, relative: bool = True) -> PydanticCustomError:
    """Several errors in one, each with its own path (relative to the validated model's
    location, or absolute), so cross-field problems are all reported at once."""
    return PydanticCustomError(
        "spec_errors",
        "{summary}",
        {
            "summary": "; ".join(f"{p}: {m}" for p, m in errors),
            "errors": errors,
            "relative": relative,
        },
    )


def _field_error(message: str) -> PydanticCustomError:
    """A validation error whose message is shown as-is (no 'Value error,' prefix)."""
    return PydanticCustomError("spec_field", "{message}", {"message": message})


# --------------------------------------------------------------------------- pipeline


class FailoverOptions(_Model):
    """What the orchestrator does with a task whose replica was lost (kill, crash, restart)."""

    max_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries per request after a replica loss: the lost stage task runs again "
        "on another replica of its stage from the outputs the orchestrator kept (an AR stream "
        "resumes from the tokens already delivered). 0 fails the request with replica_lost at "
        "once. A request that loses two replicas of the same stage fails as a suspect.",
    )


class OrchestratorSpec(_Model):
    """The API front door: it routes every request through the stage graph."""

    replicas: int = Field(1, ge=0, le=16, description="Number of orchestrator replicas.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the API.")
    api: list[ApiSurface] = Field(
        default_factory=lambda: ["chat", "images", "speech", "generic"],
        min_length=1,
        description="API surface to serve: chat (/v1/chat/completions), images "
        "(/v1/images/generations), speech (/v1/audio/speech, where a stage's kind emits audio) "
        "and generic (/v1/pipelines/{name}/requests).",
        json_schema_extra=_SET,
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="Model name reported by /v1/models and accepted in requests; defaults to "
        "metadata.name.",
    )
    chat_stage: StageName | None = Field(
        None,
        description="The ar stage that answers /v1/chat/completions; defaults to the first ar "
        "stage in topological order.",
    )
    request_timeout_seconds: float = Field(
        300.0, gt=0, le=86_400, description="Upper bound on a request's lifetime end to end."
    )
    failover: FailoverOptions = Field(
        default_factory=FailoverOptions,
        description="Retry of a stage task whose replica was lost (docs/architecture.md, "
        "\"Failover\").",
    )
    shutdown_delay_seconds: float = Field(
        5.0,
        ge=0,
        le=300,
        description="On SIGTERM an orchestrator fails /readyz at once but keeps serving this "
        "long, so endpoints and load balancers drop it before it stops admitting and drains.",
    )
    resources: OrchestratorResources = Field(
        default_factory=OrchestratorResources, description="Resources of each orchestrator replica."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels an orchestrator replica's node must have."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the orchestrator replicas tolerate."
    )

    @field_validator("api")
    @classmethod
    def _unique_api(cls, value: list[str]) -> list[str]:
        """A repeated surface is almost certainly a typo for another one."""
        _reject_duplicates(value)
        return value


GPUS_PER_MODEL_REPLICA = (
    "replicas of kind '{kind}' load their model onto one GPU (got {gpus}); spreading a model "
    "over several GPUs is not supported: request 1 and scale with replicas"
)


def _reject_duplicates(values: list[str]) -> None:
    """Name the repeated entry by index, as the API server does for a set-type list."""
    seen: set[str] = set()
    errors = []
    for i, item in enumerate(values):
        if item in seen:
            errors.append((f"[{i}]", f"duplicate entry {item!r}"))
        seen.add(item)
    if errors:
        raise _path_errors(errors)


class SecretKeyRef(_Model):
    """A key of a Secret in the pipeline's namespace; only the reference is ever stored."""

    name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Name of the Secret."
    )
    key: str = Field(
        "token",
        pattern=r"^[-._a-zA-Z0-9]+$",
        max_length=253,
        description="Key in the Secret whose value is the token.",
    )


class ModelCache(_Model):
    """Where stage pods keep hub models; a local `omnistage serve` uses the Hugging Face cache
    ($HF_HOME) instead and ignores this.

    Pods of stages with a hub id get an init container that runs `omnistage models pull` into
    this volume from the stage's own image; the worker then loads with HF_HUB_OFFLINE=1.
    Without a modelCache each such pod fetches into its own unbounded emptyDir.
    """

    claim_name: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="A PersistentVolumeClaim shared by the replicas (ReadWriteMany, or "
        "ReadOnlyMany with readOnly: true and the models already in it).",
    )
    size: Quantity | None = Field(
        None,
        description="Instead of a claim: a per-pod ephemeral cache of this size (an emptyDir "
        "with this sizeLimit), filled anew by every pod.",
    )
    read_only: bool = Field(
        False,
        description="With claimName: the claim is mounted read-only and must already hold the "
        "models; the init container only checks that (`omnistage models pull --offline`).",
    )
    endpoint: str | None = Field(
        None,
        pattern=URL_PATTERN,
        max_length=2048,
        description="Hub to fetch from (HF_ENDPOINT of the init container), for example an "
        "in-cluster mirror; default the public Hugging Face hub.",
    )
    token_secret: SecretKeyRef | None = Field(
        None,
        description="Secret holding a Hugging Face token for gated models. Only the fetching "
        "init container gets it (as HF_TOKEN, from a secretKeyRef); it never appears in a pod "
        "spec, a status or a log.",
    )

    @model_validator(mode="after")
    def _one_volume(self) -> ModelCache:
        errors = []
        if (self.claim_name is None) == (self.size is None):
            errors.append(("claimName", MODEL_CACHE_ONE_OF))
        if self.read_only and self.claim_name is None:
            errors.append(("readOnly", MODEL_CACHE_READ_ONLY))
        if errors:
            raise _path_errors(errors)
        return self


MODEL_CACHE_ONE_OF = "set exactly one of claimName (a shared PVC) and size (a per-pod volume)"
MODEL_CACHE_READ_ONLY = "readOnly applies to a claimName only"


class PipelineSpec(_Model):
    """The desired pipeline: the stage graph and the orchestrator in front of it."""

    image: ImageRef = Field(
        DEFAULT_IMAGE,
        description=f"Container image for stage and orchestrator pods: {IMAGE_GRAMMAR}.",
    )
    orchestrator: OrchestratorSpec = Field(
        default_factory=OrchestratorSpec, description="The orchestrator (API front door)."
    )
    model_cache: ModelCache | None = Field(
        None, description="On a cluster: the volume stage pods keep hub models in."
    )
    stages: list[Stage] = Field(
        min_length=1,
        max_length=MAX_STAGES,
        description="The stages, a directed acyclic graph through their inputs.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )

    @model_validator(mode="after")
    def _check_graph(self) -> PipelineSpec:
        """Cross-field rules: report every problem at once, each with its own path."""
        errors = _graph_errors(self)
        if errors:
            raise _path_errors(errors)
        return self

    # -- helpers (valid specs only) ---------------------------------------------------------

    def stage(self, name: str) -> Stage:
        """The stage called name; KeyError names the known stages."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"unknown stage {name!r} (stages: {', '.join(self.stage_names())})")

    def stage_names(self) -> list[str]:
        """Stage names in declaration order."""
        return [s.name for s in self.stages]

    def topo_order(self) -> list[str]:
        """Stages in dependency order; ties keep declaration order so the result is stable."""
        placed: set[str] = set()
        order: list[str] = []
        remaining = list(self.stages)
        while remaining:
            for stage in remaining:
                if all(i in placed for i in stage.inputs):
                    order.append(stage.name)
                    placed.add(stage.name)
                    remaining.remove(stage)
                    break
            else:  # unreachable after validation; guards direct construction
                raise ValueError("stage graph has a cycle")
        return order

    def downstream(self, name: str) -> list[str]:
        """Stages that consume name's output, in declaration order."""
        self.stage(name)
        return [s.name for s in self.stages if name in s.inputs]

    def entry_stages(self) -> list[str]:
        """Stages without inputs: they receive the client request."""
        return [s.name for s in self.stages if not s.inputs]

    def final_stages(self) -> list[str]:
        """Stages whose output goes back to the client."""
        return [s.name for s in self.stages if s.final_output]

    def chat_stage(self) -> str | None:
        """The stage behind /v1/chat/completions, or None if no stage's kind serves chat."""
        if self.orchestrator.chat_stage is not None:
            return self.orchestrator.chat_stage
        for name in self.topo_order():
            if stage_kinds.get(self.stage(name).kind).serves_chat:
                return name
        return None


def _graph_errors(spec: PipelineSpec) -> list[tuple[str, str]]:
    """All cross-field problems as (path relative to spec, message)."""
    errors: list[tuple[str, str]] = []
    index: dict[str, int] = {}
    for i, stage in enumerate(spec.stages):
        if stage.name in index:
            # The item itself, as the API server names a duplicate key of a map-type list
            # (apiextensions-apiserver schema/listtype: field.Duplicate(fldPath.Index(i), ...),
            # "spec.stages[1]: Duplicate value: {"name": "a"}"). It refuses the object before any
            # webhook runs, so `<item>.name` (a built-in type's wording) would break the parity
            # tests/cluster/test_validation.py checks.
            errors.append(
                (
                    f"stages[{i}]",
                    f"duplicate stage name {stage.name!r} (also stages[{index[stage.name]}])",
                )
            )
        else:
            index[stage.name] = i
    # Messages name the index and the value; the CRD's CEL rules word them the same way (CEL
    # cannot join a list within its cost budget, so the known stages are not listed).

    for i, stage in enumerate(spec.stages):
        seen: set[str] = set()
        for j, upstream in enumerate(stage.inputs):
            path = f"stages[{i}].inputs[{j}]"
            if upstream == stage.name:
                errors.append((path, f"stage {upstream!r} cannot consume its own output"))
            elif upstream not in index:
                errors.append((path, f"unknown stage {upstream!r}"))
            elif upstream in seen:
                errors.append((path, f"duplicate input {upstream!r}"))
            seen.add(upstream)
        seen = set()
        for j, other in enumerate(stage.placement.colocate_with):
            path = f"stages[{i}].placement.colocateWith[{j}]"
            if other == stage.name:
                errors.append((path, f"stage {other!r} cannot colocate with itself"))
            elif other not in index:
                errors.append((path, f"unknown stage {other!r}"))
            elif other in seen:
                errors.append((path, f"duplicate entry {other!r}"))
            seen.add(other)

    errors.extend(_cycle_errors(spec, index))

    if not any(not s.inputs for s in spec.stages):
        errors.append(
            ("stages", "no entry stage: every stage has inputs, so none can receive requests")
        )
    if not any(s.final_output for s in spec.stages):
        errors.append(
            (
                "stages",
                "no final-output stage: set finalOutput: true on the stage(s) whose "
                "output the client receives",
            )
        )

    chat = spec.orchestrator.chat_stage
    if chat is not None:
        if chat not in index:
            errors.append(("orchestrator.chatStage", f"unknown stage {chat!r}"))
        elif not stage_kinds.get(kind := spec.stages[index[chat]].kind).serves_chat:
            errors.append(
                (
                    "orchestrator.chatStage",
                    f"stage {chat!r} has kind {kind!r}; {chat_stage_rule()}",
                )
            )
    return errors


def _cycle_errors(spec: PipelineSpec, index: dict[str, int]) -> list[tuple[str, str]]:
    """Find cycles by DFS along data flow and name each one once, e.g. 'a -> b -> a'."""
    consumers: dict[str, list[str]] = {name: [] for name in index}
    for stage in spec.stages:
        if index.get(stage.name) is None:
            continue
        for upstream in stage.inputs:
            if upstream in consumers and upstream != stage.name:
                if stage.name not in consumers[upstream]:
                    consumers[upstream].append(stage.name)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    found: list[tuple[str, str]] = []
    reported: set[frozenset[str]] = set()

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for nxt in consumers[name]:
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                key = frozenset(cycle)
                if key not in reported:
                    reported.add(key)
                    closing = cycle[-2]  # nxt lists closing among its inputs
                    target = spec.stages[index[nxt]]
                    path = f"stages[{index[nxt]}].inputs[{target.inputs.index(closing)}]"
                    found.append((path, "cycle detected: " + " -> ".join(cycle)))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[name] = 2

    for name in index:
        if name not in state:
            visit(name)
    return found


# --------------------------------------------------------------------------- metadata

# Label and annotation keys: an optional DNS subdomain prefix and '/', then a name part.
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
ANNOTATIONS_MAX_BYTES = 256 * 1024


def _key_error(kind: str, key: str) -> str | None:
    """The API server's rule for label and annotation keys, in words."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (
        not prefix or len(prefix) > 253 or not re.fullmatch(_DNS_SUBDOMAIN, prefix)
    ):
        return (
            f"invalid {kind} key {key!r}: the prefix before '/' must be a DNS subdomain "
            "(lowercase letters, digits, '-' and '.')"
        )
    if not name or len(name) > 63 or not re.fullmatch(_QUALIFIED_NAME, name):
        return (
            f"invalid {kind} key {key!r}: the name must be 1-63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        problem = _key_error("label", key)
        if problem is None and value and (
            len(value) > 63 or not re.fullmatch(_QUALIFIED_NAME, value)
        ):
            problem = (
                f"invalid label value {value!r} for {key!r}: at most 63 letters, digits, '-', "
                "'_' or '.', starting and ending with a letter or digit"
            )
        if problem:
            raise _field_error(problem)
    return labels


def _check_annotations(annotations: dict[str, str]) -> dict[str, str]:
    for key in annotations:
        problem = _key_error("annotation", key)
        if problem:
            raise _field_error(problem)
    size = sum(len(k) + len(v) for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        raise _field_error(f"annotations total {size} bytes; at most {ANNOTATIONS_MAX_BYTES}")
    # The shared-memory opt-in is a switch: a typo must not silently mean "off".
    flag = annotations.get(ANNOTATION_SHARED_MEMORY)
    if flag is not None and flag not in ("true", "false"):
        raise _field_error(f"{ANNOTATION_SHARED_MEMORY} must be \"true\" or \"false\", "
                           f"got {flag!r}")
    return annotations


class _ObjectMeta(BaseModel):
    """Kubernetes object metadata. Unknown keys are errors (`metadata.lables` must not silently
    drop the labels); the fields the API server writes are accepted, so live objects parse."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_collapse_nullable,
    )

    name: str = Field(min_length=1, description="Object name.")
    namespace: str | None = Field(None, description="Namespace of the object on Kubernetes.")
    labels: Annotated[dict[str, str], AfterValidator(_check_labels)] = Field(
        default_factory=dict, description="Labels."
    )
    annotations: Annotated[dict[str, str], AfterValidator(_check_annotations)] = Field(
        default_factory=dict, description="Annotations."
    )
    # Written by the API server or by controllers; never read here, so any type passes.
    generate_name: Any = Field(None, description="Set by the API server.")
    uid: Any = Field(None, description="Set by the API server.")
    resource_version: Any = Field(None, description="Set by the API server.")
    generation: Any = Field(None, description="Set by the API server.")
    creation_timestamp: Any = Field(None, description="Set by the API server.")
    deletion_timestamp: Any = Field(None, description="Set by the API server.")
    deletion_grace_period_seconds: Any = Field(None, description="Set by the API server.")
    finalizers: Any = Field(None, description="Set by controllers (the operator's finalizer).")
    owner_references: Any = Field(None, description="Set by controllers.")
    managed_fields: Any = Field(None, description="Set by the API server.")
    self_link: Any = Field(None, description="Set by the API server.")


class Metadata(_ObjectMeta):
    """An OmniPipeline's metadata: its name prefixes every derived object's name."""

    name: str = Field(
        pattern=DNS1035_LABEL_PATTERN,
        min_length=1,
        max_length=PIPELINE_NAME_MAX,
        description="Pipeline name; a DNS-1035 label (it prefixes Service names) of at most "
        f"{PIPELINE_NAME_MAX} characters so derived pod names fit.",
    )


class PoolMetadata(_ObjectMeta):
    """A StagePool's metadata: its name is <pipeline>-<stage>, and its pods add -<ordinal>."""

    name: str = Field(
        pattern=DNS_LABEL_PATTERN,
        min_length=1,
        max_length=POOL_NAME_MAX,
        description=f"Pool name, <pipeline>-<stage>; at most {POOL_NAME_MAX} characters.",
    )


class OmniPipeline(_Model):
    """An OmniPipeline manifest: the same document runs locally and on Kubernetes."""

    api_version: Literal[API_VERSION] = Field(  # type: ignore[valid-type]
        description=f"Must be {API_VERSION}.")
    kind: Literal["OmniPipeline"] = Field(description=f"Must be {KIND}.")
    metadata: Metadata = Field(description="Object metadata; name is required.")
    spec: PipelineSpec = Field(description="The desired pipeline.")
    status: dict[str, Any] | None = Field(
        None,
        description="Observed state, written by the operator; the runtime ignores it.",
    )

    @model_validator(mode="after")
    def _check_pod_names(self) -> OmniPipeline:
        """Pod names combine pipeline and stage names, so their lengths are checked together."""
        ordinal = len(str(MAX_REPLICAS - 1))
        errors = []
        for i, stage in enumerate(self.spec.stages):
            pod = f"{self.metadata.name}-{stage.name}-{'9' * ordinal}"
            if len(pod) > POD_NAME_MAX:
                errors.append(
                    (
                        f"spec.stages[{i}].name",
                        f"pod names '{self.metadata.name}-{stage.name}-<ordinal>' would exceed "
                        f"{POD_NAME_MAX} characters; shorten the stage or pipeline name",
                    )
                )
        if errors:
            raise _path_errors(errors, relative=False)
        return self

    def served_model_name(self) -> str:
        """Model name the API reports: spec.orchestrator.servedModelName or metadata.name."""
        return self.spec.orchestrator.served_model_name or self.metadata.name

    def to_manifest(self) -> dict[str, Any]:
        """JSON-ready manifest with camelCase keys; parse_pipeline(to_manifest()) == self."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StagePoolSpec(_Model):
    """Desired replicas of one stage; written by the operator from its OmniPipeline."""

    pipeline: str = Field(
        pattern=DNS1035_LABEL_PATTERN,
        max_length=PIPELINE_NAME_MAX,
        description="Name of the OmniPipeline this pool belongs to. Immutable.",
    )
    stage: Stage = Field(description="The stage, as resolved from the pipeline.")
    replicas: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Desired replicas; `kubectl scale sp/<pool>` changes this. Overrides "
        "stage.replicas, which only seeds it.",
    )
    image: ImageRef = Field(description=f"Container image of the stage worker: {IMAGE_GRAMMAR}.")
    model_cache: ModelCache | None = Field(
        None, description="The pipeline's modelCache: where the pods keep hub models."
    )


class StagePool(_Model):
    """A StagePool manifest: the replica pods of one stage of one OmniPipeline."""

    api_version: Literal[API_VERSION] = Field(  # type: ignore[valid-type]
        description=f"Must be {API_VERSION}.")
    kind: Literal["StagePool"] = Field(description=f"Must be {POOL_KIND}.")
    metadata: PoolMetadata = Field(description="Object metadata (name <pipeline>-<stage>).")
    spec: StagePoolSpec = Field(description="The desired pool.")
    status: dict[str, Any] | None = Field(None, description="Observed state, operator-written.")

    @model_validator(mode="after")
    def _check_name(self) -> StagePool:
        """The operator finds a stage's pool by name; the CRD has the same rule in CEL."""
        want = f"{self.spec.pipeline}-{self.spec.stage.name}"
        if self.metadata.name != want:
            raise _path_errors([("metadata.name", pool_name_message(want, self.metadata.name))],
                               relative=False)
        return self


def pool_name_message(want: str, got: str) -> str:
    return f"a StagePool is named <pipeline>-<stage>: expected {want!r} (got {got!r})"


# --------------------------------------------------------------------------- errors & loading


class SpecError(ValueError):
    """An invalid pipeline; .errors lists (path, message), str() shows one per line."""

    def __init__(self, errors: list[tuple[str, str]], *, source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        super().__init__(str(self))

    def __reduce__(self) -> tuple[Any, ...]:
        """Keep .errors intact when the error crosses a process boundary."""
        return (_rebuild_spec_error, (self.errors, self.source))

    def __str__(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        return "\n".join(f"{prefix}{path}: {message}" for path, message in self.errors)


def _rebuild_spec_error(errors: list[tuple[str, str]], source: str | None) -> SpecError:
    return SpecError(errors, source=source)


def _unwrap(annotation: Any) -> tuple[Any, str | None]:
    """Strip Optional/Annotated; return (inner type, "list" or "dict" when an index or a key
    follows in an error location)."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0] if len(args) == 1 else Any
        elif origin in (list, dict):
            return typing.get_args(annotation)[-1], "list" if origin is list else "dict"
        else:
            return annotation, None


def _field_of(model: type[BaseModel], key: str) -> tuple[str, Any] | None:
    for name, info in model.model_fields.items():
        if key == (info.alias or name):  # documents use aliases only (camelCase)
            return info.alias or name, info.annotation
    return None


def _format_loc(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    """k8s-style path using camelCase names: ('spec','stages',1,'replicas') -> spec.stages[1]..."""
    parts: list[str] = []
    current: Any = root
    container: str | None = None
    for item in loc:
        if container == "dict":  # a map key: metadata.labels.team, nodeSelector.gpu
            parts.append(f".{item}")
            container = None
            continue
        if container == "list" or isinstance(item, int):
            parts.append(f"[{item}]")
            container = None
            continue
        key = str(item)
        is_model = isinstance(current, type) and issubclass(current, BaseModel)
        field = _field_of(current, key) if is_model else None
        if field is None:
            parts.append(f".{key}" if parts else key)
            current = Any
            continue
        alias, annotation = field
        parts.append(f".{alias}" if parts else alias)
        current, container = _unwrap(annotation)
    return "".join(parts)


def _join(base: str, rel: str) -> str:
    if not base:
        return rel
    return f"{base}{rel}" if rel.startswith("[") else f"{base}.{rel}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
}


def _unknown_field(key: str, model: type[BaseModel] | None) -> str:
    message = f"unknown field {key!r}"
    if model is None:
        return message
    allowed = [info.alias or n for n, info in model.model_fields.items()]
    camel = to_camel(key)
    if camel != key and camel in allowed:
        return message + f" (did you mean {camel!r}? keys are camelCase)"
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        return message + f" (did you mean {close[0]!r}?)"
    return message + f" (allowed: {', '.join(allowed)})"


def _convert(exc: ValidationError, root: type[BaseModel]) -> list[tuple[str, str]]:
    """Pydantic errors to (k8s path, readable message) pairs that quote the bad value."""
    out: list[tuple[str, str]] = []
    for err in exc.errors():
        path = _format_loc(tuple(err["loc"]), root)
        kind = err["type"]
        ctx = err.get("ctx") or {}
        value = err.get("input")
        if kind == "spec_errors":
            base = path if ctx.get("relative", True) else ""
            out.extend((_join(base, rel), msg) for rel, msg in ctx["errors"])
            continue
        if kind == "spec_field":
            message = ctx["message"]
        elif kind == "extra_forbidden":
            key = str(err["loc"][-1])
            message = _unknown_field(key, _model_at(tuple(err["loc"][:-1]), root))
        elif kind == "missing":
            message = "required field is missing"
        elif kind == "literal_error":
            message = f"invalid value {_short(value)} (expected {ctx.get('expected')})"
        elif kind == "string_pattern_mismatch":
            # Lowercase only the first letter: the pattern quoted in the message keeps its case.
            fallback = err["msg"][:1].lower() + err["msg"][1:]
            help_text = _PATTERN_HELP.get(ctx.get("pattern", ""), fallback)
            message = f"{help_text} (got {_short(value)})"
        elif kind in _TYPE_NAMES:
            # Strict parsing, as the API server types JSON: "3" is not 3 and "true" is not true.
            message = f"must be {_TYPE_NAMES[kind]} (got {type(value).__name__} {_short(value)})"
        else:
            message = err["msg"]
            if kind in ("too_long", "too_short"):
                pass  # the message already counts the items
            elif kind not in ("model_type", "model_attributes_type", "dict_type", "list_type"):
                message += f" (got {_short(value)})"
            else:
                message += f" (got {type(value).__name__})"
        out.append((path or "(root)", message))
    return out


def _model_at(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class found at loc, for typo suggestions."""
    current: Any = root
    container: str | None = None
    for item in loc:
        if container or isinstance(item, int):
            container = None
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = _field_of(current, str(item))
        if field is None:
            return None
        current, container = _unwrap(field[1])
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    return None


M = typing.TypeVar("M", bound=BaseModel)


def _strict(model: type[M], doc: Any) -> M:
    """Validate a document the way the API server types JSON: no coercion, camelCase keys only.

    Python code may still build the models by field name (populate_by_name); documents may not.
    """
    if not isinstance(doc, dict):
        raise SpecError([("(root)", f"expected a mapping, got {type(doc).__name__}")])
    try:
        return model.model_validate(doc, strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise SpecError(_convert(exc, model)) from None


def parse_pipeline(
    doc: dict[str, Any], *, check_paths: bool = False, base_dir: Path | None = None
) -> OmniPipeline:
    """Validate an OmniPipeline mapping; every problem becomes a field-pathed SpecError entry.

    check_paths also requires local model paths to exist (relative to base_dir, default cwd);
    the operator leaves it off because paths refer to the pod's filesystem.
    """
    pipeline = _strict(OmniPipeline, doc)
    if check_paths:
        missing = []
        for i, stage in enumerate(pipeline.spec.stages):
            path = stage.model_path(base_dir)
            if path is not None and not path.exists():
                missing.append(
                    (f"spec.stages[{i}].model", f"model path {stage.model!r} does not exist")
                )
        if missing:
            raise SpecError(missing)
    return pipeline


def parse_stagepool(doc: dict[str, Any]) -> StagePool:
    """Validate a StagePool mapping (the operator writes them; people may too)."""
    return _strict(StagePool, doc)


KIND_IMMUTABLE = "kind is immutable; create a stage with a new name instead"
PIPELINE_IMMUTABLE = "pipeline is immutable"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _update_errors(doc: dict[str, Any], old: dict[str, Any]) -> list[tuple[str, str]]:
    """What an update may not change. Both objects are read leniently (the old one may predate
    today's rules, the new one may be invalid otherwise too); the CRD's transition rules (CEL)
    say the same with the same paths."""
    spec, old_spec = _dict(doc.get("spec")), _dict(old.get("spec"))
    if doc.get("kind") == POOL_KIND:
        errors = []
        if old_spec.get("pipeline") not in (None, spec.get("pipeline")):
            errors.append(("spec.pipeline", PIPELINE_IMMUTABLE))
        old_kind = _dict(old_spec.get("stage")).get("kind")
        if old_kind not in (None, _dict(spec.get("stage")).get("kind")):
            errors.append(("spec.stage.kind", KIND_IMMUTABLE))
        return errors
    stages = [_dict(s) for s in old_spec.get("stages") or [] if isinstance(s, dict)]
    old_kinds = {s.get("name"): s.get("kind") for s in stages}
    new_stages = spec.get("stages") if isinstance(spec.get("stages"), list) else []
    return [
        (f"spec.stages[{i}].kind", KIND_IMMUTABLE)
        for i, stage in enumerate(_dict(s) for s in new_stages)
        if old_kinds.get(stage.get("name")) not in (None, stage.get("kind"))
    ]


def validate_manifest(
    doc: Any,
    *,
    old: Any = None,
    check_paths: bool = False,
    base_dir: Path | None = None,
) -> OmniPipeline | StagePool:
    """The one validator of an Omnistage object (OmniPipeline or StagePool).

    `omnistage validate`, `omnistage serve` and the operator's admission webhook call it, so
    each refuses the same documents naming the same field paths. old is the stored object of
    an update: changes to immutable fields are refused too. Raises SpecError with every problem.
    """
    if not isinstance(doc, dict):
        raise SpecError([("(root)", f"expected a mapping, got {type(doc).__name__}")])
    kind = doc.get("kind")
    if kind not in (KIND, POOL_KIND):
        problem = "required field is missing" if kind is None else f"invalid value {_short(kind)}"
        raise SpecError([("kind", f"{problem} (expected {KIND!r} or {POOL_KIND!r})")])
    errors = _update_errors(doc, old) if isinstance(old, dict) else []
    try:
        if kind == POOL_KIND:
            obj: OmniPipeline | StagePool = parse_stagepool(doc)
        else:
            obj = parse_pipeline(doc, check_paths=check_paths, base_dir=base_dir)
    except SpecError as exc:
        raise SpecError(errors + exc.errors) from None
    if errors:
        raise SpecError(errors)
    return obj


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML would otherwise silently drop."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_manifests(path: str | Path) -> list[Any]:
    """Every YAML document of a file (empty documents skipped); file problems raise SpecError
    naming the file."""
    file = Path(path)
    source = str(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([("(file)", "file not found")], source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([("(file)", f"cannot read file: {exc}")], source=source) from None
    try:
        return [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d is not None]
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([("(file)", f"invalid YAML{where}: {problem}")], source=source) from None


def load_pipeline(path: str | Path, *, check_paths: bool = True) -> OmniPipeline:
    """Read one OmniPipeline from a YAML file; errors name the file."""
    source = str(path)
    try:
        docs = load_manifests(path)
    except SpecError as exc:
        if exc.errors == [("(file)", "file not found")]:
            raise SpecError([("(file)", "pipeline file not found")], source=source) from None
        raise
    if not docs:
        raise SpecError([("(file)", "file is empty; expected one OmniPipeline")], source=source)
    if len(docs) > 1:
        raise SpecError(
            [("(file)", f"expected exactly one YAML document, found {len(docs)}")], source=source
        )
    base_dir = Path(path).parent.resolve()
    try:
        return parse_pipeline(docs[0], check_paths=check_paths, base_dir=base_dir)
    except SpecError as exc:
        raise SpecError(exc.errors, source=source) from None
