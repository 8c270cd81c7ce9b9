"""One bounds table: every engine knob's range comes from EngineOptions, wherever it is checked.

The spec (EngineOptions), the HTTP bodies (schemas.py, and so /openapi.json) and the executors'
request params (params.stage_params) must show the same range for the same knob. These tests
read the ranges back from each consumer's own JSON Schema and compare, and check that the
executors refuse a request value just outside the range with a message naming the field.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from omnistage.executors import BadRequest, create_executor
from omnistage.executors.ar import ARParams
from omnistage.executors.diffusion import DiffusionParams
from omnistage.executors.echo import EchoExecutor, EchoParams
from omnistage.kinds import KindError
from omnistage.models import BUILTIN_CONTEXT
from omnistage.orchestrator.openapi import openapi_document
from omnistage.params import max_tokens_bound, per_request
from omnistage.spec import STAGE_KINDS, EngineOptions, Stage

BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "type")


def _bounds(schema: dict[str, Any]) -> dict[str, Any]:
    """The range of a property schema, looking through `anyOf: [X, null]`."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") != "null":
            return {k: v for k, v in branch.items() if k in BOUND_KEYS}
    raise AssertionError(schema)


ENGINE = EngineOptions.model_json_schema(by_alias=False)["properties"]


def test_every_kind_has_its_knobs() -> None:
    assert per_request("ar") == {"max_tokens": "max_tokens", "temperature": "temperature",
                                 "return_hidden_states": "return_hidden_states", "seed": "seed"}
    assert per_request("diffusion") == {"height": "height", "width": "width",
                                        "num_inference_steps": "num_inference_steps",
                                        "guidance_scale": "guidance_scale", "seed": "seed"}
    assert per_request("echo") == {"delay_ms": "echo_delay_ms", "chunk_chars": "echo_chunk_chars",
                                   "chunk_delay_ms": "echo_chunk_delay_ms"}
    assert per_request("thinker") == per_request("ar")
    assert per_request("talker") == {"voice": "voice", "max_frames": "max_frames",
                                     "chunk_frames": "chunk_frames", "seed": "seed"}
    assert per_request("vocoder") == {"chunk_frames": "chunk_frames"}
    assert set(STAGE_KINDS) == {"ar", "diffusion", "echo", "thinker", "talker", "vocoder"}


def test_per_request_is_cached_but_each_caller_gets_its_own_table() -> None:
    """The table is read on every request (seed_defaults), so it is built once per kind; a
    caller that edits its answer must not change the next caller's."""
    first = per_request("ar")
    first["extra"] = "x"
    del first["seed"]
    assert per_request("ar") == {"max_tokens": "max_tokens", "temperature": "temperature",
                                 "return_hidden_states": "return_hidden_states", "seed": "seed"}
    with pytest.raises(KindError, match="unknown stage kind 'nope'"):
        per_request("nope")


@pytest.mark.parametrize(("model", "kind"), [(ARParams, "ar"), (DiffusionParams, "diffusion"),
                                             (EchoParams, "echo")])
def test_executor_params_have_the_spec_bounds(model: Any, kind: str) -> None:
    props = model.model_json_schema()["properties"]
    for key, name in per_request(kind).items():
        assert _bounds(props[key]) == _bounds(ENGINE[name]), (kind, key)


def test_openapi_bodies_have_the_spec_bounds() -> None:
    schemas = openapi_document()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    images = schemas["ImagesRequest"]["properties"]
    pairs = [(chat["temperature"], "temperature"), (chat["seed"], "seed"),
             (chat["max_tokens"], "max_tokens"), (chat["max_completion_tokens"], "max_tokens"),
             (images["seed"], "seed"), (images["num_inference_steps"], "num_inference_steps"),
             (images["guidance_scale"], "guidance_scale")]
    for prop, name in pairs:
        assert _bounds(prop) == _bounds(ENGINE[name]), name
    lo, hi, step = (ENGINE["width"][k] for k in ("minimum", "maximum", "multipleOf"))
    assert f"each side {lo}..{hi} and a multiple of {step}" in images["size"]["anyOf"][0][
        "description"]


def test_the_unified_ranges() -> None:
    """The ranges docs/pipeline-spec.md and docs/http-api.md show (one per knob)."""
    got = {name: _bounds(ENGINE[name]) for name in ("temperature", "num_inference_steps",
                                                   "seed", "max_tokens", "height")}
    assert got["temperature"] == {"minimum": 0.0, "maximum": 2.0, "type": "number"}
    assert got["num_inference_steps"] == {"minimum": 1, "maximum": 1000, "type": "integer"}
    assert got["seed"] == {"minimum": 0, "maximum": 2**53 - 1, "type": "integer"}
    assert got["max_tokens"] == {"minimum": 0, "maximum": 2**20, "type": "integer"}
    assert got["height"] == {"minimum": 8, "maximum": 2048, "multipleOf": 8, "type": "integer"}


def _echo(engine: dict[str, Any]) -> Stage:
    return Stage.model_validate({"name": "e", "kind": "echo", "engine": engine})


