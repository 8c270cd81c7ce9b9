"""Bounds, defaults and value parsing of the pipeline spec, edge by edge.

EngineOptions is the one bounds table of every engine knob (the HTTP API and the executors derive
their request models from it), so each of its bounds is checked at the edge, just outside it,
with the exact path and message a user sees. The other bounded fields of a pipeline get the same
treatment, and every model's defaults are pinned.

The bounds live in class bodies (Field(...)), which mutmut does not mutate; these tests pin them
against hand edits. The "Kills:" lines name the mutants of omnistage.spec functions they also
catch.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

import omnistage.kinds as stage_kinds
from omnistage.spec import (
    DEFAULT_IMAGE,
    MAX_REPLICAS,
    AdmissionOptions,
    EngineOptions,
    ModelCache,
    OrchestratorSpec,
    Placement,
    SpecError,
    StageResources,
    Toleration,
    engine_for_kind,
    engine_kinds,
    parse_pipeline,
    validate_manifest,
)
from tests.unit.test_spec import manifest, stage

ENGINE = "spec.stages[0].engine"


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    """Set the value at a k8s-style path such as spec.stages[0].engine.maxTokens."""
    keys: list[Any] = []
    for part in path.split("."):
        name, *indexes = re.split(r"\[(\d+)\]", part)
        keys.append(name)
        keys.extend(int(i) for i in indexes if i)
    node: Any = doc
    for key in keys[:-1]:
        if isinstance(key, str):
            node = node.setdefault(key, {})
        else:
            node = node[key]
    node[keys[-1]] = value


def _get(doc: dict[str, Any], path: str) -> Any:
    node: Any = doc
    for part in path.split("."):
        name, *indexes = re.split(r"\[(\d+)\]", part)
        node = node[name]
        for i in indexes:
            if i:
                node = node[int(i)]
    return node


def errors_of(doc: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_manifest(doc)
    return info.value.errors


def one_stage() -> dict[str, Any]:
    return manifest(stage("a", finalOutput=True))


# --------------------------------------------------------------------------- the bounds table

GE = "Input should be greater than or equal to"
LE = "Input should be less than or equal to"
GT = "Input should be greater than"

# (path, value, None when valid or the exact message at that path)
BOUNDS: list[tuple[str, Any, str | None]] = [
    (f"{ENGINE}.maxTokens", 0, None),
    (f"{ENGINE}.maxTokens", -1, f"{GE} 0 (got -1)"),
    (f"{ENGINE}.maxTokens", 2**20, None),
    (f"{ENGINE}.maxTokens", 2**20 + 1, f"{LE} 1048576 (got 1048577)"),
    (f"{ENGINE}.temperature", 0.0, None),
    (f"{ENGINE}.temperature", -0.01, f"{GE} 0 (got -0.01)"),
    (f"{ENGINE}.temperature", 2.0, None),
    (f"{ENGINE}.temperature", 2, None),  # an integer is a number
    (f"{ENGINE}.temperature", 2.01, f"{LE} 2 (got 2.01)"),
    (f"{ENGINE}.height", 8, None),
    (f"{ENGINE}.height", 0, f"{GE} 8 (got 0)"),
    (f"{ENGINE}.height", 2048, None),
    (f"{ENGINE}.height", 2056, f"{LE} 2048 (got 2056)"),
    (f"{ENGINE}.height", 12, "Input should be a multiple of 8 (got 12)"),
    (f"{ENGINE}.width", 8, None),
    (f"{ENGINE}.width", 0, f"{GE} 8 (got 0)"),
    (f"{ENGINE}.width", 2048, None),
    (f"{ENGINE}.width", 2056, f"{LE} 2048 (got 2056)"),
    (f"{ENGINE}.width", 9, "Input should be a multiple of 8 (got 9)"),
    (f"{ENGINE}.numInferenceSteps", 1, None),
    (f"{ENGINE}.numInferenceSteps", 0, f"{GE} 1 (got 0)"),
    (f"{ENGINE}.numInferenceSteps", 1000, None),
    (f"{ENGINE}.numInferenceSteps", 1001, f"{LE} 1000 (got 1001)"),
    (f"{ENGINE}.guidanceScale", 0.0, None),
    (f"{ENGINE}.guidanceScale", -0.5, f"{GE} 0 (got -0.5)"),
    (f"{ENGINE}.guidanceScale", 100.0, None),
    (f"{ENGINE}.guidanceScale", 100.5, f"{LE} 100 (got 100.5)"),
    (f"{ENGINE}.seed", 0, None),
    (f"{ENGINE}.seed", -1, f"{GE} 0 (got -1)"),
    (f"{ENGINE}.seed", 2**53 - 1, None),
    (f"{ENGINE}.seed", 2**53, f"{LE} 9007199254740991 (got 9007199254740992)"),
    (f"{ENGINE}.echoDelayMs", 0, None),
    (f"{ENGINE}.echoDelayMs", -1, f"{GE} 0 (got -1)"),
    (f"{ENGINE}.echoDelayMs", 60_000, None),
    (f"{ENGINE}.echoDelayMs", 60_001, f"{LE} 60000 (got 60001)"),
    (f"{ENGINE}.maxFrames", 1, None),
    (f"{ENGINE}.maxFrames", 0, f"{GE} 1 (got 0)"),
    (f"{ENGINE}.maxFrames", 65_536, None),
    (f"{ENGINE}.maxFrames", 65_537, f"{LE} 65536 (got 65537)"),
    (f"{ENGINE}.chunkFrames", 1, None),
    (f"{ENGINE}.chunkFrames", 0, f"{GE} 1 (got 0)"),
    (f"{ENGINE}.chunkFrames", 4096, None),
    (f"{ENGINE}.chunkFrames", 4097, f"{LE} 4096 (got 4097)"),
    (f"{ENGINE}.maxBatchSize", 1, None),
    (f"{ENGINE}.maxBatchSize", 0, f"{GE} 1 (got 0)"),
    (f"{ENGINE}.maxBatchSize", 1024, None),
    (f"{ENGINE}.maxBatchSize", 1025, f"{LE} 1024 (got 1025)"),
    (f"{ENGINE}.maxBatchTokens", 1, None),
    (f"{ENGINE}.maxBatchTokens", 0, f"{GE} 1 (got 0)"),
    (f"{ENGINE}.maxBatchTokens", 2**24, None),
    (f"{ENGINE}.maxBatchTokens", 2**24 + 1, f"{LE} 16777216 (got 16777217)"),
    (f"{ENGINE}.dtype", "bfloat16", None),
    (f"{ENGINE}.dtype", "float64",
     "invalid value 'float64' (expected 'auto', 'float32', 'float16' or 'bfloat16')"),
    (f"{ENGINE}.returnHiddenStates", True, None),
    (f"{ENGINE}.returnHiddenStates", 1, "must be a boolean (got int 1)"),
    # stage
    ("spec.stages[0].replicas", 0, None),
    ("spec.stages[0].replicas", -1, f"{GE} 0 (got -1)"),
    ("spec.stages[0].replicas", MAX_REPLICAS, None),
    ("spec.stages[0].replicas", MAX_REPLICAS + 1, f"{LE} 64 (got 65)"),
    ("spec.stages[0].drainTimeoutSeconds", 0, None),
    ("spec.stages[0].drainTimeoutSeconds", -1, f"{GE} 0 (got -1)"),
    ("spec.stages[0].drainTimeoutSeconds", 3600, None),
    ("spec.stages[0].drainTimeoutSeconds", 3601, f"{LE} 3600 (got 3601)"),
    ("spec.stages[0].drainTimeoutSeconds", "30s", "must be an integer (got str '30s')"),
    ("spec.stages[0].maxUnavailable", 0, None),
    ("spec.stages[0].maxUnavailable", -1, f"{GE} 0 (got -1)"),
    ("spec.stages[0].maxUnavailable", MAX_REPLICAS, None),
    ("spec.stages[0].maxUnavailable", MAX_REPLICAS + 1, f"{LE} 64 (got 65)"),
    ("spec.stages[0].resources.gpus", 0, None),
    ("spec.stages[0].resources.gpus", -1, f"{GE} 0 (got -1)"),
    ("spec.stages[0].resources.gpus", 16, None),  # echo: no model, so no one-GPU rule
    ("spec.stages[0].resources.gpus", 17, f"{LE} 16 (got 17)"),
    ("spec.stages[0].admission.maxRequests", 1, None),
    ("spec.stages[0].admission.maxRequests", 0, f"{GE} 1 (got 0)"),
    ("spec.stages[0].admission.maxRequests", 65_536, None),
    ("spec.stages[0].admission.maxRequests", 65_537, f"{LE} 65536 (got 65537)"),
    ("spec.stages[0].admission.maxCost", 1, None),
    ("spec.stages[0].admission.maxCost", 0, f"{GE} 1 (got 0)"),
    ("spec.stages[0].admission.maxQueue", 1, None),
    ("spec.stages[0].admission.maxQueue", 0, f"{GE} 1 (got 0)"),
    ("spec.stages[0].admission.maxQueue", 1_000_000, None),
    ("spec.stages[0].admission.maxQueue", 1_000_001, f"{LE} 1000000 (got 1000001)"),
    ("spec.stages[0].admission.defaultDeadlineSeconds", 0.001, None),
    ("spec.stages[0].admission.defaultDeadlineSeconds", 0, f"{GT} 0 (got 0)"),
    ("spec.stages[0].admission.defaultDeadlineSeconds", 86_400, None),
    ("spec.stages[0].admission.defaultDeadlineSeconds", 86_400.5, f"{LE} 86400 (got 86400.5)"),
    ("spec.stages[0].admission.defaultDeadlineSeconds", "60s", "must be a number (got str '60s')"),
    # orchestrator
    ("spec.orchestrator.replicas", 0, None),
    ("spec.orchestrator.replicas", -1, f"{GE} 0 (got -1)"),
    ("spec.orchestrator.replicas", 16, None),
    ("spec.orchestrator.replicas", 17, f"{LE} 16 (got 17)"),
    ("spec.orchestrator.port", 1, None),
    ("spec.orchestrator.port", 0, f"{GE} 1 (got 0)"),
    ("spec.orchestrator.port", 65535, None),
    ("spec.orchestrator.port", 65536, f"{LE} 65535 (got 65536)"),
    ("spec.orchestrator.adminPort", 1, None),
    ("spec.orchestrator.adminPort", 0, f"{GE} 1 (got 0)"),
    ("spec.orchestrator.adminPort", 65535, None),
    ("spec.orchestrator.adminPort", 65536, f"{LE} 65535 (got 65536)"),
    ("spec.orchestrator.requestTimeoutSeconds", 0.5, None),
    ("spec.orchestrator.requestTimeoutSeconds", 0, f"{GT} 0 (got 0)"),
    ("spec.orchestrator.requestTimeoutSeconds", 86_400, None),
    ("spec.orchestrator.requestTimeoutSeconds", 86_401, f"{LE} 86400 (got 86401)"),
    ("spec.orchestrator.shutdownDelaySeconds", 0, None),
    ("spec.orchestrator.shutdownDelaySeconds", -0.1, f"{GE} 0 (got -0.1)"),
    ("spec.orchestrator.shutdownDelaySeconds", 300, None),
    ("spec.orchestrator.shutdownDelaySeconds", 300.1, f"{LE} 300 (got 300.1)"),
    ("spec.orchestrator.servedModelName", "m", None),
    ("spec.orchestrator.servedModelName", "", "String should have at least 1 character (got '')"),
    # names and references
    ("metadata.name", "p" * 40, None),
    ("metadata.name", "p" * 41, f"String should have at most 40 characters (got '{'p' * 41}')"),
    ("spec.stages[0].name", "s" * 20, None),
    ("spec.stages[0].name", "s" * 21,
     f"String should have at most 20 characters (got '{'s' * 21}')"),
    ("spec.image", "a" * 512, None),
    ("spec.image", "a" * 513,
     "String should have at most 512 characters (got '" + "a" * 56 + "...)"),
]


@pytest.mark.parametrize(("path", "value", "expected"), BOUNDS,
                         ids=[f"{p.rsplit('.', 1)[-1]}={v!r:.20}" for p, v, _ in BOUNDS])
def test_each_bound_at_its_edge(path: str, value: Any, expected: str | None) -> None:
    """The value at the edge passes and is kept; one step outside fails with the field's path,
    the bound and the bad value. Kills: _spec_message's `message + " (got ...)"` -> `message`
    and its `short_repr(value)` -> `short_repr(None)`, _strict's strict=True -> False (the '30s'
    and bool cases)."""
    doc = one_stage()
    if path.startswith(ENGINE + "."):  # a stage of a kind that reads the option
        alias = path.rsplit(".", 1)[-1]
        [field] = [n for n, f in EngineOptions.model_fields.items() if f.alias == alias]
        kind = stage_kinds.get(engine_kinds(field)[0])
        doc["spec"]["stages"][0].update(kind=kind.name)
        if kind.needs_model:
            doc["spec"]["stages"][0]["model"] = kind.builtin_models[0]
    _set(doc, path, value)
    if expected is None:
        assert _get(parse_pipeline(doc).to_manifest(), path) == value
    else:
        assert errors_of(doc) == [(path, expected)]


def test_the_admin_listener_has_a_port_of_its_own() -> None:
    """adminPort defaults to the port after the API's; the API's own port is refused."""
    assert OrchestratorSpec().admin_listen_port == 8001
    assert OrchestratorSpec(port=65535).admin_listen_port == 65534
    assert OrchestratorSpec(port=9000, admin_port=7000).admin_listen_port == 7000
    doc = one_stage()
    _set(doc, "spec.orchestrator.port", 9000)
    _set(doc, "spec.orchestrator.adminPort", 9000)
    assert errors_of(doc) == [("spec.orchestrator.adminPort", "the admin listener needs a port "
                               "of its own, not the API's port 9000")]


def test_several_field_errors_are_all_reported_with_their_paths() -> None:
    """Kills: describe_errors' `continue` -> `break` after a cross-field error (the later errors
    must still be listed)."""
    doc = manifest(stage("a", finalOutput=True, replicas=-1, engine={"height": 9, "seed": -1}),
                   orchestrator={"api": ["chat", "chat"], "port": 0})
    assert errors_of(doc) == [
        ("spec.orchestrator.port", f"{GE} 1 (got 0)"),
        ("spec.orchestrator.api[1]", "duplicate entry 'chat'"),
        ("spec.stages[0].engine.height", "Input should be a multiple of 8 (got 9)"),
        ("spec.stages[0].engine.seed", f"{GE} 0 (got -1)"),
        ("spec.stages[0].replicas", f"{GE} 0 (got -1)"),
    ]


def test_a_model_stage_asks_for_at_most_one_gpu() -> None:
    """A replica loads its model onto one device. Kills: a changed bound or message of
    Stage._one_gpu_per_model (a decorated validator, which mutmut leaves alone), and
    path_errors' relative default True -> False (the path would lose spec.stages[0])."""
    for kind in ("ar", "diffusion"):
        doc = manifest(stage("a", kind, finalOutput=True, resources={"gpus": 2}))
        assert errors_of(doc) == [(
            "spec.stages[0].resources.gpus",
            f"replicas of kind '{kind}' load their model onto one GPU (got 2); spreading a model "
            "over several GPUs is not supported: request 1 and scale with replicas",
        )]
        doc["spec"]["stages"][0]["resources"]["gpus"] = 1
        assert parse_pipeline(doc).spec.stages[0].resources.gpus == 1


