"""Hub models on the real control plane: a shared model cache volume, the model-fetch init
container running `omnistage models pull` from the pipeline's image, workers loading offline,
a gated-model token from a Secret that never shows up in pod specs, statuses or logs, and a
model that cannot be fetched reported in StagePool and OmniPipeline status and events.

The operator is installed by the Helm chart and every container runs in its image (the pod
runner's image mode, read-only root filesystems); the "hub" is tests/harness/hubcache.py's fake
hub on loopback, serving the tiny random-initialised models, so nothing leaves the machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from omnistage import kube as k
from omnistage.kubeapi import resource_path
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.helm import Release
from tests.harness.hubcache import FakeHub, tiny_models
from tests.harness.operator import apply, get, pipeline_doc, pod_url, wait_for

pytestmark = pytest.mark.timeout(600)
TOKEN = "hf_e2eSecretTokenValue9876543210"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    models = tiny_models(tmp_path_factory.mktemp("tiny"))
    with FakeHub({"acme/tiny-llm": models["ar"], "acme/tiny-unet": models["diffusion"]},
                 token=TOKEN) as fake:
        yield fake


@pytest.fixture
def claim(kube: Cluster, namespace: str) -> Iterator[str]:
    """A bound ReadWriteMany claim "models" (a static PV: the local cluster has no
    provisioner); the PV is cluster-scoped, so it is deleted here."""
    pv = f"{namespace}-models"
    kube.kube.create(resource_path("v1", "persistentvolumes"), {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "storageClassName": "manual", "persistentVolumeReclaimPolicy": "Retain",
                 "hostPath": {"path": f"/tmp/omnistage-e2e-{pv}"}}})
    kube.kube.create(resource_path("v1", "persistentvolumeclaims", namespace), {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                 "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}}})
    try:
        yield "models"
    finally:
        kube.kubectl("delete", "pv", pv, "--wait=false", check=False)


def _secret(kube: Cluster, ns: str) -> None:
    kube.kube.create(resource_path("v1", "secrets", ns), {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
        "stringData": {"token": TOKEN}})


def _ready(kube: Cluster, ns: str, name: str) -> Obj | None:
    obj = get(kube, ns, "omnipipe", name)
    cond = k.condition(obj, "Ready")
    return obj if cond and cond["status"] == "True" else None


def _diagnose(kube: Cluster, runner: PodRunner, ns: str, name: str) -> str:
    out = [json.dumps((get(kube, ns, "omnipipe", name) or {}).get("status"), indent=1)]
    for pod in pods(kube.kube, ns):
        pname = pod["metadata"]["name"]
        out.append(f"--- {pname} {json.dumps(pod.get('status', {}).get('initContainerStatuses'))}"
                   f"\n{runner.log_tail(ns, pname, lines=15)}")
    return "\n".join(out)


def test_hub_models_fetched_into_a_shared_cache_and_served(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release, hub: FakeHub,
    claim: str,
) -> None:
    _secret(kube, namespace)
    cache = {"claimName": claim, "endpoint": hub.url, "tokenSecret": {"name": "hf-token"}}
    stages = [
        {"name": "enc", "kind": "ar", "model": "acme/tiny-llm@main",
         "engine": {"maxTokens": 4, "returnHiddenStates": True}},
        {"name": "img", "kind": "diffusion", "model": "acme/tiny-unet", "inputs": ["enc"],
         "finalOutput": True, "engine": {"height": 32, "width": 32, "numInferenceSteps": 2}},
    ]
    doc = pipeline_doc("hubpipe", stages, modelCache=cache,
                       orchestrator={"auth": {"disabled": True},
                                     "api": ["chat", "images", "generic"]})
    apply(kube, namespace, doc)
    wait_for(lambda: _ready(kube, namespace, "hubpipe"), 300, "hubpipe Ready",
             lambda: _diagnose(kube, podrunner, namespace, "hubpipe"), interval=1)

    stage_pods = [p for p in pods(kube.kube, namespace, k.stage_selector("hubpipe"))
                  if not p["metadata"].get("deletionTimestamp")]
    assert len(stage_pods) == 2
    for pod in stage_pods:
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["name"] == k.MODEL_FETCH_CONTAINER
        assert init["state"]["terminated"]["exitCode"] == 0
        worker = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env
        assert worker["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["spec"]["initContainers"][0]["securityContext"]["readOnlyRootFilesystem"]
        fetch_log = podrunner.log_path(namespace, pod["metadata"]["name"],
                                       k.MODEL_FETCH_CONTAINER)
        assert fetch_log is not None and "model(s) in /var/cache/omnistage/hf/hub" in (
            fetch_log.read_text())
    # The init containers fetched with the token, into the one shared claim.
    assert ("GET", "/api/models/acme/tiny-llm/revision/main", f"Bearer {TOKEN}") in hub.requests
    assert podrunner.state_dir is not None
    claim_dir = podrunner.state_dir / "claims" / namespace / claim / "hub"
    assert {"models--acme--tiny-llm", "models--acme--tiny-unet"} <= {
        p.name for p in claim_dir.iterdir()}

    [orch] = [p for p in pods(kube.kube, namespace,
                              f"{k.LABEL_PIPELINE}=hubpipe,{k.LABEL_COMPONENT}=orchestrator")
              if not p["metadata"].get("deletionTimestamp")]
    with pod_url(podrunner, orch, 8000) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        chat = client.chat.completions.create(
            model="hubpipe", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.usage is not None and chat.usage.completion_tokens >= 1
        image = client.images.generate(model="hubpipe", prompt="x", size="32x32",
                                       response_format="b64_json")
        assert image.data[0].b64_json

    _assert_token_nowhere(kube, podrunner, namespace)


def _assert_token_nowhere(kube: Cluster, runner: PodRunner, ns: str) -> None:
    """The token is in the Secret only: not in any pod spec or status, in the pipeline's or the
    pools' spec or status, in an event, or in any container's log."""
    for kind in ("pods", "omnipipelines", "stagepools", "events"):
        text = kube.kubectl("get", kind, "-n", ns, "-o", "json").stdout
        assert json.loads(text)["items"], kind  # there is something to look at
        assert TOKEN not in text, kind
    assert runner.state_dir is not None
    # Every container's log, and the pod runner's own (the kubelet's) log.
    logs = [p for p in (runner.state_dir / "logs").rglob("*") if p.is_file()]
    logs.append(runner.state_dir / "podrunner.log")
    assert any(p.name == f"{k.MODEL_FETCH_CONTAINER}.log" for p in logs)
    leaked = [str(p) for p in logs if TOKEN in p.read_text(errors="replace")]
    assert leaked == []


def test_a_model_that_cannot_be_fetched_is_reported(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release, hub: FakeHub
) -> None:
    _secret(kube, namespace)
    cache = {"size": "1Gi", "endpoint": hub.url, "tokenSecret": {"name": "hf-token"}}
    doc = pipeline_doc("gone", [{"name": "llm", "kind": "ar", "model": "acme/absent",
                                 "finalOutput": True}], modelCache=cache)
    apply(kube, namespace, doc)

    def reported() -> tuple[Obj, Obj] | None:
        pool = get(kube, namespace, "stagepool", "gone-llm")
        pipe = get(kube, namespace, "omnipipe", "gone")
        pr, pp = k.condition(pool, "Ready") or {}, k.condition(pipe, "Ready") or {}
        ok = pr.get("reason") == "ModelFetchFailed" and pp.get("reason") == "ModelFetchFailed"
        return (pr, pp) if ok else None

    pool_ready, pipe_ready = wait_for(reported, 300, "ModelFetchFailed in status",
                                      lambda: _diagnose(kube, podrunner, namespace, "gone"),
                                      interval=1)
    for cond in (pool_ready, pipe_ready):
        assert cond["status"] == "False"
        assert "stage 'llm'" in cond["message"] and "acme/absent" in cond["message"]
        assert "no such repository" in cond["message"]
    events = json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    warned = [e for e in events["items"] if e.get("reason") == "ModelFetchFailed"
              and e["involvedObject"]["kind"] == "StagePool"]
    assert warned and warned[0]["type"] == "Warning" and "acme/absent" in warned[0]["message"]
    pod = next(p for p in pods(kube.kube, namespace, k.stage_selector("gone")))
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "1Gi"}} in pod["spec"]["volumes"]
    _assert_token_nowhere(kube, podrunner, namespace)
