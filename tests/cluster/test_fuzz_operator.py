"""Property-based fuzzing of the routes the operator serves: its side port (/livez /readyz
/metrics) and the validating admission webhook (kopf's HTTPS server, one path per kind; its
document is generated from the AdmissionReview model the server checks requests with).

The operator runs as a real process against the local control plane (tests/harness/operator.py);
schemathesis runs as in tests/integration/test_fuzz_api.py (every check, bounded examples,
fixed seed; OMNISTAGE_FUZZ_EXAMPLES / OMNISTAGE_FUZZ_SEED for a longer local campaign).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_operator.webhook import webhook_document
from omnistage.sideport import ops_document
from tests.harness.operator import Operator
from tests.integration.test_fuzz_api import schemathesis

pytest.importorskip("schemathesis")
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_fuzz_operator_side_port(operator: Operator, tmp_path: Path) -> None:
    doc = tmp_path / "operator-sideport.json"
    doc.write_text(json.dumps(ops_document(state=False, title="operator side port")))
    schemathesis(str(doc), tmp_path, url=f"http://127.0.0.1:{operator.port}")


def test_fuzz_admission_webhook(operator: Operator, tmp_path: Path) -> None:
    doc = tmp_path / "webhook.json"
    doc.write_text(json.dumps(webhook_document()))
    # The serving certificate is self-signed at every start, for 127.0.0.1: the connection
    # is encrypted but not verified, as nothing here has the CA bundle kopf registered.
    schemathesis(str(doc), tmp_path, "--tls-verify", "false",
                 url=f"https://127.0.0.1:{operator.webhook_port}")
