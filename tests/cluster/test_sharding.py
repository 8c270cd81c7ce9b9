"""A fleet split across two operators by namespace sets (charts/omnistage/README.md,
"Sharding a fleet across operator releases"), on the real local control plane, under load.

Two `omnistage operator` processes run with the flags the chart passes for
`watch.scope=namespaced` (one `--namespace=` per namespace of `watch.namespaces`); two helm
releases would run the same command in pods, which this control plane starts slowly, so the test
runs the processes directly. Shard A also serves the admission webhook for the whole cluster
(the documented layout: one release has `webhook.enabled=true`, the others false), and an
invalid pipeline in shard B's namespace is refused by it.

What proves "exactly one writer per object": each operator's own write log
(`omnistage.kubeapi.writes`, one line per POST/PATCH/PUT/DELETE with its path). Every path an
operator wrote names one of its own namespaces, each shard's namespaces got writes from their
operator, and every pipeline of both shards converges to Ready while both reconcile at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omni_operator.webhook import CONFIGURATION
from tests.cluster.test_operator import kwok_pipeline, ready, stage, stage_pods
from tests.cluster.test_validation import PROBE
from tests.harness.cluster import Cluster, temp_namespace
from tests.harness.local import free_port
from tests.harness.operator import REPO, apply, wait_for

pytestmark = pytest.mark.timeout(900)

PIPELINES_PER_NAMESPACE = 4  # x 2 namespaces x 2 shards, 2 stages x 2 replicas: 64 stage pods
WRITE_LINE = re.compile(r"omnistage\.kubeapi\.writes: (?P<verb>[A-Z]+) (?P<path>/\S+)")
NAMESPACE_IN_PATH = re.compile(r"/namespaces/(?P<ns>[^/?]+)")


@dataclass
class Shard:
    """One operator process serving a set of namespaces, as one chart release would."""

    cluster: Cluster
    namespaces: list[str]
    log_path: Path
    webhook: bool
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "omnistage.cli", "operator",
               f"--kubeconfig={self.cluster.kubeconfig}", f"--metrics-port={self.port}",
               "--resync-seconds=3", "--workers=4", "--write-qps=50", "--write-burst=20",
               *(f"--namespace={ns}" for ns in self.namespaces)]
        cmd += (["--webhook", "--webhook-addr=127.0.0.1", f"--webhook-port={free_port()}"]
                if self.webhook else ["--no-webhook"])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(self._live, 60, f"operator for {self.namespaces} /livez", self.log_tail)

    def _live(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def written_namespaces(self) -> dict[str, int]:
        """Writes this operator logged, by the namespace in their path ("" : none)."""
        out: dict[str, int] = {}
        for m in WRITE_LINE.finditer(self.log_path.read_text(errors="replace")):
            found = NAMESPACE_IN_PATH.search(m.group("path"))
            ns = found.group("ns") if found else ""
            out[ns] = out.get(ns, 0) + 1
        return out


@contextlib.contextmanager
def namespaces(cluster: Cluster, count: int) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(temp_namespace(cluster.kube, prefix="omnistage-shard-"))
               for _ in range(count)]


def test_two_operators_split_a_fleet_by_namespace(kube: Cluster, crds: None,
                                                  tmp_path: Path) -> None:
    with namespaces(kube, 4) as (a1, a2, b1, b2):
        shard_a = Shard(kube, [a1, a2], tmp_path / "a.log", webhook=kube.is_local)
        shard_b = Shard(kube, [b1, b2], tmp_path / "b.log", webhook=False)
        try:
            shard_a.start()
            shard_b.start()
            # Load: every pipeline of both shards applied at once, so both operators ramp
            # together against the one API server.
            names = {ns: [f"p{i}" for i in range(PIPELINES_PER_NAMESPACE)]
                     for ns in (a1, a2, b1, b2)}
            for i in range(PIPELINES_PER_NAMESPACE):
                for ns in (a1, b1, a2, b2):
                    apply(kube, ns, kwok_pipeline(names[ns][i], [
                        stage("a", replicas=2), stage("b", inputs=("a",), final=True,
                                                      replicas=2)]))

            def converged() -> bool:
                return all(ready(kube, ns, name) for ns, pipes in names.items()
                           for name in pipes)

            wait_for(converged, 600, "every pipeline of both shards Ready",
                     lambda: f"A:\n{shard_a.log_tail()}\nB:\n{shard_b.log_tail()}")
            for ns, pipes in names.items():
                for name in pipes:
                    assert len(stage_pods(kube, ns, name)) == 4, (ns, name)
            # Both shards' operators reconciled their objects: pools created (writes by A only
            # in A's namespaces, by B only in B's, so each pool has exactly one writer).
            for ns in (a1, a2, b1, b2):
                pools = kube.kubectl("get", "stagepools", "-n", ns, "-o", "name").stdout.split()
                assert len(pools) == 2 * PIPELINES_PER_NAMESPACE, (ns, pools)

            if kube.is_local:  # shard A's webhook validates shard B's namespaces too
                def refused() -> str:  # a server-side dry run passes admission, stores nothing
                    out = kube.kubectl("apply", "--dry-run=server", "-n", b1, "-f", str(PROBE),
                                       check=False)
                    return out.stderr if out.returncode else ""

                denial = wait_for(refused, 60, "shard A's webhook refusing a cycle in " + b1)
                assert "validation.omnistage.io" in denial and "cycle" in denial, denial
        finally:
            # Each shard's operator releases its own pipelines (ordered shutdown, finalizers
            # removed) before it stops: a pipeline left with its finalizer would outlive the
            # namespace for every later test's operator to find.
            try:
                for ns in (a1, a2, b1, b2):
                    kube.kubectl("delete", "omnipipelines", "--all", "-n", ns, "--wait=false",
                                 check=False)
                wait_for(lambda: not any(
                    kube.kubectl("get", "omnipipelines", "-n", ns, "-o", "name",
                                 check=False).stdout.split() for ns in (a1, a2, b1, b2)),
                    300, "every pipeline of both shards released by its operator",
                    lambda: f"A:\n{shard_a.log_tail()}\nB:\n{shard_b.log_tail()}")
            finally:
                shard_a.stop()
                shard_b.stop()
                if kube.is_local:  # kopf created it; a later test's chart owns one that name
                    kube.kubectl("delete", "--ignore-not-found", "--wait=false",
                                 f"validatingwebhookconfigurations.admissionregistration.k8s.io/"
                                 f"{CONFIGURATION}")

        wrote_a, wrote_b = shard_a.written_namespaces(), shard_b.written_namespaces()
        # Exactly one writer per object: no operator wrote outside its own namespaces (nor
        # anything cluster-scoped), and each shard's namespaces were written by their operator.
        assert set(wrote_a) <= {a1, a2}, wrote_a
        assert set(wrote_b) <= {b1, b2}, wrote_b
        assert all(wrote_a.get(ns, 0) > 0 for ns in (a1, a2)), wrote_a
        assert all(wrote_b.get(ns, 0) > 0 for ns in (b1, b2)), wrote_b
