"""The orchestrator's shutdown settings: the spec field, the flags, and the time budget a pod's
terminationGracePeriodSeconds must cover."""

from __future__ import annotations

import pytest

from omnistage.cli import build_parser
from omnistage.orchestrator.shutdown import CLOSE_MARGIN_SECONDS, drain_timeout, shutdown_seconds
from omnistage.spec import SpecError, parse_pipeline


def _pipeline(**orchestrator: object) -> object:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "demo"},
        "spec": {"orchestrator": orchestrator, "stages": [
            {"name": "a", "kind": "echo", "drainTimeoutSeconds": 12},
            {"name": "b", "kind": "echo", "inputs": ["a"], "finalOutput": True,
             "drainTimeoutSeconds": 40}]},
    })


def test_shutdown_delay_field_and_budget() -> None:
    pipeline = _pipeline()
    assert pipeline.spec.orchestrator.shutdown_delay_seconds == 5
    assert drain_timeout(pipeline) == 40  # the longest stage drain
    assert shutdown_seconds(pipeline) == 5 + 40 + CLOSE_MARGIN_SECONDS
    assert shutdown_seconds(pipeline, shutdown_delay=0) == 40 + CLOSE_MARGIN_SECONDS
    assert shutdown_seconds(_pipeline(shutdownDelaySeconds=1.5)) == 1.5 + 40 + CLOSE_MARGIN_SECONDS
    for bad in (-1, 301):
        with pytest.raises(SpecError, match=r"spec\.orchestrator\.shutdownDelaySeconds"):
            _pipeline(shutdownDelaySeconds=bad)


def test_shutdown_delay_flags() -> None:
    parser = build_parser(plugins=[])
    assert parser.parse_args(["serve", "p.yaml"]).shutdown_delay == 0  # locally: no delay
    assert parser.parse_args(["orchestrator"]).shutdown_delay is None  # the spec decides
    assert parser.parse_args(["orchestrator", "--shutdown-delay", "2.5"]).shutdown_delay == 2.5


@pytest.mark.parametrize("value", ["-1", "soon", "301"])
def test_bad_shutdown_delay_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser(plugins=[]).parse_args(["serve", "p.yaml", "--shutdown-delay", value])
    assert info.value.code == 2
    assert "--shutdown-delay" in capsys.readouterr().err
