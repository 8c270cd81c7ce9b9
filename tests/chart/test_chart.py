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
                     "Role", "RoleBinding", "Secret", "Service", "Service", "ServiceAccount",
                     "ValidatingWebhookConfiguration"]
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
    svc = next(s for s in by_kind(objs, "Service") if s["metadata"]["name"].endswith("-metrics"))
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    binding = one(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "omnistage-operator",
                                    "namespace": "omnistage-system"}]


def test_namespaced_scope_grants_nothing_cluster_wide_but_the_webhook_configuration() -> None:
    objs = render("--set=watch.scope=namespaced", "--set=watch.namespaces={team-a,team-b}")
    [cluster_role] = by_kind(objs, "ClusterRole")
    assert cluster_role["metadata"]["name"] == "omnistage-operator-webhook"
    assert {(g, r, v) for rule in cluster_role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]} == {
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "create"),
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "patch")}
    assert [r.get("resourceNames") for r in cluster_role["rules"]] == [
        None, ["validation.omnistage.io"]]
    [binding] = by_kind(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "omnistage-operator-webhook"
    off = render("--set=watch.scope=namespaced", "--set=watch.namespaces={team-a}",
                 "--set=webhook.enabled=false")
    assert not by_kind(off, "ClusterRole") and not by_kind(off, "ClusterRoleBinding")
    # The leader labels its own pod for the webhook Service (in the release namespace).
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]} in next(
        r for r in by_kind(render("--set=watch.scope=namespaced", "--set=watch.namespaces={a}",
                                  "--set=webhook.clientConfig=podIP"), "Role")
        if r["metadata"]["name"].endswith("-leader"))["rules"]
    leader = next(r for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-leader"))
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]} in leader["rules"]
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
        (["webhook.failurePolicy=Sometimes"],
         "at '/webhook/failurePolicy': value must be one of 'Ignore', 'Fail'"),
        (["webhook.clientConfig=url"],
         "at '/webhook/clientConfig': value must be one of 'service', 'podIP'"),
        (["webhook.certManager=true", "webhook.clientConfig=podIP"],
         "at '/webhook/clientConfig': value must be 'service'"),
        (["webhook.port=443"], "at '/webhook/port': minimum: got 443, want 1,024"),
        (["webhook.certSecretName=x"], "additional properties 'certSecretName' not allowed"),
        (["networkPolicy.enabled=maybe"], "at '/networkPolicy/enabled': got string, want boolean"),
        (["networkPolicy.monitoringNamespace=Prom_NS"],
         "at '/networkPolicy/monitoringNamespace': 'Prom_NS' does not match pattern"),
        (["adminKey.existingSecret=Not_A_Name"],
         "at '/adminKey/existingSecret': 'Not_A_Name' does not match pattern"),
        (["adminKey.key=x"], "additional properties 'key' not allowed"),
    ],
)
def test_values_schema_refuses_bad_values_naming_them(values: list[str], message: str) -> None:
    proc = helm("template", "omnistage", str(CHART), *[f"--set={v}" for v in values],
                f"--kube-version={K8S}", check=False)
    assert proc.returncode != 0, proc.stdout[:300]
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


def _args(objs: list[Obj]) -> list[str]:
    return list(_container(objs)["args"])


def test_webhook_is_on_by_default_behind_a_service_that_selects_the_leader() -> None:
    objs = render()
    c = _container(objs)
    args = _args(objs)
    assert {"--webhook", "--webhook-addr=$(POD_IP)", "--webhook-port=9443",
            "--webhook-failure-policy=Ignore",
            "--webhook-service=omnistage-system/omnistage-operator-webhook:443"} <= set(args)
    assert not any(a.startswith(("--webhook-host", "--webhook-cert-dir")) for a in args)
    assert {"name": "webhook", "containerPort": 9443} in c["ports"]
    # The self-signed certificate is written under $TMPDIR: /tmp is a writable emptyDir.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    svc = next(s for s in by_kind(objs, "Service") if s["metadata"]["name"].endswith("-webhook"))
    assert svc["metadata"]["name"] == "omnistage-operator-webhook"
    assert svc["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook",
                                     "protocol": "TCP"}]
    # Only the leader runs kopf's webhook server: the Service selects the label it sets.
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "omnistage-operator",
                                       "app.kubernetes.io/instance": "omnistage",
                                       "omnistage.io/webhook": "true"}
    from omni_operator.webhook import CONFIGURATION, SERVING_LABEL

    assert SERVING_LABEL in svc["spec"]["selector"]
    # The release owns the configuration (helm uninstall deletes it); the operator fills it.
    vwc = one(objs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["name"] == CONFIGURATION and "webhooks" not in vwc
    rules = one(objs, "ClusterRole")["rules"]
    assert {"apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"],
            "resourceNames": [CONFIGURATION], "verbs": ["patch"]} in rules
    # Without leader election every operator pod serves, so the Service selects them all.
    no_le = render("--set=leaderElection.enabled=false")
    svc = next(s for s in by_kind(no_le, "Service") if s["metadata"]["name"].endswith("-webhook"))
    assert "omnistage.io/webhook" not in svc["spec"]["selector"]


