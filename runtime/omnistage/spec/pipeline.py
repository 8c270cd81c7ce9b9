"""The pipeline: the stage graph and the orchestrator in front of it.

The graph's rules (names, inputs, cycles, entry and final stages, the chat stage) are checked
together in PipelineSpec._check_graph, so one run names every problem at its own path; the
CRD's CEL rules word them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import Field, field_validator, model_validator

import omnistage.kinds as stage_kinds
from omnistage.spec.errors import path_errors
from omnistage.spec.fields import LIST_SET, ImageRef, Quantity, SpecModel, StageName
from omnistage.spec.patterns import (
    DEFAULT_IMAGE,
    DNS_SUBDOMAIN_PATTERN,
    IMAGE_GRAMMAR,
    MAX_STAGES,
    URL_PATTERN,
    join_words,
)
from omnistage.spec.stage import Stage, Toleration

ApiSurface = Literal["chat", "images", "speech", "generic"]


def chat_stage_rule() -> str:
    """Why a stage cannot be the chat stage; the CRD's CEL rule words it the same way."""
    chat = [f"'{k}'" for k in stage_kinds.chat_kinds()]
    if len(chat) == 1:
        return f"the chat stage must be an {chat[0]} stage"
    return f"the chat stage must be a stage of kind {join_words(chat, 'or')}"


class OrchestratorResources(SpecModel):
    """Resources of one orchestrator replica; it never needs a GPU."""

    cpu: Quantity = Field("1", description="CPU per orchestrator replica, a Kubernetes quantity.")
    memory: Quantity = Field(
        "1Gi", description="Memory per orchestrator replica, a Kubernetes quantity."
    )


class FailoverOptions(SpecModel):
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


class OrchestratorAuth(SpecModel):
    """Who may call the API (docs/http-api.md, "API keys"; docs/security.md). Keys are on by
    default: without apiKeySecret the operator makes a Secret with one key for the pipeline."""

    api_key_secret: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="A Secret in the pipeline's namespace whose every key holds API keys (one "
        "a line, at least 16 characters each): the OpenAI and pipeline routes then need "
        "Authorization: Bearer KEY with one of them, and a changed Secret takes effect without "
        "a restart. Unset: the operator makes the Secret <pipeline>-api-keys-<uid> with one "
        "random key (status.apiKeySecret names it) and never changes it after.",
    )
    disabled: bool = Field(
        False,
        description="Serve the API without API keys: anyone who reaches the API port may call "
        "it. Only where something in front of it authenticates (a gateway, a mesh).",
    )

    @model_validator(mode="after")
    def _one_way(self) -> OrchestratorAuth:
        if self.disabled and self.api_key_secret is not None:
            raise path_errors([("disabled", "API keys cannot be disabled while apiKeySecret "
                                            f"({self.api_key_secret!r}) asks for them")])
        return self


def admin_port_beside(port: int) -> int:
    """adminPort's default for an API on `port`: the port after it (before it, at 65535)."""
    return port + 1 if port < 65535 else port - 1


class OrchestratorSpec(SpecModel):
    """The API front door: it routes every request through the stage graph."""

    replicas: int = Field(1, ge=0, le=16, description="Number of orchestrator replicas.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the API.")
    admin_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="HTTP port of the admin listener: control (sleep, wake, pause, resume), "
        "GET /v1/load and /metrics, apart from the public API (docs/security.md); default "
        "`port` + 1 (8001). The operator and its autoscaler call it with their own "
        "credential; the pipeline's Service and any gateway route expose only `port`.",
    )
    api: list[ApiSurface] = Field(
        default_factory=lambda: ["chat", "images", "speech", "generic"],
        min_length=1,
        description="API surface to serve: chat (/v1/chat/completions), images "
        "(/v1/images/generations), speech (/v1/audio/speech, where a stage's kind emits audio) "
        "and generic (/v1/pipelines/{name}/requests).",
        json_schema_extra=LIST_SET,
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
    auth: OrchestratorAuth = Field(
        default_factory=OrchestratorAuth, description="API keys for the orchestrator's API."
    )

    @field_validator("api")
    @classmethod
    def _unique_api(cls, value: list[str]) -> list[str]:
        """A repeated surface is almost certainly a typo for another one."""
        _reject_duplicates(value)
        return value

    @property
    def admin_listen_port(self) -> int:
        """adminPort, or its default: the port after the API's (before it, at 65535)."""
        return self.admin_port if self.admin_port is not None else admin_port_beside(self.port)

    @model_validator(mode="after")
    def _two_ports(self) -> OrchestratorSpec:
        if self.admin_port == self.port:
            raise path_errors([("adminPort", f"the admin listener needs a port of its own, "
                                             f"not the API's port {self.port}")])
        return self


def _reject_duplicates(values: list[str]) -> None:
    """Name the repeated entry by index, as the API server does for a set-type list."""
    seen: set[str] = set()
    errors = []
    for i, item in enumerate(values):
        if item in seen:
            errors.append((f"[{i}]", f"duplicate entry {item!r}"))
        seen.add(item)
    if errors:
        raise path_errors(errors)


class SecretKeyRef(SpecModel):
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


class ModelCache(SpecModel):
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
            raise path_errors(errors)
        return self


MODEL_CACHE_ONE_OF = "set exactly one of claimName (a shared PVC) and size (a per-pod volume)"
MODEL_CACHE_READ_ONLY = "readOnly applies to a claimName only"


class PipelineSpec(SpecModel):
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
            raise path_errors(errors)
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

    def needed_by(self, finals: Iterable[str]) -> list[str]:
        """finals and every stage they need, in topological order (the engine's plans and the
        HTTP API's speech and chat checks walk the graph the same way)."""
        needed: set[str] = set()
        stack = list(finals)
        while stack:
            name = stack.pop()
            if name not in needed:
                needed.add(name)
                stack.extend(self.stage(name).inputs)
        return [s for s in self.topo_order() if s in needed]

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


def _reference_errors(names: Iterable[str], path: str, own: str, index: Mapping[str, int],
                      own_message: str, duplicate: str) -> list[tuple[str, str]]:
    """A list of stage names that must name other, known stages, each once."""
    errors: list[tuple[str, str]] = []
    seen: set[str] = set()
    for j, name in enumerate(names):
        at = f"{path}[{j}]"
        if name == own:
            errors.append((at, f"stage {name!r} {own_message}"))
        elif name not in index:
            errors.append((at, f"unknown stage {name!r}"))
        elif name in seen:
            errors.append((at, f"{duplicate} {name!r}"))
        seen.add(name)
    return errors


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
        errors += _reference_errors(stage.inputs, f"stages[{i}].inputs", stage.name, index,
                                    "cannot consume its own output", "duplicate input")
        errors += _reference_errors(stage.placement.colocate_with,
                                    f"stages[{i}].placement.colocateWith", stage.name, index,
                                    "cannot colocate with itself", "duplicate entry")

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

