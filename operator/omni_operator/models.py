"""The StagePool resource: one pool of replica Pods for one stage of one pipeline.

OmniPipeline's own models live in omnistage.spec (the runtime owns the pipeline document); the
operator adds StagePool, the per-stage child it reconciles into Pods.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from omnistage.spec import (
    DNS1035_LABEL_PATTERN,
    MAX_REPLICAS,
    PIPELINE_NAME_MAX,
    Stage,
    _Model,
)

GROUP = "omnistage.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class StagePoolSpec(_Model):
    """Desired replicas of one stage; written by the operator from its OmniPipeline."""

    pipeline: str = Field(
        pattern=DNS1035_LABEL_PATTERN,
        max_length=PIPELINE_NAME_MAX,
        description="Name of the OmniPipeline this pool belongs to.",
    )
    stage: Stage = Field(description="The stage, as resolved from the pipeline.")
    replicas: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Desired replicas; `kubectl scale sp/<pool>` changes this. Overrides "
        "stage.replicas, which only seeds it.",
    )
    image: str = Field(description="Container image of the stage worker.")


class StagePool(_Model):
    """A StagePool manifest."""

    api_version: Literal["omnistage.io/v1alpha1"] = Field(description=f"Must be {API_VERSION}.")
    kind: Literal["StagePool"] = Field(description="Must be StagePool.")
    metadata: dict[str, Any] = Field(description="Object metadata (name <pipeline>-<stage>).")
    spec: StagePoolSpec = Field(description="The desired pool.")
    status: dict[str, Any] | None = Field(None, description="Observed state, operator-written.")
