"""Pure builders: an OmniPipeline or StagePool in, the Kubernetes objects it wants out.

No I/O here: the reconcilers server-side apply these as the operator's whole intent for each
object (docs/architecture.md, "How the operator writes"), so a field left out here is removed
from the live object; they write only when the intent or the live object differs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from omni_operator.curve_rotation import pod_generation
from omni_operator.metadata import component_selector, labels, orchestrator_name, owner_ref
from omni_operator.metadata import object_meta as _meta
from omni_operator.models import API_VERSION, desired_replicas
from omni_operator.network_policy import NetworkPolicySettings, policies_for
from omni_operator.placement import pod_scheduling, tolerations
from omni_operator.release import (
    ANNOTATION_SURGE,
    doc_revision,
    format_order,
    pool_order,
    pool_revision,
    release_order,
    stored_orders,
)
from omnistage import kube
from omnistage.curve_keys import (
    CURVE_GENERATION_ENV,
    CURVE_KEYS_ENV,
    CurveKeys,
    public_file,
    secret_file,
)
from omnistage.curve_keys import PUBLIC_FILE as CURVE_PUBLIC_FILE
from omnistage.curve_keys import SECRET_FILE as CURVE_SECRET_FILE
from omnistage.orchestrator.shutdown import shutdown_seconds
from omnistage.revision import IMAGE_ENV
from omnistage.spec import ModelCache, OmniPipeline, Stage, engine_for_kind
from omnistage.tuning import worker_env
from omnistage.worker.config import worker_args

Obj = dict[str, Any]

ANNOTATION_SEED_REPLICAS = "omnistage.io/seed-replicas"
#: The one field manager of every operator write (server-side applies, creates, patches), so
#: an object's metadata.managedFields says which fields the operator owns.
FIELD_MANAGER = kube.MANAGED_BY
PIPELINE_KEY = "pipeline.json"
NONROOT_UID = 65532
# The shared-memory opt-in (kube.ANNOTATION_SHARED_MEMORY): a directory on the node's tmpfs,
# the same for the orchestrator and the stage pods, so those on one node see each other's
# segments. It must be writable by NONROOT_UID (docs/protocol.md says how to make it so).
SHM_HOST_PATH = "/dev/shm/omnistage"
SHM_MOUNT_PATH = "/var/run/omnistage/shm"
SHM_CAP_SHARE = 4  # a pod's segment takes at most this fraction of its memory limit


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _downward_env() -> list[Obj]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"},
        *({"name": k, "value": v} for k, v in worker_env({}).items()),
    ]


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "runAsGroup": NONROOT_UID,
        "fsGroup": NONROOT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def shared_memory(annotations: dict[str, str] | None) -> bool:
    return (annotations or {}).get(kube.ANNOTATION_SHARED_MEMORY) == "true"


def _with_shared_memory(pod_spec: Obj, pipeline: str, memory_limit: str) -> None:
    """Mount the node's shared directory and point the runtime at it (omnistage.shm).

    Segment pages count toward the pod's memory limit, so the cap is a quarter of it.
    """
    container = pod_spec["containers"][0]
    container["volumeMounts"].append({"name": "omnistage-shm", "mountPath": SHM_MOUNT_PATH})
    container["env"] = [*container["env"],
                        {"name": kube.ENV_SHM_DIR, "value": SHM_MOUNT_PATH},
                        {"name": kube.ENV_SHM_SESSION, "value": pipeline},
                        {"name": kube.ENV_SHM_CAP,
                         "value": str(_quantity_bytes(memory_limit) // SHM_CAP_SHARE >> 20)}]
    pod_spec["volumes"].append({"name": "omnistage-shm",
                                "hostPath": {"path": SHM_HOST_PATH, "type": "DirectoryOrCreate"}})


_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
             "Ei": 1 << 60, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
             "E": 10**18, "m": 10**-3}


def _quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (already validated by the spec) in bytes."""
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if quantity.endswith(suffix):
            return int(float(quantity[:-len(suffix)]) * _SUFFIXES[suffix])
    return int(float(quantity))


