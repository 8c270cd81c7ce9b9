"""The models' shared config and the field types several of them use.

Every spec model is CRD-friendly the same way (camelCase keys, unknown keys rejected, no
`anyOf: [X, null]`), so the config is written once here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel

from omnistage.spec.errors import field_error
from omnistage.spec.patterns import (
    DNS_LABEL_PATTERN,
    IMAGE_MAX,
    QUANTITY_PATTERN,
    STAGE_NAME_MAX,
    image_error,
)


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


#: camelCase keys, unknown keys rejected, CRD-friendly schema: every spec model's config.
MODEL_CONFIG = ConfigDict(
    alias_generator=to_camel,
    populate_by_name=True,
    extra="forbid",
    json_schema_extra=_collapse_nullable,
)


class SpecModel(BaseModel):
    """Base of the spec's models: the shared config."""

    model_config = MODEL_CONFIG


def _number_to_str(value: Any) -> Any:
    """YAML reads ``cpu: 1`` as an int; Kubernetes quantities are int-or-string.

    Floats are left to fail: the API server refuses ``cpu: 0.5`` too, so write "500m" or "0.5".
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _check_image(value: str) -> str:
    problem = image_error(value)
    if problem is not None:
        raise field_error(problem)
    return value


Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN), BeforeValidator(_number_to_str)]
StageName = Annotated[
    str, Field(pattern=DNS_LABEL_PATTERN, min_length=1, max_length=STAGE_NAME_MAX)
]
# The CRD carries the grammar as a CEL rule with a readable message, not as a schema pattern.
ImageRef = Annotated[str, Field(max_length=IMAGE_MAX), AfterValidator(_check_image)]
#: json_schema_extra of a list whose entries are unique (a CRD set-type list).
LIST_SET = {"x-kubernetes-list-type": "set"}
