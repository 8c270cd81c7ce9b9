"""A kind added to the kind table reaches the real API server's schema.

The OmniPipeline CRD is generated with the test-only `reverse` kind registered
(tests/integration/test_stage_kinds.py) and served under a group of its own, so the session's
real CRDs stay as they are. The API server then accepts a reverse stage, and the CEL rules
generated from its row refuse a model on it, in the validator's words.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import omnistage.kinds as stage_kinds
from omni_operator.crd import omnipipeline_crd
from tests.harness.cluster import Cluster
from tests.integration.test_stage_kinds import REVERSE, manifest

GROUP = "kindtest.omnistage.io"


@pytest.fixture(scope="module")
def api_version(kube: Cluster) -> Iterator[str]:
    """The CRD with `reverse` in its kind enum, Established under GROUP; deleted afterwards."""
    with stage_kinds.registered(REVERSE):
        crd = omnipipeline_crd()
    spec = crd["spec"]
    spec["group"] = GROUP
    # Names of its own too: a second `omnipipelines` would make kubectl's plain
    # `get omnipipelines` ambiguous for the tests that run after this one (and its discovery
    # cache would still name this group after the CRD is gone).
    spec["names"] = {"kind": "KindTestPipeline", "listKind": "KindTestPipelineList",
                     "plural": "kindtestpipelines", "singular": "kindtestpipeline"}
    name = f"{spec['names']['plural']}.{GROUP}"
    crd["metadata"]["name"] = name
    kube.kubectl("apply", "-f", "-", input=json.dumps(crd))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
    yield f"{GROUP}/{spec['versions'][0]['name']}"
    kube.kubectl("delete", "crd", name, "--timeout=60s", check=False)


def _apply(kube: Cluster, namespace: str, doc: dict[str, Any]) -> Any:
    return kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)


def test_the_api_server_takes_a_registered_kind_by_its_row(
    kube: Cluster, namespace: str, api_version: str
) -> None:
    doc = {**manifest(maxTokens=3), "apiVersion": api_version, "kind": "KindTestPipeline"}
    out = _apply(kube, namespace, doc)
    assert out.returncode == 0, out.stderr
    doc["metadata"] = {"name": "rev-model"}
    doc["spec"]["stages"][0]["model"] = "tiny-llama"
    out = _apply(kube, namespace, doc)
    assert out.returncode != 0
    assert ("spec.stages[0].model: Invalid value: reverse stages take no model; omit "
            "it or set it to none (got 'tiny-llama')") in out.stderr, out.stderr
    doc["metadata"] = {"name": "rev-unknown"}
    doc["spec"]["stages"][0] = {"name": "rev", "kind": "nosuch"}
    out = _apply(kube, namespace, doc)
    assert out.returncode != 0 and "spec.stages[0].kind: Unsupported value: \"nosuch\"" in \
        out.stderr, out.stderr
