"""Helm for the tests: the pinned helm binary, the chart in charts/omnistage, and the operator
as users install it (``helm install``), running in its image under the pod runner.

Why: the chart is how users get the operator, so the e2e suite installs, upgrades and
uninstalls it exactly that way, and the chart tests render it with ``helm template``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omnistage.kubeapi import ApiError, resource_path
from tests.harness.cluster import Cluster, PodRunner, cache_dir, pods, which
from tests.harness.kubeclient import wait_until

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "omnistage"
Obj = dict[str, Any]


def helm_binary() -> str | None:
    """The helm hack/build-k8s.sh built (HELM_VERSION), else one on PATH."""
    return which("helm")


def helm(*args: str, kubeconfig: Path | None = None, check: bool = True, timeout: float = 600,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm with private config/cache dirs (nothing from the user's helm setup leaks in)."""
    binary = helm_binary()
    if binary is None:
        raise AssertionError("helm not found: run hack/build-k8s.sh helm")
    base = cache_dir() / "helm-test"
    env = {"HELM_CONFIG_HOME": str(base / "config"), "HELM_CACHE_HOME": str(base / "cache"),
           "HELM_DATA_HOME": str(base / "data"), "PATH": "/usr/bin:/bin", "HOME": str(base)}
    cmd = [binary, *args]
    if kubeconfig is not None:
        cmd.append(f"--kubeconfig={kubeconfig}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          input=input, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return proc


def render(*args: str, release: str = "omnistage", namespace: str = "omnistage-system",
           kube_version: str | None = None) -> list[Obj]:
    """``helm template`` of the chart: the objects it would install."""
    from tests.harness.cluster import _versions

    version = kube_version or _versions()["K8S_VERSION"]
    out = helm("template", release, str(CHART), "-n", namespace, f"--kube-version={version}",
               *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str) -> Obj:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


@dataclass
class Release:
    """An installed release of the chart, whose operator pods run under the pod runner."""

    cluster: Cluster
    runner: PodRunner
    namespace: str
    name: str = "omnistage"
    values: list[str] = field(default_factory=list)  # --set arguments of the last install

    @property
    def fullname(self) -> str:
        return f"{self.name}-operator"

    def helm(self, *args: str, check: bool = True, timeout: float = 600
             ) -> subprocess.CompletedProcess[str]:
        return helm(*args, "-n", self.namespace, kubeconfig=self.cluster.kubeconfig,
                    check=check, timeout=timeout)

    def cluster_values(self) -> list[str]:
        """What this cluster needs: the local control plane routes no Service, so its API
        server calls the webhook at the leader's (loopback) pod IP; kind uses the Service."""
        return ["webhook.clientConfig=podIP"] if self.cluster.is_local else []

    def install(self, *sets: str, timeout: str = "300s") -> str:
        """``helm install --wait``: returns (its output, NOTES included) once the operator
        Deployment is available."""
        self.values = list(sets)
        args = [f"--set={s}" for s in (*self.cluster_values(), *sets)]
        return self.helm("install", self.name, str(CHART), "--wait", f"--timeout={timeout}",
                         *args).stdout

    def upgrade(self, *sets: str, timeout: str = "300s") -> None:
        self.values = list(sets)
        args = [f"--set={s}" for s in (*self.cluster_values(), *sets)]
        self.helm("upgrade", self.name, str(CHART), "--wait", f"--timeout={timeout}", *args)

    def uninstall(self) -> None:
        self.helm("uninstall", self.name, "--wait", "--timeout=120s", check=False)

    def operator_pods(self) -> list[Obj]:
        selector = f"app.kubernetes.io/instance={self.name}"
        return [p for p in pods(self.cluster.kube, self.namespace, selector)
                if not p["metadata"].get("deletionTimestamp")]

    def lease(self) -> Obj | None:
        path = resource_path("coordination.k8s.io/v1", "leases", self.namespace, self.fullname)
        try:
            return dict(self.cluster.kube.get(path))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def leader(self) -> str | None:
        lease = self.lease()
        return (lease or {}).get("spec", {}).get("holderIdentity")

    def wait_leader(self, timeout: float = 90) -> str:
        live = lambda: {p["metadata"]["name"] for p in self.operator_pods()}  # noqa: E731
        return str(wait_until(lambda: self.leader() in live() and self.leader(), timeout,
                              "an operator pod holding the lease", on_timeout=self.log_tail))

    def log_tail(self, lines: int = 60) -> str:
        """The operator pods' output (for failure messages)."""
        out = [f"lease holder: {self.leader()}"]
        for pod in pods(self.cluster.kube, self.namespace):
            name = pod["metadata"]["name"]
            state = json.dumps(pod.get("status", {}).get("containerStatuses", []))[:600]
            tail = self.runner.log_tail(self.namespace, name, lines=lines)
            out.append(f"--- {name}: {state}\n{tail}")
        return "\n".join(out)


def iter_docs(text: str) -> Iterator[Obj]:
    for doc in yaml.safe_load_all(text):
        if doc:
            yield doc
