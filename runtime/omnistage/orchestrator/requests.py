"""What goes into the orchestrator and what comes out: requests, stream events, outcomes.

The HTTP layer only translates between these and HTTP; it never routes. Every request ends in
exactly one Outcome, whose `status` says which of the four terminal kinds it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

#: The largest seed (EngineOptions.seed's bound: the largest integer JSON keeps exact).
SEED_MAX = 2**53 - 1

# Terminal kinds of the orchestration contract.
OK = "ok"  # success
ABORT = "abort"  # aborted by the client (AR prefix kept, diffusion sample dropped)
REQUEST_ERROR = "request_error"  # request-scoped: 4xx (bad input, overload, deadline)
FATAL = "fatal"  # stage failure: 5xx (replica lost, no live replica, internal error)

# Error code -> HTTP status. The HTTP API uses exactly this table.
HTTP_STATUS: dict[str, int] = {
    "bad_request": 400,
    "not_found": 404,
    "overloaded": 429,
    "draining": 503,
    "no_replica": 503,
    "not_ready": 503,
    "deadline": 504,
    "replica_lost": 502,
    "stage_failed": 502,
    "internal": 500,
    "shutting_down": 503,
    "drain_timeout": 503,  # a retiring replica cut it (its drainTimeoutSeconds passed)
    "revision_mismatch": 502,  # a worker refused a cross-revision hop (docs: "Revisions")
}

# Codes that mean a stage failed rather than something about this request.
FATAL_CODES = frozenset(
    {"no_replica", "replica_lost", "stage_failed", "internal", "draining", "shutting_down",
     "not_ready", "drain_timeout", "revision_mismatch"}
)


@dataclass
class RequestError:
    code: str
    message: str
    stage: str | None = None
    retry_after: float | None = None

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    @property
    def kind(self) -> str:
        """Deadline (504) is request-scoped like 4xx; stage and replica failures are fatal."""
        return FATAL if self.code in FATAL_CODES else REQUEST_ERROR


@dataclass
class PipelineRequest:
    """One client request. Stage parameters are per stage name, with "*" applying to all."""

    prompt: str = ""
    negative_prompt: str | None = None
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    session: str | None = None
    timeout_s: float | None = None
    # Stages whose outputs are the result; None = the spec's finalOutput stages. The request
    # runs only the stages these depend on (a chat request on a text-to-image pipeline runs
    # just the AR stage).
    finals: list[str] | None = None
    request_id: str | None = None
    # Input media (numpy arrays, torch tensors or WireTensors): `input_image.<i>` and
    # `input_audio.<i>` (omnistage.kinds.Payload), each kind numbered from 0, sent to the
    # entry stages that consume IMAGE or AUDIO.
    tensors: dict[str, Any] = field(default_factory=dict)
    # Where each input tensor came from in the client's body (input_audio.0 ->
    # messages[0].content[1].input_audio), so a stage's refusal that names the tensor is
    # answered in the client's terms (errors.error_from_request_error).
    inputs: dict[str, str] = field(default_factory=dict)

    def stage_params(self, stage: str) -> dict[str, Any]:
        return {**self.params.get("*", {}), **self.params.get(stage, {})}

    def seeded(self, stages: Mapping[str, int | None],
               draw: Callable[[int], int]) -> PipelineRequest:
        """This request with a seed fixed in the params of each stage in `stages` (the stages
        it runs that take one, each with its spec's seed or None): the client's when it gave
        one, else the spec's (an operator who pins a seed wants reproducible answers), else
        one value drawn for the whole request, draw(most) in [0, most], so seed + i of every
        sample stays in range. Fixed once, at admission, so every retry of a task samples
        what the first attempt did. Unchanged (the same object) when nothing is missing."""
        missing = {s: spec for s, spec in stages.items()
                   if self.stage_params(s).get("seed") is None}
        if not missing:
            return self
        drawn = draw(SEED_MAX - (max(self.n, 1) - 1)) if None in missing.values() else None
        params = {s: dict(values) for s, values in self.params.items()}
        for s, spec in missing.items():
            params.setdefault(s, {})["seed"] = drawn if spec is None else spec
        return replace(self, params=params)


@dataclass
class Delta:
    """A streamed piece of output from a final AR stage, in order, as produced."""

    child: int
    stage: str
    text: str
    token_ids: list[int]


def _no_credit() -> None:
    return None


@dataclass
class AudioChunk:
    """A streamed piece of a final speech stage's audio, in order, as the stage made it (only
    when the request streams). The stage makes at most its chunk window of them ahead of the
    consumer: call `credit()` once this one is delivered (written to the client), or the
    stage waits; the request's outcome then only closes the audio (it still holds it whole)."""

    child: int
    stage: str
    seq: int
    audio: Any  # float32 mono samples (a protocol.WireTensor in memory of its own)
    sample_rate: int | None
    credit: Callable[[], None] = field(default=_no_credit, repr=False)


@dataclass
class StageOutput:
    """A final stage's terminal output for one child (sample)."""

    stage: str
    fields: dict[str, Any]
    tensors: dict[str, Any]  # name -> protocol.WireTensor
    replica: str = ""


@dataclass
class ChildOutcome:
    index: int
    status: Literal["ok", "abort", "request_error", "fatal"]
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    error: RequestError | None = None
    # Token counts of every stage it ran, final or not (stage -> prompt_tokens and
    # completion_tokens as the stage reported them): /v1/audio/speech reports the usage of
    # stages whose outputs are not in `outputs` (the thinker's prompt, the talker's frames).
    usage: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class Outcome:
    """The single terminal result of a request (all its children)."""

    request_id: str
    status: Literal["ok", "abort", "request_error", "fatal"]
    children: list[ChildOutcome] = field(default_factory=list)
    error: RequestError | None = None

    @property
    def http_status(self) -> int:
        return self.error.http_status if self.error else 200


Event = Delta | AudioChunk | Outcome
