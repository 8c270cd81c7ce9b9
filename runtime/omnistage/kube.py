"""Names shared by the operator (which writes them) and the orchestrator (which reads them), and
the one way to read what they both read: an object's status conditions, whether a pod is
draining, and how much work a worker's /state reports left.

Kept in the runtime because the operator depends on the runtime, never the reverse.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

#: The API group and version of OmniPipeline and StagePool.
GROUP = "omnistage.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

LABEL_PIPELINE = "omnistage.io/pipeline"
LABEL_STAGE = "omnistage.io/stage"
LABEL_POOL = "omnistage.io/pool"
LABEL_ORDINAL = "omnistage.io/ordinal"
LABEL_COMPONENT = "omnistage.io/component"  # "stage" | "orchestrator"
# On a stage pod: its payload revision (omnistage.revision.stage_revision of its stage).
LABEL_REVISION = "omnistage.io/revision"
ANNOTATION_REVISION_ORDER = "omnistage.io/revision-order"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "omnistage-operator"

ANNOTATION_DRAINING = "omnistage.io/draining"  # "true" once retirement has begun
ANNOTATION_SPEC_HASH = "omnistage.io/spec-hash"
# On an OmniPipeline: "true" lets its orchestrator and stage pods that share a node exchange
# tensors through shared memory (docs/protocol.md); "false" or absent: TCP only.
ANNOTATION_SHARED_MEMORY = "omnistage.io/shared-memory"
READINESS_GATE = "omnistage.io/routable"  # pod condition the operator controls
# On a StagePool: RFC 3339 time the orchestrator last asked to wake the pool from zero (a
# request is held for it); the operator scales a pool at 0 with a newer wake at once.
ANNOTATION_WAKE_REQUESTED = "omnistage.io/wake-requested-at"
# The orchestrator's per-stage load signal (GET; orchestrator/load.py), which the operator's
# autoscaler reads.
LOAD_PATH = "/v1/load"

WORKER_ZMQ_PORT = 5555
WORKER_HTTP_PORT = 8080
WORKER_STATE_PATH = "/state"  # on WORKER_HTTP_PORT: the replica's protocol.WorkerState as JSON
PIPELINE_ENV = "OMNISTAGE_PIPELINE"  # the resolved pipeline manifest, as JSON
# spec.orchestrator.auth.apiKeySecret: where the orchestrator pod mounts the Secret, and the
# variable that hands the path to `omnistage orchestrator` (orchestrator/auth.py).
API_KEY_FILE_ENV = "OMNISTAGE_API_KEY_FILE"
API_KEYS_DIR = "/etc/omnistage/api-keys"
# The orchestrator's admin listener (spec.orchestrator.adminPort; orchestrator/auth.py): the
# container port's name, the variable by which the operator hands an orchestrator pod the
# SHA-256 digests (hex, comma-separated) of the admin keys it accepts, and the header the
# operator presents its key in (the API server's service proxy drops Authorization).
ADMIN_PORT_NAME = "admin"
ADMIN_KEY_DIGESTS_ENV = "OMNISTAGE_ADMIN_KEY_DIGESTS"
ADMIN_KEY_HEADER = "X-Omnistage-Admin-Key"
#: Where the pipeline's CurveZMQ Secret is mounted in its pods ($OMNISTAGE_CURVE_KEYS names it).
CURVE_KEYS_DIR = "/etc/omnistage/curve"
#: On a StagePool: the Secret holding its pipeline's CurveZMQ pair, which its pods mount.
ANNOTATION_CURVE_SECRET = "omnistage.io/curve-secret"
#: On a stage pod: the generation of that pair it holds ($OMNISTAGE_CURVE_GENERATION; rotation).
ANNOTATION_CURVE_GENERATION = "omnistage.io/curve-generation"

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


def marked_draining(obj: Mapping[str, Any]) -> bool:
    """The operator has begun to retire this pod: its ANNOTATION_DRAINING is "true", exactly as
    the operator writes it (one spelling, so the operator and the orchestrator agree)."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return annotations.get(ANNOTATION_DRAINING) == "true"


def is_draining(pod: Mapping[str, Any]) -> bool:
    """On its way out: terminating (deletionTimestamp) or marked draining. It finishes the work
    it has but takes none new: the readiness gate and the orchestrator's membership both read
    this."""
    return bool((pod.get("metadata") or {}).get("deletionTimestamp")) or marked_draining(pod)


def work_left(state: Any) -> int | None:
    """The requests a replica still has to answer, from its /state body (protocol.WorkerState);
    None when it is not one. `in_flight` counts every admitted request not yet answered, queued
    ones included; `queued` is the part of them not dispatched yet, so adding it would count
    those twice."""
    if not isinstance(state, Mapping):
        return None
    try:
        return int(state.get("in_flight", 0))
    except (TypeError, ValueError):
        return None


def worker_state_url(ip: str) -> str:
    """The /state URL of a stage pod at `ip`."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{WORKER_HTTP_PORT}{WORKER_STATE_PATH}"


def read_work_left(url: str, timeout: float) -> int | None:
    """work_left of the worker answering at `url`: 0 when nothing listens there, None when it
    cannot be asked (a timeout, a bad body, an HTTP error).

    A refused connection is read as zero because a worker listens on its side port from before
    it admits its first request until it exits (worker/server.py: the side port starts before
    the receive loop and closes only once the worker has drained), so a refusal from the
    worker's own address means no process there holds work. That holds only if the
    connection goes to that address: the read never goes through an HTTP proxy named in the
    environment (http_proxy), whose own refusal would read as "idle" and let the operator delete
    a replica with work in flight, and whose answers (a 502, its own page) are not the worker's."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return work_left(json.loads(resp.read()))
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0
        return None
    except (OSError, ValueError):
        return None
