"""Request parameters: the engine knobs a request may override, typed from EngineOptions.

Why this module: EngineOptions (omnistage.spec) declares every engine knob once, with its bounds.
The HTTP API types its bodies with `engine_type`, and each executor validates a request's params
with a model from `stage_params`, so the spec, the API and the workers cannot disagree about a
range. `describe` turns a pydantic error into the wording both sides use (a path, a sentence that
names it, an OpenAI-style code), so a worker's refusal and the API's read the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic_core import ErrorDetails

from omnistage.kinds import get as get_kind
from omnistage.models import BUILTIN_CONTEXT
from omnistage.spec import EngineOptions, PerRequest, Stage

__all__ = [
    "Problem",
    "StageParams",
    "describe",
    "engine_bounds",
    "engine_type",
    "error_path",
    "json_type",
    "max_tokens_bound",
    "per_request",
    "stage_params",
]


def _mark(name: str) -> PerRequest | None:
    return next((m for m in EngineOptions.model_fields[name].metadata
                 if isinstance(m, PerRequest)), None)


def engine_type(name: str) -> Any:
    """EngineOptions.<name>'s type with its bounds, for a request field that sets that knob."""
    info = EngineOptions.model_fields[name]
    bounds = [m for m in info.metadata if not isinstance(m, PerRequest)]
    return Annotated[info.annotation, *bounds] if bounds else info.annotation


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


def per_request(kind: str) -> dict[str, str]:
    """Request key -> EngineOptions field, for the knobs a request to this kind may override:
    the kind's engine options (omnistage.kinds) that carry a PerRequest mark."""
    options = get_kind(kind).engine_options
    out = {}
    for name in EngineOptions.model_fields:
        mark = _mark(name)
        if mark is not None and name in options:
            out[mark.key or name] = name
    return out


class StageParams(BaseModel):
    """Base of a kind's request params. Strict, because the values arrive as msgpack/JSON and a
    string "5" or a boolean for a number is a client bug worth naming. Unknown keys are ignored:
    `*` params reach every stage, and each kind takes only its own."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    #: request key -> EngineOptions field (set by stage_params)
    knobs: ClassVar[dict[str, str]] = {}

    def options(self, engine: EngineOptions) -> EngineOptions:
        """The stage's options with this request's overrides. They were validated against the
        same bounds, so the copy needs no second check."""
        given = {field: getattr(self, key) for key, field in self.knobs.items()
                 if getattr(self, key) is not None}
        return engine.model_copy(update=given) if given else engine


B = TypeVar("B", bound=StageParams)


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


@dataclass(frozen=True)
class Problem:
    """One validation error: the field's path, a sentence that starts with it, and a code."""

    path: str
    message: str
    code: str  # invalid_type | invalid_value | missing_required_parameter | unsupported_parameter


# Custom pydantic error types whose code is already the API's.
_OWN_CODES = frozenset({"invalid_type", "invalid_value", "unsupported_parameter",
                        "missing_required_parameter"})
_OBJECT_ERRORS = frozenset({"model_type", "model_attributes_type", "dict_type"})


def json_type(value: Any) -> str:
    """A value's JSON type name, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    return "object"


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return "{...}"
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def error_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """('messages', 0, '<message>', 'content') -> messages[0].content. Union tags are spelt
    <tag> in the models (see orchestrator/schemas.py) so they can be dropped here, and a bad
    dict key is named by the key itself."""
    out = prefix
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item != "[key]" and not (item.startswith("<") and item.endswith(">")):
            out += f".{item}" if out else item
    return out


def describe(err: ErrorDetails, prefix: str = "") -> Problem:
    """Readable wording of one pydantic error, naming the field by its request path. A custom
    error may carry `at` in its context: where inside the value the problem is."""
    ctx = err.get("ctx") or {}
    path = error_path(tuple(err["loc"]), prefix) + str(ctx.get("at", ""))
    kind, value, msg = err["type"], err.get("input"), err["msg"]
    name = path or "the request body"
    is_type = kind.endswith("_type") or kind in _OBJECT_ERRORS
    if kind == "missing" or (value is None and is_type):
        return Problem(path, f"{name} is required", "missing_required_parameter")
    if kind == "string_unicode":  # pydantic's own check, on the name of an extra field
        return Problem(path, f"{path or 'a field name'} is not valid Unicode text (lone "
                       "surrogate)", "invalid_value")
    if kind == "extra_forbidden":
        return Problem(path, f"unknown field {_short(err['loc'][-1])}", "unsupported_parameter")
    got = f", got {json_type(value)}" if is_type or kind == "invalid_type" else \
        f", got {_short(value)}"
    if kind in _OWN_CODES:
        return Problem(path, f"{name} {msg}{got if kind == 'invalid_type' else ''}", kind)
    if kind in _OBJECT_ERRORS:
        msg = "must be an object"
    elif kind == "list_type":
        msg = "must be an array"
    for lead in ("Input should", "List should", "String should", "Value should"):
        if msg.startswith(lead):
            msg = "must" + msg[len(lead):]
    msg = msg.replace(" after validation", "").split(", not ")[0]
    return Problem(path, f"{name} {msg}{got}", "invalid_type" if is_type else "invalid_value")
