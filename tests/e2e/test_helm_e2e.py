"""The operator as users install it: `helm install`, `helm upgrade` under load, `helm uninstall`.

Every pod runs in its image (the pod runner's image mode): the operator in the operator image
from the chart, the pipeline in the runtime image. Requests go to the orchestrator pod's
loopback IP (nothing routes Service ClusterIPs here). The chart's admission webhook is on: here
the API server calls the leader's pod IP (webhook.clientConfig=podIP), on kind the webhook
Service, which selects the leader's pod.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from omni_operator.webhook import CONFIGURATION, SERVING_LABEL
from omnistage import kube as k
from omnistage.kubeapi import resource_path
from omnistage.spec import DEFAULT_IMAGE
from tests.e2e.conftest import E2E_VALUES, release_namespace, require_images
from tests.harness.cluster import Cluster, PodRunner, cleanup_namespace, pods, temp_namespace
from tests.harness.helm import Release
from tests.harness.metrics import sample
from tests.harness.operator import api_key, get, pod_url, wait_for

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
ECHO = REPO / "examples" / "echo.yaml"
#: Refused only by the webhook (CEL cannot see a cycle behind an entry stage).
CYCLE = REPO / "tests" / "cluster" / "invalid" / "cycle.yaml"
CYCLE_PATH = "spec.stages[1].inputs[1]"
Obj = dict[str, Any]
OPERATOR_PORT = 8081


#: The example's API key (keys on by default: the Secret its status names), once read.
KEYS: dict[str, str] = {}


def _post(url: str, body: Obj, timeout: float = 30) -> tuple[int, Obj]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": f"Bearer {KEYS['echo']}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def _refused_by_the_webhook(kube: Cluster, ns: str, log_tail: Any) -> None:
    """kubectl apply of an invalid OmniPipeline is refused by the chart-installed webhook (the
    leader registers it once its server runs; a dry run probes until then), naming the field."""
    def probe() -> bool:
        return kube.kubectl("apply", "--dry-run=server", "-n", ns, "-f", str(CYCLE),
                            check=False).returncode != 0

    wait_for(probe, 90, "the webhook refusing the cycle", log_tail, 1)
    proc = kube.kubectl("apply", "-n", ns, "-f", str(CYCLE), check=False)
    assert proc.returncode != 0, f"kubectl apply accepted a cycle:\n{proc.stdout}"
    assert 'admission webhook "omnipipelines.validation.omnistage.io" denied the request' in \
        proc.stderr, proc.stderr
    assert f"{CYCLE_PATH}: cycle detected" in proc.stderr, proc.stderr
    assert get(kube, ns, "omnipipe", "cycle") is None


def _only_the_leader_is_labelled(release: Release, leader: str) -> None:
    """The webhook Service selects SERVING_LABEL: only the leader's pod may carry it."""
    def labelled() -> list[str]:
        return [p["metadata"]["name"] for p in release.operator_pods()
                if p["metadata"].get("labels", {}).get(SERVING_LABEL) == "true"]

    wait_for(lambda: labelled() == [leader], 30, f"only {leader} labelled {SERVING_LABEL}",
             lambda: f"labelled: {labelled()}\n{release.log_tail()}", 0.5)


def _reconciles(runner: PodRunner, pod: Obj) -> float:
    _, text = runner.http_get(pod, OPERATOR_PORT, "/metrics")
    value = sample(text, "omnistage_operator_reconciles_total")
    assert value is not None, text[:500]
    return value


def _ready(kube: Cluster, ns: str, name: str) -> bool:
    cond = k.condition(get(kube, ns, "omnipipe", name) or {}, "Ready")
    return bool(cond and cond["status"] == "True")


def _stage_pods(kube: Cluster, ns: str) -> list[Obj]:
    return [p for p in pods(kube.kube, ns, k.stage_selector("echo"))
            if not p["metadata"].get("deletionTimestamp")]


def _release_objects(kube: Cluster, release: Release) -> list[str]:
    """Every object of the release that is left (by the labels the chart puts on all of them)."""
    selector = f"app.kubernetes.io/instance={release.name}"
    left = []
    namespaced = [("apps/v1", "deployments"), ("v1", "serviceaccounts"), ("v1", "services"),
                  ("policy/v1", "poddisruptionbudgets"), ("rbac.authorization.k8s.io/v1", "roles"),
                  ("rbac.authorization.k8s.io/v1", "rolebindings"), ("v1", "pods")]
    for api, resource in namespaced:
        for obj in kube.kube.get(resource_path(api, resource, release.namespace),
                                 labelSelector=selector)["items"]:
            left.append(f"{resource}/{obj['metadata']['name']}")
    for resource in ("clusterroles", "clusterrolebindings"):
        for obj in kube.kube.get(resource_path("rbac.authorization.k8s.io/v1", resource),
                                 labelSelector=selector)["items"]:
            if obj["metadata"]["name"].startswith(release.fullname):
                left.append(f"{resource}/{obj['metadata']['name']}")
    # The webhook configuration the operator filled in belongs to the release.
    for obj in kube.kube.get(resource_path("admissionregistration.k8s.io/v1",
                                           "validatingwebhookconfigurations"))["items"]:
        if obj["metadata"]["name"] == CONFIGURATION:
            left.append(f"validatingwebhookconfigurations/{CONFIGURATION}")
    return left


