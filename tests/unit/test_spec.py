"""Unit tests for the pipeline spec: examples, validation messages and graph helpers."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from omnistage.modelref import ModelRef
from omnistage.spec import (
    API_VERSION,
    BUILTIN_MODELS,
    DEFAULT_IMAGE,
    KIND,
    MAX_REPLICAS,
    MAX_STAGES,
    OmniPipeline,
    SpecError,
    engine_for_kind,
    image_error,
    load_pipeline,
    parse_pipeline,
    parse_stagepool,
    validate_manifest,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def stage(name: str, kind: str = "echo", **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "kind": kind}
    if kind == "ar":
        doc["model"] = "tiny-llama"
    elif kind == "diffusion":
        doc["model"] = "tiny-unet"
    doc.update(extra)
    return doc


def manifest(*stages: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "demo"},
        "spec": {"stages": list(stages), **spec},
    }


def chain() -> dict[str, Any]:
    """a (ar) -> b (echo) -> c (diffusion, final)."""
    return manifest(
        stage("a", "ar"),
        stage("b", inputs=["a"]),
        stage("c", "diffusion", inputs=["b"], finalOutput=True),
    )


def errors_of(doc: dict[str, Any], **kwargs: Any) -> str:
    with pytest.raises(SpecError) as info:
        parse_pipeline(doc, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("name", ["text-to-image", "chat", "echo"])
def test_examples_load_with_path_checks(name: str) -> None:
    pipeline = load_pipeline(EXAMPLES / f"{name}.yaml", check_paths=True)
    assert pipeline.metadata.name == name
    assert pipeline.spec.final_stages()


def test_text_to_image_example_shape() -> None:
    spec = load_pipeline(EXAMPLES / "text-to-image.yaml").spec
    assert spec.topo_order() == ["encoder", "denoiser"]
    encoder, denoiser = spec.stage("encoder"), spec.stage("denoiser")
    assert (encoder.kind, encoder.model, encoder.replicas) == ("ar", "tiny-llama", 2)
    assert encoder.engine.return_hidden_states and encoder.engine.max_tokens == 8
    assert (denoiser.kind, denoiser.model, denoiser.inputs) == (
        "diffusion",
        "tiny-unet",
        ["encoder"],
    )
    assert denoiser.final_output and denoiser.engine.num_inference_steps == 4
    assert encoder.resources.gpus == 0 and denoiser.resources.gpus == 0
    assert spec.chat_stage() == "encoder"


def test_chat_and_echo_example_shape() -> None:
    chat = load_pipeline(EXAMPLES / "chat.yaml").spec
    assert [(s.name, s.kind, s.final_output) for s in chat.stages] == [("llm", "ar", True)]
    echo = load_pipeline(EXAMPLES / "echo.yaml").spec
    assert echo.topo_order() == ["a", "b"] and echo.final_stages() == ["b"]
    assert echo.stage("a").model is None and echo.chat_stage() is None


# --------------------------------------------------------------------------- defaults & helpers


def test_defaults() -> None:
    pipeline = parse_pipeline(manifest(stage("llm", "ar", finalOutput=True)))
    spec = pipeline.spec
    assert spec.image == DEFAULT_IMAGE
    assert spec.orchestrator.replicas == 1 and spec.orchestrator.port == 8000
    assert spec.orchestrator.api == ["chat", "images", "speech", "generic"]
    assert spec.orchestrator.request_timeout_seconds == 300
    llm = spec.stage("llm")
    assert llm.replicas == 1 and llm.resources.gpus == 0 and llm.resources.memory == "2Gi"
    assert llm.admission.max_requests == 64 and llm.admission.max_cost is None
    assert llm.drain_timeout_seconds == 30 and llm.max_unavailable == 1
    assert llm.placement.spread_across_nodes is True
    assert pipeline.served_model_name() == "demo"


def test_graph_helpers() -> None:
    doc = manifest(
        stage("d", inputs=["b", "c"], finalOutput=True),
        stage("c", inputs=["a"]),
        stage("b", "ar", inputs=["a"], finalOutput=True),
        stage("a"),
        stage("e"),
    )
    spec = parse_pipeline(doc).spec
    assert spec.topo_order() == ["a", "c", "b", "d", "e"]
    assert spec.downstream("a") == ["c", "b"]
    assert spec.downstream("d") == []
    assert spec.entry_stages() == ["a", "e"]
    assert spec.final_stages() == ["d", "b"]
    assert spec.chat_stage() == "b"
    with pytest.raises(KeyError, match="'zz'"):
        spec.stage("zz")


def test_chat_stage_explicit_and_served_model_name() -> None:
    doc = manifest(
        stage("a", "ar"),
        stage("b", "ar", inputs=["a"], finalOutput=True),
        orchestrator={"chatStage": "b", "servedModelName": "my-model"},
    )
    pipeline = parse_pipeline(doc)
    assert pipeline.spec.chat_stage() == "b"
    assert pipeline.served_model_name() == "my-model"


def test_model_ref() -> None:
    doc = manifest(
        stage("a", "ar"),
        stage("b", "ar", model="./weights/llm", inputs=["a"]),
        stage("c", model="none", inputs=["b"]),
        stage("d", "ar", model="Qwen/Qwen2.5-0.5B-Instruct", inputs=["c"]),
        stage("e", "ar", model="acme/tiny_llm.v2@refs/pr/1", inputs=["d"], finalOutput=True),
    )
    spec = parse_pipeline(doc).spec
    assert spec.stage("a").model_ref() == ModelRef("builtin", "tiny-llama")
    assert spec.stage("b").model_ref() == ModelRef("path", "./weights/llm")
    assert spec.stage("c").model_ref() is None
    assert spec.stage("d").model_ref() == ModelRef("hub", "Qwen/Qwen2.5-0.5B-Instruct")
    assert spec.stage("e").model_ref() == ModelRef("hub", "acme/tiny_llm.v2", "refs/pr/1")
    assert str(spec.stage("e").model_ref()) == "acme/tiny_llm.v2@refs/pr/1"
    assert spec.stage("b").model_path(Path("/base")) == Path("/base/weights/llm")
    assert set(BUILTIN_MODELS) == {"tiny-llama", "tiny-unet", "tiny-omni-thinker",
                                   "tiny-omni-talker", "tiny-omni-vocoder"}


def test_round_trip_to_manifest() -> None:
    pipeline = load_pipeline(EXAMPLES / "text-to-image.yaml")
    doc = pipeline.to_manifest()
    assert doc["apiVersion"] == API_VERSION and doc["kind"] == KIND
    assert "finalOutput" in doc["spec"]["stages"][1]
    assert "maxCost" not in doc["spec"]["stages"][0]["admission"]  # None is omitted
    assert parse_pipeline(doc) == pipeline
    assert parse_pipeline(copy.deepcopy(doc)).to_manifest() == doc


def test_live_object_metadata_and_status_are_tolerated() -> None:
    doc = chain()
    doc["metadata"].update(
        uid="1234",
        resourceVersion="42",
        generation=3,
        creationTimestamp="2026-01-01T00:00:00Z",
        managedFields=[{"manager": "kubectl"}],
        namespace="ml",
    )
    doc["status"] = {"phase": "Ready", "observedGeneration": 3}
    pipeline = parse_pipeline(doc)
    assert pipeline.metadata.namespace == "ml"
    assert pipeline.to_manifest()["metadata"]["resourceVersion"] == "42"


def test_snake_case_keys_are_refused_with_the_camel_case_name() -> None:
    """One choice for both paths: the API server knows only camelCase, so neither does serve."""
    doc = manifest(stage("a", "ar", final_output=True, drain_timeout_seconds=5))
    message = errors_of(doc)
    assert (
        "spec.stages[0].final_output: unknown field 'final_output' (did you mean 'finalOutput'? "
        "keys are camelCase)"
    ) in message
    assert "spec.stages[0].drain_timeout_seconds: unknown field" in message
    doc = manifest(stage("a", "ar", finalOutput=True, drainTimeoutSeconds=5))
    assert parse_pipeline(doc).spec.stage("a").drain_timeout_seconds == 5


def test_numeric_quantities_are_coerced() -> None:
    doc = manifest(stage("a", finalOutput=True, resources={"cpu": 2, "memory": "512Mi"}))
    assert parse_pipeline(doc).spec.stage("a").resources.cpu == "2"


def test_json_schema_is_crd_friendly() -> None:
    schema = OmniPipeline.model_json_schema()
    text = str(schema)
    assert "anyOf" not in text and "'null'" not in text
    stages = schema["$defs"]["PipelineSpec"]["properties"]["stages"]
    assert stages["maxItems"] == MAX_STAGES and stages["x-kubernetes-list-map-keys"] == ["name"]
    stage_props = schema["$defs"]["Stage"]["properties"]
    assert stage_props["replicas"]["maximum"] == MAX_REPLICAS
    assert stage_props["inputs"]["x-kubernetes-list-type"] == "set"
    assert "pattern" in schema["$defs"]["StageResources"]["properties"]["cpu"]
    for name, model in schema["$defs"].items():
        for prop, body in model.get("properties", {}).items():
            assert body.get("description"), f"{name}.{prop} has no description"


# --------------------------------------------------------------------------- field errors


def test_unknown_field_typo_names_field_and_suggests() -> None:
    doc = chain()
    doc["spec"]["stages"][1]["replica"] = 2
    message = errors_of(doc)
    assert "spec.stages[1].replica: unknown field 'replica'" in message
    assert "did you mean 'replicas'" in message


def test_final_output_typo() -> None:
    doc = manifest(stage("a", finalOuput=True), stage("b", inputs=["a"], finalOutput=True))
    assert "spec.stages[0].finalOuput: unknown field 'finalOuput'" in errors_of(doc)


def test_unknown_top_level_and_nested_fields() -> None:
    doc = chain()
    doc["spce"] = {}
    doc["spec"]["orchestrator"] = {"prot": 80}
    doc["spec"]["stages"][0]["engine"] = {"maxToken": 3}
    message = errors_of(doc)
    assert "spce: unknown field 'spce'" in message
    assert "spec.orchestrator.prot: unknown field 'prot'" in message
    assert "spec.stages[0].engine.maxToken: unknown field 'maxToken'" in message


def test_negative_replicas() -> None:
    doc = chain()
    doc["spec"]["stages"][2]["replicas"] = -1
    message = errors_of(doc)
    assert "spec.stages[2].replicas:" in message and "-1" in message


def test_too_many_replicas() -> None:
    doc = chain()
    doc["spec"]["stages"][0]["replicas"] = MAX_REPLICAS + 1
    assert f"spec.stages[0].replicas: Input should be less than or equal to {MAX_REPLICAS}" in (
        errors_of(doc)
    )


def test_negative_gpus() -> None:
    doc = chain()
    doc["spec"]["stages"][0]["resources"] = {"gpus": -1}
    message = errors_of(doc)
    assert "spec.stages[0].resources.gpus:" in message and "-1" in message


def test_bad_quantity() -> None:
    doc = chain()
    doc["spec"]["stages"][1]["resources"] = {"memory": "2 gigs"}
    message = errors_of(doc)
    assert "spec.stages[1].resources.memory: must be a Kubernetes quantity" in message
    assert "'2 gigs'" in message


def test_unknown_kind_lists_allowed_kinds() -> None:
    doc = chain()
    doc["spec"]["stages"][1]["kind"] = "tts"
    message = errors_of(doc)
    assert "spec.stages[1].kind:" in message and "'tts'" in message
    for kind in ("ar", "diffusion", "echo"):
        assert repr(kind) in message


def test_wrong_api_version_and_kind() -> None:
    doc = chain()
    doc["apiVersion"] = "omnistage.io/v1"
    doc["kind"] = "Pipeline"
    message = errors_of(doc)
    assert "apiVersion: invalid value 'omnistage.io/v1'" in message
    assert "kind: invalid value 'Pipeline'" in message


def test_bad_names() -> None:
    doc = chain()
    doc["metadata"]["name"] = "Bad_Name"
    doc["spec"]["stages"][0]["name"] = "x" * 21
    message = errors_of(doc)
    assert "metadata.name: must be a DNS-1035 label" in message and "'Bad_Name'" in message
    assert "spec.stages[0].name:" in message and "at most 20" in message
    doc = chain()
    doc["metadata"]["name"] = "1pipe"  # DNS-1123 but not a valid Service name prefix
    assert "metadata.name: must be a DNS-1035 label" in errors_of(doc)


def test_pod_names_must_fit_a_dns_label() -> None:
    doc = chain()
    doc["metadata"]["name"] = "p" * 40
    doc["spec"]["stages"][2]["name"] = "c" * 20
    doc["spec"]["stages"][2]["inputs"] = ["b"]
    message = errors_of(doc)
    assert f"spec.stages[2].name: pod names '{'p' * 40}-{'c' * 20}-<ordinal>' would exceed 63" in (
        message
    )
    doc["spec"]["stages"][2]["name"] = "c" * 19
    assert parse_pipeline(doc)


def test_missing_required_fields() -> None:
    message = errors_of({"apiVersion": API_VERSION, "kind": KIND, "metadata": {}, "spec": {}})
    assert "metadata.name: required field is missing" in message
    assert "spec.stages: required field is missing" in message


def test_unknown_builtin_model() -> None:
    doc = chain()
    doc["spec"]["stages"][0]["model"] = "foo"
    message = errors_of(doc)
    assert (
        "spec.stages[0].model: model 'foo' is not a built-in for kind 'ar' (built-ins: "
        "tiny-llama), a Hugging Face id org/name[@revision], or a local path starting with / "
        "or ./"
    ) in message


def test_builtin_of_wrong_kind() -> None:
    doc = chain()
    doc["spec"]["stages"][2]["model"] = "tiny-llama"
    message = errors_of(doc)
    assert "spec.stages[2].model: built-in model 'tiny-llama' is a 'ar' model" in message


def test_ar_stage_requires_model() -> None:
    doc = chain()
    del doc["spec"]["stages"][0]["model"]
    assert "spec.stages[0].model: a model is required for kind 'ar'" in errors_of(doc)


def test_echo_stage_rejects_model() -> None:
    doc = chain()
    doc["spec"]["stages"][1]["model"] = "tiny-llama"
    message = errors_of(doc)
    assert (
        "spec.stages[1].model: echo stages take no model" in message and "'tiny-llama'" in message
    )


def test_missing_model_path_with_check_paths(tmp_path: Path) -> None:
    doc = chain()
    doc["spec"]["stages"][0]["model"] = "/no/such/model"
    parse_pipeline(doc)  # structure alone is valid
    message = errors_of(doc, check_paths=True)
    assert "spec.stages[0].model: model path '/no/such/model' does not exist" in message


def test_relative_model_path_resolves_against_base_dir(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    doc = chain()
    doc["spec"]["stages"][0]["model"] = "./weights"
    assert parse_pipeline(doc, check_paths=True, base_dir=tmp_path)
    doc["spec"]["stages"][0]["model"] = "./other"
    assert "model path './other' does not exist" in errors_of(
        doc, check_paths=True, base_dir=tmp_path
    )


def test_bad_toleration_and_api_entries() -> None:
    doc = chain()
    doc["spec"]["stages"][0]["placement"] = {
        "tolerations": [{"key": "gpu", "operator": "Sometimes"}]
    }
    doc["spec"]["orchestrator"] = {"api": ["chat", "chat"]}
    message = errors_of(doc)
    assert "spec.stages[0].placement.tolerations[0].operator: invalid value 'Sometimes'" in message
    assert "spec.orchestrator.api[1]: duplicate entry 'chat'" in message


# --------------------------------------------------------------------------- graph errors


def test_duplicate_stage_names() -> None:
    doc = manifest(stage("a"), stage("a", finalOutput=True))
    assert "spec.stages[1]: duplicate stage name 'a' (also stages[0])" in errors_of(doc)


def test_unknown_input() -> None:
    doc = manifest(stage("a"), stage("b", inputs=["a", "ghost"], finalOutput=True))
    assert "spec.stages[1].inputs[1]: unknown stage 'ghost'" in errors_of(doc)


def test_self_reference() -> None:
    doc = manifest(stage("a"), stage("b", inputs=["b"], finalOutput=True))
    assert "spec.stages[1].inputs[0]: stage 'b' cannot consume its own output" in errors_of(doc)


def test_duplicate_input() -> None:
    doc = manifest(stage("a"), stage("b", inputs=["a", "a"], finalOutput=True))
    assert "spec.stages[1].inputs[1]: duplicate input 'a'" in errors_of(doc)


def test_cycle_is_named() -> None:
    doc = manifest(
        stage("src"),
        stage("a", inputs=["src", "c"]),
        stage("b", inputs=["a"]),
        stage("c", inputs=["b"], finalOutput=True),
    )
    message = errors_of(doc)
    assert "spec.stages[1].inputs[1]: cycle detected: a -> b -> c -> a" in message
    assert message.count("cycle detected") == 1


def test_two_stage_cycle_has_no_entry_stage() -> None:
    doc = manifest(stage("a", inputs=["b"]), stage("b", inputs=["a"], finalOutput=True))
    message = errors_of(doc)
    assert "cycle detected: a -> b -> a" in message
    assert "spec.stages: no entry stage" in message


def test_no_final_output_stage() -> None:
    doc = manifest(stage("a"), stage("b", inputs=["a"]))
    assert "spec.stages: no final-output stage" in errors_of(doc)


def test_no_stages_and_too_many_stages() -> None:
    assert "spec.stages:" in errors_of(manifest())
    many = [stage(f"s{i}", finalOutput=True) for i in range(MAX_STAGES + 1)]
    message = errors_of(manifest(*many))
    assert f"spec.stages: List should have at most {MAX_STAGES} items" in message


def test_colocate_with_unknown_and_self() -> None:
    doc = manifest(
        stage("a", placement={"colocateWith": ["a", "zz"]}),
        stage("b", inputs=["a"], finalOutput=True, placement={"colocateWith": ["a"]}),
    )
    message = errors_of(doc)
    assert "spec.stages[0].placement.colocateWith[0]: stage 'a' cannot colocate with itself" in (
        message
    )
    assert "spec.stages[0].placement.colocateWith[1]: unknown stage 'zz'" in message


def test_chat_stage_unknown_or_not_ar() -> None:
    doc = chain()
    doc["spec"]["orchestrator"] = {"chatStage": "nope"}
    assert "spec.orchestrator.chatStage: unknown stage 'nope'" in errors_of(doc)
    doc["spec"]["orchestrator"] = {"chatStage": "c"}
    message = errors_of(doc)
    assert "spec.orchestrator.chatStage: stage 'c' has kind 'diffusion'" in message


def test_all_graph_errors_reported_at_once() -> None:
    doc = manifest(stage("a", inputs=["x"]), stage("a", inputs=["a"]))
    with pytest.raises(SpecError) as info:
        parse_pipeline(doc)
    paths = [path for path, _ in info.value.errors]
    assert "spec.stages[1]" in paths and "spec.stages[0].inputs[0]" in paths
    assert len(str(info.value).splitlines()) == len(info.value.errors)


# --------------------------------------------------------------------------- files


def test_load_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="pipeline file not found") as info:
        load_pipeline(missing)
    assert str(missing) in str(info.value)


def test_load_yaml_syntax_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: [unclosed\n")
    with pytest.raises(SpecError, match="invalid YAML at line") as info:
        load_pipeline(bad)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- a\n- b\n", "expected a mapping, got list"),
        ("", "file is empty"),
        ("a: 1\n---\nb: 2\n", "expected exactly one YAML document, found 2"),
        ("kind: OmniPipeline\nkind: OmniPipeline\n", "duplicate key 'kind'"),
    ],
)
def test_load_bad_documents(tmp_path: Path, text: str, expected: str) -> None:
    file = tmp_path / "p.yaml"
    file.write_text(text)
    with pytest.raises(SpecError, match=expected) as info:
        load_pipeline(file)
    assert str(info.value).startswith(str(file))


def test_load_validation_error_names_file_and_path(tmp_path: Path) -> None:
    file = tmp_path / "p.yaml"
    file.write_text(
        "apiVersion: omnistage.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: p}\n"
        "spec:\n  stages:\n    - {name: a, kind: echo, finalOutput: true, replicas: -1}\n"
    )
    with pytest.raises(SpecError) as info:
        load_pipeline(file)
    assert str(info.value).startswith(f"{file}: spec.stages[0].replicas:")
    assert info.value.errors[0][0] == "spec.stages[0].replicas"


def test_load_relative_model_path_is_relative_to_file(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    text = (
        "apiVersion: omnistage.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: p}\n"
        "spec:\n  stages:\n    - {name: a, kind: ar, model: ./weights, finalOutput: true}\n"
    )
    file = tmp_path / "p.yaml"
    file.write_text(text)
    assert load_pipeline(file).spec.stage("a").model == "./weights"
    elsewhere = tmp_path / "sub" / "p.yaml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(text)
    with pytest.raises(SpecError, match=re.escape("model path './weights' does not exist")):
        load_pipeline(elsewhere)
    assert load_pipeline(elsewhere, check_paths=False).spec.stage("a").model == "./weights"


def test_spec_error_pickles() -> None:
    err = SpecError([("spec.stages", "boom")], source="p.yaml")
    again = pickle.loads(pickle.dumps(err))
    assert again.errors == [("spec.stages", "boom")] and str(again) == "p.yaml: spec.stages: boom"


# --------------------------------------------------------------------------- strict parsing


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("replicas", "3", "spec.stages[0].replicas: must be an integer (got str '3')"),
        ("finalOutput", "true", "spec.stages[0].finalOutput: must be a boolean (got str 'true')"),
        ("drainTimeoutSeconds", 1.5, "spec.stages[0].drainTimeoutSeconds: must be an integer"),
        ("replicas", True, "spec.stages[0].replicas: must be an integer (got bool True)"),
    ],
)
def test_no_coercion_matching_the_api_servers_typing(field: str, value: Any, expected: str) -> None:
    doc = manifest(stage("a", finalOutput=True))
    doc["spec"]["stages"][0][field] = value
    assert expected in errors_of(doc)


def test_integers_are_numbers_and_quantities_take_integers() -> None:
    doc = manifest(stage("a", finalOutput=True, admission={"defaultDeadlineSeconds": 5},
                         resources={"cpu": 2}))
    stage_a = parse_pipeline(doc).spec.stage("a")
    assert stage_a.admission.default_deadline_seconds == 5.0 and stage_a.resources.cpu == "2"
    doc["spec"]["stages"][0]["resources"] = {"cpu": 0.5}
    assert "spec.stages[0].resources.cpu: must be a string (got float 0.5)" in errors_of(doc)


def test_unknown_metadata_keys_are_refused_but_server_fields_pass() -> None:
    doc = chain()
    doc["metadata"]["lables"] = {"team": "ml"}
    assert "metadata.lables: unknown field 'lables' (did you mean 'labels'?)" in errors_of(doc)
    doc = chain()
    doc["metadata"].update(finalizers=["x"], ownerReferences=[{"uid": "1"}],
                           deletionTimestamp="2026-01-01T00:00:00Z", selfLink="/x",
                           deletionGracePeriodSeconds=30, generateName="demo-")
    assert parse_pipeline(doc).metadata.finalizers == ["x"]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"team name": "ml"}, "invalid label key 'team name'"),
        ({"Example.com/x": "y"}, "the prefix before '/' must be a DNS subdomain"),
        ({"team": "-ml"}, "invalid label value '-ml' for 'team'"),
        ({"team": "x" * 64}, "invalid label value"),
    ],
)
def test_label_syntax(labels: dict[str, str], expected: str) -> None:
    doc = chain()
    doc["metadata"]["labels"] = labels
    message = errors_of(doc)
    assert message.startswith("metadata.labels: ") and expected in message


def test_valid_labels_and_annotations() -> None:
    doc = chain()
    doc["metadata"]["labels"] = {"app.kubernetes.io/name": "demo", "empty": ""}
    doc["metadata"]["annotations"] = {"example.com/note": "anything at all: 1 2 3"}
    assert parse_pipeline(doc).metadata.labels["empty"] == ""


def test_map_keys_appear_as_fields_in_paths() -> None:
    doc = manifest(stage("a", finalOutput=True, placement={"nodeSelector": {"gpus": 8}}))
    assert "spec.stages[0].placement.nodeSelector.gpus: must be a string" in errors_of(doc)


# --------------------------------------------------------------------------- images


@pytest.mark.parametrize(
    "image",
    [
        "ubuntu",
        "library/ubuntu:22.04",
        "ghcr.io/omnistage/omnistage:0.1.0",
        "localhost:5000/a/b_c__d-e.f:v1.2-rc_3",
        "registry.example.com:443/team/img@sha256:" + "a" * 64,
        "quay.io/x/y:1@sha256:" + "0" * 64,
        "[::1]:5000/img",
    ],
)
def test_image_references_that_are_valid(image: str) -> None:
    assert image_error(image) is None
    assert parse_pipeline(manifest(stage("a", finalOutput=True), image=image))


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("", "an image is required: [registry[:port]/]name[:tag][@digest]"),
        ("https://ghcr.io/x/y:1", "an image reference has no scheme: write 'ghcr.io/x/y:1'"),
        ("ghcr.io/Org/img", "not a container image reference (got 'ghcr.io/Org/img')"),
        ("img:bad+tag", "not a container image reference"),
        ("img@sha256:short", "not a container image reference"),
        ("img:", "not a container image reference"),
    ],
)
def test_image_references_that_are_not(image: str, expected: str) -> None:
    message = errors_of(manifest(stage("a", finalOutput=True), image=image))
    assert message.startswith("spec.image: ") and expected in message


# --------------------------------------------------------------------------- StagePool


def pool_doc(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": "StagePool", "metadata": {"name": "demo-a"},
        "spec": {"pipeline": "demo", "stage": {"name": "a", "kind": "echo"}, "replicas": 2,
                 "image": DEFAULT_IMAGE, **spec},
    }


def test_stagepool_parses_and_checks_its_name_and_image() -> None:
    pool = parse_stagepool(pool_doc())
    assert pool.spec.replicas == 2 and pool.spec.stage.kind == "echo"
    wrong = pool_doc()
    wrong["metadata"]["name"] = "other"
    with pytest.raises(SpecError) as info:
        validate_manifest(wrong)
    assert info.value.errors == [
        ("metadata.name",
         "a StagePool is named <pipeline>-<stage>: expected 'demo-a' (got 'other')")]
    with pytest.raises(SpecError, match=r"spec\.image: an image is required"):
        validate_manifest(pool_doc(image=""))
    with pytest.raises(SpecError, match=r"spec\.stage\.model: echo stages take no model"):
        validate_manifest(pool_doc(stage={"name": "a", "kind": "echo", "model": "tiny-unet"}))


def test_validate_manifest_dispatches_on_kind_and_checks_updates() -> None:
    assert isinstance(validate_manifest(chain()), OmniPipeline)
    with pytest.raises(SpecError, match="kind: invalid value 'Pipeline' "
                                        r"\(expected 'OmniPipeline' or 'StagePool'\)"):
        validate_manifest({**chain(), "kind": "Pipeline"})
    with pytest.raises(SpecError, match="kind: required field is missing"):
        validate_manifest({"spec": {}})
    old = pool_doc()
    new = pool_doc(pipeline="other", stage={"name": "a", "kind": "ar", "model": "tiny-llama"})
    with pytest.raises(SpecError) as info:
        validate_manifest(new, old=old)
    paths = [p for p, _ in info.value.errors]
    assert paths[:2] == ["spec.pipeline", "spec.stage.kind"] and "metadata.name" in paths


# --------------------------------------------------------------------------- engine by kind


def test_a_pool_stores_only_the_engine_options_of_its_kind() -> None:
    stages = parse_pipeline(chain()).spec
    ar = engine_for_kind(stages.stage("a").engine, "ar")
    assert {"dtype", "maxTokens", "temperature", "returnHiddenStates"} <= set(ar)
    assert "seed" not in ar  # unset: each request gets its own (stored only when pinned)
    assert not {"height", "numInferenceSteps", "echoDelayMs"} & set(ar)
    diffusion = engine_for_kind(stages.stage("c").engine, "diffusion")
    assert "height" in diffusion and "maxTokens" not in diffusion
    echo = engine_for_kind(stages.stage("b").engine, "echo")
    assert echo["echoDelayMs"] == 0 and not {"dtype", "maxTokens", "height"} & set(echo)
