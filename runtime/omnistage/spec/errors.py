"""Pydantic errors in words: the one formatter of the spec, the request parameters and the
worker's stage.

Each error becomes a Problem: the field's path, a sentence, an OpenAI-style code. The path and
the spec's own error types (several errors in one, a message shown as-is) are read the same way
for every caller; the sentence follows the caller's audience (`wording`):

- "spec": a manifest's errors, k8s style (`spec.stages[1].replicas`), quoting the bad value and
  suggesting the key a typo meant; `omnistage validate`, `serve` and the webhook print these.
- "request": an HTTP body or a request's params (`params.delay_ms must be ..., got boolean`), the
  wording the HTTP API and a worker's refusal share.
- "pydantic": pydantic's own sentence at the path, for `omnistage stage --stage-json`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails, PydanticCustomError

from omnistage.spec.patterns import PATTERN_HELP

Wording = Literal["spec", "request", "pydantic"]


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


def path_errors(errors: list[tuple[str, str]], *, relative: bool = True) -> PydanticCustomError:
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


def field_error(message: str) -> PydanticCustomError:
    """A validation error whose message is shown as-is (no 'Value error,' prefix)."""
    return PydanticCustomError("spec_field", "{message}", {"message": message})


@dataclasses.dataclass(frozen=True)
class Problem:
    """One validation error: the field's path, a sentence about it, and a code."""

    path: str
    message: str
    code: str  # invalid_type | invalid_value | missing_required_parameter | unsupported_parameter


def describe_errors(
    errors: Iterable[ErrorDetails],
    *,
    wording: Wording,
    root: type[BaseModel] | None = None,
    prefix: str = "",
) -> list[Problem]:
    """Every pydantic error as a Problem, in order; a spec_errors error becomes one per path.

    root is the validated model (paths follow its fields: a map key is `.key`, never `[1]`);
    prefix goes in front of every path. A custom error may carry `at` in its context: where
    inside the value the problem is.
    """
    out: list[Problem] = []
    for err in errors:
        kind, ctx = err["type"], err.get("ctx") or {}
        path = error_path(tuple(err["loc"]), prefix, root=root) + str(ctx.get("at", ""))
        if kind == "spec_errors":
            base = path if ctx.get("relative", True) else ""
            out += [Problem(_join(base, rel), msg, "invalid_value") for rel, msg in ctx["errors"]]
            continue
        code = _code(kind, err.get("input"))
        if kind == "spec_field":
            message = ctx["message"]
        elif wording == "request":
            message = _request_message(err, path)
        elif wording == "spec":
            message = _spec_message(err, root)
        else:
            message = err["msg"]
        out.append(Problem(path or ("" if wording == "request" else "(root)"), message, code))
    return out


# --------------------------------------------------------------------------- paths


def error_path(
    loc: tuple[int | str, ...], prefix: str = "", *, root: type[BaseModel] | None = None
) -> str:
    """('messages', 0, 'content') -> messages[0].content.

    With root, the walk follows its fields, so a map's key is named as one (`labels.1`, where
    YAML allows an integer key) and pydantic's `[key]` stays to say that the key itself is bad.
    Without it, union tags (spelt <tag> in the request models, see orchestrator/schemas.py) and
    `[key]` are dropped: a bad dict key is named by the key itself.
    """
    out = prefix
    current: Any = root
    container: str | None = None
    for item in loc:
        if container == "dict":  # a map key: metadata.labels.team, nodeSelector.gpu
            out += f".{item}"
            container = None
            continue
        if container == "list" or isinstance(item, int):
            out += f"[{item}]"
            container = None
            continue
        key = str(item)
        if root is None and (key == "[key]" or (key.startswith("<") and key.endswith(">"))):
            continue
        is_model = isinstance(current, type) and issubclass(current, BaseModel)
        field = _field_of(current, key) if is_model else None
        out += f".{key}" if out else key
        if field is None:
            current = Any
        else:
            current, container = _unwrap(field[1])
    return out


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