def _http_probe(path: str, port: int, period: int, failures: int, timeout: int = 5) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,  # by default generous: a busy CPU pod must not flap
    }


# A stage pod's readiness: how soon a hung worker (SIGSTOPped, or its event loop stuck) leaves
# Ready. The kubelet probes one at a time, so a worker that never answers is NotReady after
# FAILURES x (TIMEOUT, or PERIOD when longer) seconds, plus up to one PERIOD before the first
# failing probe: 3 x 1 + 1 = 4 s at most. With the former 5 s timeout that was 15-16 s, while
# the orchestrator had declared the replica lost at its 3 s heartbeat timeout
# (orchestrator/replicas.py heartbeat_timeout; 3.4 s measured). A busy worker does not flap: /readyz
# and the heartbeats are answered by its event loop while the model runs on its own thread, in
# milliseconds; a loop that misses three 1 s answers in a row misses the heartbeats too, and the
# orchestrator has already stopped routing to it.
WORKER_READINESS_PERIOD_SECONDS = 1
WORKER_READINESS_TIMEOUT_SECONDS = 1
WORKER_READINESS_FAILURES = 3


# ---- OmniPipeline -> children ------------------------------------------------------------------


#: Stage fields only the stage runtime reads (engine, pool size, resources, scheduling,
#: budgets). The orchestrator's copy of the pipeline leaves them out, so changing one of them
#: rolls the stage's replicas and never the orchestrator. The orchestrator reads a stage's name,
#: kind, model, inputs, finalOutput, drainTimeoutSeconds, admission.defaultDeadlineSeconds,
#: streaming and dispatch (which only the orchestrator reads: pool_stage leaves them out).
STAGE_RUNTIME_ONLY = ("engine", "replicas", "resources", "placement", "maxUnavailable")
ADMISSION_ORCHESTRATOR_READS = ("defaultDeadlineSeconds",)
#: Orchestrator fields no orchestrator process reads: how many of them run is the Deployment's
#: spec.replicas. Left out of the manifest (and so of the template's hash), scaling the front
#: door adds or removes pods and restarts none.
ORCHESTRATOR_DEPLOYMENT_ONLY = ("replicas",)


def pipeline_manifest(pipeline: OmniPipeline) -> Obj:
    """The pipeline as the orchestrator runs it: identity and spec, without the stage fields
    only the stage runtime reads (see STAGE_RUNTIME_ONLY), the orchestrator's replica count
    (ORCHESTRATOR_DEPLOYMENT_ONLY) and no server state."""
    man = pipeline.to_manifest()
    man.pop("status", None)
    man["metadata"] = {"name": pipeline.metadata.name}
    for key in ORCHESTRATOR_DEPLOYMENT_ONLY:
        man["spec"].get("orchestrator", {}).pop(key, None)
    for stage in man["spec"]["stages"]:
        for key in STAGE_RUNTIME_ONLY:
            stage.pop(key, None)
        admission = {k: v for k, v in (stage.get("admission") or {}).items()
                     if k in ADMISSION_ORCHESTRATOR_READS}
        stage.pop("admission", None)
        if admission:
            stage["admission"] = admission
    return man


def pool_stage(stage: Stage) -> Obj:
    """The stage as a pool stores it: only the engine options its kind reads, and no
    streaming or dispatch options (the orchestrator's alone: changing them rolls no replica)."""
    doc = stage.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["engine"] = engine_for_kind(stage.engine, stage.kind)
    doc.pop("streaming", None)
    doc.pop("dispatch", None)
    return doc


