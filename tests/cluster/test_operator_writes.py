"""The operator's write discipline, read from its own write counter, on a small kwok fleet.

The operator here runs with the chart's ServiceAccount and RBAC (rendered from charts/omnistage,
token from the TokenRequest API), not with admin credentials: a grant the chart lacks shows up
as a 403 in its log and a fleet that never converges.

Waits are on observable state (the reconcile counter passing a mark), never on wall-clock
windows: a slow machine only makes the tests take longer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.test_operator import kwok_pipeline, stage, stage_pods, wait_ready
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
