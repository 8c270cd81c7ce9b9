"""The generated CRDs: no drift from the models, structural schemas, the rules the API server needs.

Why here and not only in tests/cluster: these checks need no API server, so a model change that
forgets `hack/gen-crds`, or a schema the API server would refuse, fails fast in the unit suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.crd import crd_files, omnipipeline_crd, render, stagepool_crd, structural
from omnistage.spec import (
    KIND_IMMUTABLE,
    MAX_REPLICAS,
    MAX_STAGES,
    image_error,
)

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
GEN = REPO / "hack" / "gen-crds"


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with a readable path; array items are shown as []."""
    if not isinstance(node, dict):
        return
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


CRD_BUILDERS = {"omnipipelines": omnipipeline_crd, "stagepools": stagepool_crd}


@pytest.fixture(params=sorted(CRD_BUILDERS))
def crd(request: pytest.FixtureRequest) -> dict[str, Any]:
    return CRD_BUILDERS[request.param]()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- drift


def test_checked_in_crds_match_the_models() -> None:
    files = crd_files()
    assert sorted(files) == sorted(p.name for p in CRDS.glob("*.yaml")), "run hack/gen-crds"
    for name, text in files.items():
        assert (CRDS / name).read_text(encoding="utf-8") == text, f"{name} drifted: hack/gen-crds"


def test_generation_is_deterministic() -> None:
    assert crd_files() == crd_files()
    assert render(omnipipeline_crd()) == render(omnipipeline_crd())
    assert "&id" not in render(omnipipeline_crd()), "shared sub-schemas must not become anchors"


def test_gen_crds_check_passes_on_the_checkout() -> None:
    proc = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gen_crds_check_fails_with_a_diff_on_drift(tmp_path: Path) -> None:
    out = tmp_path / "crds"
    subprocess.run([sys.executable, str(GEN), "--out", str(out)], check=True, capture_output=True)
    target = out / "omnipipelines.omnistage.io.yaml"
    target.write_text(target.read_text().replace("maxItems: 16", "maxItems: 99"))
    (out / "stale.yaml").write_text("kind: Leftover\n")
    proc = subprocess.run(
        [sys.executable, str(GEN), "--check", "--out", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    removed = [line for line in proc.stdout.splitlines() if line.startswith("-")]
    assert any("maxItems: 99" in line for line in removed)
    assert "stale.yaml" in proc.stdout
    assert "run hack/gen-crds" in proc.stderr
    # Without --check it repairs the directory.
    subprocess.run([sys.executable, str(GEN), "--out", str(out)], check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(crd_files())


def test_checked_in_yaml_parses_to_the_generated_dicts() -> None:
    by_name = {c["metadata"]["name"]: c for c in (omnipipeline_crd(), stagepool_crd())}
    for path in CRDS.glob("*.yaml"):
        loaded = yaml.safe_load(path.read_text())
        assert loaded == by_name[loaded["metadata"]["name"]]


# ---------------------------------------------------------------------------- structural schema


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    """What apiextensions' structural-schema check requires, plus our own conventions."""
    for path, node in _walk(_schema(crd)):
        where = path or "(root)"
        assert "$ref" not in node and "$defs" not in node, where
        assert "title" not in node, where
        assert "default" not in node, f"{where}: defaults live in the models only"
        assert node.get("additionalProperties") is not False, where
        assert not {"oneOf", "allOf", "not"} & set(node), where
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, where
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], where
            assert "type" not in node, where
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}
        if "properties" in node:
            assert "additionalProperties" not in node, where
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node:
                assert node[key] is True, f"{where}: OpenAPI v3.0 uses a boolean {key}"


def test_every_property_has_a_description(crd: dict[str, Any]) -> None:
    """So `kubectl explain` is useful everywhere (metadata is ObjectMeta's and may carry none)."""
    missing = [
        f"{path}.{name}"
        for path, node in _walk(_schema(crd))
        for name, sub in node.get("properties", {}).items()
        if not sub.get("description", "").strip() and not f"{path}.{name}".startswith(".metadata")
    ]
    assert not missing


def test_stages_are_a_map_list_keyed_by_name() -> None:
    stages = _schema(omnipipeline_crd())["properties"]["spec"]["properties"]["stages"]
    assert stages["x-kubernetes-list-type"] == "map"
    assert stages["x-kubernetes-list-map-keys"] == ["name"]
    assert stages["items"]["required"] == ["name", "kind"]
    assert stages["maxItems"] == MAX_STAGES
    assert stages["minItems"] == 1
    item = stages["items"]["properties"]
    assert item["replicas"]["maximum"] == MAX_REPLICAS
    assert item["replicas"]["minimum"] == 0
    for name_list in (item["inputs"], item["placement"]["properties"]["colocateWith"]):
        assert name_list["x-kubernetes-list-type"] == "set"
        assert name_list["maxItems"] == MAX_STAGES  # bounds CEL cost


def test_stagepool_replicas_are_bounded() -> None:
    spec = _schema(stagepool_crd())["properties"]["spec"]
    assert spec["properties"]["replicas"]["maximum"] == MAX_REPLICAS
    assert spec["properties"]["stage"]["properties"]["replicas"]["maximum"] == MAX_REPLICAS
    assert set(spec["required"]) == {"pipeline", "stage", "image"}


def test_quantities_are_int_or_string() -> None:
    item = _schema(omnipipeline_crd())["properties"]["spec"]["properties"]["stages"]["items"]
    cpu = item["properties"]["resources"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True
    assert cpu["pattern"].startswith("^")
    assert "Defaults to 1." in cpu["description"]


def test_maps_keep_string_values() -> None:
    item = _schema(omnipipeline_crd())["properties"]["spec"]["properties"]["stages"]["items"]
    selector = item["properties"]["placement"]["properties"]["nodeSelector"]
    assert selector == {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": selector["description"],
    }


def test_conversion_of_json_schema_details() -> None:
    """Exclusive bounds, nullable unions, consts and $refs become their OpenAPI v3.0 forms."""
    converted = structural(
        {
            "$defs": {"Inner": {"type": "object", "title": "Inner", "description": "model doc"}},
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "t": {"type": "number", "exclusiveMinimum": 0, "default": 1.5, "title": "T"},
                "n": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "x"},
                "c": {"const": "v", "type": "string", "description": "c"},
                "i": {"$ref": "#/$defs/Inner", "description": "field doc"},
            },
        }
    )
    props = converted["properties"]
    assert "additionalProperties" not in converted
    assert props["t"] == {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "description": "Defaults to 1.5.",
    }
    assert props["n"] == {"type": "string", "description": "x"}
    assert props["c"]["enum"] == ["v"]
    assert props["i"] == {"type": "object", "description": "field doc"}