def stage_pool(owner: Obj, pipeline: OmniPipeline, stage: Stage,
               current: Obj | None = None, curve_generation: int = 0) -> Obj:
    """The stage's StagePool. `current`: the live pool, whose release order is kept while its
    revision stays (omni_operator.release); a new revision gets the pipeline's generation."""
    name, ns = pipeline.metadata.name, owner["metadata"]["namespace"]
    meta = _meta(kube.pool_name(name, stage.name), ns, labels(name, "stage", stage.name), owner)
    stored = pool_stage(stage)
    revision = doc_revision(stored, pipeline.spec.image)
    order = release_order(current, revision, int(owner["metadata"].get("generation") or 0))
    meta["annotations"] = {
        ANNOTATION_SEED_REPLICAS: str(stage.replicas),
        # Always written, "false" included, so turning it off reaches the pool too.
        kube.ANNOTATION_SHARED_MEMORY: str(shared_memory(pipeline.metadata.annotations)).lower(),
        kube.ANNOTATION_REVISION_ORDER: format_order(revision, order, stored_orders(current)),
        # The pool's pods mount the pipeline's CurveZMQ pair (pod_template).
        kube.ANNOTATION_CURVE_SECRET: curve_secret_name(name, owner["metadata"].get("uid", "")),
    }
    if curve_generation:  # which pair of the Secret its pods are (0, the first: unsaid)
        meta["annotations"][kube.ANNOTATION_CURVE_GENERATION] = str(curve_generation)
    return {
        "apiVersion": API_VERSION,
        "kind": "StagePool",
        "metadata": meta,
        "spec": {
            "pipeline": name,
            "stage": stored,
            "replicas": stage.replicas,
            "image": pipeline.spec.image,
            **({"modelCache": pipeline.spec.model_cache.model_dump(
                by_alias=True, exclude_none=True, mode="json")}
               if pipeline.spec.model_cache else {}),
        },
    }


def curve_secret_name(pipeline: str, uid: str) -> str:
    """The pipeline's CurveZMQ Secret, named with the pipeline's uid: a pipeline deleted and
    made again never meets its predecessor's Secret while the garbage collector removes it
    (the operator creates the Secret once and never reads it)."""
    return _uid_named(pipeline, "curve", uid)


def _uid_named(pipeline: str, what: str, uid: str) -> str:
    suffix = uid.replace("-", "")[:10]
    return f"{pipeline}-{what}-{suffix}" if suffix else f"{pipeline}-{what}"


def _pipeline_secret(owner: Obj, pipeline: OmniPipeline, secret: str,
                     data: dict[str, bytes]) -> Obj:
    """A Secret the operator makes for a pipeline (owned by it, so it goes with it)."""
    ns = owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(secret, ns, labels(pipeline.metadata.name, "orchestrator"), owner),
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def curve_secret(owner: Obj, pipeline: OmniPipeline, keys: CurveKeys) -> Obj:
    """The pipeline's CurveZMQ pair as a Secret (files `public` and `secret`, omnistage.curve),
    owned by the pipeline. The keys are the caller's: this stays a pure function."""
    secret = curve_secret_name(pipeline.metadata.name, owner["metadata"].get("uid", ""))
    return _pipeline_secret(owner, pipeline, secret, {CURVE_PUBLIC_FILE: keys.public,
                                                      CURVE_SECRET_FILE: keys.secret})


def _curve_generation_env(generation: int) -> list[Obj]:
    """$OMNISTAGE_CURVE_GENERATION: which pair of the mounted Secret is the process's own
    (omnistage.curve_keys); unsaid for the first, so pods of pipelines never rotated keep their
    spec (and are not replaced by an operator upgrade)."""
    return [{"name": CURVE_GENERATION_ENV, "value": str(generation)}] if generation else []


def curve_generation_of(pool: Obj) -> int:
    """The CurveZMQ generation a pool's pods are built with (its annotation; absent: 0)."""
    return pod_generation(pool["metadata"].get("annotations"))


def curve_secret_add(generation: int, keys: CurveKeys) -> Obj:
    """The merge patch that adds a pair to the pipeline's CurveZMQ Secret (never read: a
    merge patch needs no read; omni_operator.curve_rotation)."""
    return {"data": {public_file(generation): base64.b64encode(keys.public).decode(),
                     secret_file(generation): base64.b64encode(keys.secret).decode()}}


