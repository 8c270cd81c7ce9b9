"""Pure builders: the shared-memory opt-in on the pods they build (the rest is covered against a
real API server in tests/cluster)."""

from __future__ import annotations

import base64
import inspect
import json
import re
from typing import Any

import pytest

from omni_operator import builders as b
from omnistage import kube
from omnistage.orchestrator.engine import Orchestrator
from omnistage.shm import ENV_CAP, ENV_DIR, ENV_SESSION, ShmConfig
from omnistage.spec import SpecError, parse_pipeline

OWNER = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
         "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}}


def pipeline(annotations: dict[str, str] | None = None) -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "p", "annotations": annotations or {}},
        "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                             "resources": {"memory": "8Gi"}}]},
    })


def pods(pipe: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(orchestrator pod spec, stage pod spec) as the operator would create them."""
    children = b.pipeline_children(OWNER, pipe)
    [deployment] = [c for c in children if c["kind"] == "Deployment"]
    [pool] = [c for c in children if c["kind"] == "StagePool"]
    pool["metadata"]["uid"] = "u2"  # the API server's, once created
    return deployment["spec"]["template"]["spec"], b.pool_pod(pool, 0)["spec"]


def test_shared_memory_is_off_unless_asked() -> None:
    for switch in (None, {kube.ANNOTATION_SHARED_MEMORY: "false"}):
        for spec in pods(pipeline(switch)):
            assert all("hostPath" not in v for v in spec["volumes"])
            names = {e["name"] for e in spec["containers"][0]["env"]}
            assert ENV_DIR not in names


def test_opting_in_mounts_the_node_directory_in_every_pod() -> None:
    orch, stage = pods(pipeline({kube.ANNOTATION_SHARED_MEMORY: "true"}))
    for spec, memory in ((orch, 1 << 30), (stage, 8 << 30)):
        [volume] = [v for v in spec["volumes"] if "hostPath" in v]
        assert volume["hostPath"] == {"path": b.SHM_HOST_PATH, "type": "DirectoryOrCreate"}
        container = spec["containers"][0]
        assert {"name": volume["name"], "mountPath": b.SHM_MOUNT_PATH} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        cfg = ShmConfig.from_env(env)  # exactly what the runtime in the pod will read
        assert cfg is not None and str(cfg.dir) == b.SHM_MOUNT_PATH and cfg.session == "p"
        assert cfg.cap_bytes == memory // b.SHM_CAP_SHARE  # pages count toward the limit
        assert env[ENV_SESSION] == "p" and env[ENV_CAP]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_pool_carries_the_switch_both_ways() -> None:
    for value in ("true", "false"):
        [pool] = [c for c in b.pipeline_children(OWNER, pipeline(
            {kube.ANNOTATION_SHARED_MEMORY: value})) if c["kind"] == "StagePool"]
        assert pool["metadata"]["annotations"][kube.ANNOTATION_SHARED_MEMORY] == value


def test_a_misspelt_switch_is_refused() -> None:
    with pytest.raises(SpecError, match=re.escape(
            'omnistage.io/shared-memory must be "true" or "false", got \'yes\'')):
        pipeline({kube.ANNOTATION_SHARED_MEMORY: "yes"})


@pytest.mark.parametrize(("quantity", "expected"), [
    ("2Gi", 2 << 30), ("512Mi", 512 << 20), ("1G", 10**9), ("1.5Gi", 3 << 29), ("1000", 1000),
    ("64Mi", 64 << 20),
])
def test_memory_quantities(quantity: str, expected: int) -> None:
    assert b._quantity_bytes(quantity) == expected


def _orchestrator(orchestrator: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the orchestrator Deployment, its ConfigMap) for a pipeline with this orchestrator."""
    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"orchestrator": orchestrator,
                 "stages": [{"name": "a", "kind": "echo", "finalOutput": True}]},
    })
    children = b.pipeline_children(OWNER, pipe)
    [deployment] = [c for c in children if c["kind"] == "Deployment"]
    [config] = [c for c in children if c["kind"] == "ConfigMap"]
    return deployment, config