def test_create_executor_gets_the_stages_typed_options() -> None:
    stage = _echo({"echoDelayMs": 7, "echoChunkChars": 2})
    ex = create_executor(stage, None)
    assert isinstance(ex, EchoExecutor) and ex.engine is stage.engine
    assert (ex.engine.echo_delay_ms, ex.engine.echo_chunk_chars) == (7, 2)
    with pytest.raises(ValidationError, match="temperature"):
        Stage.model_validate({"name": "a", "kind": "ar", "model": "tiny-llama",
                              "engine": {"temperature": 2.5}})
    with pytest.raises(ValidationError, match="maxToken"):
        _echo({"maxToken": 5})  # typo: unknown keys are errors
    # An option of another kind would be ignored: refused, with its path and what echo reads.
    with pytest.raises(ValidationError, match=r"engine\.temperature: the echo kind does not "
                       r"read this option \(its engine options: echoDelayMs, echoChunkChars, "
                       r"echoChunkDelayMs\)"):
        _echo({"echoDelayMs": 7, "temperature": 1.5})
    assert _echo({"temperature": 0.0}).engine.temperature == 0.0  # its default: harmless


def test_echo_request_params_override_the_stage_default_within_bounds() -> None:
    ex = create_executor(_echo({"echoDelayMs": 250}), None)
    assert ex.prepare({"prompt": "x"}, {}).delay_s == 0.25  # the stage default
    job = ex.prepare({"prompt": "x", "delay_ms": 5, "stream": True, "max_tokens": "ignored"}, {})
    assert (job.delay_s, job.stream, job.text) == (0.005, True, "x")
    assert ex.prepare({"prompt": "x", "delay_ms": None}, {}).delay_s == 0.25  # null: default


@pytest.mark.parametrize(("params", "message"), [
    ({"delay_ms": 60_001}, "params.delay_ms must be less than or equal to 60000"),
    ({"delay_ms": -1}, "params.delay_ms must be greater than or equal to 0"),
    ({"delay_ms": 1.5}, "params.delay_ms must be a valid integer"),
    ({"delay_ms": True}, "params.delay_ms must be a valid integer, got boolean"),
    ({"prompt": 5}, "params.prompt must be a valid string, got number"),
    ({"stream": "yes"}, "params.stream must be a valid boolean"),
])
def test_executor_refusals_name_the_param(params: dict[str, Any], message: str) -> None:
    ex = create_executor(_echo({}), None)
    with pytest.raises(BadRequest) as info:
        ex.prepare({"prompt": "x", **params}, {})
    assert str(info.value).startswith(message), info.value


@pytest.mark.parametrize(("model", "params", "field"), [
    (ARParams, {"temperature": 2.01}, "temperature"),
    (ARParams, {"seed": 2**53}, "seed"),
    (ARParams, {"max_tokens": 2**20 + 1}, "max_tokens"),
    (ARParams, {"token_ids": [1, True]}, "token_ids[1]"),
    (ARParams, {"ignore_eos": 1}, "ignore_eos"),
    (DiffusionParams, {"num_inference_steps": 1001}, "num_inference_steps"),
    (DiffusionParams, {"height": 2056}, "height"),
    (DiffusionParams, {"width": 36}, "width"),
    (DiffusionParams, {"guidance_scale": -0.5}, "guidance_scale"),
])
def test_ar_and_diffusion_params_refuse_out_of_range_values(model: Any, params: dict[str, Any],
                                                            field: str) -> None:
    with pytest.raises(BadRequest, match="^" + re.escape(f"params.{field} ")):
        EchoExecutor.parse(model, params)


def test_request_overrides_produce_typed_options() -> None:
    engine = EngineOptions(temperature=0.5, seed=3, max_tokens=9)
    req = ARParams.model_validate({"temperature": 1.25, "prompt": "p", "num_inference_steps": 9})
    opts = req.options(engine)
    assert (opts.temperature, opts.seed, opts.max_tokens) == (1.25, 3, 9)
    assert engine.temperature == 0.5  # the stage's options are not changed
    assert ARParams.model_validate({}).options(engine) is engine


@pytest.mark.parametrize(("model", "engine", "most"), [
    ("tiny-llama", {}, BUILTIN_CONTEXT["tiny-llama"] - 1),  # the context, less one prompt token
    ("tiny-llama", {"maxBatchTokens": 100}, 99),  # the tighter of the two
    ("tiny-llama", {"maxBatchTokens": 5000}, 1023),
    ("tiny-llama", {"maxBatchTokens": 1}, 0),  # a one-token prompt fills the batch
    ("./weights", {}, 2**20),  # only the worker knows this model's context: the knob's own bound
    ("org/model", {"maxBatchTokens": 64}, 63),
])
def test_max_tokens_bound_is_what_a_one_token_prompt_may_ask(model: str, engine: dict[str, Any],
                                                             most: int) -> None:
    stage = Stage.model_validate({"name": "a", "kind": "ar", "model": model, "engine": engine})
    assert max_tokens_bound(stage) == most