# ---------------------------------------------------------------------------- rules and metadata


def _rules(node: dict[str, Any]) -> list[dict[str, Any]]:
    return node.get("x-kubernetes-validations", [])  # type: ignore[no-any-return]


def test_cel_rules_cover_the_graph_checks() -> None:
    """The second line of defence: every graph rule except cycles, each naming index and value."""
    spec = _schema(omnipipeline_crd())["properties"]["spec"]
    by_message = {r["message"]: r for r in _rules(spec)}
    for message, path in (
        ("spec.stages[].inputs must name existing stages", "spec.stages[%d].inputs[%d]: "),
        ("a stage cannot consume its own output", "spec.stages[%d].inputs[%d]: "),
        ("spec.stages[].placement.colocateWith must name existing stages",
         "spec.stages[%d].placement.colocateWith[%d]: "),
        ("a stage cannot colocate with itself", "spec.stages[%d].placement.colocateWith[%d]: "),
    ):
        rule = by_message[message]
        assert rule["fieldPath"] == ".stages"
        assert path in rule["messageExpression"]  # index and entry, as the validator words it
        assert "transformList(i, s," in rule["messageExpression"]
    assert "no entry stage" in " ".join(by_message)
    assert "no final-output stage" in " ".join(by_message)
    chat = by_message["spec.orchestrator.chatStage must name an existing stage of kind ar or "
                      "thinker"]
    assert "the chat stage must be a stage of kind 'ar' or 'thinker'" in chat[
        "messageExpression"]
    # Duplicate names are the map-list key's job (the API server says "Duplicate value").
    assert not any("unique" in m for m in by_message)
    item = spec["properties"]["stages"]["items"]
    kind_rules = _rules(item["properties"]["kind"])
    assert kind_rules == [{"rule": "self == oldSelf", "message": KIND_IMMUTABLE}]


def test_cel_rules_carry_the_stage_model_toleration_and_image_checks(crd: dict[str, Any]) -> None:
    spec = _schema(crd)["properties"]["spec"]
    stage = spec["properties"]["stages"]["items"] if "stages" in spec["properties"] else (
        spec["properties"]["stage"])
    model_rules = [r for r in _rules(stage) if r.get("fieldPath") == ".model"]
    expressions = " | ".join(r["messageExpression"] for r in model_rules)
    for words in ("stages take no model", "a model is required for kind",
                  "is not a built-in for kind", "model, not"):
        assert words in expressions
    toleration = stage["properties"]["placement"]["properties"]["tolerations"]["items"]
    assert {r["fieldPath"] for r in _rules(toleration)} == {
        ".value", ".key", ".tolerationSeconds"}
    [image] = _rules(spec["properties"]["image"])
    assert image["rule"].startswith("self.matches(")
    assert "an image reference has no scheme" in image["messageExpression"]


