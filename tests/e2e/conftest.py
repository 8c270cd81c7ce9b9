"""End-to-end tests: the whole path on a cluster (local control plane + pod runner, or kind)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.fixtures import kube, namespace, podrunner

__all__ = ["kube", "namespace", "podrunner"]

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)