def test_scaling_the_orchestrator_restarts_none_of_its_pods() -> None:
    """Only spec.replicas changes: the pod template, its hash annotation and the pipeline the
    orchestrator reads are the same, so the Deployment adds or removes pods and rolls none.
    Kills: the replica count inside the orchestrator's manifest (every orchestrator pod was
    rolled on a scale)."""
    one, one_config = _orchestrator({"replicas": 1})
    three, three_config = _orchestrator({"replicas": 3})
    assert (one["spec"]["replicas"], three["spec"]["replicas"]) == (1, 3)
    assert one["spec"]["template"] == three["spec"]["template"]
    assert one_config["data"] == three_config["data"]
    assert "replicas" not in json.loads(one_config["data"][b.PIPELINE_KEY])["spec"].get(
        "orchestrator", {})
    # The hash is not inert: a field the orchestrator reads still rolls it.
    slower, _ = _orchestrator({"replicas": 1, "requestTimeoutSeconds": 123})
    hash_of = lambda d: d["spec"]["template"]["metadata"]["annotations"][  # noqa: E731
        kube.ANNOTATION_SPEC_HASH]
    assert hash_of(slower) != hash_of(one)


def test_a_hung_worker_leaves_ready_within_the_orchestrator_s_heartbeat_bound() -> None:
    """The kubelet probes one at a time: a worker that never answers is NotReady after
    failureThreshold x max(timeoutSeconds, periodSeconds), plus up to one period before the
    first failing probe. That must stay within a few seconds of the orchestrator's 3 s
    heartbeat timeout (it declared a SIGSTOPped replica lost at 3.4 s while the pod stayed
    Ready for 15 s: timeoutSeconds 5). Kills: going back to the 5 s timeout, or a threshold
    that stretches it. The behaviour itself is tested with a SIGSTOPped worker in
    tests/cluster/test_lifecycle_operator.py."""
    heartbeat = inspect.signature(Orchestrator).parameters["heartbeat_timeout"].default
    probe = pods(pipeline())[1]["containers"][0]["readinessProbe"]
    worst = probe["failureThreshold"] * max(probe["timeoutSeconds"], probe["periodSeconds"]) \
        + probe["periodSeconds"]
    assert worst <= heartbeat + 1, probe
    assert probe["failureThreshold"] >= 2  # one slow answer alone never takes it out


