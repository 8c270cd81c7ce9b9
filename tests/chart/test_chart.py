"""The Helm chart rendered by the pinned helm: lint, the objects it makes, the values it refuses.

No cluster needed: `helm template --kube-version <K8S_VERSION>` renders what `helm install`
would send. tests/e2e/test_helm_e2e.py installs the same chart on the real control plane.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.crd import crd_files
from omnistage import __version__
from tests.harness.cluster import _versions
from tests.harness.helm import CHART, by_kind, helm, helm_binary, one, render

REPO = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]
K8S = _versions()["K8S_VERSION"]

pytestmark = pytest.mark.skipif(helm_binary() is None,
                                reason="helm not built: run hack/build-k8s.sh helm")


def _container(objs: list[Obj]) -> Obj:
    [c] = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def test_helm_lint_strict() -> None:
    out = helm("lint", str(CHART), "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_default_render_is_a_cluster_wide_operator_with_leader_election() -> None:
    objs = render()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "PodDisruptionBudget",
                     "Role", "RoleBinding", "Service", "ServiceAccount"]
    deploy = one(objs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = _container(objs)
    assert c["image"] == f"ghcr.io/omnistage/omnistage-operator:{__version__}"
    assert c["command"] == ["omnistage", "operator"]
    assert "--leader-elect" in c["args"]
    assert "--leader-elect-namespace=omnistage-system" in c["args"]
    assert "--leader-elect-name=omnistage-operator" in c["args"]
    assert "--metrics-host=$(POD_IP)" in c["args"]
    assert not any(a.startswith("--namespace=") for a in c["args"])
    # Probes, resources, non-root with a read-only root filesystem.
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["serviceAccountName"] == "omnistage-operator"
    # Surge first, so a standby comes up before the leader goes.
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    svc = one(objs, "Service")
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    binding = one(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "omnistage-operator",
                                    "namespace": "omnistage-system"}]


def test_namespaced_scope_grants_nothing_cluster_wide() -> None:
    objs = render("--set=watch.scope=namespaced", "--set=watch.namespaces={team-a,team-b}")
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in by_kind(objs, "Role")}
    assert roles == {("team-a", "omnistage-operator"), ("team-b", "omnistage-operator"),
                     ("omnistage-system", "omnistage-operator-leader")}
    bindings = by_kind(objs, "RoleBinding")
    assert all(b["subjects"][0]["namespace"] == "omnistage-system" for b in bindings)
    args = _container(objs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_leader_lease_role_is_limited_to_its_own_lease() -> None:
    objs = render("--set=leaderElection.leaseName=my-lease")
    role = next(r for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-leader"))
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["my-lease"], "verbs": ["get", "update"]},
    ]
    assert "--leader-elect-name=my-lease" in _container(objs)["args"]


def test_optional_pieces_follow_their_values() -> None:
    objs = render("--set=metrics.serviceMonitor.enabled=true",
                  "--set=metrics.serviceMonitor.labels.release=prom",
                  "--set=podDisruptionBudget.enabled=false", "--set=replicaCount=3",
                  "--set=image.tag=dev", "--set=leaderElection.enabled=true")
    monitor = one(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert not by_kind(objs, "PodDisruptionBudget")
    deploy = one(objs, "Deployment")
    assert deploy["spec"]["replicas"] == 3
    assert _container(objs)["image"].endswith(":dev")
    no_le = render("--set=leaderElection.enabled=false")
    assert "--leader-elect" not in _container(no_le)["args"]
    assert not [r for r in by_kind(no_le, "Role") if r["metadata"]["name"].endswith("-leader")]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["replicaCount=0"], "at '/replicaCount': minimum: got 0, want 1"),
        (["replicaCount=2", "leaderElection.enabled=false"],
         "at '/leaderElection/enabled': value must be true"),
        (["watch.scope=everywhere"],
         "at '/watch/scope': value must be one of 'cluster', 'namespaced'"),
        (["watch.scope=namespaced"], "at '/watch/namespaces': minItems: got 0, want 1"),
        (["watch.scope=namespaced", "watch.namespaces={Team_A}"],
         "at '/watch/namespaces/0': 'Team_A' does not match pattern"),
        (["image.pullPolicy=Sometimes"], "at '/image/pullPolicy': value must be one of"),
        (["replicas=2"], "additional properties 'replicas' not allowed"),
        (["resyncSeconds=0"], "at '/resyncSeconds': exclusiveMinimum"),
        (["metricsPort=70000"], "at '/metricsPort': maximum: got 70,000, want 65,535"),
        (["podDisruptionBudget.maxUnavailable=0"], "at '/podDisruptionBudget/maxUnavailable'"),
        (["image.tag=not a tag"], "at '/image/tag'"),
    ],
)
def test_values_schema_refuses_bad_values_naming_them(values: list[str], message: str) -> None:
    proc = helm("template", "omnistage", str(CHART), *[f"--set={v}" for v in values],
                f"--kube-version={K8S}", check=False)
    assert proc.returncode != 0, proc.stdout[:300]
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


def test_webhook_is_refused_until_it_exists() -> None:
    proc = helm("template", "omnistage", str(CHART), "--set=webhook.enabled=true",
                f"--kube-version={K8S}", check=False)
    assert proc.returncode != 0
    assert "webhook.enabled: the admission webhook is not part of this chart version" in \
        proc.stderr


def test_chart_crds_are_the_generated_crds() -> None:
    wanted = crd_files()
    chart_crds = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    assert chart_crds == wanted, "run hack/gen-crds"
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "gen-crds"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_operator_rbac_yaml_is_rendered_from_the_chart() -> None:
    """operator/rbac.yaml (for `kubectl apply` without helm) is generated: hack/gen-rbac."""
    proc = subprocess.run([str(REPO / "hack" / "gen-rbac"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = [d for d in yaml.safe_load_all((REPO / "operator" / "rbac.yaml").read_text()) if d]
    chart = render("--set=leaderElection.enabled=false")
    wanted = [o for o in chart if o["kind"] in ("ServiceAccount", "ClusterRole",
                                                "ClusterRoleBinding")]
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "ClusterRole",
                                         "ClusterRoleBinding"]
    assert [d["rules"] for d in docs if d["kind"] == "ClusterRole"] == \
        [o["rules"] for o in wanted if o["kind"] == "ClusterRole"]
