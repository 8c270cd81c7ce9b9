"""Request parameters: the engine knobs a request may override, typed from EngineOptions.

Why this module: EngineOptions (omnistage.spec) declares every engine knob once, with its bounds.
The HTTP API types its bodies with `engine_type`, and each executor validates a request's params
with a model from `stage_params`, so the spec, the API and the workers cannot disagree about a
range. `describe` gives a pydantic error the wording both sides use (a path, a sentence that
names it, an OpenAI-style code), so a worker's refusal and the API's read the same: the
"request" wording of the one pydantic-error formatter, omnistage.spec.errors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from types import UnionType
from typing import Annotated, Any, ClassVar, TypeVar, get_args

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic_core import ErrorDetails

from omnistage.kinds import get as get_kind
from omnistage.models import BUILTIN_CONTEXT
from omnistage.spec import EngineOptions, PerRequest, Stage
from omnistage.spec.errors import Problem, describe_errors, error_path, json_type

__all__ = [
    "WORKER_SEED",
    "Problem",
    "StageParams",
    "describe",
    "engine_bounds",
    "engine_type",
    "error_path",
    "json_type",
    "max_tokens_bound",
    "per_request",
    "seed_defaults",
    "stage_params",
]


def _mark(name: str) -> PerRequest | None:
    return next((m for m in EngineOptions.model_fields[name].metadata
                 if isinstance(m, PerRequest)), None)


def engine_type(name: str) -> Any:
    """EngineOptions.<name>'s type with its bounds, for a request field that sets that knob."""
    info = EngineOptions.model_fields[name]
    bounds = [m for m in info.metadata if not isinstance(m, PerRequest)]
    # A knob the spec may leave unset (seed) is still a plain value in a request: the request
    # field adds its own `| None`.
    args = [a for a in get_args(info.annotation) if a is not type(None)]
    kind = args[0] if isinstance(info.annotation, UnionType) and len(args) == 1 \
        else info.annotation
    return Annotated[kind, *bounds] if bounds else kind


def engine_bounds(name: str) -> tuple[Any, Any, Any]:
    """(min, max, multiple) of an EngineOptions knob (None: unbounded; multiple 1: any)."""
    lo = hi = None
    multiple = 1
    for m in EngineOptions.model_fields[name].metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.MultipleOf):
            multiple = m.multiple_of
    return lo, hi, multiple


def max_tokens_bound(stage: Stage) -> int:
    """The most max_tokens a request to this ar stage can be served with: the ar worker refuses
    prompt + max_tokens beyond its model's context and beyond engine.maxBatchTokens, and every
    prompt is at least one token (an empty one is the BOS token). The model's context counts
    when it is known without the model's files (a built-in's); otherwise only the worker knows
    it. The HTTP API's document states this bound and its validator applies it."""
    most: int = engine_bounds("max_tokens")[1]
    context = BUILTIN_CONTEXT.get(stage.model or "")
    for limit in (context, stage.engine.max_batch_tokens):
        if limit is not None:
            most = min(most, limit - 1)
    return max(most, 0)


def seed_defaults(stages: Iterable[Stage]) -> dict[str, int | None]:
    """Stage name -> its spec's seed (None: unset), for each stage whose kind takes a seed:
    what the orchestrator fixes a request's seeds from (PipelineRequest.seeded)."""
    return {s.name: s.engine.seed for s in stages if _takes_seed(s.kind)}


@functools.cache
def _takes_seed(kind: str) -> bool:
    return any(field == "seed" for _, field in _per_request(kind))


def per_request(kind: str) -> dict[str, str]:
    """Request key -> EngineOptions field, for the knobs a request to this kind may override:
    the kind's engine options (omnistage.kinds) that carry a PerRequest mark. A copy of the
    kind's cached table: the orchestrator asks on every request (seed_defaults)."""
    return dict(_per_request(kind))


@functools.cache
def _per_request(kind: str) -> tuple[tuple[str, str], ...]:
    options = get_kind(kind).engine_options
    return tuple((mark.key or name, name) for name in EngineOptions.model_fields
                 if (mark := _mark(name)) is not None and name in options)


class StageParams(BaseModel):
    """Base of a kind's request params. Strict, because the values arrive as msgpack/JSON and a
    string "5" or a boolean for a number is a client bug worth naming. Unknown keys are ignored:
    `*` params reach every stage, and each kind takes only its own."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    #: request key -> EngineOptions field (set by stage_params)
    knobs: ClassVar[dict[str, str]] = {}

    def options(self, engine: EngineOptions) -> EngineOptions:
        """The stage's options with this request's overrides. They were validated against the
        same bounds, so the copy needs no second check. The orchestrator gives every request
        a seed (requests.PipelineRequest.seeded); a worker asked directly with none, and no
        seed in its spec, uses WORKER_SEED, so its executors always have one."""
        given = {field: getattr(self, key) for key, field in self.knobs.items()
                 if getattr(self, key) is not None}
        if engine.seed is None and "seed" not in given:
            given["seed"] = WORKER_SEED
        return engine.model_copy(update=given) if given else engine


B = TypeVar("B", bound=StageParams)

#: The seed of a request that reaches a worker without one (not through an orchestrator).
WORKER_SEED = 0


def stage_params(kind: str, base: type[B]) -> type[B]:
    """`base` (the kind's own request fields) plus every knob it may override, each optional
    (absent or null: the stage's default) with EngineOptions' bounds and description."""
    knobs = per_request(kind)
    fields: dict[str, Any] = {}
    for key, name in knobs.items():
        info = EngineOptions.model_fields[name]
        fields[key] = (engine_type(name) | None, Field(None, description=info.description))
    model = create_model(f"{kind.capitalize()}Params", __base__=base, **fields)
    model.knobs = knobs
    return model


# --------------------------------------------------------------------------- error wording


def describe(err: ErrorDetails, prefix: str = "") -> Problem:
    """Readable wording of one pydantic error, naming the field by its request path."""
    return describe_errors([err], wording="request", prefix=prefix)[0]