# --------------------------------------------------------------------------- defaults


def test_engine_defaults() -> None:
    """What a stage gets when it omits engine. Kills: a changed default in the bounds table
    (class bodies are not mutated by mutmut; this pins them against hand edits)."""
    assert EngineOptions().model_dump() == {
        "dtype": "auto", "max_tokens": 16, "temperature": 0.0, "return_hidden_states": False,
        "height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 1.0, "seed": None,
        "echo_delay_ms": 0, "echo_chunk_chars": 0, "echo_chunk_delay_ms": 0,
        "voices": None, "voice": None, "max_frames": 256, "chunk_frames": 8,
        "max_batch_size": 16, "max_batch_tokens": None, "prefix_cache_mib": 256,
    }


def test_other_defaults() -> None:
    """Kills: a changed default of a resource, admission, placement, toleration, orchestrator,
    stage or model-cache field (class bodies, not mutated by mutmut)."""
    assert StageResources().model_dump() == {"gpus": 0, "cpu": "1", "memory": "2Gi"}
    assert AdmissionOptions().model_dump() == {
        "max_requests": 64, "max_cost": None, "max_queue": 256, "default_deadline_seconds": 60.0}
    assert Placement().model_dump() == {
        "node_selector": {}, "tolerations": [], "colocate_with": [], "spread_across_nodes": True}
    assert Toleration(operator="Exists").model_dump() == {
        "key": None, "operator": "Exists", "value": None, "effect": None,
        "toleration_seconds": None}
    orchestrator = OrchestratorSpec().model_dump()
    assert orchestrator == {
        "replicas": 1, "port": 8000, "admin_port": None,
        "api": ["chat", "images", "speech", "generic"],
        "served_model_name": None, "chat_stage": None, "request_timeout_seconds": 300.0,
        "shutdown_delay_seconds": 5.0, "failover": {"max_retries": 2},
        "resources": {"cpu": "1", "memory": "1Gi"},
        "node_selector": {}, "tolerations": [], "auth": {"api_key_secret": None, "disabled": False}}
    stage_a = parse_pipeline(one_stage()).spec
    assert stage_a.image == DEFAULT_IMAGE and stage_a.model_cache is None
    only = stage_a.stages[0]
    assert (only.model, only.inputs, only.replicas, only.drain_timeout_seconds,
            only.max_unavailable) == (None, [], 1, 30, 1)
    cache = ModelCache(size="10Gi")
    assert (cache.claim_name, cache.read_only, cache.endpoint, cache.token_secret) == (
        None, False, None, None)


