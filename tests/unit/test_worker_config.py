"""The worker's one configuration: a Stage in, one command line out, the same Stage back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omni_operator.builders import worker_command
from omnistage import kube
from omnistage.cli import build_parser, main
from omnistage.spec import SpecError, Stage
from omnistage.worker.config import (
    WORKER_FIELDS,
    WorkerConfig,
    config_from_args,
    resolve_model,
    worker_args,
)
from tests.harness.podrunner import expand_vars

FULL: dict[str, Any] = {
    "name": "llm",
    "kind": "ar",
    "model": "/weights/llm",
    "engine": {"maxTokens": 5, "temperature": 0.5, "returnHiddenStates": True},
    "admission": {"maxRequests": 3, "maxCost": 99, "maxQueue": 11,
                  "defaultDeadlineSeconds": 2.5},
    "drainTimeoutSeconds": 7,
    "replicas": 4,
    "inputs": ["src"],
    "finalOutput": True,
    "resources": {"gpus": 1, "cpu": "2"},
    "placement": {"spreadAcrossNodes": False, "nodeSelector": {"gpu": "h100"}},
    "maxUnavailable": 2,
}


def parse(args: list[str]) -> WorkerConfig:
    """What the worker process makes of its command line (the real `omnistage` parser)."""
    assert args[0] == "stage"
    return config_from_args(build_parser(plugins=[]).parse_args(args))


def worker_view(stage: Stage) -> dict[str, Any]:
    return stage.model_dump(include=set(WORKER_FIELDS))


def test_stage_round_trips_through_the_command_line() -> None:
    stage = Stage.model_validate(FULL)
    cfg = parse(worker_args(stage, replica_id="p-llm-0", host="127.0.0.2", port=5001,
                            http_port=5002, device="cpu", port_file="/tmp/x.json"))
    assert worker_view(cfg.stage) == worker_view(stage)
    assert cfg.stage.admission.max_cost == 99 and cfg.stage.engine.temperature == 0.5
    assert (cfg.replica_id, cfg.host, cfg.port, cfg.http_port, cfg.device, cfg.port_file) == (
        "p-llm-0", "127.0.0.2", 5001, 5002, "cpu", "/tmp/x.json")


def test_only_worker_fields_reach_the_command() -> None:
    """Scaling or rewiring a stage must not change its pods' command (and roll them)."""
    stage = Stage.model_validate(FULL)
    other = Stage.model_validate({**FULL, "replicas": 1, "inputs": [], "finalOutput": False,
                                  "resources": {"gpus": 0}, "placement": {},
                                  "maxUnavailable": 0})
    assert worker_args(other) == worker_args(stage)
    doc = json.loads(worker_args(stage)[2])
    assert set(doc) == {"name", "kind", "model", "engine", "admission", "drainTimeoutSeconds"}
    changed = Stage.model_validate({**FULL, "admission": {"maxRequests": 4}})
    assert worker_args(changed) != worker_args(stage)


def test_placement_defaults_come_from_the_pod_environment(monkeypatch) -> None:
    monkeypatch.setenv("POD_NAME", "pipe-a-3")
    monkeypatch.setenv("POD_IP", "127.0.0.9")
    cfg = parse(worker_args(Stage(name="a", kind="echo")))
    assert (cfg.replica_id, cfg.host, cfg.port, cfg.http_port) == ("pipe-a-3", "127.0.0.9", 0, 0)
    monkeypatch.delenv("POD_NAME")
    monkeypatch.delenv("POD_IP")
    cfg = parse(worker_args(Stage(name="a", kind="echo")))
    assert cfg.host == "127.0.0.1" and cfg.replica_id.startswith("a-")


def test_operator_pods_run_the_same_command() -> None:
    stage = Stage.model_validate(FULL)
    cmd = worker_command(stage)
    assert cmd == ["omnistage", *worker_args(stage, port=kube.WORKER_ZMQ_PORT,
                                             http_port=kube.WORKER_HTTP_PORT)]


def test_operator_escapes_dollar_for_kubelet_expansion() -> None:
    """The kubelet expands $(VAR) in commands; a model path holding one must arrive intact."""
    stage = Stage(name="a", kind="ar", model="/models/$(HOME)/$x")
    cmd = worker_command(stage)
    expanded = [expand_vars(a, {"HOME": "/tmp"}) for a in cmd]  # what the container gets
    assert parse(expanded[1:]).stage.model == "/models/$(HOME)/$x"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--stage-json", '{"name":"a","kind":"echo","admission":{"maxRequests":0}}'],
         "--stage-json: admission.maxRequests: Input should be greater than or equal to 1"),
        (["--stage-json", '{"name":"a","kind":"ar"}'], "model: a model is required"),
        # A check across fields names its own path (the one formatter, spec.errors), not (root).
        (["--stage-json", '{"name":"a","kind":"ar","model":"tiny-llama","resources":{"gpus":2}}'],
         "--stage-json: resources.gpus: replicas of kind 'ar' load"),
        (["--stage-json", '{"name":"a","kind":"echo","replics":2}'], "replics: Extra inputs"),
        (["--stage-json", "{not json"], "(root): Invalid JSON"),
        (["--stage-json", '{"name":"a","kind":"echo"}', "--stage", "a"], "--stage: only with"),
    ],
)
def test_bad_stage_exits_2_naming_the_field(argv: list[str], expected: str, capsys) -> None:
    assert main(["stage", *argv]) == 2
    err = capsys.readouterr().err
    assert "error: invalid stage" in err and expected in err, err


def test_neither_or_both_stage_sources_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["stage"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["stage", "--stage-json", "{}", "--pipeline-file", "x.yaml"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_stage_from_a_pipeline_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "weights").mkdir()
    file = tmp_path / "p.yaml"
    file.write_text(
        "apiVersion: omnistage.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: p}\n"
        "spec:\n  stages:\n"
        "  - {name: enc, kind: ar, model: ./weights, admission: {maxQueue: 5}}\n"
        "  - {name: out, kind: echo, inputs: [enc], finalOutput: true}\n"
    )
    cfg = parse(["stage", "--pipeline-file", str(file), "--stage", "enc", "--port", "7"])
    assert cfg.stage.model == str(tmp_path / "weights")  # relative to the file, not the cwd
    assert cfg.stage.admission.max_queue == 5 and cfg.port == 7
    with pytest.raises(SpecError, match="unknown stage 'nope' \\(stages: enc, out\\)"):
        parse(["stage", "--pipeline-file", str(file), "--stage", "nope"])
    assert main(["stage", "--pipeline-file", str(file)]) == 2
    assert "--stage: required with --pipeline-file" in capsys.readouterr().err
    assert main(["stage", "--pipeline-file", str(tmp_path / "none.yaml"), "--stage", "a"]) == 2
    assert "pipeline file not found" in capsys.readouterr().err


def test_resolve_model_leaves_builtins_and_absolute_paths(tmp_path: Path) -> None:
    builtin = Stage(name="a", kind="ar", model="tiny-llama")
    assert resolve_model(builtin, tmp_path) is builtin
    rel = Stage(name="a", kind="ar", model="./w")
    assert resolve_model(rel, tmp_path).model == str(tmp_path / "w")
    assert rel.model == "./w"  # the pipeline's own stage is not changed
