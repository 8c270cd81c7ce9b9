"""Root conftest: shared fixtures for the cluster and e2e suites (one operator per session)."""

pytest_plugins = ["tests.harness.operator"]