# --------------------------------------------------------------------------- sizes and durations


@pytest.mark.parametrize("value", ["500m", "2", "1.5", ".5", "4Gi", "512Mi", "1Ki", "1e3",
                                   "1E-3", "2k", "3M", "1T", "2P", "1E", "7Ei", "100n", "10u"])
def test_quantities_that_parse(value: str) -> None:
    """Every suffix form of a Kubernetes quantity. Kills: a narrowed QUANTITY_PATTERN
    (module constant, not mutated by mutmut)."""
    doc = manifest(stage("a", finalOutput=True, resources={"memory": value, "cpu": value}))
    resources = parse_pipeline(doc).spec.stages[0].resources
    assert (resources.memory, resources.cpu) == (value, value)
    assert ModelCache(size=value).size == value


QUANTITY_HELP = "must be a Kubernetes quantity such as '500m', '2', '1.5' or '4Gi'"


@pytest.mark.parametrize("value", ["2 gigs", "4gi", "1.5.5", "-1", "", "Gi", "1KB", "1e", "0x10"])
def test_quantities_that_do_not(value: str) -> None:
    """Kills: a widened QUANTITY_PATTERN, and in _spec_message the "string_pattern_mismatch"
    branch and PATTERN_HELP lookup (ctx.get("pattern", "") -> get(None, "") / "XXpatternXX")."""
    doc = manifest(stage("a", finalOutput=True, resources={"memory": value}))
    assert errors_of(doc) == [
        ("spec.stages[0].resources.memory", f"{QUANTITY_HELP} (got {value!r})")]


