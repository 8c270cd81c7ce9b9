"""The chart's RBAC is exactly what the operator uses: no 403, and no verb it never uses.

The operator runs from the chart, in its image, as exactly the chart's ServiceAccount (the pod
runner projects that account's token into the pod), with the admission webhook on (the chart's
default). A pipeline goes through its whole life (create, scale up, drain-style scale down, an
operator restart, the same scale again, delete through the finalizer). The API server's audit
log (hack/cluster.sh logs every request of a service account: verb, resource, response code)
then says what the operator did; every grant of the chart must appear there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omnistage import kube as k
from tests.e2e.conftest import E2E_VALUES, installed, require_images
from tests.harness.cluster import Cluster, PodRunner, pods, temp_namespace
from tests.harness.helm import Release, by_kind, render
from tests.harness.operator import get, wait_for

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
ECHO = REPO / "examples" / "echo.yaml"
Obj = dict[str, Any]
Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

#: Grants no request of the operator exercises, each with the reason it is still needed.
NOT_REQUESTS: dict[Grant, str] = {
    ("omnistage.io", "omnipipelines/finalizers", "update"):
        "checked by the OwnerReferencesPermissionEnforcement admission plugin when the operator "
        "sets blockOwnerDeletion on a child; it is not a request of its own",
    ("omnistage.io", "stagepools/finalizers", "update"):
        "the same check, for the pods a StagePool owns",
    # The autoscaler's (omni_operator/autoscaler.py): used only for stages with autoscaling,
    # which the echo pipeline here has none of; tests/cluster/test_autoscaler.py drives them.
    ("omnistage.io", "stagepools/scale", "patch"):
        "the autoscaler writes spec.replicas as `kubectl scale` does (autoscaled stages only)",
    ("", "services/proxy", "get"):
        "the autoscaler reads an orchestrator's GET /v1/load through the admin Service "
        "(autoscaled stages only)",
    ("autoscaling", "horizontalpodautoscalers", "list"):
        "the autoscaler refuses pools an HPA scales (autoscaled stages only)",
    # omni_operator/curve_rotation.py: only for a pipeline asked to rotate its CurveZMQ keys;
    # tests/cluster/test_curve_rotation_cluster.py drives one.
    ("", "secrets", "patch"):
        "a CurveZMQ key rotation adds and drops pairs of a pipeline's Secret by merge patch",
}


#: The children of the echo pipeline, one of each kind the operator creates.
CHILDREN = ("configmap/echo-pipeline", "service/echo-orchestrator",
            "service/echo-orchestrator-admin", "serviceaccount/echo-orchestrator",
            "role/echo-orchestrator", "rolebinding/echo-orchestrator",
            "deployment/echo-orchestrator", "sp/echo-b", "pdb/echo-b",
            "networkpolicy/echo-stages", "networkpolicy/echo-orchestrator")


def _grants(rules: list[Obj]) -> set[Grant]:
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def _audit(path: Path, start: int, end: int, user: str) -> tuple[set[Grant], list[str]]:
    """(what the user did, its denied requests) from the audit log between two offsets."""
    used: set[Grant] = set()
    denied: list[str] = []
    with open(path, "rb") as f:
        f.seek(start)
        for line in f.read(end - start).splitlines():
            event = json.loads(line)
            if event.get("user", {}).get("username") != user:
                continue
            ref = event.get("objectRef") or {}
            if not ref.get("resource"):
                continue  # discovery (/apis/...) is open to every authenticated user
            resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource")
                                          else "")
            grant = (ref.get("apiGroup", ""), resource, event["verb"])
            code = event.get("responseStatus", {}).get("code", 0)
            # A 403 that RBAC allowed came from admission (e.g. creating a pod in a namespace
            # that is being terminated, left over by an earlier test): not a missing grant.
            decision = (event.get("annotations") or {}).get("authorization.k8s.io/decision")
            if code == 403 and decision != "allow":
                denied.append(f"{grant} {event.get('requestURI')}")
            else:
                used.add(grant)
                if event["verb"] == "patch" and code == 201:
                    # A server-side apply that created its object: the API server authorizes
                    # it as a create as well (the patch handler's create validation), so the
                    # operator's children need `create` although no request says POST.
                    used.add((grant[0], grant[1], "create"))
    return used, denied


def _restart(kube: Cluster, release: Release) -> None:
    """Delete the operator pods; a new one takes the Lease."""
    old = {p["metadata"]["name"] for p in release.operator_pods()}
    kube.kubectl("delete", "pod", "-n", release.namespace, "--wait=false",
                 f"-l=app.kubernetes.io/instance={release.name}")
    wait_for(lambda: (release.leader() or "") not in old | {""}, 180,
             "a new operator pod leading", release.log_tail, 1)


def _lifecycle(kube: Cluster, ns: str, release: Release) -> None:
    """Everything the operator does to a pipeline: create, scale up, scale down, an operator
    restart and the same scale again (the restarted operator finds its aggregated events by
    name: create answers 409, it reads the count and patches it), delete."""
    log_tail = release.log_tail
    def ready_pods(stage: str) -> int:
        return sum(p["metadata"]["labels"].get(k.LABEL_STAGE) == stage
                   and not p["metadata"].get("deletionTimestamp")
                   and k.condition_status(p, "Ready") == "True"
                   for p in pods(kube.kube, ns, k.stage_selector("echo")))

    def ready() -> bool:
        cond = k.condition(get(kube, ns, "omnipipe", "echo") or {}, "Ready")
        return bool(cond and cond["status"] == "True")

    kube.kubectl("apply", "-n", ns, "-f", str(ECHO))
    wait_for(ready, 300, "echo Ready", log_tail, 1)
    # Drift: every child kind edited by hand is patched back.
    for child in CHILDREN:
        kube.kubectl("label", "-n", ns, child, f"{k.LABEL_COMPONENT}=tampered", "--overwrite")
    def component(child: str) -> str:
        obj = json.loads(kube.kubectl("get", "-n", ns, child, "-o", "json").stdout)
        return str(obj["metadata"]["labels"].get(k.LABEL_COMPONENT))

    for child in CHILDREN:
        wait_for(lambda c=child: component(c) != "tampered", 60, f"{child} repaired",
                 log_tail, 0.5)
    def scale_up_and_down() -> None:
        kube.kubectl("scale", "-n", ns, "sp/echo-a", "--replicas=2")
        wait_for(lambda: ready_pods("a") == 2, 300, "echo-a at 2", log_tail, 1)
        kube.kubectl("scale", "-n", ns, "sp/echo-a", "--replicas=1")
        wait_for(lambda: len([p for p in pods(kube.kube, ns, k.stage_selector("echo"))
                              if p["metadata"]["labels"].get(k.LABEL_STAGE) == "a"]) == 1,
                 300, "echo-a drained to 1", log_tail, 1)

    scale_up_and_down()
    _restart(kube, release)
    scale_up_and_down()  # the same ReplicasCreated/ScalingDown events: counted on
    kube.kubectl("delete", "-n", ns, "omnipipe/echo", "--wait=false")
    wait_for(lambda: get(kube, ns, "omnipipe", "echo") is None and not pods(kube.kube, ns),
             300, "echo and its pods gone (ordered shutdown through the finalizer)", log_tail, 1)


@pytest.fixture
def audit_log(kube: Cluster, podrunner: PodRunner) -> Path:
    require_images(podrunner)
    if kube.state_dir is None:
        pytest.skip("needs the local control plane's audit log (hack/cluster.sh)")
    path = kube.state_dir / "logs" / "audit.log"
    assert path.exists(), "hack/cluster.sh runs the API server with an audit log"
    return path


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(
    kube: Cluster, podrunner: PodRunner, audit_log: Path
) -> None:
    start = audit_log.stat().st_size
    with installed(kube, podrunner, *E2E_VALUES, prefix="omnistage-rbac-") as release, \
            temp_namespace(kube.kube, "rbac-app-") as app:
        user = f"system:serviceaccount:{release.namespace}:{release.fullname}"
        release.wait_leader()
        _lifecycle(kube, app, release)
        # Up to here: `helm uninstall` deletes the RBAC and the Deployment at once, so the
        # stopping operator's last Lease release may be refused; that is helm's ordering.
        end = audit_log.stat().st_size
    used, denied = _audit(audit_log, start, end, user)
    assert not denied, denied
    objs = render(*[f"--set={v}" for v in (*release.cluster_values(), *E2E_VALUES)],
                  namespace=release.namespace)
    granted = _grants(by_kind(objs, "ClusterRole")[0]["rules"])
    granted |= {g for role in by_kind(objs, "Role") for g in _grants(role["rules"])}
    unused = sorted(granted - used - set(NOT_REQUESTS))
    assert not unused, f"granted but never used: {unused}\nused: {sorted(used)}"
    assert set(NOT_REQUESTS) <= granted


def test_namespaced_rbac_serves_its_namespace_without_a_403(
    kube: Cluster, podrunner: PodRunner, audit_log: Path
) -> None:
    start = audit_log.stat().st_size
    with temp_namespace(kube.kube, "rbac-ns-app-") as app:
        with installed(kube, podrunner, *E2E_VALUES, "watch.scope=namespaced",
                       f"watch.namespaces={{{app}}}", prefix="omnistage-rbac-ns-") as release:
            user = f"system:serviceaccount:{release.namespace}:{release.fullname}"
            release.wait_leader()
            _lifecycle(kube, app, release)
            end = audit_log.stat().st_size
    used, denied = _audit(audit_log, start, end, user)
    assert not denied, denied
    assert used, "the audit log shows the operator's requests"