def curve_secret_drop(generations: Sequence[int]) -> Obj:
    """The merge patch that removes these generations' pairs from the Secret."""
    return {"data": {name: None for g in generations
                     for name in (public_file(g), secret_file(g))}}


def _with_curve(pod_spec: Obj, secret: str) -> None:
    """The pipeline's CurveZMQ Secret mounted read-only (group-readable: the pod's fsGroup is
    the non-root user's) and named in $OMNISTAGE_CURVE_KEYS; orchestrator and workers alike."""
    pod_spec["volumes"].append({"name": "curve-keys",
                                "secret": {"secretName": secret, "defaultMode": 0o440}})
    container = pod_spec["containers"][0]
    container["volumeMounts"].append(
        {"name": "curve-keys", "mountPath": kube.CURVE_KEYS_DIR, "readOnly": True})
    container["env"].append({"name": CURVE_KEYS_ENV, "value": kube.CURVE_KEYS_DIR})


def api_key_secret_name(pipeline: str, uid: str) -> str:
    """The API-key Secret the operator makes for a pipeline that names none (keys on by
    default), named with the uid as curve_secret_name is and for the same reason."""
    return _uid_named(pipeline, "api-keys", uid)


def api_key_secret_of(pipeline: OmniPipeline, uid: str) -> str | None:
    """The Secret whose keys the pipeline's API needs: spec.orchestrator.auth.apiKeySecret, the
    one the operator makes (api_key_secret_name), or None with auth.disabled."""
    auth = pipeline.spec.orchestrator.auth
    if auth.disabled:
        return None
    return auth.api_key_secret or api_key_secret_name(pipeline.metadata.name, uid)


#: The key in the API-key Secret the operator makes (one key; add others beside it to rotate).
API_KEY_SECRET_KEY = "api-key"


def api_key_secret(owner: Obj, pipeline: OmniPipeline, key: str) -> Obj:
    """The pipeline's API-key Secret with one key (the caller's: this stays pure), owned by
    the pipeline. The operator creates it once and never changes it: the user rotates it."""
    secret = api_key_secret_name(pipeline.metadata.name, owner["metadata"].get("uid", ""))
    return _pipeline_secret(owner, pipeline, secret, {API_KEY_SECRET_KEY: key.encode()})


def _with_api_keys(pod_spec: Obj, secret: str) -> None:
    """spec.orchestrator.auth.apiKeySecret: the Secret mounted read-only (the kubelet swaps a
    changed one in, and the orchestrator re-reads it: orchestrator/auth.py) and its path in
    $OMNISTAGE_API_KEY_FILE. A volume, not an env value from the Secret: a key in the
    environment would need a restart to rotate."""
    pod_spec["volumes"].append({"name": "api-keys", "secret": {"secretName": secret}})
    container = pod_spec["containers"][0]
    container["volumeMounts"].append(
        {"name": "api-keys", "mountPath": kube.API_KEYS_DIR, "readOnly": True})
    container["env"].append({"name": kube.API_KEY_FILE_ENV, "value": kube.API_KEYS_DIR})


def _wake_rules(pipeline: OmniPipeline) -> list[Obj]:
    """`patch` on the pipeline's autoscaled StagePools, by name, so the orchestrator can ask for
    a pool at zero to be woken (omnistage.autoscaling.ANNOTATION_WAKE_REQUESTED). None without
    autoscaling: an empty resourceNames would grant every pool of the namespace."""
    names = sorted(kube.pool_name(pipeline.metadata.name, s.name)
                   for s in pipeline.spec.stages if s.autoscaling is not None)
    if not names:
        return []
    return [{"apiGroups": [kube.GROUP], "resources": ["stagepools"], "verbs": ["patch"],
             "resourceNames": names}]