def test_webhook_values_map_onto_flags_and_objects() -> None:
    pod_ip = render("--set=webhook.clientConfig=podIP", "--set=webhook.failurePolicy=Fail",
                    "--set=webhook.port=9555")
    args = _args(pod_ip)
    assert {"--webhook-host=$(POD_IP)", "--webhook-failure-policy=Fail",
            "--webhook-port=9555"} <= set(args)
    assert not any(a.startswith("--webhook-service") for a in args)
    assert not [s for s in by_kind(pod_ip, "Service") if s["metadata"]["name"].endswith("-webhook")]
    assert {"name": "webhook", "containerPort": 9555} in _container(pod_ip)["ports"]

    cm = render("--set=webhook.certManager=true")
    assert "--webhook-cert-dir=/etc/omnistage/webhook-tls" in _args(cm)
    assert {"name": "webhook-tls", "mountPath": "/etc/omnistage/webhook-tls",
            "readOnly": True} in _container(cm)["volumeMounts"]
    volumes = one(cm, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": "omnistage-operator-webhook-tls"}} \
        in volumes
    certs = {c["metadata"]["name"]: c["spec"] for c in by_kind(cm, "Certificate")}
    assert certs["omnistage-operator-webhook-tls"]["secretName"] == "omnistage-operator-webhook-tls"
    assert certs["omnistage-operator-webhook-tls"]["dnsNames"] == [
        "omnistage-operator-webhook.omnistage-system.svc",
        "omnistage-operator-webhook.omnistage-system.svc.cluster.local"]
    assert certs["omnistage-operator-webhook-ca"]["isCA"] is True
    assert len(by_kind(cm, "Issuer")) == 2

    off = render("--set=webhook.enabled=false")
    assert "--no-webhook" in _args(off)
    assert not any(a.startswith("--webhook-") for a in _args(off))
    assert not by_kind(off, "ValidatingWebhookConfiguration")
    assert [s["metadata"]["name"] for s in by_kind(off, "Service")] == [
        "omnistage-operator-metrics"]
    rules = one(off, "ClusterRole")["rules"]
    assert not [r for r in rules if "admissionregistration.k8s.io" in r["apiGroups"]]


def test_network_policy_is_on_by_default_and_admits_exactly_the_operator_pods() -> None:
    """The flags the operator builds the pipelines' NetworkPolicies from: on, with the release
    namespace and the labels every operator pod carries (the Deployment's selector, so a value
    such as podLabels cannot narrow it), parsed as the operator parses them."""
    from tests.unit.test_network_policy import OPERATOR_LABELS, settings_from_flags

    objs = render("--set=podLabels.team=x", release="shard-a", namespace="omnistage-a")
    args = _args(objs)
    assert len([a for a in args if a.startswith("--operator-pod-labels=")]) == 1
    assert {"--network-policy", "--operator-namespace=omnistage-a"} <= set(args)
    ours = [a for a in args if a.startswith(("--network-policy", "--operator-"))]
    settings = settings_from_flags(*ours)
    deploy = one(objs, "Deployment")
    assert settings.enabled and settings.operator is not None
    assert settings.operator.namespace == "omnistage-a"
    assert dict(settings.operator.pod_labels) == deploy["spec"]["selector"]["matchLabels"]
    template = deploy["spec"]["template"]["metadata"]["labels"]
    assert settings.operator.pod_labels.items() <= template.items()
    # The unit tests' operator labels are the default release's.
    default = settings_from_flags(*(a for a in _args(render()) if a.startswith("--operator-")))
    assert default.operator is not None and dict(default.operator.pod_labels) == OPERATOR_LABELS
    for rules in (one(objs, "ClusterRole")["rules"],
                  *(r["rules"] for r in by_kind(render("--set=watch.scope=namespaced",
                                                       "--set=watch.namespaces={a}"), "Role")
                    if not r["metadata"]["name"].endswith("-leader"))):
        assert {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                "verbs": ["list", "watch", "create", "patch"]} in rules

    off = _args(render("--set=networkPolicy.enabled=false"))
    assert "--no-network-policy" in off
    assert not any(a.startswith(("--network-policy", "--operator-", "--monitoring-"))
                   for a in off)


def test_the_monitoring_namespace_reaches_the_operator_as_its_flag() -> None:
    """networkPolicy.monitoringNamespace: "monitoring" by default, another name, or "" (none),
    each parsed as the operator parses its flags."""
    from tests.unit.test_network_policy import settings_from_flags

    def monitoring(*sets: str) -> str | None:
        args = [a for a in _args(render(*sets)) if a.startswith("--monitoring-namespace")]
        assert len(args) == 1, args
        return settings_from_flags(*args).monitoring_namespace

    assert monitoring() == "monitoring"
    assert monitoring("--set=networkPolicy.monitoringNamespace=prometheus") == "prometheus"
    assert monitoring("--set=networkPolicy.monitoringNamespace=") is None


def _volumes(objs: list[Obj]) -> list[Obj]:
    return list(one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"])


def test_the_admin_key_is_a_secret_made_once_and_mounted_read_only() -> None:
    """The operator's root admin key: a Secret of the release (48 random alphanumerics, a new
    one only when there is none: `lookup`, which `helm template` cannot do, so two renders
    differ here), kept at uninstall, mounted read-only for the non-root operator (mode 0440,
    the pod's fsGroup; the root filesystem stays read-only) and named by --admin-key-file.
    The file holds a key the operator accepts."""
    import base64

    from omni_operator.admin_credential import MIN_ROOT_KEY_CHARS, read_root_key

    objs = render()
    secret = one(objs, "Secret")
    assert secret["metadata"]["name"] == "omnistage-operator-admin-key"
    assert secret["metadata"]["namespace"] == "omnistage-system"
    assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == "omnistage"
    assert secret["type"] == "Opaque" and list(secret["data"]) == ["admin-key"]
    key = base64.b64decode(secret["data"]["admin-key"]).decode()
    assert len(key) == 48 and key.isalnum()
    other = base64.b64decode(one(render(), "Secret")["data"]["admin-key"]).decode()
    assert other != key  # random: made once on a cluster (lookup), anew per `helm template`

    c = _container(objs)
    assert "--admin-key-file=/etc/omnistage/admin-key/admin-key" in c["args"]
    assert {"name": "admin-key", "mountPath": "/etc/omnistage/admin-key",
            "readOnly": True} in c["volumeMounts"]
    assert {"name": "admin-key", "secret": {
        "secretName": "omnistage-operator-admin-key", "defaultMode": 0o440,
        "items": [{"key": "admin-key", "path": "admin-key"}]}} in _volumes(objs)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 65532
    assert len(key) >= MIN_ROOT_KEY_CHARS
    # The operator reads what the kubelet writes there.
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "admin-key").write_text(key)
        assert read_root_key(Path(tmp) / "admin-key") == key.encode()
    # Off with the network policies too: the key is the operator's, not the policies'.
    off = render("--set=networkPolicy.enabled=false")
    assert "--admin-key-file=/etc/omnistage/admin-key/admin-key" in _args(off)
    # The operator needs no RBAC for it: the kubelet mounts it; the operator reads no Secret
    # (create: the pipelines' Secrets; patch: a CurveZMQ rotation's merge patches).
    rules = one(objs, "ClusterRole")["rules"]
    assert [r["verbs"] for r in rules if "secrets" in r["resources"]] == [["create", "patch"]]


def test_an_existing_secret_replaces_the_chart_s_own() -> None:
    objs = render("--set=adminKey.existingSecret=my-admin-key")
    assert not by_kind(objs, "Secret")
    [volume] = [v for v in _volumes(objs) if v["name"] == "admin-key"]
    assert volume["secret"]["secretName"] == "my-admin-key"
    assert "--admin-key-file=/etc/omnistage/admin-key/admin-key" in _args(objs)


def test_an_upgrade_keeps_the_admin_key_it_finds() -> None:
    """The template's lookup branch, as `helm upgrade` runs it against a cluster holding the
    Secret: the key found is the key rendered (so no orchestrator rolls), a new one only
    without it. `helm template` has no cluster to look up: here, the template's shape;
    tests/cluster/test_admin_listener.py renders it against the real API server."""
    text = (CHART / "templates" / "admin-key-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in text
    assert '$key = index $existing.data "admin-key"' in text
    assert "randAlphaNum 48 | b64enc" in text
    assert text.index("index $existing.data") < text.index("randAlphaNum")


def test_webhook_port_must_differ_from_the_metrics_port() -> None:
    proc = helm("template", "omnistage", str(CHART), "--set=webhook.port=8081",
                f"--kube-version={K8S}", check=False)
    assert proc.returncode != 0
    assert "webhook.port and metricsPort must differ" in proc.stderr


def test_chart_crds_are_the_generated_crds() -> None:
    wanted = crd_files()
    chart_crds = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    assert chart_crds == wanted, "run hack/gen-crds"
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "gen-crds"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_operator_rbac_and_webhook_yaml_are_rendered_from_the_chart() -> None:
    """operator/rbac.yaml and operator/webhook*.yaml (for `kubectl apply` without helm) are
    generated: hack/gen-rbac."""
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
    webhook = [d for d in yaml.safe_load_all((REPO / "operator" / "webhook.yaml").read_text())
               if d]
    assert sorted(d["kind"] for d in webhook) == ["Service", "ValidatingWebhookConfiguration"]
    [svc] = [d for d in webhook if d["kind"] == "Service"]
    # Without leader election (no Lease Role in rbac.yaml) every operator pod serves.
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "omnistage-operator",
                                       "app.kubernetes.io/instance": "omnistage"}
    cm = [d for d in yaml.safe_load_all(
        (REPO / "operator" / "webhook-cert-manager.yaml").read_text()) if d]
    assert sorted(d["kind"] for d in cm) == ["Certificate", "Certificate", "Issuer", "Issuer"]
