"""Cluster tests run against a real kube-apiserver (hack/cluster.sh, or kind via $KUBECONFIG)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.fixtures import kube, namespace, podrunner

__all__ = ["kube", "namespace", "podrunner"]

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder needs the cluster: mark it so `-m "not cluster"` skips them."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)
