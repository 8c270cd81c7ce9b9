"""The operator's write discipline, read from its own write counter, on a small kwok fleet.

The operator here runs with the chart's ServiceAccount and RBAC (rendered from charts/omnistage,
token from the TokenRequest API), not with admin credentials: a grant the chart lacks shows up
as a 403 in its log and a fleet that never converges.

Waits are on observable state (the reconcile counter passing a mark), never on wall-clock
windows: a slow machine only makes the tests take longer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.controller import namespace_terminating
from omnistage.kubeapi import ApiError, path, resource_path
from tests.cluster.test_operator import KWOK, kwok_pipeline, stage, stage_pods, wait_ready
from tests.harness.cluster import Cluster, temp_namespace
from tests.harness.helm import render
from tests.harness.operator import Operator, apply, get, wait_for

pytestmark = pytest.mark.timeout(600)

RELEASE = "writes"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def _sa_kubeconfig(kube: Cluster, ns: str, sa: str, out: Path) -> Path:
    """The admin kubeconfig's cluster, with the ServiceAccount's token as the only user."""
    token = kube.kubectl("create", "token", sa, "-n", ns, "--duration=3h").stdout.strip()
    config = yaml.safe_load(Path(kube.kubeconfig).read_text())
    context = next(c for c in config["contexts"]
                   if c["name"] == config.get("current-context")) if config.get(
        "current-context") else config["contexts"][0]
    cluster = next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])
    out.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [cluster],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": "sa"}}],
    }))
    return out


@pytest.fixture(scope="module")
def operator(kube: Cluster, crds: None,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """`omnistage operator` as the chart's ServiceAccount (this module's only operator)."""
    tmp = tmp_path_factory.mktemp("sa-operator")
    with temp_namespace(kube.kube, prefix="omnistage-writes-") as ns:
        objs = [o for o in render(release=RELEASE, namespace=ns) if o["kind"] in RBAC_KINDS]
        for o in objs:
            o["metadata"]["namespace"] = ns if o["kind"] in ("ServiceAccount", "Role",
                                                             "RoleBinding") else None
            if o["kind"].endswith("Binding"):
                for subject in o.get("subjects", []):
                    subject["namespace"] = ns
        cluster_scoped = [o for o in objs if o["kind"].startswith("Cluster")]
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
        sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
        op = Operator(kube, tmp / "operator.log", webhook=False,
                      kubeconfig=_sa_kubeconfig(kube, ns, sa, tmp / "kubeconfig"))
        op.start()
        try:
            yield op
        finally:
            op.stop()
            for o in cluster_scoped:
                kube.kubectl("delete", o["kind"].lower(), o["metadata"]["name"],
                             "--ignore-not-found", check=False)


def _denied(op: Operator) -> list[str]:
    return [line for line in op.log_path.read_text(errors="replace").splitlines()
            # "HTTP 403" as ApiError words it; a bare 403 also matches a log line's milliseconds
            if re.search(r"\bHTTP 403\b|[Ff]orbidden", line)]


def _after_reconciles(op: Operator, passes: int) -> None:
    """Wait until the operator has made `passes` more reconcile passes (its resyncs enqueue
    every pipeline and pool, so this spans whole resync rounds)."""
    op.after_reconciles(passes)


def _settled(op: Operator, objects: int) -> None:
    """Wait until a whole resync round (every object reconciled twice) writes nothing."""
    op.settled(objects)


@pytest.fixture(scope="module")
def fleet(kube: Cluster, operator: Operator) -> Iterator[tuple[str, int]]:
    """Two pipelines of two stages, two replicas each: (namespace, pipelines + pools)."""
    with temp_namespace(kube.kube) as ns:
        for name in ("w1", "w2"):
            apply(kube, ns, kwok_pipeline(name, [stage("a"), stage("b", inputs=("a",),
                                                                   final=True)]))
        for name in ("w1", "w2"):
            wait_ready(kube, ns, name, operator, timeout=180)
        yield ns, 2 + 4


def test_idle_resync_makes_no_writes(operator: Operator, fleet: tuple[str, int]) -> None:
    """Kills: a reconcile that writes unconditionally (status rewritten with a fresh timestamp,
    a child re-applied without the diff, the readiness gate re-patched), and any grant the
    chart lacks (the fleet would not have converged under its ServiceAccount)."""
    _, objects = fleet
    _settled(operator, objects)
    before = operator.writes()
    offset = operator.log_offset()
    _after_reconciles(operator, 3 * objects)
    assert operator.writes() == before, operator.write_lines(offset)
    assert not _denied(operator), _denied(operator)[:5]


def test_restart_on_a_converged_fleet_makes_no_writes(operator: Operator,
                                                      fleet: tuple[str, int]) -> None:
    """A new operator process primes its view and finds nothing to change.

    Kills: reconciling before the view is primed (replicas look missing: 409 creates, status
    flaps), and status rebuilt with new transition times on start."""
    _, objects = fleet
    _settled(operator, objects)
    operator.stop()
    offset = operator.log_offset()
    operator.start()
    _after_reconciles(operator, 3 * objects)  # a fresh process: its counter starts at 0
    assert operator.writes() == 0, operator.write_lines(offset)


def test_teardown_writes_no_pool_or_pod_status(kube: Cluster, operator: Operator,
                                               fleet: tuple[str, int]) -> None:
    """Deleting a pipeline writes no StagePool status and flips no readiness gate of its pods;
    the pipeline's own status is written at most once per shutdown step (Terminating, with
    what it waits for), not on every poll.

    Kills: dropping the `deleting` guards in reconcile_pool (pool status and gate patches for
    objects on their way out), and a terminating status rewritten each second."""
    ns, objects = fleet
    _settled(operator, objects)
    assert len(stage_pods(kube, ns, "w2")) == 4
    offset = operator.log_offset()
    before = operator.writes()
    kube.kubectl("delete", "omnipipe", "-n", ns, "w2", "--wait=false")
    wait_for(lambda: get(kube, ns, "omnipipe", "w2") is None and not stage_pods(kube, ns, "w2"),
             300, "w2 and its pods gone", operator.log_tail)
    lines = operator.write_lines(offset)
    assert len(lines) == operator.writes() - before  # the log is the counter, line by line
    status = [line for line in lines if line.endswith("/status")]
    pool_or_pod = [line for line in status if "/stagepools/" in line or "/pods/" in line]
    assert not pool_or_pod, pool_or_pod
    pipeline_status = [line for line in status if "/omnipipelines/w2/" in line]
    assert len(pipeline_status) <= 2, pipeline_status  # one per shutdown step at most
    assert not [line for line in lines if "/w1" in line], lines  # the other pipeline: quiet
    assert not _denied(operator), _denied(operator)[:5]


FIELD_MANAGER = "omnistage-operator"
CHILDREN = (("configmap", "w1-pipeline"), ("serviceaccount", "w1-orchestrator"),
            ("role", "w1-orchestrator"), ("rolebinding", "w1-orchestrator"),
            ("service", "w1-orchestrator"), ("deployment", "w1-orchestrator"),
            ("stagepool", "w1-a"), ("stagepool", "w1-b"), ("poddisruptionbudget", "w1-a"))


def _managed_fields(kube: Cluster, ns: str, kind: str, name: str) -> list[dict[str, Any]]:
    out = kube.kubectl("get", "-n", ns, kind, name, "-o", "json", "--show-managed-fields").stdout
    return list(json.loads(out)["metadata"].get("managedFields") or [])


def _entries(fields: list[dict[str, Any]], manager: str) -> list[tuple[str, str]]:
    return [(e["operation"], e.get("subresource", "")) for e in fields if e["manager"] == manager]


def test_children_are_server_side_applied_by_the_one_field_manager(
        kube: Cluster, operator: Operator, fleet: tuple[str, int]) -> None:
    """Every child is written by an apply of the manager `omnistage-operator`, never by an
    update of the main resource (a create or a merge patch); pods are created by the same
    manager; the pipeline's finalizer is owned by that apply alone.

    Kills: a child created or patched instead of applied, an apply without the field manager
    (the API server refuses it) or under another name, and a StagePool applied without its
    replicas while nobody else owns them."""
    ns, _ = fleet
    for kind, name in CHILDREN:
        fields = _managed_fields(kube, ns, kind, name)
        ours = _entries(fields, FIELD_MANAGER)
        assert ("Apply", "") in ours and ("Update", "") not in ours, (kind, name, ours)
        [applied] = [e for e in fields if e["manager"] == FIELD_MANAGER
                     and e["operation"] == "Apply"]
        assert "f:ownerReferences" in applied["fieldsV1"]["f:metadata"], (kind, name)
        if kind == "stagepool":
            assert "f:replicas" in applied["fieldsV1"]["f:spec"]  # nobody scaled it
    for pod in stage_pods(kube, ns, "w1"):
        fields = _managed_fields(kube, ns, "pod", pod["metadata"]["name"])
        assert ("Update", "") in _entries(fields, FIELD_MANAGER)  # created, never applied
    finalizer = 'v:"omnistage.io/ordered-shutdown"'
    owners = [(e["manager"], e["operation"]) for e in _managed_fields(kube, ns, "omnipipe", "w1")
              if finalizer in e["fieldsV1"].get("f:metadata", {}).get("f:finalizers", {})]
    assert owners == [(FIELD_MANAGER, "Apply")]


def _w1(extra: dict[str, str]) -> dict[str, Any]:
    """Fleet pipeline w1, with `extra` added to stage a's and the orchestrator's nodeSelector."""
    placement = {**KWOK, "nodeSelector": {**KWOK["nodeSelector"], **extra}}
    doc = kwok_pipeline("w1", [stage("a", placement=placement),
                               stage("b", inputs=("a",), final=True)])
    doc["spec"]["orchestrator"] = placement
    return doc


def test_a_field_dropped_from_the_spec_is_removed_from_the_children(
        kube: Cluster, operator: Operator, fleet: tuple[str, int]) -> None:
    """The class of bug server-side apply removes: a nodeSelector key the pipeline no longer
    asks for must leave the StagePool, the orchestrator's Deployment and, by the rollout, the
    pods. A patch of the desired fields kept such a key forever (the desired object was a
    subset of the live one, so nothing was written). Then the fleet is quiet again.

    Kills: ensure() without the applied digest (a removal is never written), and an apply
    that leaves the digest out of the intent (every resync would write)."""
    ns, objects = fleet
    extra = {"kubernetes.io/os": "linux"}  # every kwok node has it: pods still schedule

    def selectors() -> tuple[dict[str, str], dict[str, str]]:
        pool = get(kube, ns, "stagepool", "w1-a") or {}
        dep = get(kube, ns, "deployment", "w1-orchestrator") or {}
        return (pool["spec"]["stage"]["placement"]["nodeSelector"],
                dep["spec"]["template"]["spec"]["nodeSelector"])

    apply(kube, ns, _w1(extra))
    wait_for(lambda: all("kubernetes.io/os" in s for s in selectors()), 120,
             "the extra nodeSelector key on the pool and the Deployment", operator.log_tail)
    wait_ready(kube, ns, "w1", operator, timeout=180)
    apply(kube, ns, _w1({}))
    wait_for(lambda: not any("kubernetes.io/os" in s for s in selectors()), 120,
             "the dropped nodeSelector key gone from the pool and the Deployment",
             lambda: f"{selectors()}\n{operator.log_tail()}")
    assert selectors() == (KWOK["nodeSelector"], KWOK["nodeSelector"])
    # Two applies of the pool kept its replicas: the operator still owns them (its view has
    # the managedFields), so they stayed in the intent instead of being removed by the apply.
    assert (get(kube, ns, "stagepool", "w1-a") or {})["spec"].get("replicas") == 2
    wait_ready(kube, ns, "w1", operator, timeout=180)
    wait_for(lambda: all("kubernetes.io/os" not in (p["spec"].get("nodeSelector") or {})
                         and not p["metadata"].get("deletionTimestamp")
                         for p in stage_pods(kube, ns, "w1")), 180,
             "w1's pods rolled back to the selector without the key", operator.log_tail)
    _settled(operator, objects)
    before = operator.writes()
    offset = operator.log_offset()
    _after_reconciles(operator, 3 * objects)
    assert operator.writes() == before, operator.write_lines(offset)


def test_a_terminating_namespace_is_told_by_the_api_servers_status_cause(kube: Cluster) -> None:
    """The real 403 of a create (and of an apply) in a namespace being deleted is recognised
    from its structured Status, and a plain 403 is not.

    Kills: matching a cause field the API server does not send (a StatusCause's type goes
    on the wire as "reason"), which sent the operator into backoff retries of every pool in
    a deleted namespace."""
    k = kube.kube
    ns = k.create(resource_path("v1", "namespaces"), {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"generateName": "omnistage-term-"},
    })["metadata"]["name"]
    held = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "held", "finalizers": ["omnistage.io/test-hold"]}}
    k.create(path("ConfigMap", ns), held)  # keeps the namespace Terminating until released
    try:
        k.delete(resource_path("v1", "namespaces", name=ns))
        refused: list[ApiError] = []
        new = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "new"}}
        for write in (lambda: k.create(path("ConfigMap", ns), new),
                      lambda: k.apply(path("ConfigMap", ns, "new"),
                                      {**new, "metadata": {"name": "new", "namespace": ns}},
                                      field_manager=FIELD_MANAGER, force=True)):
            with pytest.raises(ApiError) as exc:
                write()
            refused.append(exc.value)
        assert all(e.status == 403 and namespace_terminating(e) for e in refused), refused
    finally:
        k.patch(path("ConfigMap", ns, "held"), {"metadata": {"finalizers": None}})
    assert not namespace_terminating(ApiError(403, {"reason": "Forbidden", "message": (
        "unable to create new content in namespace x because it is being terminated")},
        "POST", "/x"))