def admin_service_name(pipeline: str) -> str:
    """The Service of a pipeline's orchestrator admin listener (port `admin` only): the
    autoscaler's service-proxy fallback and a ServiceMonitor's target. The public Service
    (orchestrator_name) never exposes that port."""
    return f"{orchestrator_name(pipeline)}-admin"


def pipeline_children(owner: Obj, pipeline: OmniPipeline,
                      pools: Mapping[str, Obj | None] | None = None, *,
                      network_policy: NetworkPolicySettings | None = None,
                      admin_key_digests: Sequence[str] = (),
                      curve_generation: int = 0) -> list[Obj]:
    """Everything an OmniPipeline owns, in creation order. `pools`: the live StagePools by
    stage name (their release orders are kept; see stage_pool). network_policy: the
    operator's setting (omni_operator.network_policy); on, the pipeline's NetworkPolicies too,
    which the reconciler applies with the first wave, before the workloads, so a new pipeline's
    pods start under them. None: off. admin_key_digests: SHA-256 hex digests of the admin keys
    the orchestrator's admin listener accepts (omni_operator.admin_credential: the
    reconciler's, for the key the operator presents), handed over in
    $OMNISTAGE_ADMIN_KEY_DIGESTS; the pod never holds a key. Empty: no variable (a pod that
    listens beyond loopback then refuses to start its admin listener). curve_generation: the
    CurveZMQ pair the pods are built with (omni_operator.curve_rotation; 0: the first)."""
    name, ns = pipeline.metadata.name, owner["metadata"]["namespace"]
    orch = pipeline.spec.orchestrator
    oname = orchestrator_name(name)
    olabels = labels(name, "orchestrator")
    selector = component_selector(name, "orchestrator")
    manifest = json.dumps(pipeline_manifest(pipeline), sort_keys=True)
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{name}-pipeline", ns, olabels, owner),
        "data": {PIPELINE_KEY: manifest},
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(oname, ns, olabels, owner),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(oname, ns, olabels, owner),
        # Exactly what a Pod watch needs: the orchestrator's membership lists and watches Pods.
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
                  *_wake_rules(pipeline)],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(oname, ns, olabels, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": oname},
        "subjects": [{"kind": "ServiceAccount", "name": oname, "namespace": ns}],
    }
    env = [
        *_downward_env(),
        {
            "name": kube.PIPELINE_ENV,
            "valueFrom": {"configMapKeyRef": {"name": f"{name}-pipeline", "key": PIPELINE_KEY}},
        },
    ]
    if admin_key_digests:
        env.append({"name": kube.ADMIN_KEY_DIGESTS_ENV, "value": ",".join(admin_key_digests)})
    env += _curve_generation_env(curve_generation)
    pod_spec: Obj = {
        "serviceAccountName": oname,
        "securityContext": _pod_security(),
        # SIGTERM -> shutdown delay, drain, close: the kubelet must not SIGKILL before.
        "terminationGracePeriodSeconds": math.ceil(shutdown_seconds(pipeline)),
        "containers": [
            {
                "name": "orchestrator",
                "image": pipeline.spec.image,
                # The admin listener's port comes from the pipeline ($OMNISTAGE_PIPELINE:
                # spec.orchestrator.adminPort, else port + 1), as the runtime's default.
                "command": ["omnistage", "orchestrator", "--membership", "kubernetes",
                            "--port", str(orch.port)],
                "env": env,
                "ports": [{"name": "http", "containerPort": orch.port},
                          {"name": kube.ADMIN_PORT_NAME, "containerPort": orch.admin_listen_port}],
                # Every second: a replacement orchestrator joins endpoints as soon as it can
                # serve, which is most of the gap after a deleted orchestrator pod.
                "readinessProbe": _http_probe("/readyz", orch.port, 1, 3),
                "livenessProbe": _http_probe("/livez", orch.port, 10, 3),
                "resources": {
                    "requests": {"cpu": orch.resources.cpu, "memory": orch.resources.memory},
                    "limits": {"memory": orch.resources.memory},
                },
                "securityContext": _container_security(),
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if shared_memory(pipeline.metadata.annotations):
        _with_shared_memory(pod_spec, name, orch.resources.memory)
    api_keys = api_key_secret_of(pipeline, owner["metadata"].get("uid", ""))
    if api_keys is not None:  # keys on unless the pipeline says auth.disabled
        _with_api_keys(pod_spec, api_keys)
    curve = curve_secret_name(name, owner["metadata"].get("uid", ""))
    _with_curve(pod_spec, curve)
    if orch.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(orch.node_selector.items()))
    if orch.tolerations:
        pod_spec["tolerations"] = tolerations(orch.tolerations)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(oname, ns, olabels, owner),
        "spec": {
            "replicas": orch.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                # The pipeline hash rolls the orchestrator when the spec changes.
                "metadata": {"labels": olabels,
                             "annotations": {kube.ANNOTATION_SPEC_HASH: digest(manifest),
                                             **({kube.ANNOTATION_CURVE_GENERATION:
                                                 str(curve_generation)}
                                                if curve_generation else {})}},
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(oname, ns, olabels, owner),
        "spec": {
            "selector": selector,
            # The public API only: control, /v1/load and /metrics are on the admin Service.
            "ports": [{"name": "http", "port": orch.port, "targetPort": orch.port}],
        },
    }
    admin_port = orch.admin_listen_port  # spec.orchestrator.adminPort, or port + 1
    admin_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(admin_service_name(name), ns, olabels, owner),
        "spec": {
            "selector": selector,
            "ports": [{"name": kube.ADMIN_PORT_NAME, "port": admin_port,
                       "targetPort": admin_port}],
        },
    }
    children = [stage_pool(owner, pipeline, s, (pools or {}).get(s.name), curve_generation)
                for s in pipeline.spec.stages]
    policies = policies_for(owner, pipeline, network_policy)
    return [config, account, role, binding, service, admin_service, *policies, deployment,
            *children]


def endpoint(pipeline: OmniPipeline, namespace: str) -> str:
    port = pipeline.spec.orchestrator.port
    return f"http://{orchestrator_name(pipeline.metadata.name)}.{namespace}.svc:{port}"


# ---- StagePool -> pods ---------------------------------------------------------------------


def worker_command(stage: Stage) -> list[str]:
    """The stage container's command: the runtime's worker_args, as `omnistage serve` uses.

    Replica id and bind address come from $POD_NAME and $POD_IP (downward API). Every `$` is
    doubled because the kubelet expands $(VAR) in commands and turns `$$` back into `$`.
    """
    args = worker_args(stage, port=kube.WORKER_ZMQ_PORT, http_port=kube.WORKER_HTTP_PORT)
    return ["omnistage", *(a.replace("$", "$$") for a in args)]


def model_cache_volume(cache: ModelCache | None) -> Obj:
    """The hub cache volume: a shared claim, a sized per-pod emptyDir, or an unbounded one."""
    if cache is not None and cache.claim_name:
        claim: Obj = {"claimName": cache.claim_name}
        if cache.read_only:
            claim["readOnly"] = True
        return {"name": kube.MODEL_CACHE_VOLUME, "persistentVolumeClaim": claim}
    empty: Obj = {"sizeLimit": cache.size} if cache is not None and cache.size else {}
    return {"name": kube.MODEL_CACHE_VOLUME, "emptyDir": empty}


def model_fetch(stage: Stage, image: str, cache: ModelCache | None, resources: Obj
                ) -> tuple[Obj, Obj, list[Obj]] | None:
    """For a stage with a hub model: the init container that pulls it into the cache volume,
    that volume, and the worker's env (offline, same cache). None for built-ins and paths.

    The token, if any, reaches only the init container, and only as a secretKeyRef: the pod
    spec names the Secret, never the value.
    """
    ref = stage.model_ref()
    if ref is None or not ref.is_hub:
        return None
    read_only = bool(cache and cache.read_only)
    env: list[Obj] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": kube.MODEL_CACHE_PATH},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if cache is not None and cache.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": cache.endpoint})
    if cache is not None and cache.token_secret is not None:
        secret = cache.token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": secret.name, "key": secret.key}}})
    init = {
        "name": kube.MODEL_FETCH_CONTAINER,
        "image": image,
        "command": ["omnistage", "models", "pull", str(ref), *(["--offline"] if read_only else [])],
        "env": env,
        "resources": resources,
        "securityContext": _container_security(),
        # The last log line (why the pull failed) becomes the termination message the
        # operator reports in the StagePool's status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": kube.MODEL_CACHE_VOLUME, "mountPath": kube.MODEL_CACHE_PATH,
             **({"readOnly": True} if read_only else {})},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    worker_env = [{"name": "HF_HOME", "value": kube.MODEL_CACHE_PATH},
                  {"name": "HF_HUB_OFFLINE", "value": "1"}]
    return init, model_cache_volume(cache), worker_env