def test_streaming_is_the_orchestrator_s_alone() -> None:
    """Turning streaming between stages off changes the orchestrator's copy of the pipeline
    and not the pools' (so it rolls no stage replica)."""
    def doc(enabled: bool) -> Any:
        return parse_pipeline({
            "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p"},
            "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                 "streaming": {"enabled": enabled, "window": 3}}]}})

    on, off = doc(True), doc(False)
    assert b.pool_stage(on.spec.stages[0]) == b.pool_stage(off.spec.stages[0])
    assert "streaming" not in b.pool_stage(off.spec.stages[0])
    assert b.pipeline_manifest(off)["spec"]["stages"][0]["streaming"] == {
        "enabled": False, "window": 3}


def test_the_dispatch_window_is_the_orchestrator_s_alone() -> None:
    """Setting a stage's dispatch window changes the orchestrator's copy of the pipeline and
    not the pools' (so it rolls no stage replica)."""
    def doc(window: int | None) -> Any:
        return parse_pipeline({
            "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p"},
            "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                 "dispatch": {"perReplica": window}}]}})

    on, off = doc(2), doc(None)
    assert b.pool_stage(on.spec.stages[0]) == b.pool_stage(off.spec.stages[0])
    assert "dispatch" not in b.pool_stage(on.spec.stages[0])
    assert b.pipeline_manifest(on)["spec"]["stages"][0]["dispatch"] == {"perReplica": 2}


def test_an_api_key_secret_is_mounted_read_only_and_named_in_the_environment(
        tmp_path: Any) -> None:
    """Keys on by default: spec.orchestrator.auth.apiKeySecret, else the Secret the operator
    makes (named by the uid), is a secret volume (rotates without a restart, unlike an env
    value from the Secret), mounted read-only, its path in $OMNISTAGE_API_KEY_FILE; and what
    the orchestrator in that pod does with that environment. auth.disabled: none of it."""
    from omnistage.orchestrator.auth import resolve

    def api_key_volumes(spec: dict[str, Any]) -> list[dict[str, Any]]:
        return [v for v in spec["volumes"] if v["name"] == "api-keys"]

    off, _ = _orchestrator({"auth": {"disabled": True}})
    spec = off["spec"]["template"]["spec"]
    assert api_key_volumes(spec) == []
    assert kube.API_KEY_FILE_ENV not in {e["name"] for e in spec["containers"][0]["env"]}
    made, _ = _orchestrator({})
    [volume] = api_key_volumes(made["spec"]["template"]["spec"])
    assert volume["secret"] == {"secretName": "p-api-keys-u1"}
    assert b.api_key_secret_name("p", "u1") == "p-api-keys-u1"
    keyed, _ = _orchestrator({"auth": {"apiKeySecret": "p-api-keys"}})
    spec = keyed["spec"]["template"]["spec"]
    [volume] = api_key_volumes(spec)
    assert volume["secret"] == {"secretName": "p-api-keys"}
    container = spec["containers"][0]
    assert {"name": volume["name"], "mountPath": kube.API_KEYS_DIR, "readOnly": True} in \
        container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[kube.API_KEY_FILE_ENV] == kube.API_KEYS_DIR
    # The pod's process, given that environment (the volume's files here in tmp_path):
    (tmp_path / "primary").write_text("sk-from-the-secret-0123456789")
    keys, _ = resolve(None, no_auth=False, host="0.0.0.0", secret="p-api-keys",
                      environ={kube.API_KEY_FILE_ENV: str(tmp_path)})
    assert keys is not None and keys.allows("Bearer sk-from-the-secret-0123456789")


def test_the_api_key_secret_the_operator_makes_holds_one_usable_key(tmp_path: Any) -> None:
    """The made Secret: owned by the pipeline, one key the runtime accepts as a key file."""
    from omnistage.orchestrator.auth import ApiKeys

    owner = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
             "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}}
    pipeline = parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                               "metadata": {"name": "p"}, "spec": {"stages": [
                                   {"name": "a", "kind": "echo", "finalOutput": True}]}})
    secret = b.api_key_secret(owner, pipeline, "sk-made-0123456789abcdef")
    assert secret["metadata"]["name"] == "p-api-keys-u1"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u1"
    for key, value in secret["data"].items():
        (tmp_path / key).write_bytes(base64.b64decode(value))
    keys = ApiKeys.from_file(tmp_path)
    assert keys.count == 1 and keys.allows("Bearer sk-made-0123456789abcdef")


def test_a_bad_api_key_secret_name_is_refused_with_its_path() -> None:
    with pytest.raises(SpecError) as caught:
        _orchestrator({"auth": {"apiKeySecret": "Not_A_Name"}})
    assert [p for p, _ in caught.value.errors] == ["spec.orchestrator.auth.apiKeySecret"]


def test_the_curve_secret_is_mounted_in_every_pod_and_reads_as_the_pair(tmp_path: Any) -> None:
    """The pipeline's CurveZMQ Secret: named by the pipeline's uid, holding the pair as the
    runtime's key files, mounted read-only in the orchestrator and every stage pod and named
    in $OMNISTAGE_CURVE_KEYS; a pool written by hand (no annotation) mounts nothing."""
    import base64

    from omnistage import curve_keys

    pair = curve_keys.generate()
    secret = b.curve_secret(OWNER, pipeline(), pair)
    assert secret["metadata"]["name"] == "p-curve-u1"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u1"
    for name, data in secret["data"].items():  # the files the kubelet writes
        (tmp_path / name).write_bytes(base64.b64decode(data))
    assert curve_keys.load(tmp_path) == pair
    for spec in pods(pipeline()):
        [volume] = [v for v in spec["volumes"] if v["name"] == "curve-keys"]
        assert volume["secret"] == {"secretName": "p-curve-u1", "defaultMode": 0o440}
        container = spec["containers"][0]
        assert {"name": "curve-keys", "mountPath": kube.CURVE_KEYS_DIR, "readOnly": True} in \
            container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[curve_keys.CURVE_KEYS_ENV] == kube.CURVE_KEYS_DIR
    [pool] = [c for c in b.pipeline_children(OWNER, pipeline()) if c["kind"] == "StagePool"]
    del pool["metadata"]["annotations"][kube.ANNOTATION_CURVE_SECRET]
    pool["metadata"]["uid"] = "u2"
    spec = b.pool_pod(pool, 0)["spec"]
    assert all(v["name"] != "curve-keys" for v in spec["volumes"])
    assert curve_keys.CURVE_KEYS_ENV not in {e["name"] for e in spec["containers"][0]["env"]}


