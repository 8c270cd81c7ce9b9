"""Reading what an orchestrator or worker reports in tests: /metrics parsed with
prometheus_client, never by string, and the orchestrator's GET /v1/load."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from omnistage.kube import LOAD_PATH

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


def routable(base_url: str, stage: str) -> int:
    """The replicas of `stage` that the orchestrator at `base_url` routes to now (GET /v1/load).
    A Ready pod is a ready worker; the orchestrator routes to it a moment later, once its
    membership saw it and the handshake answered: tests that spread requests wait on this."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(base_url.rstrip("/") + LOAD_PATH, timeout=10) as answer:
        return int(json.loads(answer.read())["stages"][stage]["replicas"])