def pod_template(pool: Obj) -> tuple[Obj, str]:
    """The pod every replica of this pool should be (minus name), and its hash."""
    spec = pool["spec"]
    stage = Stage.model_validate(spec["stage"])
    pipeline = spec["pipeline"]
    res = stage.resources
    requests: dict[str, str] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, str] = {"memory": res.memory}
    if res.gpus:
        requests["nvidia.com/gpu"] = str(res.gpus)
        limits["nvidia.com/gpu"] = str(res.gpus)
    cache_doc = spec.get("modelCache")
    cache = ModelCache.model_validate(cache_doc) if cache_doc else None
    fetch = model_fetch(stage, spec["image"], cache,
                        {"requests": {"cpu": res.cpu, "memory": res.memory},
                         "limits": {"memory": res.memory}})
    env, mounts, volumes = _downward_env(), [{"name": "tmp", "mountPath": "/tmp"}], [
        {"name": "tmp", "emptyDir": {}}]
    # The image is part of the revision: the worker computes the one its pod is labelled with.
    env.append({"name": IMAGE_ENV, "value": spec["image"]})
    inits: list[Obj] = []
    if fetch is not None:
        init, volume, fetch_env = fetch
        inits.append(init)
        env += fetch_env
        # The worker only reads the cache: whatever it loads was fetched by the init container.
        mounts.append({"name": kube.MODEL_CACHE_VOLUME, "mountPath": kube.MODEL_CACHE_PATH,
                       "readOnly": True})
        volumes.append(volume)
    pod_spec: Obj = {
        "securityContext": _pod_security(),
        "readinessGates": [{"conditionType": kube.READINESS_GATE}],
        # The worker drains on SIGTERM; give it its drain timeout plus margin before SIGKILL.
        "terminationGracePeriodSeconds": stage.drain_timeout_seconds + 15,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "worker",
                "image": spec["image"],
                "command": worker_command(stage),
                "env": env,
                "ports": [
                    {"name": "zmq", "containerPort": kube.WORKER_ZMQ_PORT},
                    {"name": "http", "containerPort": kube.WORKER_HTTP_PORT},
                ],
                # /livez answers while the model loads, so liveness never kills a slow load;
                # the startup probe allows 30 minutes before liveness starts counting. Both
                # the startup and readiness probes run every second, so a replica is Ready
                # about 1 s after its worker is (each rollout step waits for that).
                "startupProbe": _http_probe("/livez", kube.WORKER_HTTP_PORT, 1, 1800),
                "livenessProbe": _http_probe("/livez", kube.WORKER_HTTP_PORT, 10, 3),
                "readinessProbe": _http_probe(
                    "/readyz", kube.WORKER_HTTP_PORT, WORKER_READINESS_PERIOD_SECONDS,
                    WORKER_READINESS_FAILURES, WORKER_READINESS_TIMEOUT_SECONDS),
                "resources": {"requests": requests, "limits": limits},
                "securityContext": _container_security(),
                # A load failure's last log line (the worker exits MODEL_FAILED_EXIT) becomes
                # the termination message the operator reports.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
        **pod_scheduling(pipeline, stage),
    }
    if shared_memory(pool["metadata"].get("annotations")):
        _with_shared_memory(pod_spec, pipeline, res.memory)
    curve = (pool["metadata"].get("annotations") or {}).get(kube.ANNOTATION_CURVE_SECRET)
    if curve:  # a pool of a pipeline (one written by hand may have none): CurveZMQ
        _with_curve(pod_spec, curve)
        pod_spec["containers"][0]["env"] += _curve_generation_env(curve_generation_of(pool))
    if inits:
        pod_spec["initContainers"] = inits
    return pod_spec, digest(pod_spec)


