"""Names shared by the operator (which writes them) and the orchestrator (which reads them), and
the one way to read an object's status conditions.

Kept in the runtime because the operator depends on the runtime, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LABEL_PIPELINE = "omnistage.io/pipeline"
LABEL_STAGE = "omnistage.io/stage"
LABEL_POOL = "omnistage.io/pool"
LABEL_ORDINAL = "omnistage.io/ordinal"
LABEL_COMPONENT = "omnistage.io/component"  # "stage" | "orchestrator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "omnistage-operator"

ANNOTATION_DRAINING = "omnistage.io/draining"  # "true" once retirement has begun
ANNOTATION_SPEC_HASH = "omnistage.io/spec-hash"
# On an OmniPipeline: "true" lets its orchestrator and stage pods that share a node exchange
# tensors through shared memory (docs/protocol.md); "false" or absent: TCP only.
ANNOTATION_SHARED_MEMORY = "omnistage.io/shared-memory"
READINESS_GATE = "omnistage.io/routable"  # pod condition the operator controls

WORKER_ZMQ_PORT = 5555
WORKER_HTTP_PORT = 8080
PIPELINE_ENV = "OMNISTAGE_PIPELINE"  # the resolved pipeline manifest, as JSON

# Model fetching and loading, as the operator reads them off a stage pod's status.
MODEL_FETCH_CONTAINER = "model-fetch"  # init container: `omnistage models pull`
MODEL_CACHE_VOLUME = "model-cache"
MODEL_CACHE_PATH = "/var/cache/omnistage/hf"  # HF_HOME in stage pods
#: Exit status of a worker (and of `omnistage models pull`) whose model could not be fetched or
#: loaded; their last log line (the pod's termination message) says why.
MODEL_FAILED_EXIT = 3


def pool_name(pipeline: str, stage: str) -> str:
    return f"{pipeline}-{stage}"


def replica_name(pool: str, ordinal: int) -> str:
    return f"{pool}-{ordinal}"


def stage_selector(pipeline: str) -> str:
    return f"{LABEL_PIPELINE}={pipeline},{LABEL_COMPONENT}=stage"


def condition(obj: Mapping[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    """The status condition of type ``ctype`` of any object (Pod Ready, a pipeline's Ready,
    a Node's Ready, a CRD's Established...), or None when it has none."""
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def condition_status(obj: Mapping[str, Any] | None, ctype: str) -> str | None:
    """"True", "False" or "Unknown" for condition ``ctype``; None when it is absent."""
    cond = condition(obj, ctype)
    return None if cond is None else str(cond.get("status"))

# Shared memory (omnistage.shm reads them; the operator sets them when a pool opts in).
ENV_SHM_DIR = "OMNISTAGE_SHM_DIR"
ENV_SHM_CAP = "OMNISTAGE_SHM_CAP_MB"
ENV_SHM_SESSION = "OMNISTAGE_SHM_SESSION"
