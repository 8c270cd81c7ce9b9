"""The generated CRDs and the operator's RBAC against the real kube-apiserver.

Why against a real server: whether a schema is structural, whether CEL rules fit the cost budget,
and what `kubectl apply` prints for a bad manifest are decided by the API server alone; a mock
would only echo our own assumptions. The CRDs and RBAC are applied idempotently and left in place
(other tests of the session, such as the operator's, rely on them too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.models import StagePoolSpec
from omnistage.spec import Stage, load_pipeline
from tests.harness.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
RBAC = REPO / "operator" / "rbac.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
OPERATOR = "system:serviceaccount:omnistage-system:omnistage-operator"


@pytest.fixture(scope="module")
def crds(kube: Cluster) -> Cluster:
    """Apply crds/ and wait until both CRDs are Established (served)."""
    kube.kubectl("apply", "-f", str(CRDS))
    names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in sorted(CRDS.glob("*.yaml"))]
    kube.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names]
    )
    return kube


def _get(kube: Cluster, namespace: str, ref: str) -> dict[str, Any]:
    out = kube.kubectl("get", "-n", namespace, ref, "-o", "json").stdout
    return json.loads(out)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- valid objects


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_apply_cleanly_and_nothing_is_pruned(
    crds: Cluster, namespace: str, path: Path
) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", str(path))
    doc = yaml.safe_load(path.read_text())
    stored = _get(crds, namespace, f"omnipipe/{doc['metadata']['name']}")
    assert stored["spec"] == doc["spec"], "the API server pruned or changed fields"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_model_field_round_trips(crds: Cluster, namespace: str, path: Path) -> None:
    """The runtime's full dump (every default spelled out) survives the schema unpruned."""
    manifest = load_pipeline(path).to_manifest()
    manifest["metadata"].pop("namespace", None)
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    stored = _get(crds, namespace, f"omnipipe/{manifest['metadata']['name']}")
    assert stored["spec"] == manifest["spec"]


def test_explain_shows_descriptions(crds: Cluster) -> None:
    out = crds.kubectl("explain", "omnipipe.spec.stages").stdout
    assert "The stages, a directed acyclic graph" in out
    assert "inputs" in out and "finalOutput" in out
    engine = crds.kubectl("explain", "omnipipe.spec.stages.engine").stdout
    assert "Executor options" in engine and "numInferenceSteps" in engine
    pool = crds.kubectl("explain", "sp.spec.replicas").stdout
    assert "kubectl scale" in pool


def test_get_shows_printer_columns(crds: Cluster, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "echo.yaml"))
    status = {
        "status": {
            "observedGeneration": 1,
            "phase": "Ready",
            "stagesReady": "2/2",
            "endpoint": "http://echo-orchestrator.ns.svc:8000",
            "stages": {"a": {"pool": "echo-a", "ready": 1, "desired": 1}},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "AllReplicasReady",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "observedGeneration": 1,
                }
            ],
        }
    }
    crds.kubectl(
        "patch", "-n", namespace, "omnipipe/echo", "--subresource=status", "--type=merge",
        "-p", json.dumps(status),
    )  # fmt: skip
    out = crds.kubectl("get", "-n", namespace, "omnipipe").stdout
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "READY", "REASON", "STAGES", "ENDPOINT", "AGE"]
    endpoint = status["status"]["endpoint"]
    assert row.split()[:6] == ["echo", "Ready", "True", "AllReplicasReady", "2/2", endpoint]
    stored = _get(crds, namespace, "omnipipe/echo")
    assert stored["status"]["stages"] == status["status"]["stages"], "status fields pruned"
    # The category lists both kinds.
    assert (
        "omnipipeline.omnistage.io/echo" in crds.kubectl("get", "-n", namespace, "omnistage").stdout
    )


def _stagepool(name: str = "echo-a", replicas: int = 1) -> dict[str, Any]:
    spec = StagePoolSpec(
        pipeline="echo",
        stage=Stage(name="a", kind="echo"),
        replicas=replicas,
        image="ghcr.io/omnistage/omnistage:0.1.0",
    )
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "StagePool",
        "metadata": {"name": name},
        "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }


def test_stagepool_scale_subresource_and_columns(crds: Cluster, namespace: str) -> None:
    pool = _stagepool()
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))
    assert _get(crds, namespace, "sp/echo-a")["spec"] == pool["spec"], "StagePool spec pruned"
    crds.kubectl("scale", "-n", namespace, "sp/echo-a", "--replicas=3")
    assert _get(crds, namespace, "sp/echo-a")["spec"]["replicas"] == 3

    status = {
        "replicas": 3,
        "readyReplicas": 2,
        "updatedReplicas": 3,
        "drainingReplicas": 1,
        "ready": "2/3",
        "selector": "omnistage.io/pipeline=echo,omnistage.io/stage=a",
        "observedGeneration": 2,
    }
    crds.kubectl(
        "patch", "-n", namespace, "sp/echo-a", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    out = crds.kubectl("get", "-n", namespace, "sp").stdout
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "PIPELINE", "STAGE", "DESIRED", "CURRENT", "READY",
                              "DRAINING", "AUTOSCALER", "AGE"]
    # No autoscaling: the Autoscaler column is empty (8 words for 9 columns, Age last).
    assert row.split()[:7] == ["echo-a", "echo", "a", "3", "3", "2/3", "1"]
    assert len(row.split()) == 8
    scale = json.loads(
        crds.kubectl(
            "get", "--raw", f"/apis/omnistage.io/v1alpha1/namespaces/{namespace}/stagepools/"
            "echo-a/scale",
        ).stdout
    )  # fmt: skip
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 3, "selector": status["selector"]}

    # Scaling back down works, and the bound holds through the scale subresource too.
    crds.kubectl("scale", "-n", namespace, "sp/echo-a", "--replicas=1")
    assert _get(crds, namespace, "sp/echo-a")["spec"]["replicas"] == 1
    too_many = crds.kubectl("scale", "-n", namespace, "sp/echo-a", "--replicas=65", check=False)
    assert too_many.returncode != 0
    assert "spec.replicas" in too_many.stderr and "less than or equal to 64" in too_many.stderr


