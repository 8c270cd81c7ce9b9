"""Adding a stage kind is one executor plus one row of the kind table (omnistage.kinds).

A test-only kind, `reverse` (text in, the text reversed out), is defined here and nowhere else.
It flows through spec validation, the generated CRD schema, a real worker process and the
orchestrator of a real `omnistage serve`, which know it through OMNISTAGE_STAGE_KINDS. Nothing
else in the tree was changed to admit it, which is what the table promises.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import omnistage.kinds as stage_kinds
from omni_operator.crd import omnipipeline_crd
from omnistage.admission import ExecutionContext
from omnistage.batching import Emit
from omnistage.executors.base import Executor, Outcome
from omnistage.kinds import Payload, StageKind
from omnistage.params import StageParams, stage_params
from omnistage.protocol import WireTensor
from omnistage.spec import SpecError, parse_pipeline
from tests.integration.test_serve import post
from tests.integration.test_serve import serve as serve  # the fixture

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


class _ReverseRequest(StageParams):
    prompt: str = ""
    stream: bool = False


@dataclass
class ReverseJob:
    text: str
    stream: bool


class ReverseExecutor(Executor):
    """Reverses its prompt and keeps at most maxTokens characters of the result."""

    kind = "reverse"

    def load(self) -> None:
        # Built here, not at import: this module is imported before the kind is registered.
        self.params = stage_params("reverse", _ReverseRequest)

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> ReverseJob:
        req = self.parse(self.params, params)
        return ReverseJob(req.prompt[::-1][: req.options(self.engine).max_tokens], req.stream)

    def cost(self, job: ReverseJob) -> int:
        return 1

    def execute(self, job: ReverseJob, ctx: ExecutionContext, emit: Emit) -> Outcome:
        if job.stream:
            emit({"text": job.text})
        return Outcome({"text": job.text, "finish_reason": "stop"})


#: The one row: what OMNISTAGE_STAGE_KINDS names for the worker and `omnistage serve`.
REVERSE = StageKind(
    name="reverse",
    executor=f"{__name__}:ReverseExecutor",
    summary="test only: reverses text",
    needs_model=False,
    engine_options=("max_tokens",),
    consumes=frozenset({Payload.TEXT}),
    emits=frozenset({Payload.TEXT}),
)
ENTRY = f"{__name__}:REVERSE"


@pytest.fixture
def reverse() -> Iterator[StageKind]:
    with stage_kinds.registered(REVERSE) as kind:
        yield kind


def manifest(**engine: Any) -> dict[str, Any]:
    """rev (reverse) -> out (echo): the echo stage consumes the text that reverse emits."""
    return {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "rev"},
        "spec": {
            "orchestrator": {"api": ["generic"]},
            "stages": [
                {"name": "rev", "kind": "reverse", "engine": engine,
                 "resources": {"cpu": "1", "memory": "256Mi"}},
                {"name": "out", "kind": "echo", "inputs": ["rev"], "finalOutput": True,
                 "resources": {"cpu": "1", "memory": "256Mi"}},
            ],
        },
    }


def errors_of(doc: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_pipeline(doc)
    return info.value.errors


# --------------------------------------------------------------------------- the spec


def test_an_unregistered_kind_is_refused_naming_the_known_kinds() -> None:
    assert errors_of(manifest()) == [
        ("spec.stages[0].kind", "invalid value 'reverse' (expected 'ar', 'diffusion', 'echo', "
                                "'thinker', 'talker' or 'vocoder')")]


def test_a_registered_kind_validates_and_reads_its_engine_options(reverse: StageKind) -> None:
    spec = parse_pipeline(manifest(maxTokens=3)).spec
    assert spec.stage("rev").kind == "reverse" and spec.stage("rev").engine.max_tokens == 3
    assert errors_of(manifest(maxTokens=-1)) == [
        ("spec.stages[0].engine.maxTokens", "Input should be greater than or equal to 0 (got -1)")]
    # It takes no model (its row says so), and it cannot answer chat (it emits no tokens).
    doc = manifest()
    doc["spec"]["stages"][0]["model"] = "tiny-llama"
    assert errors_of(doc) == [
        ("spec.stages[0].model",
         "reverse stages take no model; omit it or set it to none (got 'tiny-llama')")]
    doc = manifest()
    doc["spec"]["orchestrator"]["chatStage"] = "rev"
    assert errors_of(doc) == [
        ("spec.orchestrator.chatStage",
         "stage 'rev' has kind 'reverse'; the chat stage must be a stage of kind 'ar' or "
         "'thinker'")]


def test_registering_a_bad_row_names_the_problem() -> None:
    with pytest.raises(stage_kinds.KindError, match=r"engine option.*'no_such_knob'"):
        stage_kinds.register(StageKind(name="bad", executor="x:Y", summary="",
                                       needs_model=False, engine_options=("no_such_knob",)))
    with pytest.raises(stage_kinds.KindError, match="'echo' is already registered"):
        stage_kinds.register(StageKind(name="echo", executor="x:Y", summary="",
                                       needs_model=False))
    assert "bad" not in stage_kinds.names()


# --------------------------------------------------------------------------- the CRD


def _stage_schema(crd: dict[str, Any]) -> dict[str, Any]:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["stages"]["items"]  # type: ignore[no-any-return]


def test_the_generated_crd_schema_accepts_a_registered_kind(reverse: StageKind) -> None:
    stage = {"name": "rev", "kind": "reverse", "engine": {"maxTokens": 3}}
    schema = _stage_schema(omnipipeline_crd())
    # OpenAPI 3.0 schemas are JSON Schema draft 4 in their bounds (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(schema).validate(stage)
    # The CEL rules of the CRD read the same row: no model for reverse, and chat is ar only.
    no_model = [r for r in schema["x-kubernetes-validations"]
                if r["message"].endswith("stages take no model; omit it or set it to none")]
    assert len(no_model) == 1 and "['echo', 'reverse']" in no_model[0]["rule"]
    stage_kinds.unregister("reverse")
    with pytest.raises(jsonschema.ValidationError, match="'reverse' is not one of"):
        jsonschema.Draft4Validator(_stage_schema(omnipipeline_crd())).validate(stage)
    stage_kinds.register(REVERSE)  # for the fixture's teardown


# --------------------------------------------------------------------------- worker + serve


def test_a_bad_kinds_variable_fails_with_a_clear_error() -> None:
    for value, words in (("nocolon", "is not module:attribute"),
                         ("no_such_module_xyz:X", "cannot import 'no_such_module_xyz'"),
                         (f"{__name__}:NOPE", f"module '{__name__}' has no attribute 'NOPE'"),
                         (f"{__name__}:ROOT", "not a StageKind")):
        out = subprocess.run(
            [sys.executable, "-c", "import omnistage.kinds as k; k.names()"],
            env={**os.environ, "PYTHONPATH": _pythonpath(), stage_kinds.ENV_VAR: value},
            capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 1 and stage_kinds.ENV_VAR in out.stderr, out
        assert words in out.stderr, (value, out.stderr)


def _pythonpath() -> str:
    return os.pathsep.join([str(ROOT), str(ROOT / "runtime"), str(ROOT / "operator"),
                            os.environ.get("PYTHONPATH", "")])


def test_serve_runs_a_kind_registered_through_the_environment(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real `omnistage serve`: its spec check, the orchestrator's routing (text from rev to
    out) and the rev worker process all know `reverse` from OMNISTAGE_STAGE_KINDS alone."""
    monkeypatch.setenv(stage_kinds.ENV_VAR, ENTRY)
    monkeypatch.setenv("PYTHONPATH", _pythonpath())
    path = tmp_path / "rev.yaml"
    path.write_text(yaml.safe_dump(manifest(maxTokens=8)))
    url = serve(path).url()
    status, body = post(f"{url}/v1/pipelines/rev/requests", {"prompt": "hello world"})
    assert status == 200 and body["status"] == "ok", body
    outputs = body["children"][0]["outputs"]
    assert outputs["out"]["fields"]["text"] == "dlrow ol"  # reversed, then cut to maxTokens
    # A request's override of the kind's per-request knob reaches the worker, bounds and all.
    status, body = post(f"{url}/v1/pipelines/rev/requests",
                        {"prompt": "hello world", "params": {"rev": {"max_tokens": 3}}})
    assert status == 200 and body["children"][0]["outputs"]["out"]["fields"]["text"] == "dlr"
    status, body = post(f"{url}/v1/pipelines/rev/requests",
                        {"prompt": "x", "params": {"rev": {"max_tokens": -1}}})
    assert "params.max_tokens" in str(body), body