@pytest.mark.parametrize(("value", "expected"), [
    (2, "2"), (0, "0"), (2.5, "must be a string (got float 2.5)"),
    (True, "must be a string (got bool True)"), ([1], "must be a string (got list [1])"),
])
def test_integer_quantities_become_strings_and_nothing_else_does(value: Any, expected: str) -> None:
    """YAML reads `cpu: 2` as an int: it is the quantity "2"; a float or a boolean is refused, as
    the API server refuses it. Kills: _number_to_str's `and` -> `or` (2.5 would become "2.5"),
    `not isinstance(value, bool)` -> `isinstance(value, bool)` (2 would stay an int) and
    `str(value)` -> `str(None)`."""
    for path in ("spec.stages[0].resources.cpu", "spec.orchestrator.resources.memory"):
        doc = one_stage()
        _set(doc, path, value)
        if expected.startswith("must"):
            assert errors_of(doc) == [(path, expected)]
        else:
            assert _get(parse_pipeline(doc).to_manifest(), path) == expected


def test_durations_are_plain_seconds() -> None:
    """Seconds fields take numbers only: an integer where a float is expected is kept exactly,
    and a unit suffix or a numeric string is refused as the API server refuses it."""
    doc = manifest(stage("a", finalOutput=True, drainTimeoutSeconds=45,
                         admission={"defaultDeadlineSeconds": 2}),
                   orchestrator={"requestTimeoutSeconds": 10, "shutdownDelaySeconds": 0.25})
    spec = parse_pipeline(doc).spec
    assert spec.stages[0].drain_timeout_seconds == 45
    assert spec.stages[0].admission.default_deadline_seconds == 2.0
    assert (spec.orchestrator.request_timeout_seconds,
            spec.orchestrator.shutdown_delay_seconds) == (10.0, 0.25)
    doc["spec"]["orchestrator"]["requestTimeoutSeconds"] = "10"
    assert errors_of(doc) == [
        ("spec.orchestrator.requestTimeoutSeconds", "must be a number (got str '10')")]


