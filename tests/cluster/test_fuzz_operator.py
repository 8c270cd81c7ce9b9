"""Property-based fuzzing of the routes the operator serves: its side port (/livez /readyz
/metrics) and the validating admission webhook (kopf's HTTPS server, one path per kind).

The operator runs as a real process against the local control plane (tests/harness/operator.py);
schemathesis runs as in tests/integration/test_fuzz_api.py (every check, bounded examples,
fixed seed; OMNISTAGE_FUZZ_EXAMPLES / OMNISTAGE_FUZZ_SEED for a longer local campaign).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omnistage.sideport import ops_document
from tests.harness.operator import Operator
from tests.integration.test_fuzz_api import schemathesis

pytest.importorskip("schemathesis")
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_fuzz_operator_side_port(operator: Operator, tmp_path: Path) -> None:
    doc = tmp_path / "operator-sideport.json"
    doc.write_text(json.dumps(ops_document(state=False, title="operator side port")))
    schemathesis(str(doc), tmp_path, url=f"http://127.0.0.1:{operator.port}")


def _object(kind: str) -> dict[str, Any]:
    return {"type": "object", "properties": {
        "apiVersion": {"const": "omnistage.io/v1alpha1"}, "kind": {"const": kind},
        "metadata": {"type": "object"}, "spec": {"type": "object"}}}


def webhook_document() -> dict[str, Any]:
    """The webhook's contract: an AdmissionReview (admission.k8s.io/v1) in, one out. The API
    server is its only client; this is what it sends (the fields kopf reads)."""
    paths: dict[str, Any] = {}
    for plural, kind in (("omnipipelines", "OmniPipeline"), ("stagepools", "StagePool")):
        request = {"type": "object", "required": ["uid", "kind", "resource", "operation",
                                                  "userInfo", "object"], "properties": {
            "uid": {"type": "string", "minLength": 1},
            "kind": {"type": "object", "required": ["group", "version", "kind"], "properties": {
                "group": {"const": "omnistage.io"}, "version": {"const": "v1alpha1"},
                "kind": {"const": kind}}},
            "resource": {"type": "object", "required": ["group", "version", "resource"],
                         "properties": {"group": {"const": "omnistage.io"},
                                        "version": {"const": "v1alpha1"},
                                        "resource": {"const": plural}}},
            "operation": {"enum": ["CREATE", "UPDATE"]},
            "userInfo": {"type": "object", "properties": {"username": {"type": "string"}}},
            "object": _object(kind),
            "oldObject": {"anyOf": [{"type": "null"}, _object(kind)]},
            "dryRun": {"type": "boolean"},
        }}
        review = {"type": "object", "required": ["apiVersion", "kind", "request"], "properties": {
            "apiVersion": {"const": "admission.k8s.io/v1"}, "kind": {"const": "AdmissionReview"},
            "request": request}}
        reply = {"type": "object", "required": ["apiVersion", "kind", "response"], "properties": {
            "response": {"type": "object", "required": ["uid", "allowed"], "properties": {
                "uid": {"type": "string"}, "allowed": {"type": "boolean"}}}}}
        paths[f"/{plural}"] = {"post": {
            "operationId": f"validate_{plural}",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": review}}},
            "responses": {"200": {"description": "The review, allowed or denied with every "
                                  "`path: message` line", "content": {
                                      "application/json": {"schema": reply}}},
                          "400": {"description": "Not an admission review"}}}}
    return {"openapi": "3.1.0", "info": {"title": "Omnistage admission webhook",
                                         "version": "0.1.0"}, "paths": paths}


def test_fuzz_admission_webhook(operator: Operator, tmp_path: Path) -> None:
    doc = tmp_path / "webhook.json"
    doc.write_text(json.dumps(webhook_document()))
    # The serving certificate is self-signed at every start, for 127.0.0.1: the connection
    # is encrypted but not verified, as nothing here has the CA bundle kopf registered.
    schemathesis(str(doc), tmp_path, "--tls-verify", "false",
                 url=f"https://127.0.0.1:{operator.webhook_port}")