def test_cel_messages_match_the_validator_text() -> None:
    """The literal parts of each messageExpression are the validator's own words."""
    text = " | ".join(
        r.get("messageExpression", r["message"])
        for _, node in _walk(_schema(omnipipeline_crd()))
        for r in _rules(node)
    )
    for fragment in (
        "unknown stage '%s'",
        "stage '%s' cannot consume its own output",
        "stage '%s' cannot colocate with itself",
        "value must be empty when operator is Exists (got '%s')",
        "pod names '%s-%s-<ordinal>' would exceed 63 characters",
    ):
        assert fragment in text, fragment
    assert image_error("https://x/y") == (
        "an image reference has no scheme: write 'x/y' instead of 'https://x/y'")


def test_every_rule_has_a_message_and_a_valid_field_path(crd: dict[str, Any]) -> None:
    for path, node in _walk(_schema(crd)):
        for rule in _rules(node):
            assert rule["message"], path
            field_path = rule.get("fieldPath")
            if field_path:
                target = node
                for part in field_path.lstrip(".").split("."):
                    target = target["properties"][part]  # KeyError: a path the server rejects


def test_names_subresources_and_columns() -> None:
    pipe, pool = omnipipeline_crd(), stagepool_crd()
    assert pipe["spec"]["group"] == pool["spec"]["group"] == "omnistage.io"
    assert pipe["spec"]["names"]["shortNames"] == ["omnipipe"]
    assert pool["spec"]["names"]["shortNames"] == ["sp"]
    for c in (pipe, pool):
        assert c["spec"]["names"]["categories"] == ["omnistage"]
        (version,) = c["spec"]["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    pipe_v, pool_v = pipe["spec"]["versions"][0], pool["spec"]["versions"][0]
    assert pipe_v["subresources"] == {"status": {}}
    assert pool_v["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in pipe_v["additionalPrinterColumns"]]
    assert columns == ["Phase", "Ready", "Reason", "Stages", "Endpoint", "Age"]
    columns = [c["name"] for c in pool_v["additionalPrinterColumns"]]
    assert columns == ["Pipeline", "Stage", "Desired", "Current", "Ready", "Draining",
                       "Autoscaler", "Age"]
    conditions = _schema(pipe)["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"} <= (
        set(conditions["items"]["properties"])
    )


_STEP = re.compile(r'\.([A-Za-z]+)|\[\?\(@\.([A-Za-z]+)=="[^"]*"\)\]')


def _resolve(schema: dict[str, Any], json_path: str) -> dict[str, Any]:
    """The schema node a printer column's (or the scale subresource's) JSONPath reads; a filter
    [?(@.key=="v")] steps into the list's items, whose key field must exist."""
    node = schema
    steps = _STEP.findall(json_path)
    assert steps, json_path
    for field, key in steps:
        if key:
            node = node["items"]
            assert key in node["properties"], f"{json_path}: no {key} to filter on"
        else:
            assert field in node.get("properties", {}), f"{json_path}: no field {field}"
            node = node["properties"][field]
    return node


@pytest.mark.parametrize("kind", sorted(CRD_BUILDERS))
def test_printer_columns_and_the_scale_subresource_read_typed_fields(kind: str) -> None:
    """Every column reads a field the (generated) schema has, of the column's type, so `kubectl
    get` never shows an empty column because a status field was renamed in the model."""
    crd = CRD_BUILDERS[kind]()
    version = crd["spec"]["versions"][0]
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".metadata."):
            continue  # set by the API server, not in our schema
        node = _resolve(_schema(crd), column["jsonPath"])
        assert node["type"] == column["type"], column
    scale = version["subresources"].get("scale")
    if scale:
        assert _resolve(_schema(crd), scale["statusReplicasPath"])["type"] == "integer"
        assert _resolve(_schema(crd), scale["labelSelectorPath"])["type"] == "string"
        assert _resolve(_schema(crd), scale["specReplicasPath"])["type"] == "integer"
    with pytest.raises(AssertionError, match="no field stagesready"):
        _resolve(_schema(crd), ".status.stagesready")