def pool_pod(pool: Obj, ordinal: int, *, surge: bool = False) -> Obj:
    """Replica `ordinal` of the pool, labelled with its revision and annotated with its release
    order (metadata only: neither is in the spec hash). surge: a release's extra replica
    (omni_operator.release.ANNOTATION_SURGE)."""
    pod_spec, spec_hash = pod_template(pool)
    meta = pool["metadata"]
    pipeline, stage = pool["spec"]["pipeline"], pool["spec"]["stage"]["name"]
    lbls = {**labels(pipeline, "stage", stage), kube.LABEL_ORDINAL: str(ordinal),
            kube.LABEL_REVISION: pool_revision(pool)}
    annotations = {kube.ANNOTATION_SPEC_HASH: spec_hash,
                   kube.ANNOTATION_REVISION_ORDER: str(pool_order(pool)),
                   # Which CurveZMQ pair it is: the orchestrators connect with its public key.
                   kube.ANNOTATION_CURVE_GENERATION: str(curve_generation_of(pool))}
    if surge:
        annotations[ANNOTATION_SURGE] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": kube.replica_name(meta["name"], ordinal),
            "namespace": meta["namespace"],
            "labels": lbls,
            "annotations": annotations,
            "ownerReferences": [owner_ref(pool)],
        },
        "spec": {**pod_spec, "hostname": kube.replica_name(meta["name"], ordinal)},
    }