# --------------------------------------------------------------------------- engine by kind

AR = {"dtype": "auto", "maxTokens": 16, "temperature": 0.0, "returnHiddenStates": False,
      "maxBatchSize": 16, "prefixCacheMib": 256}
DIFFUSION = {"dtype": "auto", "height": 32, "width": 32, "numInferenceSteps": 4,
             "guidanceScale": 1.0, "maxBatchSize": 16}
ECHO = {"echoDelayMs": 0, "echoChunkChars": 0, "echoChunkDelayMs": 0}


def test_engine_for_kind_is_exactly_the_options_of_the_kind() -> None:
    """Kills: engine_for_kind's by_alias=True -> False (or dropped), exclude_none=True -> False
    (maxBatchTokens: None would appear), `kind in engine_kinds(name)` -> `not in`, `and` -> `or`,
    `info.alias or name` -> `and`, and engine_kinds `field in` -> `not in`."""
    engine = EngineOptions()
    assert engine_for_kind(engine, "ar") == AR
    assert engine_for_kind(engine, "diffusion") == DIFFUSION
    assert engine_for_kind(engine, "echo") == ECHO
    tuned = EngineOptions(max_batch_tokens=4096, echo_delay_ms=5, height=64)
    assert engine_for_kind(tuned, "ar") == {**AR, "maxBatchTokens": 4096}
    assert engine_for_kind(tuned, "diffusion") == {**DIFFUSION, "height": 64}
    assert engine_for_kind(tuned, "echo") == {**ECHO, "echoDelayMs": 5}


