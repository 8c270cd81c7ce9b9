"""Kubernetes object metadata, checked as the API server checks it.

Unknown keys are errors (`metadata.lables` must not silently drop the labels), label and
annotation keys follow the API server's rules, and the fields the API server writes are
accepted so that live objects parse.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from omnistage.kube import ANNOTATION_SHARED_MEMORY
from omnistage.spec.errors import field_error
from omnistage.spec.fields import MODEL_CONFIG
from omnistage.spec.patterns import (
    DNS1035_LABEL_PATTERN,
    DNS_LABEL_PATTERN,
    PIPELINE_NAME_MAX,
    POOL_NAME_MAX,
)

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
            raise field_error(problem)
    return labels


def _check_annotations(annotations: dict[str, str]) -> dict[str, str]:
    for key in annotations:
        problem = _key_error("annotation", key)
        if problem:
            raise field_error(problem)
    size = sum(len(k) + len(v) for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        raise field_error(f"annotations total {size} bytes; at most {ANNOTATIONS_MAX_BYTES}")
    # The shared-memory opt-in is a switch: a typo must not silently mean "off".
    flag = annotations.get(ANNOTATION_SHARED_MEMORY)
    if flag is not None and flag not in ("true", "false"):
        raise field_error(f"{ANNOTATION_SHARED_MEMORY} must be \"true\" or \"false\", "
                           f"got {flag!r}")
    return annotations


class _ObjectMeta(BaseModel):
    """Kubernetes object metadata. Unknown keys are errors (`metadata.lables` must not silently
    drop the labels); the fields the API server writes are accepted, so live objects parse."""

    model_config = MODEL_CONFIG

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
