"""Names shared by the operator (which writes them) and the orchestrator (which reads them).

Kept in the runtime because the operator depends on the runtime, never the reverse.
"""

from __future__ import annotations

LABEL_PIPELINE = "omnistage.io/pipeline"
LABEL_STAGE = "omnistage.io/stage"
LABEL_POOL = "omnistage.io/pool"
LABEL_ORDINAL = "omnistage.io/ordinal"
LABEL_COMPONENT = "omnistage.io/component"  # "stage" | "orchestrator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "omnistage-operator"

ANNOTATION_DRAINING = "omnistage.io/draining"  # "true" once retirement has begun
ANNOTATION_SPEC_HASH = "omnistage.io/spec-hash"
READINESS_GATE = "omnistage.io/routable"  # pod condition the operator controls

WORKER_ZMQ_PORT = 5555
WORKER_HTTP_PORT = 8080
PIPELINE_ENV = "OMNISTAGE_PIPELINE"  # the resolved pipeline manifest, as JSON


def pool_name(pipeline: str, stage: str) -> str:
    return f"{pipeline}-{stage}"


def replica_name(pool: str, ordinal: int) -> str:
    return f"{pool}-{ordinal}"


def stage_selector(pipeline: str) -> str:
    return f"{LABEL_PIPELINE}={pipeline},{LABEL_COMPONENT}=stage"
