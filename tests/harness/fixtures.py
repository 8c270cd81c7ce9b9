"""pytest fixtures for tests that need a real cluster (import them into a conftest).

Why a separate module: tests/cluster and tests/e2e both import these, and the underlying handles
are shared singletons, so one pytest session starts at most one control plane and one pod runner.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.cluster import (
    Cluster,
    PodRunner,
    acquire_cluster,
    acquire_podrunner,
    release_cluster,
    release_podrunner,
    temp_namespace,
)


@pytest.fixture(scope="session")
def kube() -> Iterator[Cluster]:
    """The cluster under test: $KUBECONFIG's (kind) or a private hack/cluster.sh control plane."""
    cluster = acquire_cluster()
    try:
        yield cluster
    finally:
        release_cluster()


@pytest.fixture(scope="session")
def podrunner(kube: Cluster) -> Iterator[PodRunner]:
    """Pods really run: via the local pod runner here, via the real kubelets on kind."""
    runner = acquire_podrunner(kube)
    try:
        yield runner
    finally:
        release_podrunner()


@pytest.fixture
def namespace(kube: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted (and waited for) afterwards."""
    with temp_namespace(kube.kube) as ns:
        yield ns