def test_stagepool_immutable_fields(crds: Cluster, namespace: str) -> None:
    pool = _stagepool()
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))
    pool["spec"]["pipeline"] = "other"
    pool["spec"]["stage"]["kind"] = "ar"
    pool["spec"]["stage"]["model"] = "tiny-llama"
    proc = crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool), check=False)
    assert proc.returncode != 0
    assert "spec.pipeline" in proc.stderr and "pipeline is immutable" in proc.stderr
    assert "spec.stage.kind" in proc.stderr and "kind is immutable" in proc.stderr


def test_every_status_the_operator_writes_is_stored_unpruned(crds: Cluster, namespace: str) -> None:
    """Each status variant the status module can produce, through the real status subresource."""
    from tests.unit.test_status import every_status

    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "echo.yaml"))
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_stagepool()))
    for name, status in every_status():
        ref = "sp/echo-a" if name.startswith("pool") else "omnipipe/echo"
        proc = crds.kubectl(
            "patch", "-n", namespace, ref, "--subresource=status", "--type=merge",
            "--dry-run=server", "-o", "json", "-p", json.dumps({"status": status}), check=False,
        )  # fmt: skip
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
        stored = json.loads(proc.stdout)["status"]
        assert stored == status, f"{name}: the API server pruned or changed the status"


# Invalid manifests: tests/cluster/test_validation.py runs each through the API server (with and
# without the admission webhook) and through `omnistage validate`.


# ---------------------------------------------------------------------------- RBAC


@pytest.fixture(scope="module")
def rbac(crds: Cluster) -> Iterator[Cluster]:
    crds.kubectl("apply", "-f", str(RBAC))
    yield crds
    # The e2e suite's `helm install` in this session creates the same cluster-scoped names and
    # refuses to adopt objects it did not create.
    crds.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", str(RBAC))


def _can(kube: Cluster, *args: str, namespace: str = "default") -> bool:
    proc = kube.kubectl("auth", "can-i", *args, f"--as={OPERATOR}", "-n", namespace, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stdout + proc.stderr
    return answer == "yes"


ALLOWED = [
    ("watch", "omnipipelines.omnistage.io"),
    ("create", "stagepools.omnistage.io"),
    ("delete", "stagepools.omnistage.io"),
    ("patch", "omnipipelines.omnistage.io", "--subresource=status"),
    ("update", "omnipipelines.omnistage.io", "--subresource=finalizers"),
    ("create", "pods"),
    ("delete", "pods"),
    ("patch", "pods", "--subresource=status"),
    ("create", "services"),
    ("create", "configmaps"),
    ("create", "serviceaccounts"),
    ("patch", "deployments.apps"),
    ("create", "poddisruptionbudgets.policy"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("create", "events"),
    ("patch", "events"),
    ("get", "events"),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "validatingwebhookconfigurations.admissionregistration.k8s.io"),
    ("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io/"
              "validation.omnistage.io"),
]
DENIED = [
    ("delete", "nodes"),
    ("get", "secrets"),
    ("list", "secrets"),
    ("create", "pods", "--subresource=exec"),
    ("update", "deployments.apps"),
    ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("delete", "namespaces"),
    ("create", "statefulsets.apps"),
    ("patch", "nodes"),
    # Never used by the operator (tests/e2e/test_chart_rbac.py reads the audit log).
    ("get", "pods"),
    ("delete", "services"),
    ("create", "events.events.k8s.io"),
    ("list", "namespaces"),
    # The webhook configuration: patch only its own, never delete or read it.
    ("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io/other"),
    ("delete", "validatingwebhookconfigurations.admissionregistration.k8s.io"),
    ("patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io"),
]


@pytest.mark.parametrize("args", ALLOWED, ids=lambda a: " ".join(a))
def test_operator_may(rbac: Cluster, args: tuple[str, ...]) -> None:
    assert _can(rbac, *args)


@pytest.mark.parametrize("args", DENIED, ids=lambda a: " ".join(a))
def test_operator_may_not(rbac: Cluster, args: tuple[str, ...]) -> None:
    assert not _can(rbac, *args)


def test_operator_can_grant_the_orchestrator_role_but_nothing_more(
    rbac: Cluster, namespace: str
) -> None:
    """RBAC only lets a subject grant verbs it holds: the orchestrator's Role must be within it."""
    as_op = f"--as={OPERATOR}"
    rbac.kubectl(
        as_op, "-n", namespace, "create", "role", "orchestrator",
        "--verb=list,watch", "--resource=pods",
    )  # fmt: skip
    rbac.kubectl(
        as_op, "-n", namespace, "create", "rolebinding", "orchestrator",
        "--role=orchestrator", f"--serviceaccount={namespace}:default",
    )  # fmt: skip
    bad = rbac.kubectl(
        as_op, "-n", namespace, "create", "role", "greedy", "--verb=get", "--resource=secrets",
        check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "forbidden" in bad.stderr.lower()
