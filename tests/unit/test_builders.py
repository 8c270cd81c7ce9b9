"""Pure builders: the shared-memory opt-in on the pods they build (the rest is covered against a
real API server in tests/cluster)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from omni_operator import builders as b
from omnistage import kube
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
