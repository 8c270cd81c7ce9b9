"""Root conftest: the shared cluster fixtures (one control plane, pod runner and operator per
session) and the `cluster` mark for the suites that need them."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.harness.fixtures", "tests.harness.operator"]

CLUSTER_SUITES = tuple(Path(__file__).parent / "tests" / d for d in ("cluster", "e2e"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under tests/cluster and tests/e2e need a cluster: `-m "not cluster"` skips them."""
    for item in items:
        path = Path(str(item.fspath))
        if any(suite in path.parents for suite in CLUSTER_SUITES):
            item.add_marker(pytest.mark.cluster)
