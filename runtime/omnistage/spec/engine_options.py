"""EngineOptions: the one bounds table of every engine knob.

The spec, the HTTP API and the executors all read these fields (omnistage.params derives the
request models), so no range is written twice. Which kinds read a knob is the kind table's
business (omnistage.kinds); `engine_kinds` and `engine_for_kind` answer from it.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

import omnistage.kinds as stage_kinds
from omnistage.spec.fields import SpecModel
from omnistage.spec.patterns import VOICE_PATTERN


@dataclasses.dataclass(frozen=True)
class PerRequest:
    """Marks an EngineOptions field that a request may override, in the stage kinds whose row
    of the kind table (omnistage.kinds) lists it among their engine options.

    `key` is the request parameter's name when it differs from the field's. Executors and the
    HTTP API derive their request models from these marks (omnistage.params), so a knob's bounds
    are written once, here.
    """

    key: str | None = None


class EngineOptions(SpecModel):
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
    # Unset by default: a pinned seed makes every request sample alike, which is what an
    # operator who sets one wants (reproducible runs) and what nobody else expects.
    seed: Annotated[int | None, PerRequest()] = Field(
        None,
        ge=0,
        le=2**53 - 1,
        description="Random seed; sample i of a request with n > 1 uses seed + i. Set here, it "
        "pins every request that gives none (reproducible). Unset: a request without a seed "
        "gets one drawn at random when the orchestrator admits it (kept for its retries).",
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
        "frames a second of speech); the talker also stops at its codec's end code, never "
        "before the first frame.",
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
        description="ar, thinker, diffusion, talker, vocoder: most requests that share one "
        "forward step (ar, thinker, talker: continuous batching; diffusion: requests of the "
        "same size and guidance; vocoder: windows of the same length). 1 runs requests one at "
        "a time.",
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=2**24,
        description="ar, thinker: most tokens (prompt + max_tokens of each sequence) a running "
        "batch may hold; a request above it is refused. Unset: only maxBatchSize limits the batch.",
    )
    prefix_cache_mib: int = Field(
        256,
        ge=0,
        le=1_048_576,
        description="ar, thinker: memory (MiB, on the stage's device) for the keys and values of "
        "prompt prefixes kept for reuse: a request that begins with a kept prefix (a system "
        "prompt, a conversation's earlier turns) computes only the rest of its prompt. Reused "
        "in blocks of 16 tokens; a thinker's prompt up to its first image or audio; the least "
        "recently used blocks go first. 0 turns it off.",
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