def test_engine_kinds_of_every_field() -> None:
    """Kills: a changed engine_options entry in the kind table (omnistage.kinds)."""
    assert {name: engine_kinds(name) for name in EngineOptions.model_fields} == {
        "dtype": ("ar", "diffusion", "thinker", "talker", "vocoder"),
        "max_tokens": ("ar", "thinker"), "temperature": ("ar", "thinker"),
        "return_hidden_states": ("ar", "thinker"), "height": ("diffusion",),
        "width": ("diffusion",), "num_inference_steps": ("diffusion",),
        "guidance_scale": ("diffusion",), "seed": ("ar", "diffusion", "thinker", "talker"),
        "echo_delay_ms": ("echo",), "echo_chunk_chars": ("echo",),
        "echo_chunk_delay_ms": ("echo",), "voices": ("talker",), "voice": ("talker",),
        "max_frames": ("talker",), "chunk_frames": ("talker", "vocoder"),
        "max_batch_size": ("ar", "diffusion", "thinker", "talker", "vocoder"),
        "max_batch_tokens": ("ar", "thinker"), "prefix_cache_mib": ("ar", "thinker"),
    }


def test_engine_kinds_follow_the_kind_table() -> None:
    """A kind's engine options are its row's (omnistage.kinds): a registered kind that
    lists maxBatchSize gets it in its pool, and every EngineOptions field is read by some kind,
    so a new knob is never silently dropped from every pool. Kills: engine_kinds reading anything
    but the table, and a field missing from every row."""
    probe = stage_kinds.StageKind(name="probe", executor="tests.unit.nowhere:Probe", summary="",
                                  needs_model=False, engine_options=("max_batch_size",))
    with stage_kinds.registered(probe):
        assert engine_kinds("max_batch_size") == ("ar", "diffusion", "thinker", "talker",
                                                  "vocoder", "probe")
        assert engine_for_kind(EngineOptions(), "probe") == {"maxBatchSize": 16}
    assert engine_kinds("max_batch_size") == ("ar", "diffusion", "thinker", "talker",
                                              "vocoder")
    assert all(engine_kinds(name) for name in EngineOptions.model_fields)
    with pytest.raises(KeyError, match="'nope' is not an EngineOptions field"):
        engine_kinds("nope")
