"""Root conftest: the shared cluster fixtures (one control plane, pod runner and operator per
session) and the `cluster` mark for the suites that need them."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.harness.fixtures", "tests.harness.operator"]

TESTS = Path(__file__).parent / "tests"
CLUSTER_SUITES = tuple(TESTS / d for d in ("cluster", "e2e"))
#: Modules that test the test harness or the image build tooling, not Omnistage: counted apart
#: (`-m "not harness"` runs only Omnistage's own tests).
HARNESS_MODULES = frozenset(TESTS / f for f in (
    "unit/test_harness_images.py",  # the pod runner's image rules (tests/harness/images.py)
    "unit/test_build_images.py",  # hack/build_images.py
    "unit/test_hack_test_sh.py",  # hack/test.sh's steps side by side
    "unit/test_harness_load.py",  # the emulated Service endpoints (tests/harness/load.py)
    "unit/test_podrunner_backoff.py",  # the pod runner's crash-loop back-off
    "cluster/test_podrunner.py",  # the local "kubelet" (tests/harness/podrunner.py)
    "cluster/test_scale.py",  # kwok and the control plane carry 500 pods
))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under tests/cluster and tests/e2e need a cluster: `-m "not cluster"` skips them.
    Harness tests get the `harness` mark."""
    for item in items:
        path = Path(str(item.fspath))
        if any(suite in path.parents for suite in CLUSTER_SUITES):
            item.add_marker(pytest.mark.cluster)
        if path in HARNESS_MODULES:
            item.add_marker(pytest.mark.harness)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how many of the tests that ran test Omnistage and how many the harness."""
    ran = [r for key in ("passed", "failed", "xfailed", "xpassed")
           for r in terminalreporter.stats.get(key, []) if getattr(r, "when", "") == "call"]
    harness = sum(1 for r in ran if "harness" in r.keywords)
    if ran:
        terminalreporter.write_line(
            f"omnistage tests: {len(ran) - harness}, harness tests: {harness} (counted apart)")
