"""The stage kind table: what each `kind` of a stage means, in one place.

Why one table: the spec, the CRD generator, the webhook, the worker, the orchestrator's engine
and the HTTP API all need to know something about a kind (which executor runs it, whether it
takes a model, which engine options it reads, what it consumes and emits). Each reads it here,
so adding a kind is one executor module plus one `StageKind` row, and nothing else names the
list of kinds.

Importing this module is cheap and imports nothing of Omnistage's: the executor is named by an
import path and loaded only by the worker (`StageKind.executor_class`), so the spec, the CRD
generator and the webhook can read the table without torch.

Kinds from outside the package (a test's, a plugin's) are registered with `register`, or, so a
worker or `omnistage serve` process knows them too, named in the environment variable
OMNISTAGE_STAGE_KINDS as comma-separated `module:attribute` entries (the attribute is a
StageKind or a list of them); it is read on the first look-up of the table.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "ENV_VAR",
    "KindError",
    "Payload",
    "StageKind",
    "builtin_models",
    "chat_kinds",
    "get",
    "image_kinds",
    "kinds",
    "markdown_table",
    "names",
    "on_register",
    "register",
    "registered",
    "unregister",
]

#: Extra kinds for every process that inherits the environment: `module:attr[,module:attr]`.
ENV_VAR = "OMNISTAGE_STAGE_KINDS"
_NAME_PATTERN = r"^[a-z][a-z0-9-]{0,31}$"
_ENTRY_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class KindError(ValueError):
    """A kind that cannot be registered or looked up; the message names the value."""


class Payload(StrEnum):
    """What flows between stages. The orchestrator routes by these, never by kind names.

    The tensors that carry each one (the names executors and the engine agree on):

    - TEXT: param `prompt` in (the request's, or the first upstream's text); field `text` out.
    - TOKENS: fields `token_ids`, `prompt_tokens`, `completion_tokens`.
    - HIDDEN_STATES: tensor `hidden_states` float [tokens, hidden] out; a consumer gets the
      first upstream's as `encoder_hidden_states`. A thinker adds `token_embeds` (its input
      embeddings of the same tokens, float [tokens, hidden]) and `token_ids` (int64 [tokens]:
      prompt then generated ids), which its talker reads by these names. Streamed (thinker ->
      talker), each chunk carries `hidden_states`, `token_embeds` and `token_ids` of its rows,
      the first one also `prompt_length`.
    - IMAGE: out, tensor `image` (diffusion). In: request tensors `input_image.<i>` (uint8
      [H, W, 3] RGB), i = 0, 1, ... in the order of the message's content parts.
    - AUDIO: out, tensor `audio` float32 mono [samples] in [-1, 1] and field `sample_rate`
      (streamed: each chunk a tensor `audio`, one decode window's samples).
      In: request tensors `input_audio.<i>` (float32 mono [samples] in [-1, 1]) at
      omnistage.media.INPUT_AUDIO_SAMPLE_RATE Hz.
    - CODEC_CODES: tensor `codec_codes` int64 [frames, quantizers] (talker -> vocoder;
      streamed: each chunk a tensor `codec_codes` of the frames made since the last).
    """

    TEXT = "text"  # a prompt in, generated text out (streamed as text deltas)
    TOKENS = "tokens"  # token ids and usage counts (what the chat API reports)
    HIDDEN_STATES = "hidden_states"  # hidden states, a conditioning tensor
    LATENTS = "latents"  # latent tensors (no built-in kind emits them yet)
    IMAGE = "image"  # emitted: a generated image; consumed: the request's input images
    AUDIO = "audio"  # emitted: PCM audio (tensor "audio", field sample_rate); consumed: input audio
    CODEC_CODES = "codec_codes"  # a speech codec's codes, frame by frame (talker -> vocoder)


@dataclass(frozen=True)
class StageKind:
    """One row of the table.

    engine_options are EngineOptions field names (omnistage.spec): their bounds live there,
    once; the ones with a PerRequest mark may also be overridden by a request to this kind.
    """

    name: str
    #: "module:Class" of the Executor subclass, imported only when a worker builds it.
    executor: str
    #: A few words for the docs and the CRD's description of `kind`.
    summary: str
    needs_model: bool
    engine_options: tuple[str, ...] = ()
    #: Built-in tiny models of this kind (omnistage.models knows how to build each).
    builtin_models: tuple[str, ...] = ()
    consumes: frozenset[Payload] = frozenset()
    emits: frozenset[Payload] = frozenset()
    #: Streaming between stages (executors.base.StageIO): the executor hands its output on in
    #: chunks as it makes them (emit_chunk), and/or starts on the first chunk of its input
    #: (inputs()). The engine streams an edge only when the upstream's row says
    #: chunked_output and the downstream's says chunked_input.
    chunked_output: bool = False
    chunked_input: bool = False
    #: After failover, a new replica can continue this kind's output from what the client was
    #: already shown (request params `resume_token_ids` and `resume_text`), so a stream that
    #: reached the client resumes instead of failing. Kinds without it fail such a request.
    resumable: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(_NAME_PATTERN, self.name):
            raise KindError(f"stage kind name {self.name!r} must be 1-32 lowercase letters, "
                            "digits or '-', starting with a letter")
        if not re.fullmatch(_ENTRY_PATTERN, self.executor):
            raise KindError(f"stage kind {self.name!r}: executor {self.executor!r} must be "
                            "'module:Class'")
        if self.builtin_models and not self.needs_model:
            raise KindError(f"stage kind {self.name!r} takes no model but lists built-in "
                            f"models {list(self.builtin_models)}")
        for what, payloads in (("consumes", self.consumes), ("emits", self.emits)):
            bad = [p for p in payloads if not isinstance(p, Payload)]
            if bad:
                raise KindError(f"stage kind {self.name!r}: {what} must hold Payload values, "
                                f"got {bad!r} (known: {', '.join(p.value for p in Payload)})")

    def executor_class(self) -> type[Any]:
        """Import the executor module (the executors import torch only in their `load`)."""
        module, _, attr = self.executor.partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]

    @property
    def serves_chat(self) -> bool:
        """Text in, text and token counts out: what /v1/chat/completions needs of its stage."""
        return Payload.TEXT in self.consumes and {Payload.TEXT, Payload.TOKENS} <= self.emits

    @property
    def serves_images(self) -> bool:
        return Payload.IMAGE in self.emits


_P = Payload
_BUILTIN: tuple[StageKind, ...] = (
    StageKind(
        name="ar",
        executor="omnistage.executors.ar:ARExecutor",
        summary="autoregressive LLM",
        needs_model=True,
        engine_options=("dtype", "max_tokens", "temperature", "return_hidden_states", "seed",
                        "max_batch_size", "max_batch_tokens", "prefix_cache_mib"),
        builtin_models=("tiny-llama",),
        consumes=frozenset({_P.TEXT}),
        emits=frozenset({_P.TEXT, _P.TOKENS, _P.HIDDEN_STATES}),
        resumable=True,
    ),
    StageKind(
        name="diffusion",
        executor="omnistage.executors.diffusion:DiffusionExecutor",
        summary="image generation",
        needs_model=True,
        engine_options=("dtype", "height", "width", "num_inference_steps", "guidance_scale",
                        "seed", "max_batch_size"),
        builtin_models=("tiny-unet",),
        consumes=frozenset({_P.HIDDEN_STATES}),
        emits=frozenset({_P.IMAGE}),
    ),
    StageKind(
        name="echo",
        executor="omnistage.executors.echo:EchoExecutor",
        summary="no model; for tests and benchmarks",
        needs_model=False,
        engine_options=("echo_delay_ms", "echo_chunk_chars", "echo_chunk_delay_ms"),
        consumes=frozenset({_P.TEXT}),
        emits=frozenset({_P.TEXT}),
        chunked_output=True,
        chunked_input=True,
    ),
    StageKind(
        name="thinker",
        executor="omnistage.executors.ar:ThinkerExecutor",
        summary="multimodal LLM (Qwen3-Omni thinker): text, image and audio in",
        needs_model=True,
        engine_options=("dtype", "max_tokens", "temperature", "return_hidden_states", "seed",
                        "max_batch_size", "max_batch_tokens", "prefix_cache_mib"),
        builtin_models=("tiny-omni-thinker",),
        consumes=frozenset({_P.TEXT, _P.IMAGE, _P.AUDIO}),
        emits=frozenset({_P.TEXT, _P.TOKENS, _P.HIDDEN_STATES}),
        chunked_output=True,
        resumable=True,
    ),
    StageKind(
        name="talker",
        executor="omnistage.executors.talker:TalkerExecutor",
        summary="speech codec LM (Qwen3-Omni talker + code predictor)",
        needs_model=True,
        engine_options=("dtype", "voices", "voice", "max_frames", "chunk_frames", "seed",
                        "max_batch_size"),
        builtin_models=("tiny-omni-talker",),
        consumes=frozenset({_P.TEXT, _P.HIDDEN_STATES}),
        emits=frozenset({_P.CODEC_CODES}),
        chunked_output=True,
        chunked_input=True,
    ),
    StageKind(
        name="vocoder",
        executor="omnistage.executors.vocoder:VocoderExecutor",
        summary="codec codes to waveform (Qwen3-Omni Code2Wav)",
        needs_model=True,
        engine_options=("dtype", "chunk_frames", "max_batch_size"),
        builtin_models=("tiny-omni-vocoder",),
        consumes=frozenset({_P.CODEC_CODES}),
        emits=frozenset({_P.AUDIO}),
        chunked_output=True,
        chunked_input=True,
    ),
)

_table: dict[str, StageKind] = {k.name: k for k in _BUILTIN}
_checks: list[Callable[[StageKind], None]] = []
_env_loaded = False


def on_register(check: Callable[[StageKind], None]) -> None:
    """Run check on every kind in the table and on each one registered later; it raises
    KindError for a bad row. The spec adds one that knows EngineOptions (this module cannot
    import the spec: the spec imports it)."""
    for kind in _table.values():
        check(kind)
    _checks.append(check)


def register(kind: StageKind) -> StageKind:
    """Add a kind; a name already in the table is an error (kinds are not overridden)."""
    if not isinstance(kind, StageKind):
        raise KindError(f"expected a StageKind, got {type(kind).__name__}")
    if kind.name in _table:
        raise KindError(f"stage kind {kind.name!r} is already registered")
    taken = builtin_models()
    clash = [m for m in kind.builtin_models if m in taken]
    if clash:
        raise KindError(f"stage kind {kind.name!r}: built-in model(s) {clash} already belong "
                        f"to another kind")
    for check in _checks:
        check(kind)
    _table[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a registered kind (tests); the built-in kinds stay."""
    if name in {k.name for k in _BUILTIN}:
        raise KindError(f"stage kind {name!r} is built in and cannot be removed")
    _table.pop(name, None)


@contextmanager
def registered(kind: StageKind) -> Iterator[StageKind]:
    """The kind is in the table inside the block only."""
    register(kind)
    try:
        yield kind
    finally:
        unregister(kind.name)


def _load_env() -> None:
    """Register the kinds OMNISTAGE_STAGE_KINDS names (once per process)."""
    global _env_loaded
    if _env_loaded:
        return
    _env_loaded = True
    value = os.environ.get(ENV_VAR, "").strip()
    for entry in filter(None, (e.strip() for e in value.split(","))):
        if not re.fullmatch(_ENTRY_PATTERN, entry):
            raise KindError(f"{ENV_VAR}: {entry!r} is not module:attribute "
                            "(for example mypkg.kinds:REVERSE)")
        module, _, attr = entry.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise KindError(f"{ENV_VAR}: cannot import {module!r} ({exc})") from None
        except AttributeError:
            raise KindError(f"{ENV_VAR}: module {module!r} has no attribute {attr!r}") from None
        rows = [found] if isinstance(found, StageKind) else found
        if not isinstance(rows, Iterable) or not all(isinstance(k, StageKind) for k in rows):
            raise KindError(f"{ENV_VAR}: {entry} is a {type(found).__name__}, not a StageKind "
                            "or a list of them")
        for kind in rows:
            if _table.get(kind.name) is not kind:  # the module may have registered it itself
                register(kind)


def kinds() -> tuple[StageKind, ...]:
    """Every kind, built-ins first, then in registration order."""
    _load_env()
    return tuple(_table.values())


def names() -> tuple[str, ...]:
    return tuple(k.name for k in kinds())


def get(name: str) -> StageKind:
    """The kind called name; KindError lists the known ones."""
    _load_env()
    kind = _table.get(name)
    if kind is None:
        raise KindError(f"unknown stage kind {name!r}; expected one of: {', '.join(names())}")
    return kind


def builtin_models() -> dict[str, str]:
    """Built-in model name -> the kind it serves."""
    return {m: k.name for k in kinds() for m in k.builtin_models}


def chat_kinds() -> tuple[str, ...]:
    """Kinds whose stage can answer /v1/chat/completions."""
    return tuple(k.name for k in kinds() if k.serves_chat)


def image_kinds() -> tuple[str, ...]:
    """Kinds whose stage output answers /v1/images/generations."""
    return tuple(k.name for k in kinds() if k.serves_images)


def markdown_table() -> str:
    """The table as docs/pipeline-spec.md shows it (a unit test keeps the two equal)."""
    from pydantic.alias_generators import to_camel

    def cell(items: Iterable[str]) -> str:
        return ", ".join(f"`{i}`" for i in items) or "—"

    lines = ["| kind | what | needs a model | built-in models | engine options | consumes | "
             "emits | serves |", "|---|---|---|---|---|---|---|---|"]
    for k in kinds():
        serves = [s for s, ok in (("chat", k.serves_chat), ("images", k.serves_images)) if ok]
        order = list(Payload)
        lines.append(
            f"| `{k.name}` | {k.summary or '—'} | {'yes' if k.needs_model else 'no'} | "
            f"{cell(k.builtin_models)} | {cell(to_camel(o) for o in k.engine_options)} | "
            f"{cell(sorted(k.consumes, key=order.index))} | "
            f"{cell(sorted(k.emits, key=order.index))} | {', '.join(serves) or '—'} |")
    return "\n".join(lines)