def _model_at(loc: tuple[Any, ...], root: type[BaseModel] | None) -> type[BaseModel] | None:
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


def _join(base: str, rel: str) -> str:
    if not base:
        return rel
    return f"{base}{rel}" if rel.startswith("[") else f"{base}.{rel}"


# --------------------------------------------------------------------------- codes and values

# Custom pydantic error types whose code is already the API's.
_OWN_CODES = frozenset({"invalid_type", "invalid_value", "unsupported_parameter",
                        "missing_required_parameter"})
_OBJECT_ERRORS = frozenset({"model_type", "model_attributes_type", "dict_type"})


def _is_type(kind: str) -> bool:
    return kind.endswith("_type") or kind in _OBJECT_ERRORS


def _code(kind: str, value: Any) -> str:
    """The OpenAI-style code of an error (the HTTP API answers with it)."""
    if kind == "missing" or (value is None and _is_type(kind)):
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unsupported_parameter"
    if kind in _OWN_CODES:
        return kind
    return "invalid_type" if _is_type(kind) else "invalid_value"


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


def short_repr(value: Any) -> str:
    """A value as Python writes it, cut to 60 characters (the spec's messages quote YAML)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _short_json(value: Any) -> str:
    """A value as JSON writes it, cut to 40 characters (a request's messages quote JSON)."""
    if isinstance(value, dict):
        return "{...}"
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- the spec's words

_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
}


def _spec_message(err: ErrorDetails, root: type[BaseModel] | None) -> str:
    """A manifest's error, quoting the bad value; the path is said apart."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        key = str(err["loc"][-1])
        return _unknown_field(key, _model_at(tuple(err["loc"][:-1]), root))
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        return f"invalid value {short_repr(value)} (expected {ctx.get('expected')})"
    if kind == "string_pattern_mismatch":
        # Lowercase only the first letter: the pattern quoted in the message keeps its case.
        fallback = err["msg"][:1].lower() + err["msg"][1:]
        return f"{PATTERN_HELP.get(ctx.get('pattern', ''), fallback)} (got {short_repr(value)})"
    if kind in _TYPE_NAMES:
        # Strict parsing, as the API server types JSON: "3" is not 3 and "true" is not true.
        return f"must be {_TYPE_NAMES[kind]} (got {type(value).__name__} {short_repr(value)})"
    message = err["msg"]
    if kind in ("too_long", "too_short"):
        return message  # the message already counts the items
    if kind not in ("model_type", "model_attributes_type", "dict_type", "list_type"):
        return message + f" (got {short_repr(value)})"
    return message + f" (got {type(value).__name__})"


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


# --------------------------------------------------------------------------- a request's words


def _request_message(err: ErrorDetails, path: str) -> str:
    """A sentence that starts with the field's path and ends with what came instead."""
    kind, value, msg = err["type"], err.get("input"), err["msg"]
    name = path or "the request body"
    is_type = _is_type(kind)
    if kind == "missing" or (value is None and is_type):
        return f"{name} is required"
    if kind == "string_unicode":  # pydantic's own check, on the name of an extra field
        return f"{path or 'a field name'} is not valid Unicode text (lone surrogate)"
    if kind == "extra_forbidden":
        return f"unknown field {_short_json(err['loc'][-1])}"
    got = f", got {json_type(value)}" if is_type or kind == "invalid_type" else \
        f", got {_short_json(value)}"
    if kind in _OWN_CODES:
        return f"{name} {msg}{got if kind == 'invalid_type' else ''}"
    if kind in _OBJECT_ERRORS:
        msg = "must be an object"
    elif kind == "list_type":
        msg = "must be an array"
    for lead in ("Input should", "List should", "String should", "Value should"):
        if msg.startswith(lead):
            msg = "must" + msg[len(lead):]
    msg = msg.replace(" after validation", "").split(", not ")[0]
    return f"{name} {msg}{got}"
