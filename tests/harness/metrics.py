"""Reading /metrics in tests: parse the exposition with prometheus_client, never by string."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample in a Prometheus text exposition, keyed by (sample name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample called `name` whose labels include `labels`; None if there is
    none. More than one match is a mistake in the test, so it raises."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples(text).items() if n == name and want <= ls]
    if len(found) > 1:
        raise AssertionError(f"{name}{labels} matches {len(found)} samples; name more labels")
    return found[0] if found else None