def test_helm_install_upgrade_under_load_and_uninstall(kube: Cluster, podrunner: PodRunner) -> None:
    require_images(podrunner)
    release = Release(kube, podrunner, release_namespace(kube, "omnistage-helm-"))
    with temp_namespace(kube.kube, "helm-app-") as app_ns:
        try:
            _install_run_upgrade_uninstall(kube, podrunner, release, app_ns)
        finally:
            release.uninstall()
            cleanup_namespace(kube.kube, release.namespace)
            # Pipelines outlive `helm uninstall` (their finalizer waits for an operator): let
            # the namespace go without one.
            for kind in ("omnipipelines", "stagepools"):
                for obj in kube.kube.get(resource_path("omnistage.io/v1alpha1", kind,
                                                       app_ns))["items"]:
                    kube.kube.patch(resource_path("omnistage.io/v1alpha1", kind, app_ns,
                                                  obj["metadata"]["name"]),
                                    {"metadata": {"finalizers": None}})


def _install_run_upgrade_uninstall(kube: Cluster, runner: PodRunner, release: Release,
                                   app_ns: str) -> None:
    # 1. helm install: two operator replicas from the chart, in the operator image.
    out = release.install(*E2E_VALUES, "replicaCount=2")
    notes = out.split("NOTES:", 1)[1]
    assert f"installed as omnistage-operator in {release.namespace}" in notes
    assert "never upgrades or deletes them" in notes  # the CRD policy
    op_pods = release.operator_pods()
    assert len(op_pods) == 2
    for pod in op_pods:
        [c] = pod["spec"]["containers"]
        assert c["image"] == f"ghcr.io/omnistage/omnistage-operator:{DEFAULT_IMAGE.split(':')[-1]}"
        assert pod["spec"]["serviceAccountName"] == release.fullname
    leader = release.wait_leader()
    assert kube.kubectl("get", "crd", "omnipipelines.omnistage.io", check=False).returncode == 0
    assert "admission webhook" in notes
    _refused_by_the_webhook(kube, app_ns, release.log_tail)
    _only_the_leader_is_labelled(release, leader)

    # 2. A pipeline reconciled by the leader only.
    kube.kubectl("apply", "-n", app_ns, "-f", str(ECHO))
    wait_for(lambda: _ready(kube, app_ns, "echo"), 300, "echo Ready", release.log_tail, 1)
    by_name = {p["metadata"]["name"]: p for p in release.operator_pods()}
    standby = next(p for name, p in by_name.items() if name != leader)
    assert _reconciles(runner, by_name[leader]) > 0
    assert _reconciles(runner, standby) == 0  # a standby never reconciles
    [orch] = [p for p in pods(kube.kube, app_ns, f"{k.LABEL_PIPELINE}=echo,"
                                                  f"{k.LABEL_COMPONENT}=orchestrator")
              if not p["metadata"].get("deletionTimestamp")]
    KEYS["echo"] = api_key(kube, app_ns, "echo")
    with pod_url(runner, orch, 8000) as base:  # the pod IP here, a port-forward on kind
        _serve_through_upgrade_and_uninstall(kube, release, app_ns,
                                             f"{base}/v1/pipelines/echo/requests")


def _serve_through_upgrade_and_uninstall(kube: Cluster, release: Release, app_ns: str,
                                         url: str) -> None:
    assert _post(url, {"prompt": "hello"})[0] == 200

    # 3. helm upgrade with a changed value rolls the operator while the pipeline serves.
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                status, body = _post(url, {"prompt": "under upgrade"})
                results.append("ok" if status == 200 else f"{status}: {body}")
            except Exception as exc:  # every failure is a lost request
                results.append(f"{type(exc).__name__}: {exc}")
            stop.wait(0.05)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    old = {p["metadata"]["uid"] for p in release.operator_pods()}
    try:
        wait_for(lambda: len(results) >= 10, 60, "load running")
        release.upgrade(*E2E_VALUES, "replicaCount=2",
                        "podAnnotations.omnistage\\.io/rollout=second")
        wait_for(lambda: not old & {p["metadata"]["uid"] for p in release.operator_pods()}
                 and len(release.operator_pods()) == 2, 180,
                 "every operator pod replaced", release.log_tail)
        new_leader = release.wait_leader()
        assert new_leader in {p["metadata"]["name"] for p in release.operator_pods()}
        # The new leader serves the webhook (it rewrote the configuration at its start).
        _refused_by_the_webhook(kube, app_ns, release.log_tail)
        _only_the_leader_is_labelled(release, new_leader)
        # The new leader reconciles: a scale-up of a pool is carried out.
        kube.kubectl("scale", "-n", app_ns, "sp/echo-a", "--replicas=2")
        wait_for(lambda: sum(p["metadata"]["labels"].get(k.LABEL_STAGE) == "a"
                             and k.condition_status(p, "Ready") == "True"
                             for p in _stage_pods(kube, app_ns)) == 2,
                 300, "echo-a scaled to 2 by the new leader", release.log_tail, 1)
        during = len(results)
        wait_for(lambda: len(results) >= during + 10, 60, "load after the upgrade")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    failures = [r for r in results if r != "ok"]
    assert not failures, failures[:5]
    assert len(results) >= 20

    # 4. helm uninstall removes the release's objects; the CRDs and the live pipeline stay.
    release.uninstall()
    wait_for(lambda: not _release_objects(kube, release), 120, "the release's objects gone",
             lambda: str(_release_objects(kube, release)))
    for crd in ("omnipipelines.omnistage.io", "stagepools.omnistage.io"):
        assert kube.kubectl("get", "crd", crd, check=False).returncode == 0, crd
    assert get(kube, app_ns, "omnipipe", "echo") is not None
    time.sleep(1)
    assert _post(url, {"prompt": "after uninstall"})[0] == 200  # pipelines keep serving