# ---- the admin listener (issue 43) -------------------------------------------------------------


def _admin_children(orchestrator: dict[str, Any] | None = None,
                    digests: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"orchestrator": orchestrator or {},
                 "stages": [{"name": "a", "kind": "echo", "finalOutput": True}]},
    })
    return b.pipeline_children(OWNER, pipe, admin_key_digests=digests)


def _by_name(children: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == kind}


def test_the_orchestrator_listens_on_an_admin_port_with_the_operator_s_digest() -> None:
    """The orchestrator container declares its admin port (named admin, spec.orchestrator.
    adminPort) beside the API port, and gets the digest of the pipeline's derived key in
    $OMNISTAGE_ADMIN_KEY_DIGESTS, never the key; the orchestrator in that pod, given that
    environment, admits exactly that key. Kills: the key itself in the pod, a digest of
    another pipeline's key, a port left out."""
    from omni_operator.admin_credential import AdminCredential
    from omnistage.orchestrator.auth import key_digest_hex, resolve_admin

    credential = AdminCredential(b"r" * 40, "/etc/omnistage/admin-key/admin-key")
    key = credential.key("ns", "p", "u1")  # OWNER's namespace, name and uid
    digest = credential.digest("ns", "p", "u1")
    assert digest == key_digest_hex(key) and key not in digest
    children = _admin_children({"port": 9000, "adminPort": 9100}, (digest,))
    [deployment] = _by_name(children, "Deployment").values()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": 9000},
                                  {"name": kube.ADMIN_PORT_NAME, "containerPort": 9100}]
    assert kube.ADMIN_PORT_NAME == "admin"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[kube.ADMIN_KEY_DIGESTS_ENV] == digest
    assert key not in json.dumps(children)  # nowhere in what the operator writes
    # The admin port is the pipeline's (in the manifest the orchestrator reads), not a flag.
    assert "--admin-port" not in container["command"]
    config = _by_name(children, "ConfigMap")["p-pipeline"]
    assert json.loads(config["data"][b.PIPELINE_KEY])["spec"]["orchestrator"]["adminPort"] == 9100
    keys, _ = resolve_admin(None, no_auth=False, host="pod.example",
                            environ={k: v for k, v in env.items() if v is not None})
    assert keys is not None and keys.allows(f"Bearer {key}")
    assert not keys.allows(f"Bearer {credential.key('ns', 'p', 'another-uid')}")
    # Several digests (a rotation) go comma-separated.
    two = _admin_children(digests=(digest, "0" * 64))
    [deployment] = _by_name(two, "Deployment").values()
    env = {e["name"]: e.get("value")
           for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[kube.ADMIN_KEY_DIGESTS_ENV] == f"{digest},{'0' * 64}"


def test_the_admin_port_defaults_and_the_probes_stay_on_the_api_port() -> None:
    [deployment] = _by_name(_admin_children(digests=("0" * 64,)), "Deployment").values()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000},
                                  {"name": "admin", "containerPort": 8001}]
    assert container["readinessProbe"]["httpGet"]["port"] == 8000
    assert container["livenessProbe"]["httpGet"]["port"] == 8000
    # adminPort unset: the port after the API's, in the pod, the Service and the policy.
    moved = _admin_children({"port": 9000})
    [deployment] = _by_name(moved, "Deployment").values()
    assert deployment["spec"]["template"]["spec"]["containers"][0]["ports"][1] == {
        "name": "admin", "containerPort": 9001}
    assert _by_name(moved, "Service")["p-orchestrator-admin"]["spec"]["ports"][0]["port"] == 9001
    # Without digests given (a builder called outside the reconciler): no variable at all.
    [plain] = _by_name(_admin_children(), "Deployment").values()
    names = {e["name"] for e in plain["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert kube.ADMIN_KEY_DIGESTS_ENV not in names


def test_the_public_service_has_only_the_api_port_and_the_admin_service_only_admin() -> None:
    """Control, /v1/load and /metrics are never behind the pipeline's Service (its clients and
    gateways); the admin Service `<orchestrator>-admin` exposes the admin port alone, selects
    the same pods, and is owned and labelled like every child (so the view watches it and the
    garbage collector takes it with the pipeline). It comes before the workloads."""
    children = _admin_children({"port": 9000, "adminPort": 9100}, ("0" * 64,))
    services = _by_name(children, "Service")
    assert sorted(services) == ["p-orchestrator", "p-orchestrator-admin"]
    assert b.admin_service_name("p") == "p-orchestrator-admin"
    public, admin = services["p-orchestrator"], services["p-orchestrator-admin"]
    assert public["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": 9000}]
    assert admin["spec"]["ports"] == [{"name": "admin", "port": 9100, "targetPort": 9100}]
    [deployment] = _by_name(children, "Deployment").values()
    assert admin["spec"]["selector"] == public["spec"]["selector"] == \
        deployment["spec"]["selector"]["matchLabels"]
    assert admin["metadata"]["labels"] == public["metadata"]["labels"]
    assert admin["metadata"]["labels"][kube.LABEL_MANAGED_BY] == kube.MANAGED_BY
    assert admin["metadata"]["ownerReferences"] == public["metadata"]["ownerReferences"]
    assert admin["metadata"]["ownerReferences"][0]["uid"] == "u1"
    kinds = [c["kind"] for c in children]
    assert kinds.index("Deployment") > max(i for i, k in enumerate(kinds) if k == "Service")
    # The endpoint in the pipeline's status stays the public API.
    pipe = parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                           "metadata": {"name": "p"},
                           "spec": {"orchestrator": {"port": 9000, "adminPort": 9100},
                                    "stages": [{"name": "a", "kind": "echo",
                                                "finalOutput": True}]}})
    assert b.endpoint(pipe, "ns") == "http://p-orchestrator.ns.svc:9000"


