"""The two Omnistage objects: an OmniPipeline and a StagePool, as whole manifests.

Their own validators check what spans metadata and spec (pod-name lengths, a pool's name), with
absolute paths; the CRD has the same rules in CEL.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from omnistage.kube import API_VERSION
from omnistage.spec.errors import path_errors
from omnistage.spec.fields import ImageRef, SpecModel
from omnistage.spec.metadata import Metadata, PoolMetadata
from omnistage.spec.patterns import (
    DNS1035_LABEL_PATTERN,
    IMAGE_GRAMMAR,
    KIND,
    MAX_REPLICAS,
    PIPELINE_NAME_MAX,
    POD_NAME_MAX,
    POOL_KIND,
)
from omnistage.spec.pipeline import ModelCache, PipelineSpec
from omnistage.spec.stage import Stage


class OmniPipeline(SpecModel):
    """An OmniPipeline manifest: the same document runs locally and on Kubernetes."""

    api_version: Literal[API_VERSION] = Field(  # type: ignore[valid-type]
        description=f"Must be {API_VERSION}.")
    kind: Literal["OmniPipeline"] = Field(description=f"Must be {KIND}.")
    metadata: Metadata = Field(description="Object metadata; name is required.")
    spec: PipelineSpec = Field(description="The desired pipeline.")
    status: dict[str, Any] | None = Field(
        None,
        description="Observed state, written by the operator; the runtime ignores it.",
    )

    @model_validator(mode="after")
    def _check_pod_names(self) -> OmniPipeline:
        """Pod names combine pipeline and stage names, so their lengths are checked together."""
        ordinal = len(str(MAX_REPLICAS - 1))
        errors = []
        for i, stage in enumerate(self.spec.stages):
            pod = f"{self.metadata.name}-{stage.name}-{'9' * ordinal}"
            if len(pod) > POD_NAME_MAX:
                errors.append(
                    (
                        f"spec.stages[{i}].name",
                        f"pod names '{self.metadata.name}-{stage.name}-<ordinal>' would exceed "
                        f"{POD_NAME_MAX} characters; shorten the stage or pipeline name",
                    )
                )
        if errors:
            raise path_errors(errors, relative=False)
        return self

    def served_model_name(self) -> str:
        """Model name the API reports: spec.orchestrator.servedModelName or metadata.name."""
        return self.spec.orchestrator.served_model_name or self.metadata.name

    def to_manifest(self) -> dict[str, Any]:
        """JSON-ready manifest with camelCase keys; parse_pipeline(to_manifest()) == self."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StagePoolSpec(SpecModel):
    """Desired replicas of one stage; written by the operator from its OmniPipeline."""

    pipeline: str = Field(
        pattern=DNS1035_LABEL_PATTERN,
        max_length=PIPELINE_NAME_MAX,
        description="Name of the OmniPipeline this pool belongs to. Immutable.",
    )
    stage: Stage = Field(description="The stage, as resolved from the pipeline.")
    replicas: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Desired replicas; `kubectl scale sp/<pool>` changes this. Overrides "
        "stage.replicas, which only seeds it.",
    )
    image: ImageRef = Field(description=f"Container image of the stage worker: {IMAGE_GRAMMAR}.")
    model_cache: ModelCache | None = Field(
        None, description="The pipeline's modelCache: where the pods keep hub models."
    )


class StagePool(SpecModel):
    """A StagePool manifest: the replica pods of one stage of one OmniPipeline."""

    api_version: Literal[API_VERSION] = Field(  # type: ignore[valid-type]
        description=f"Must be {API_VERSION}.")
    kind: Literal["StagePool"] = Field(description=f"Must be {POOL_KIND}.")
    metadata: PoolMetadata = Field(description="Object metadata (name <pipeline>-<stage>).")
    spec: StagePoolSpec = Field(description="The desired pool.")
    status: dict[str, Any] | None = Field(None, description="Observed state, operator-written.")

    @model_validator(mode="after")
    def _check_name(self) -> StagePool:
        """The operator finds a stage's pool by name; the CRD has the same rule in CEL."""
        want = f"{self.spec.pipeline}-{self.spec.stage.name}"
        if self.metadata.name != want:
            raise path_errors([("metadata.name", pool_name_message(want, self.metadata.name))],
                               relative=False)
        return self


def pool_name_message(want: str, got: str) -> str:
    return f"a StagePool is named <pipeline>-<stage>: expected {want!r} (got {got!r})"