def pdb_due(pdb: Obj, current: Obj | None, ready_replicas: int) -> bool:
    """Whether the pool's PodDisruptionBudget is written now: once it exists, always (its
    minAvailable follows the spec); before, from the first moment the pool has minAvailable
    replicas ready.

    Why not at once: below minAvailable a budget allows no eviction at all, not even of a
    replica that serves nothing, so a `kubectl drain` of a node holding a pool that is still
    starting (or short of capacity) would wait on it; and the disruption controller counts
    every pod of the namespace for a budget at each event of its pods, so budgets present
    through a fleet's ramp cost the controller-manager time per pod that grows with the
    fleet (docs/benchmarks.md, the growth ladder)."""
    return current is not None or ready_replicas >= int(pdb["spec"]["minAvailable"])


def pool_pdb(pool: Obj) -> Obj:
    meta = pool["metadata"]
    stage = Stage.model_validate(pool["spec"]["stage"])
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            # Managed-by always, so the operator's view sees the PDB even of a pool written
            # by hand (without it, every resync would try to create it again).
            "labels": {**(meta.get("labels") or {}), kube.LABEL_MANAGED_BY: kube.MANAGED_BY,
                       kube.LABEL_POOL: meta["name"]},
            "ownerReferences": [owner_ref(pool)],
        },
        # An integer minAvailable, not maxUnavailable: for pods of a custom controller the
        # disruption controller resolves maxUnavailable through the owner's scale subresource,
        # which fails until its discovery cache learns the CRD. minAvailable needs no lookup.
        "spec": {
            "minAvailable": max(0, desired_replicas(pool) - stage.max_unavailable),
            "selector": {"matchLabels": {kube.LABEL_POOL: meta["name"]}},
        },
    }