def test_the_reconciler_builds_with_its_credential_s_digest() -> None:
    """The digest in the Deployment the reconciler applies is its credential's for the
    pipeline as the API server has it (namespace, name, uid); the same root gives the same
    digest (a restarted operator writes nothing), another root or uid another."""
    import asyncio

    from omni_operator.admin_credential import AdminCredential
    from omni_operator.controller import Controller
    from tests.unit.test_network_policy import Api

    def applied_digest(root: bytes, uid: str) -> str:
        api = Api()
        c = Controller(api=api)  # type: ignore[arg-type]
        c.writes.event = lambda *a, **k: None  # type: ignore[method-assign,assignment]
        c.pipeline_reconciler.admin = AdminCredential(root, "file")
        owner = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                 "metadata": {"name": "p", "namespace": "ns", "uid": uid, "generation": 1},
                 "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}}
        c.view.observe("OmniPipeline", "ADDED", owner)
        asyncio.run(c.pipeline_reconciler.reconcile(owner))
        [deployment] = [o for url, o in api.applies if "/deployments/" in url]
        env = {e["name"]: e.get("value")
               for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert c.pipeline_reconciler.admin_key("ns", "p") == AdminCredential(root).key(
            "ns", "p", uid)
        assert c.pipeline_reconciler.admin_key("ns", "gone") is None
        assert any("/services/p-orchestrator-admin" in url for url, _ in api.applies)
        return str(env[kube.ADMIN_KEY_DIGESTS_ENV])

    first = applied_digest(b"a" * 32, "u1")
    assert first == AdminCredential(b"a" * 32).digest("ns", "p", "u1")
    assert applied_digest(b"a" * 32, "u1") == first
    assert applied_digest(b"b" * 32, "u1") != first
    assert applied_digest(b"a" * 32, "u2") != first
