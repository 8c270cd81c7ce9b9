"""Pipeline spec: the OmniPipeline and StagePool manifests as pydantic models.

One document describes a pipeline. ``omnistage serve FILE`` runs it locally and
``kubectl apply -f FILE`` runs it on a cluster, so these models are the single source of truth:
the runtime parses them here and the CRD OpenAPI schema is generated from them. That is why every
field has a description, uses a camelCase alias, forbids unknown keys (typos are errors) and keeps
to JSON-schema friendly types (Literals for enums, explicit bounds, optional values instead of
unions).

The package re-exports every name; its modules, each for one job:

- patterns: names, limits and string grammars (shared with the CRD's CEL rules)
- errors: SpecError and the one formatter of pydantic errors (spec, request params, worker)
- fields: the models' shared config and field types
- engine_options: EngineOptions, the one bounds table of the engine knobs
- stage: a stage and its parts (resources, placement, admission, autoscaling, ...)
- pipeline: the stage graph, its checks, and the orchestrator
- metadata: object metadata, checked as the API server checks it
- manifests: OmniPipeline and StagePool
- loading: parsing and loading, and validate_manifest, the one validator

Submodules import each other directly, never this package: that would close a cycle through
this __init__, which imports them all.
"""

from __future__ import annotations

from typing import Any

import omnistage.kinds as stage_kinds
from omnistage.kube import API_VERSION
from omnistage.modelref import HUB_ID_GRAMMAR, HUB_ID_PATTERN, LOCAL_PATH_PREFIXES
from omnistage.spec.engine_options import (
    EngineOptions,
    PerRequest,
    engine_for_kind,
    engine_kinds,
)
from omnistage.spec.errors import SpecError
from omnistage.spec.fields import ImageRef, Quantity, StageName
from omnistage.spec.loading import (
    KIND_IMMUTABLE,
    PIPELINE_IMMUTABLE,
    load_manifests,
    load_pipeline,
    parse_pipeline,
    parse_stagepool,
    validate_manifest,
)
from omnistage.spec.manifests import OmniPipeline, StagePool, StagePoolSpec, pool_name_message
from omnistage.spec.metadata import ANNOTATIONS_MAX_BYTES, Metadata, PoolMetadata
from omnistage.spec.patterns import (
    DEFAULT_IMAGE,
    DNS1035_LABEL_PATTERN,
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    IMAGE_GRAMMAR,
    IMAGE_MAX,
    IMAGE_PATTERN,
    IMAGE_REPOSITORY,
    KIND,
    MAX_REPLICAS,
    MAX_STAGES,
    PIPELINE_NAME_MAX,
    POD_NAME_MAX,
    POOL_KIND,
    POOL_NAME_MAX,
    QUANTITY_PATTERN,
    STAGE_NAME_MAX,
    URL_PATTERN,
    VOICE_PATTERN,
    image_error,
    join_words,
)
from omnistage.spec.pipeline import (
    MODEL_CACHE_ONE_OF,
    MODEL_CACHE_READ_ONLY,
    ApiSurface,
    FailoverOptions,
    ModelCache,
    OrchestratorAuth,
    OrchestratorResources,
    OrchestratorSpec,
    PipelineSpec,
    SecretKeyRef,
    chat_stage_rule,
)
from omnistage.spec.stage import (
    AUTOSCALING_MIN_MAX,
    AUTOSCALING_ONE_TARGET,
    AUTOSCALING_SEED,
    AUTOSCALING_TARGETS,
    DEFAULT_VOICES,
    GPUS_PER_MODEL_REPLICA,
    AdmissionOptions,
    Autoscaling,
    AutoscalingTarget,
    DispatchOptions,
    Placement,
    Stage,
    StageResources,
    StreamingOptions,
    Toleration,
    stage_voices,
)

__all__ = [
    "ANNOTATIONS_MAX_BYTES",
    "API_VERSION",
    "AUTOSCALING_MIN_MAX",
    "AUTOSCALING_ONE_TARGET",
    "AUTOSCALING_SEED",
    "AUTOSCALING_TARGETS",
    "DEFAULT_IMAGE",
    "DEFAULT_VOICES",
    "DNS1035_LABEL_PATTERN",
    "DNS_LABEL_PATTERN",
    "DNS_SUBDOMAIN_PATTERN",
    "GPUS_PER_MODEL_REPLICA",
    "HUB_ID_GRAMMAR",
    "HUB_ID_PATTERN",
    "IMAGE_GRAMMAR",
    "IMAGE_MAX",
    "IMAGE_PATTERN",
    "IMAGE_REPOSITORY",
    "KIND",
    "KIND_IMMUTABLE",
    "LOCAL_PATH_PREFIXES",
    "MAX_REPLICAS",
    "MAX_STAGES",
    "MODEL_CACHE_ONE_OF",
    "MODEL_CACHE_READ_ONLY",
    "PIPELINE_IMMUTABLE",
    "PIPELINE_NAME_MAX",
    "POD_NAME_MAX",
    "POOL_KIND",
    "POOL_NAME_MAX",
    "QUANTITY_PATTERN",
    "STAGE_NAME_MAX",
    "URL_PATTERN",
    "VOICE_PATTERN",
    "AdmissionOptions",
    "ApiSurface",
    "Autoscaling",
    "AutoscalingTarget",
    "DispatchOptions",
    "EngineOptions",
    "FailoverOptions",
    "ImageRef",
    "Metadata",
    "ModelCache",
    "OmniPipeline",
    "OrchestratorAuth",
    "OrchestratorResources",
    "OrchestratorSpec",
    "PerRequest",
    "PipelineSpec",
    "Placement",
    "PoolMetadata",
    "Quantity",
    "SecretKeyRef",
    "SpecError",
    "Stage",
    "StageName",
    "StagePool",
    "StagePoolSpec",
    "StageResources",
    "StreamingOptions",
    "Toleration",
    "chat_stage_rule",
    "engine_for_kind",
    "engine_kinds",
    "image_error",
    "join_words",
    "load_manifests",
    "load_pipeline",
    "parse_pipeline",
    "parse_stagepool",
    "pool_name_message",
    "stage_voices",
    "validate_manifest",
]


def __getattr__(name: str) -> Any:
    """Views of the kind table, computed when read so registered kinds are included."""
    if name == "STAGE_KINDS":
        return stage_kinds.names()
    if name == "BUILTIN_MODELS":
        return stage_kinds.builtin_models()
    if name == "MODEL_KINDS":
        return tuple(k.name for k in stage_kinds.kinds() if k.needs_model)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
