"""`omnistage validate`, `omnistage serve --dry-run` and the admission webhook's review function:
the one validator behind each, on real files and real processes (the CLI runs as a subprocess).

tests/cluster/test_validation.py runs the same invalid manifests through kubectl and the API
server with the webhook; here every one is checked locally in a second.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from omni_operator.webhook import parse_service, review, self_signed
from omnistage.spec import SpecError, validate_manifest

REPO = Path(__file__).resolve().parents[2]
INVALID = REPO / "tests" / "cluster" / "invalid"
CASES = sorted(INVALID.glob("*.yaml"))
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
ECHO, TEXT_TO_IMAGE = REPO / "examples" / "echo.yaml", REPO / "examples" / "text-to-image.yaml"


def header(path: Path, key: str) -> str | None:
    found = re.search(rf"^# {key}: (.+)$", path.read_text(), re.M)
    return found.group(1).strip() if found else None


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnistage.cli", *args], capture_output=True,
                          text=True, cwd=cwd, check=False)


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_each_invalid_manifest_names_its_path(path: Path) -> None:
    base = header(path, "base")
    old = yaml.safe_load((REPO / base).read_text()) if base else None
    if old is not None:
        validate_manifest(old)  # the stored object itself is valid
    with pytest.raises(SpecError) as info:
        validate_manifest(yaml.safe_load(path.read_text()), old=old)
    assert header(path, "path") in [p for p, _ in info.value.errors]


def test_validate_reports_every_error_as_text_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: omnistage.io/v1alpha1\nkind: OmniPipeline\n"
        "metadata: {name: p, lables: {a: b}}\n"
        "spec:\n  stages:\n    - {name: a, kind: echo, finalOutput: 'true', replicas: '3'}\n"
    )
    proc = cli("validate", str(bad), *(str(e.relative_to(REPO)) for e in EXAMPLES))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"{bad}: metadata.lables: unknown field 'lables' (did you mean 'labels'?)" in lines
    assert f"{bad}: spec.stages[0].replicas: must be an integer (got str '3')" in lines
    assert f"{bad}: spec.stages[0].finalOutput: must be a boolean (got str 'true')" in lines
    assert "examples/echo.yaml: OmniPipeline echo is valid" in lines
    assert lines[-1] == (f"{len(EXAMPLES) + 1} document(s) checked: {len(EXAMPLES)} valid, "
                         "1 invalid (3 error(s))")


def test_validate_json_output_and_exit_0() -> None:
    proc = cli("validate", "-o", "json", *map(str, EXAMPLES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["valid"] is True
    assert [(d["kind"], d["name"], d["errors"]) for d in report["documents"]] == [
        ("OmniPipeline", "chat", []), ("OmniPipeline", "echo", []),
        ("OmniPipeline", "omni-speech", []), ("OmniPipeline", "qwen3-omni", []),
        ("OmniPipeline", "text-to-image", []), ("OmniPipeline", "tts", [])]


def test_validate_multi_document_files_and_file_errors(tmp_path: Path) -> None:
    both = tmp_path / "both.yaml"
    pool = {"apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
            "metadata": {"name": "echo-a"},
            "spec": {"pipeline": "echo", "stage": {"name": "a", "kind": "echo"}, "image": ""}}
    both.write_text(ECHO.read_text() + "---\n" + yaml.safe_dump(pool))
    proc = cli("validate", "-o", "json", str(both), str(tmp_path / "missing.yaml"),
               str(INVALID / "cycle.yaml"))
    assert proc.returncode == 2
    docs = json.loads(proc.stdout)["documents"]
    assert [(d["document"], d["valid"]) for d in docs] == [(0, True), (1, False), (None, False),
                                                           (0, False)]
    assert docs[1]["errors"][0]["path"] == "spec.image"
    assert docs[2]["errors"] == [{"path": "(file)", "message": "file not found"}]
    text = cli("validate", str(both)).stdout
    assert f"{both} (document 2): spec.image: an image is required" in text


def test_validate_old_checks_immutable_fields() -> None:
    update = INVALID / "change-kind.yaml"
    old = REPO / str(header(update, "base"))
    assert cli("validate", str(update)).returncode == 0  # alone, it is a valid pipeline
    proc = cli("validate", str(update), f"--old={old}")
    assert proc.returncode == 2
    assert "spec.stages[1].kind: kind is immutable; create a stage with a new name instead" in (
        proc.stdout)


def test_serve_dry_run_checks_paths_and_the_gpu_plan(tmp_path: Path) -> None:
    assert cli("serve", "--dry-run", str(TEXT_TO_IMAGE)).returncode == 0
    doc = yaml.safe_load(ECHO.read_text())
    doc["spec"]["stages"][0].update(kind="ar", model="./weights")
    del doc["spec"]["stages"][0]["engine"]
    file = tmp_path / "p.yaml"
    file.write_text(yaml.safe_dump(doc))
    proc = cli("serve", "--dry-run", "-o", "json", str(file))
    assert proc.returncode == 2
    [report] = json.loads(proc.stdout)["documents"]
    assert report["errors"] == [{"path": "spec.stages[0].model",
                                 "message": "model path './weights' does not exist"}]
    assert cli("validate", str(file)).returncode == 0  # a pod path is not checked here
    gpus = yaml.safe_load(ECHO.read_text())
    gpus["spec"]["stages"][0]["resources"]["gpus"] = 16
    file.write_text(yaml.safe_dump(gpus))
    proc = subprocess.run([sys.executable, "-m", "omnistage.cli", "serve", "--dry-run",
                           str(file)], capture_output=True, text=True, cwd=REPO, check=False,
                          env={**_env(), "CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 2
    assert "(placement): stage 'a' asks for 16 GPU(s) per replica" in proc.stdout


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


# ---------------------------------------------------------------------------- webhook


def test_review_refuses_with_every_line_and_admits_valid_objects() -> None:
    cycle = yaml.safe_load((INVALID / "cycle.yaml").read_text())
    with pytest.raises(kopf.AdmissionError) as info:
        review(cycle, None)
    assert str(info.value) == "spec.stages[1].inputs[1]: cycle detected: a -> b -> c -> a"
    assert info.value.code == 422
    review(yaml.safe_load(EXAMPLES[0].read_text()), None)


def test_review_of_updates() -> None:
    update = INVALID / "change-kind.yaml"
    old = yaml.safe_load((REPO / str(header(update, "base"))).read_text())
    with pytest.raises(kopf.AdmissionError, match="kind is immutable"):
        review(yaml.safe_load(update.read_text()), old)
    # Spec unchanged (finalizers, labels): not re-validated, even if today's rules refuse it.
    stored = yaml.safe_load((INVALID / "cycle.yaml").read_text())
    relabelled: dict[str, Any] = {**stored, "metadata": {**stored["metadata"],
                                                          "labels": {"team": "ml"}}}
    review(relabelled, stored)


def test_self_signed_certificate_serves_the_names_it_is_for(tmp_path: Path) -> None:
    cert, key, ca = self_signed(["127.0.0.1", "omnistage-webhook.omnistage-system.svc"])
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate(cert)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["omnistage-webhook.omnistage-system.svc"]
    authority = x509.load_pem_x509_certificate(ca)
    leaf.verify_directly_issued_by(authority)
    assert authority.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_parse_service() -> None:
    assert parse_service("omnistage-system/omnistage-webhook") == (
        "omnistage-system", "omnistage-webhook", 443)
    assert parse_service("ns/svc:9443") == ("ns", "svc", 9443)
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        parse_service("svc")


async def test_the_webhook_server_announces_a_service_or_a_url(tmp_path: Path) -> None:
    """kopf's server, started for real on loopback; the client config it yields is what the
    managed ValidatingWebhookConfiguration gets."""
    import asyncio
    import base64

    from omni_operator.webhook import WebhookSettings, server
    from tests.harness.local import free_port

    async def refuse_all(request: Any, **_: Any) -> Any:
        return {}

    for settings, expected in (
        (WebhookSettings(port=free_port(), service="omnistage-system/omnistage-webhook"),
         {"service": {"namespace": "omnistage-system", "name": "omnistage-webhook",
                      "port": 443}}),
        (WebhookSettings(port=free_port()), None),
    ):
        configs = server(settings)(refuse_all)
        config = await asyncio.wait_for(configs.__anext__(), 10)
        try:
            assert base64.b64decode(config["caBundle"]).startswith(b"-----BEGIN CERTIFICATE")
            if expected:
                assert {k: v for k, v in config.items() if k != "caBundle"} == expected
            else:
                assert config["url"] == f"https://127.0.0.1:{settings.port}"
        finally:
            await configs.aclose()


async def test_kopf_manages_no_mutating_configuration() -> None:
    """kopf's runner spawns admission.mutating_configuration_manager by attribute lookup, before
    the startup handlers run; registering the webhook (before kopf.operator()) swaps in one that
    idles instead of creating a MutatingWebhookConfiguration, which the chart's RBAC does not
    allow (tests/e2e/test_chart_rbac.py fails on the 403 otherwise)."""
    import asyncio
    import inspect

    from kopf._core.engines import admission
    from kopf._core.reactor import running

    from omni_operator.webhook import WebhookSettings, register

    assert "admission.mutating_configuration_manager(" in inspect.getsource(running)
    register(kopf.OperatorRegistry(), WebhookSettings())
    register(kopf.OperatorRegistry(), WebhookSettings())  # idempotent
    manager = admission.mutating_configuration_manager
    assert getattr(manager, "omnistage_idle", False)
    # One step of the coroutine, by hand: kopf's own manager would fail at once on these
    # arguments (or return); the idle one suspends on a future nobody resolves. No wait on the
    # clock decides it.
    coro = manager(registry=None, settings=None, insights=None, container=None)
    waiting_on = coro.send(None)
    assert isinstance(waiting_on, asyncio.Future) and not waiting_on.done()
    coro.close()
    assert "validating_configuration_manager" in dir(admission)  # the validating one stays
