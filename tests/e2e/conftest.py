"""tests/e2e runs the product as users install it: every pod in its image, the operator from the
Helm chart.

The ``operator`` fixture here replaces the process operator of tests/harness/operator.py: one
``helm install`` per test module (its own release namespace), uninstalled afterwards, so two
operators never reconcile the same pipelines.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import pytest

from omni_operator.admin_credential import AdminCredential
from omnistage.kubeapi import resource_path
from tests.harness.cluster import Cluster, PodRunner, cleanup_namespace
from tests.harness.helm import Release, helm_binary
from tests.harness.kubeclient import wait_until
from tests.harness.operator import Operator, get

#: e2e installs use a short resync, like the process operator of the cluster suite.
E2E_VALUES = ("resyncSeconds=3",)
#: The orchestrator's admin listener (control, GET /v1/load, /metrics) when a pipeline sets
#: only its API port's default 8000: adminPort defaults to port + 1.
ORCH_ADMIN_PORT = 8001


def admin_key_of(kube: Cluster, operator: Release | Operator, namespace: str,
                 pipeline: str) -> str:
    """The admin key `operator` presents at `pipeline`'s orchestrator pods: derived from the
    chart's Secret <fullname>-admin-key for a release, from the harness's root for a process
    operator, and the pipeline's uid as the API server has it."""
    obj = get(kube, namespace, "omnipipe", pipeline)
    if obj is None:
        raise AssertionError(f"no OmniPipeline {namespace}/{pipeline}")
    uid = obj["metadata"]["uid"]
    if isinstance(operator, Operator):
        return operator.admin_key(namespace, pipeline, uid)
    secret = kube.kube.get(resource_path("v1", "secrets", operator.namespace,
                                         f"{operator.fullname}-admin-key"))
    root = base64.b64decode(secret["data"]["admin-key"]).strip()
    return AdminCredential(root).key(namespace, pipeline, uid)


def admin_url(url: str, port: int = ORCH_ADMIN_PORT) -> str:
    """The admin listener's base URL of the orchestrator whose API is at `url`
    (http://HOST:PORT[/...]): the same host, the admin port."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def require_images(runner: PodRunner) -> None:
    """e2e proves the images: refuse to run it with pods on the checkout's Python."""
    if not runner.images:
        pytest.fail("tests/e2e runs pods in their images; this session's pod runner is in "
                    "process mode (unset OMNISTAGE_POD_MODE=process)", pytrace=False)
    if helm_binary() is None:
        pytest.fail("helm not found: run hack/build-k8s.sh", pytrace=False)


def release_namespace(kube: Cluster, prefix: str) -> str:
    """A fresh namespace for a release (names are never reused while one terminates)."""
    ns = kube.kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"generateName": prefix}},
    )["metadata"]["name"]
    wait_until(lambda: kube.kube.get(resource_path("v1", "serviceaccounts", ns, "default")),
               30, f"default service account in {ns}")
    return str(ns)


@contextlib.contextmanager
def installed(kube: Cluster, runner: PodRunner, *sets: str, prefix: str = "omnistage-"
              ) -> Iterator[Release]:
    """A chart release for the duration of the block; uninstalled and its namespace removed."""
    release = Release(kube, runner, release_namespace(kube, prefix))
    try:
        release.install(*sets)
        yield release
    finally:
        release.uninstall()
        cleanup_namespace(kube.kube, release.namespace)


@pytest.fixture(scope="module")
def operator(kube: Cluster, podrunner: PodRunner) -> Iterator[Release]:
    """The operator as `helm install` runs it (image mode), for one test module."""
    require_images(podrunner)
    with installed(kube, podrunner, *E2E_VALUES) as release:
        release.wait_leader()
        yield release
