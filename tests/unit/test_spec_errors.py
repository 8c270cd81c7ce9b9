"""What a user reads when a pipeline is refused: the exact (path, message) pairs of SpecError, the
stage-graph checks, metadata keys, updates, YAML files, and the helpers of a valid spec.

Each test asserts whole messages and whole error lists (a substring check lets a mutated message
through). The "Kills:" lines name the omnistage.spec mutants (mutmut 3.8.1) each test catches;
the mutation run is `hack/mutation.sh spec` (docs/testing.md).
"""

from __future__ import annotations

import datetime
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from omnistage.kube import ANNOTATION_SHARED_MEMORY
from omnistage.modelref import ModelRef
from omnistage.spec import (
    DEFAULT_IMAGE,
    EngineOptions,
    ModelCache,
    OmniPipeline,
    PipelineSpec,
    SpecError,
    Stage,
    Toleration,
    image_error,
    load_manifests,
    load_pipeline,
    parse_pipeline,
    parse_stagepool,
    validate_manifest,
)
from omnistage.spec import fields as spec_fields
from tests.unit.test_spec import chain, manifest, pool_doc, stage


def errors_of(doc: Any, **kwargs: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_manifest(doc, **kwargs)
    return info.value.errors


def one_stage(**extra: Any) -> dict[str, Any]:
    """One echo stage 'a'; extra fields override (name and kind too)."""
    return manifest({**stage("a"), "finalOutput": True, **extra})


# --------------------------------------------------------------------------- message kinds


@pytest.mark.parametrize(("doc", "expected"), [
    ({**one_stage(), "spec": "x"},
     [("spec", "Input should be a valid dictionary or instance of PipelineSpec (got str)")]),
    (one_stage(placement={"nodeSelector": []}),
     [("spec.stages[0].placement.nodeSelector", "Input should be a valid dictionary (got list)")]),
    (one_stage(inputs="a"), [("spec.stages[0].inputs", "Input should be a valid list (got str)")]),
    (manifest(), [("spec.stages", "List should have at least 1 item after validation, not 0")]),
    (one_stage(placement={"colocateWith": [f"s{i}" for i in range(17)]}),
     [("spec.stages[0].placement.colocateWith",
       "List should have at most 16 items after validation, not 17")]),
    (manifest(stage("a", finalOutput=True), orchestrator={"api": []}),
     [("spec.orchestrator.api", "List should have at least 1 item after validation, not 0")]),
    ({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "spec": {"stages": []}},
     [("metadata", "required field is missing"),
      ("spec.stages", "List should have at least 1 item after validation, not 0")]),
    (one_stage(kind="tts"),
     [("spec.stages[0].kind", "invalid value 'tts' (expected 'ar', 'diffusion', 'echo', "
                              "'thinker', 'talker' or 'vocoder')")]),
    (one_stage(finalOutput="yes"),
     [("spec.stages[0].finalOutput", "must be a boolean (got str 'yes')")]),
    (one_stage(replicas=1.0), [("spec.stages[0].replicas", "must be an integer (got float 1.0)")]),
    (one_stage(engine={"temperature": "0.5"}),
     [("spec.stages[0].engine.temperature", "must be a number (got str '0.5')")]),
    (one_stage(name=5), [("spec.stages[0].name", "must be a string (got int 5)")]),
    (one_stage(name="A"), [("spec.stages[0].name",
                            "must be a DNS-1123 label: lowercase letters, digits and '-', "
                            "starting and ending with a letter or digit (got 'A')")]),
    (manifest(stage("a", finalOutput=True), modelCache={"endpoint": "ftp://x", "size": "1Gi"}),
     [("spec.modelCache.endpoint", "must be an http:// or https:// URL (got 'ftp://x')")]),
    (manifest(stage("a", finalOutput=True), modelCache={"claimName": "Bad"}),
     [("spec.modelCache.claimName",
       "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting and "
       "ending with a letter or digit (got 'Bad')")]),
], ids=["model_type", "dict_type", "list_type", "too_short", "too_long", "too_short-api",
        "missing", "literal", "bool", "int", "float", "str", "dns-label", "url", "subdomain"])
def test_each_kind_of_error_reads_as_documented(doc: dict[str, Any],
                                                expected: list[tuple[str, str]]) -> None:
    """Kills: in _spec_message, the type strings "model_type", "dict_type", "list_type" (their
    message names the type, not the value), "too_long" / "too_short" (no "(got ...)"), "missing",
    "literal_error", the _TYPE_NAMES lookup (`in` -> `not in`), ctx.get("expected") and
    ctx.get("pattern", "") -> get(None, ...), `err.get("ctx") or {}` -> `and`, and
    err.get("input") -> get(None)."""
    assert errors_of(doc) == expected


def test_a_pattern_without_help_text_quotes_the_pattern_as_written() -> None:
    """The fallback for a pattern without help text keeps the pattern's case ('A-Z' stays).
    Kills: `err["msg"][:1].lower()` -> `.upper()`, `[1:]` -> `[2:]`, the fallback -> None."""
    doc = manifest(stage("a", finalOutput=True),
                   modelCache={"size": "1Gi", "tokenSecret": {"name": "hf", "key": "bad key"}})
    assert errors_of(doc) == [("spec.modelCache.tokenSecret.key",
                               "string should match pattern '^[-._a-zA-Z0-9]+$' (got 'bad key')")]


@pytest.mark.parametrize(("length", "shown"), [(58, None), (59, 56)])
def test_long_values_are_cut_to_sixty_characters(length: int, shown: int | None) -> None:
    """A value whose repr is 60 characters is shown whole; at 61 it is cut to 57 and '...'.
    Kills: short_repr's `<= 60` -> `< 60`, 60 -> 61, 57 -> 58, `+ "..."` -> `+ "XX...XX"`."""
    value = "x" * length
    got = repr(value) if shown is None else "'" + "x" * shown + "..."
    doc = one_stage(resources={"memory": value})
    message = "must be a Kubernetes quantity such as '500m', '2', '1.5' or '4Gi'"
    assert errors_of(doc) == [("spec.stages[0].resources.memory", f"{message} (got {got})")]


def test_paths_at_the_root_have_no_leading_dot() -> None:
    """Kills: in error_path, `f".{key}" if out else key` -> always `.key` (for fields and for
    unknown keys)."""
    doc = chain()
    doc["zzz"] = {}
    doc["metadata"]["name"] = "Bad"
    assert errors_of(doc) == [
        ("metadata.name", "must be a DNS-1035 label: lowercase letters, digits and '-', starting "
                          "with a letter and ending with a letter or digit (got 'Bad')"),
        ("zzz", "unknown field 'zzz' (allowed: apiVersion, kind, metadata, spec, status)"),
    ]


def test_a_map_key_is_a_field_not_an_index() -> None:
    """A YAML map may have an integer key; it is named as a map key (.1), never as a list index
    ([1]). Kills the resolution of field types in error_path / _unwrap / _field_of:
    `get_args(annotation)[0]` -> `[1]` for Annotated, `origin in (list, dict)` -> `not in`,
    "list" if origin is list else "dict" (both arms), `container == "dict"` -> `!=`,
    `continue` -> `break` after a map key, `error_path(..., root)` -> `(..., None)`,
    _field_of's `key == (...)` -> `!=` and `info.alias or name` -> `and`."""
    for path, doc in (
        ("spec.stages[0].placement.nodeSelector.1.[key]",
         one_stage(placement={"nodeSelector": {1: "gpu"}})),
        ("metadata.labels.1.[key]", {**chain(), "metadata": {"name": "demo", "labels": {1: "x"}}}),
        ("spec.orchestrator.nodeSelector.7.[key]",
         manifest(stage("a", finalOutput=True), orchestrator={"nodeSelector": {7: "x"}})),
    ):
        number = path.split(".")[-2]
        assert errors_of(doc) == [(path, f"must be a string (got int {number})")]


# --------------------------------------------------------------------------- unknown fields


@pytest.mark.parametrize(("where", "key", "path", "message"), [
    ("stage", "drain_timeout", "spec.stages[0].drain_timeout",
     "unknown field 'drain_timeout' (did you mean 'drainTimeoutSeconds'?)"),
    ("stage", "max_unavailable", "spec.stages[0].max_unavailable",
     "unknown field 'max_unavailable' (did you mean 'maxUnavailable'? keys are camelCase)"),
    ("stage", "zzzzzz", "spec.stages[0].zzzzzz",
     "unknown field 'zzzzzz' (allowed: name, kind, model, engine, inputs, finalOutput, "
     "replicas, resources, placement, admission, streaming, dispatch, drainTimeoutSeconds, "
     "maxUnavailable, autoscaling)"),
    ("placement", "nodeSelectr", "spec.stages[0].placement.nodeSelectr",
     "unknown field 'nodeSelectr' (did you mean 'nodeSelector'?)"),
    ("toleration", "zzz", "spec.stages[0].placement.tolerations[0].zzz",
     "unknown field 'zzz' (allowed: key, operator, value, effect, tolerationSeconds)"),
    ("cache", "claimNme", "spec.modelCache.claimNme",
     "unknown field 'claimNme' (did you mean 'claimName'?)"),
    ("secret", "kee", "spec.modelCache.tokenSecret.kee",
     "unknown field 'kee' (did you mean 'key'?)"),
])
def test_unknown_fields_suggest_the_right_model_s_fields(where: str, key: str, path: str,
                                                          message: str) -> None:
    """The suggestion comes from the model at the key's parent, however deep. Kills: in
    _spec_message `err["loc"][-1]` -> `[+1]` / `[-2]`, `[:-1]` -> `[:+1]` / `[:-2]`,
    `_model_at(..., root)` -> `(..., None)`; in _model_at `continue` -> `break`, `not (...)` ->
    `(...)`, `field is None` -> `is not None`, `_unwrap(field[1])` -> `field[0]` / `field[2]`;
    in _unknown_field `info.alias or n` -> `and`, `camel != key and camel in allowed` -> `or` /
    `==` / `not in`, `", ".join` -> `"XX, XX".join`, `model is None` -> `is not None`."""
    doc = manifest({**stage("a"), "finalOutput": True,
                    "placement": {"tolerations": [{"operator": "Exists"}]}},
                   modelCache={"size": "1Gi", "tokenSecret": {"name": "hf"}})
    target = {"stage": doc["spec"]["stages"][0],
              "placement": doc["spec"]["stages"][0]["placement"],
              "toleration": doc["spec"]["stages"][0]["placement"]["tolerations"][0],
              "cache": doc["spec"]["modelCache"],
              "secret": doc["spec"]["modelCache"]["tokenSecret"]}[where]
    target[key] = 1
    assert errors_of(doc) == [(path, message)]


# --------------------------------------------------------------------------- cross-field errors


def test_python_callers_get_the_readable_message_too() -> None:
    """Code that builds the models by field name (the operator) sees the same sentence in the
    pydantic error. Kills: path_errors' "{summary}" template, its "summary" key, `"; ".join`,
    "spec_errors"; field_error's "{message}" template and "spec_field" (uppercase or XX)."""
    with pytest.raises(ValidationError) as info:
        Toleration(key=None, operator="Equal", toleration_seconds=5)
    [error] = info.value.errors()
    assert error["type"] == "spec_errors"
    assert error["msg"] == ("key: an empty key requires operator Exists; tolerationSeconds: "
                            "tolerationSeconds only applies with effect NoExecute")
    with pytest.raises(ValidationError) as info:
        PipelineSpec(image="", stages=[Stage(name="a", kind="echo", final_output=True)])
    [error] = info.value.errors()
    assert error["type"] == "spec_field"
    assert error["msg"] == ("an image is required: [registry[:port]/]name[:tag][@digest], such "
                            f"as {DEFAULT_IMAGE!r}")


def test_errors_of_a_list_entry_are_named_by_index() -> None:
    """Kills: _reject_duplicates' `item in seen` -> `not in`, `seen.add(item)` -> `add(None)`,
    `errors.append(...)` -> `append(None)`; _join's `rel.startswith("[")` -> "XX[XX" and its two
    conditional arms; describe_errors' `_join(base, rel)` -> `_join(None, rel)`; path_errors'
    relative default True -> False (a nested cross-field error would lose its prefix)."""
    doc = manifest(stage("a", finalOutput=True),
                   orchestrator={"api": ["chat", "images", "chat", "images", "generic"]})
    assert errors_of(doc) == [("spec.orchestrator.api[2]", "duplicate entry 'chat'"),
                              ("spec.orchestrator.api[3]", "duplicate entry 'images'")]
    doc = one_stage(placement={"tolerations": [{"operator": "Exists", "value": "x"}]})
    assert errors_of(doc) == [("spec.stages[0].placement.tolerations[0].value",
                               "value must be empty when operator is Exists (got 'x')")]


def test_cross_field_errors_at_the_root_are_not_prefixed() -> None:
    """Errors of the root objects' own validators (pod-name length, pool name) carry absolute
    paths. Kills: `_join`'s `if not base` -> `if base` (they would start with a dot)."""
    doc = chain()
    doc["metadata"]["name"] = "p" * 40
    doc["spec"]["stages"][0]["name"] = "a" * 20
    doc["spec"]["stages"][1]["inputs"] = ["a" * 20]
    assert errors_of(doc) == [(
        "spec.stages[0].name",
        f"pod names '{'p' * 40}-{'a' * 20}-<ordinal>' would exceed 63 characters; shorten the "
        "stage or pipeline name")]
    wrong = pool_doc()
    wrong["metadata"]["name"] = "demo-b"
    assert errors_of(wrong) == [
        ("metadata.name", "a StagePool is named <pipeline>-<stage>: expected 'demo-a' "
                          "(got 'demo-b')")]


# --------------------------------------------------------------------------- images


@pytest.mark.parametrize(("image", "expected"), [
    ("", f"an image is required: [registry[:port]/]name[:tag][@digest], such as "
         f"{DEFAULT_IMAGE!r}"),
    ("https://ghcr.io/x/y:1",
     "an image reference has no scheme: write 'ghcr.io/x/y:1' instead of 'https://ghcr.io/x/y:1'"),
    ("oci://ghcr.io/a://b",
     "an image reference has no scheme: write 'ghcr.io/a://b' instead of 'oci://ghcr.io/a://b'"),
    ("Ghcr.io/Org/Img", "not a container image reference (got 'Ghcr.io/Org/Img'): expected "
                        "[registry[:port]/]name[:tag][@digest] in lowercase, such as "
                        f"{DEFAULT_IMAGE!r}"),
])
def test_image_errors_in_full(image: str, expected: str) -> None:
    """Kills: image_error's `value == ""` -> `!=`, `"://" in value` -> `not in`, `index` ->
    `rindex` (the second '://'), `+ 3` -> `- 3` / `+ 4`; _check_image's `is not None` -> `is None`
    and `field_error(problem)` -> `field_error(None)`."""
    assert image_error(image) == expected
    assert errors_of(manifest(stage("a", finalOutput=True), image=image)) == [
        ("spec.image", expected)]
    assert errors_of(pool_doc(image=image)) == [("spec.image", expected)]


# --------------------------------------------------------------------------- stage graph


def test_duplicate_stage_names_name_the_first_one() -> None:
    """Kills: `index[stage.name] = i` -> `= None`, `stage.name in index` -> `not in`."""
    doc = manifest(stage("a"), stage("b", inputs=["a"]), stage("a", finalOutput=True))
    assert errors_of(doc) == [("spec.stages[2]", "duplicate stage name 'a' (also stages[0])")]


def test_every_input_problem_of_a_stage_is_listed() -> None:
    """A self-reference, an unknown stage and a repeat, in order, and no cycle for the
    self-reference. Kills: `upstream == stage.name` -> `!=`, `not in index` -> `in`,
    `in seen` -> `not in`, `seen.add(upstream)` -> `add(None)`, `seen = set()` -> `None`; in
    _cycle_errors `upstream != stage.name` -> `==` and `and` -> `or` (a self-loop or an unknown
    upstream must not reach the search)."""
    doc = manifest(stage("a"), stage("b", inputs=["b", "ghost", "a", "a"], finalOutput=True))
    assert errors_of(doc) == [
        ("spec.stages[1].inputs[0]", "stage 'b' cannot consume its own output"),
        ("spec.stages[1].inputs[1]", "unknown stage 'ghost'"),
        ("spec.stages[1].inputs[3]", "duplicate input 'a'"),
    ]


def test_every_colocation_problem_is_listed() -> None:
    """Kills: the colocateWith checks' `other == stage.name` -> `!=`, `not in index` -> `in`,
    `in seen` -> `not in`, `seen.add(other)` -> `add(None)`, `seen = set()` -> `None`."""
    doc = manifest(stage("a"), stage("b", inputs=["a"], finalOutput=True,
                                     placement={"colocateWith": ["b", "zz", "a", "a"]}))
    assert errors_of(doc) == [
        ("spec.stages[1].placement.colocateWith[0]", "stage 'b' cannot colocate with itself"),
        ("spec.stages[1].placement.colocateWith[1]", "unknown stage 'zz'"),
        ("spec.stages[1].placement.colocateWith[3]", "duplicate entry 'a'"),
    ]


def test_no_entry_and_no_final_stage_in_full() -> None:
    """Kills: both `not any(...)` -> `any(...)`, the inner `not s.inputs` -> `s.inputs`, and the
    message and path strings (XX, upper- or lowercase)."""
    doc = manifest(stage("a", inputs=["b"]), stage("b", inputs=["a"]))
    assert errors_of(doc) == [
        ("spec.stages[0].inputs[0]", "cycle detected: a -> b -> a"),
        ("spec.stages", "no entry stage: every stage has inputs, so none can receive requests"),
        ("spec.stages", "no final-output stage: set finalOutput: true on the stage(s) whose "
                        "output the client receives"),
    ]


def test_two_cycles_are_each_named_once_at_their_closing_input() -> None:
    """Kills: in _cycle_errors `key = frozenset(cycle)` -> `None` (the second cycle would be
    hidden), `cycle[-2]` -> `cycle[+2]` / `cycle[-3]`, `state.get(nxt) == 1` -> `!=`,
    `state[name] = 1` -> `2` / `None`, `nxt not in state` -> `in`, `" -> ".join` -> XX,
    "cycle detected: " (XX, upper), `name not in state` -> `in`."""
    doc = manifest(
        stage("src"),
        stage("a", inputs=["src", "b"]),
        stage("b", inputs=["a"]),
        stage("c", inputs=["src", "d"]),
        stage("d", inputs=["c"], finalOutput=True),
    )
    assert errors_of(doc) == [
        ("spec.stages[1].inputs[1]", "cycle detected: a -> b -> a"),
        ("spec.stages[3].inputs[1]", "cycle detected: c -> d -> c"),
    ]


def test_a_repeated_input_in_a_cycle_is_one_edge() -> None:
    """A repeated input is reported once and adds no second cycle. Kills: _cycle_errors'
    `stage.name not in consumers[upstream]` -> `in` and `consumers[...].append(None)`."""
    doc = manifest(stage("src"), stage("a", inputs=["src", "b"]),
                   stage("b", inputs=["a", "a"], finalOutput=True))
    assert errors_of(doc) == [
        ("spec.stages[2].inputs[1]", "duplicate input 'a'"),
        ("spec.stages[1].inputs[1]", "cycle detected: a -> b -> a"),
    ]


@pytest.mark.parametrize(("chat", "expected"), [
    ("nope", [("spec.orchestrator.chatStage", "unknown stage 'nope'")]),
    ("b", [("spec.orchestrator.chatStage",
            "stage 'b' has kind 'echo'; the chat stage must be a stage of kind 'ar' or "
            "'thinker'")]),
    ("a", None),
])
def test_chat_stage_must_be_a_known_ar_stage(chat: str, expected: list[tuple[str, str]] | None,
                                             ) -> None:
    """Kills: `chat is not None` -> `is None`, `chat not in index` -> `in`, `!= "ar"` -> `==`,
    "ar" (XX, upper), "orchestrator.chatStage" (XX, case)."""
    doc = manifest(stage("a", "ar"), stage("b", inputs=["a"], finalOutput=True),
                   orchestrator={"chatStage": chat})
    if expected is None:
        assert parse_pipeline(doc).spec.chat_stage() == "a"
    else:
        assert errors_of(doc) == expected


# --------------------------------------------------------------------------- metadata


def labels_doc(labels: dict[str, str] | None = None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    doc = chain()
    if labels is not None:
        doc["metadata"]["labels"] = labels
    if annotations is not None:
        doc["metadata"]["annotations"] = annotations
    return doc


PREFIX_ERROR = ("invalid {kind} key {key!r}: the prefix before '/' must be a DNS subdomain "
                "(lowercase letters, digits, '-' and '.')")
NAME_ERROR = ("invalid {kind} key {key!r}: the name must be 1-63 letters, digits, '-', '_' or "
              "'.', starting and ending with a letter or digit")
VALUE_ERROR = ("invalid label value {value!r} for {key!r}: at most 63 letters, digits, '-', '_' "
               "or '.', starting and ending with a letter or digit")


@pytest.mark.parametrize(("key", "problem"), [
    ("a" * 253 + "/x", None),
    ("a" * 254 + "/x", PREFIX_ERROR),
    ("/x", PREFIX_ERROR),
    ("example.com/a/b", PREFIX_ERROR),
    ("Example.com/x", PREFIX_ERROR),
    ("example.com/", NAME_ERROR),
    ("n" * 63, None),
    ("example.com/" + "n" * 63, None),
    ("n" * 64, NAME_ERROR),
    ("team name", NAME_ERROR),
    ("-team", NAME_ERROR),
    ("a.b_c-d", None),
])
@pytest.mark.parametrize("kind", ["label", "annotation"])
def test_label_and_annotation_keys_at_the_edges(kind: str, key: str, problem: str | None) -> None:
    """The API server's key rule: a DNS-subdomain prefix of at most 253 characters, a name of
    1-63. Kills: _key_error's `rpartition` -> `partition` (a/b/c), `"/" in key and ...` ->
    `not in` / `or`, the `or` chains -> `and` (a 254-character prefix that matches the
    pattern; a 64-character name that does), `> 253` -> `>= 253` / `> 254`, `> 63` -> `>= 63` /
    `> 64`, `not prefix` -> `prefix`, `not re.fullmatch` -> `re.fullmatch`; the kind strings
    "label" / "annotation" (XX, upper) and `problem = _key_error(...)` -> `None`."""
    doc = labels_doc(**{f"{kind}s": {key: "v"}})
    if problem is None:
        assert getattr(parse_pipeline(doc).metadata, f"{kind}s") == {key: "v"}
    else:
        assert errors_of(doc) == [(f"metadata.{kind}s", problem.format(kind=kind, key=key))]


@pytest.mark.parametrize(("labels", "expected"), [
    ({"team": "v" * 63}, None),
    ({"team": ""}, None),
    ({"team": "a.b_c-d"}, None),
    ({"team": "v" * 64}, VALUE_ERROR.format(value="v" * 64, key="team")),
    ({"team": "-ml"}, VALUE_ERROR.format(value="-ml", key="team")),
    ({"team name": "-ml"}, NAME_ERROR.format(kind="label", key="team name")),
])
def test_label_values_at_the_edges(labels: dict[str, str], expected: str | None) -> None:
    """Kills: _check_labels' `problem is None and value and (...)` -> `is not None` / either
    `and` -> `or` (an empty value is valid; a bad key is reported, not its value),
    `len(value) > 63` -> `>= 63` / `> 64`, `or` -> `and`, `not re.fullmatch` -> `re.fullmatch`,
    `field_error(problem)` -> `field_error(None)`."""
    doc = labels_doc(labels)
    if expected is None:
        assert parse_pipeline(doc).metadata.labels == labels
    else:
        assert errors_of(doc) == [("metadata.labels", expected)]


def test_annotations_total_at_most_256_kib() -> None:
    """Keys and values count together. Kills: `len(k) + len(v)` -> `-`, `size > MAX` -> `>=`,
    `size = sum(...)` -> `None`."""
    limit = 256 * 1024
    doc = labels_doc(annotations={"k": "v" * (limit - 1)})
    assert parse_pipeline(doc).metadata.annotations["k"] == "v" * (limit - 1)
    doc = labels_doc(annotations={"k": "v" * (limit - 1), "b": ""})
    assert errors_of(doc) == [
        ("metadata.annotations", f"annotations total {limit + 1} bytes; at most {limit}")]


@pytest.mark.parametrize(("flag", "valid"), [("true", True), ("false", True), ("yes", False),
                                              ("True", False), ("", False)])
def test_the_shared_memory_annotation_is_a_strict_switch(flag: str, valid: bool) -> None:
    """Kills: `flag is not None and flag not in (...)` -> `is None` / `or` / `in`,
    `annotations.get(KEY)` -> `get(None)`, and "true" / "false" (XX, upper)."""
    doc = labels_doc(annotations={ANNOTATION_SHARED_MEMORY: flag, "other": "x"})
    if valid:
        assert parse_pipeline(doc).metadata.annotations[ANNOTATION_SHARED_MEMORY] == flag
    else:
        assert errors_of(doc) == [(
            "metadata.annotations",
            f"{ANNOTATION_SHARED_MEMORY} must be \"true\" or \"false\", got {flag!r}")]
    assert parse_pipeline(labels_doc(annotations={"other": "x"})).metadata.annotations == {
        "other": "x"}


# --------------------------------------------------------------------------- updates


def test_a_pool_update_may_not_change_its_pipeline_or_stage_kind() -> None:
    """Kills: _update_errors' `kind == POOL_KIND` -> `!=`, `old.get("pipeline") not in (...)`
    -> `in`, spec.get("pipeline") -> get(None), the path strings, `old_kind not in` -> `in`;
    validate_manifest's `errors + exc.errors` order and `if errors: raise` (update errors on an
    otherwise valid object)."""
    old = pool_doc()
    assert isinstance(validate_manifest(pool_doc(replicas=5), old=old), type(parse_stagepool(old)))
    changed = pool_doc(pipeline="other")
    changed["metadata"]["name"] = "other-a"
    assert errors_of(changed, old=old) == [("spec.pipeline", "pipeline is immutable")]
    ar = pool_doc(stage={"name": "a", "kind": "ar", "model": "tiny-llama"}, image="")
    assert errors_of(ar, old=old) == [
        ("spec.stage.kind", "kind is immutable; create a stage with a new name instead"),
        ("spec.image", f"an image is required: [registry[:port]/]name[:tag][@digest], such as "
                       f"{DEFAULT_IMAGE!r}"),
    ]


def test_an_old_object_missing_fields_or_malformed_allows_the_update() -> None:
    """The old object may predate today's rules: absent or odd fields never block an update.
    Kills: _dict's `value if isinstance(value, dict) else {}` -> always `value` (an old spec that
    is a list) / always `{}`; `old_spec.get("stages") or []` -> `and`; the `new_stages`
    conditional -> always `spec.get("stages")` (null stages)."""
    new = pool_doc()
    for old in ({"kind": "StagePool"}, {"spec": []}, {"spec": {"stage": "x"}},
                {"spec": {"pipeline": None}}):
        assert validate_manifest(new, old=old).spec.pipeline == "demo"
    pipeline = chain()
    for old in ({"spec": None}, {"spec": {"stages": None}}, {"spec": {"stages": ["x", 1]}}):
        assert validate_manifest(pipeline, old=old).metadata.name == "demo"
    nulled = chain()
    nulled["spec"]["stages"] = None
    assert errors_of(nulled, old=chain()) == [
        ("spec.stages", "Input should be a valid list (got NoneType)")]


def test_a_pipeline_update_names_the_stage_whose_kind_changed() -> None:
    """Stages are matched by name, not position. Kills: `old_kinds.get(stage.get("name"))`
    -> get(None), `not in (None, ...)` -> `in`, the comprehension's `_dict(s)` -> `_dict(None)`
    and `s.get("kind")` -> get(None)."""
    old = chain()
    new = chain()
    new["spec"]["stages"] = [stage("c", "diffusion", inputs=["b"], finalOutput=True),
                             stage("b", "ar", inputs=["a"]), stage("a", "ar"),
                             stage("new", inputs=["a"])]
    assert errors_of(new, old=old) == [
        ("spec.stages[1].kind", "kind is immutable; create a stage with a new name instead")]
    assert validate_manifest(chain(), old=old).spec.stage_names() == ["a", "b", "c"]


# --------------------------------------------------------------------------- validate_manifest


@pytest.mark.parametrize(("doc", "expected"), [
    ([1], [("(root)", "expected a mapping, got list")]),
    ("text", [("(root)", "expected a mapping, got str")]),
    ({"spec": {}}, [("kind", "required field is missing (expected 'OmniPipeline' or "
                             "'StagePool')")]),
    ({"kind": "Pipeline"}, [("kind", "invalid value 'Pipeline' (expected 'OmniPipeline' or "
                                     "'StagePool')")]),
    ({"kind": "P" * 70}, [("kind", f"invalid value '{'P' * 56}... (expected 'OmniPipeline' or "
                                   "'StagePool')")]),
])
def test_validate_manifest_refuses_what_is_not_an_omnistage_object(
        doc: Any, expected: list[tuple[str, str]]) -> None:
    """Kills: `not isinstance(doc, dict)` -> `isinstance`, "(root)" (XX, upper), the
    "required field is missing" conditional (both arms, `is None` -> `is not None`), "kind"."""
    assert errors_of(doc) == expected


def test_the_parsers_refuse_a_non_mapping_at_the_root() -> None:
    """Kills: _strict's `not isinstance(doc, dict)` -> `isinstance` and its "(root)" string."""
    for parse in (parse_pipeline, parse_stagepool):
        with pytest.raises(SpecError) as info:
            parse(["a"])  # type: ignore[arg-type]
        assert info.value.errors == [("(root)", "expected a mapping, got list")]


def test_local_paths_are_checked_only_when_asked(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The webhook and `omnistage validate` leave paths alone (they refer to the pod's
    filesystem); `serve` checks them, relative to the file (base_dir) or the working directory.
    Kills: the defaults check_paths=False -> True of validate_manifest and parse_pipeline,
    `check_paths=check_paths` / `base_dir=base_dir` -> None or dropped, `path is not None and not
    path.exists()` -> `or` / `is None` / `path.exists()`, model_path(base_dir) -> (None)."""
    doc = manifest(stage("a", "ar", model="./weights", finalOutput=True),
                   stage("b", "ar", model="tiny-llama"), stage("c", "ar", model="acme/llm"))
    missing = [("spec.stages[0].model", "model path './weights' does not exist")]
    assert validate_manifest(doc).spec.stages[0].model == "./weights"
    assert parse_pipeline(doc).spec.stages[0].model == "./weights"
    monkeypatch.chdir(tmp_path)
    assert errors_of(doc, check_paths=True) == missing
    assert errors_of(doc, check_paths=True, base_dir=tmp_path) == missing
    (tmp_path / "weights").mkdir()
    assert validate_manifest(doc, check_paths=True, base_dir=tmp_path)
    assert validate_manifest(doc, check_paths=True)  # relative to the working directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert errors_of(doc, check_paths=True, base_dir=elsewhere) == missing


# --------------------------------------------------------------------------- helpers of a spec


def test_model_path_of_each_kind_of_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only local paths have one; relative ones resolve against base_dir or the working
    directory, '~' against home. Kills: model_path's `ref is None or ref.kind != "path"` ->
    `and` / `==` / "XXpathXX", `not path.is_absolute()` -> `path.is_absolute()`,
    `base_dir or Path.cwd()` -> `and`, `/` -> `*`, `ref = None`; model_ref's conditional arms
    and `is None` -> `is not None`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    doc = manifest(stage("rel", "ar", model="./w"), stage("abs", "ar", model="/opt/w"),
                   stage("home", "ar", model="~/w"), stage("hub", "ar", model="acme/llm"),
                   stage("builtin", "ar"), stage("echo", finalOutput=True))
    spec = parse_pipeline(doc).spec
    base = tmp_path / "base"
    assert spec.stage("rel").model_path(base) == base / "w"
    assert spec.stage("rel").model_path() == tmp_path / "w"
    assert spec.stage("abs").model_path(base) == Path("/opt/w")
    assert spec.stage("home").model_path(base) == tmp_path / "home" / "w"
    assert spec.stage("hub").model_ref() == ModelRef("hub", "acme/llm")
    for name in ("hub", "builtin", "echo"):
        assert spec.stage(name).model_path(base) is None
    assert spec.stage("echo").model_ref() is None


def test_graph_helpers_name_what_is_missing() -> None:
    """Kills: stage()'s `stage.name == name` -> `!=` and its ", " join; downstream's
    `self.stage(name)` -> `stage(None)` and `name in s.inputs` -> `not in`; chat_stage's
    `is not None` -> `is None`, `kind == "ar"` -> `!=` / "XXarXX"."""
    spec = parse_pipeline(chain()).spec
    assert spec.stage("b").name == "b"
    with pytest.raises(KeyError) as info:
        spec.stage("zz")
    assert info.value.args == ("unknown stage 'zz' (stages: a, b, c)",)
    with pytest.raises(KeyError):
        spec.downstream("zz")
    assert spec.downstream("b") == ["c"] and spec.downstream("c") == []
    assert spec.chat_stage() == "a"
    only_echo = parse_pipeline(one_stage()).spec
    assert only_echo.chat_stage() is None and only_echo.entry_stages() == ["a"]


def test_topo_order_refuses_a_cycle_built_without_validation() -> None:
    """Kills: topo_order's "stage graph has a cycle" (XX, upper) and ValueError(None)."""
    looped = PipelineSpec.model_construct(stages=[
        Stage.model_construct(name="a", kind="echo", inputs=["b"]),
        Stage.model_construct(name="b", kind="echo", inputs=["a"]),
    ])
    with pytest.raises(ValueError) as info:
        looped.topo_order()
    assert info.value.args == ("stage graph has a cycle",)


def test_to_manifest_is_json_ready() -> None:
    """YAML reads an unquoted timestamp as a datetime; the manifest carries it as JSON text.
    Kills: to_manifest's mode="json" -> None / dropped / "XXjsonXX" / "JSON", by_alias=True ->
    False, exclude_none=True -> False."""
    doc = chain()
    doc["metadata"]["creationTimestamp"] = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    doc["status"] = {"since": datetime.date(2026, 1, 2)}
    manifest_out = OmniPipeline.model_validate(doc).to_manifest()
    assert manifest_out["metadata"] == {"name": "demo", "labels": {}, "annotations": {},
                                        "creationTimestamp": "2026-01-01T00:00:00Z"}
    assert manifest_out["status"] == {"since": "2026-01-02"}
    assert json.loads(json.dumps(manifest_out)) == manifest_out
    assert "maxBatchTokens" not in manifest_out["spec"]["stages"][0]["engine"]
    assert manifest_out["spec"]["stages"][0]["finalOutput"] is False


def test_served_model_name_defaults_to_the_pipeline_name() -> None:
    """Kills: `served_model_name or metadata.name` -> `and`."""
    assert parse_pipeline(chain()).served_model_name() == "demo"
    named = manifest(stage("a", finalOutput=True), orchestrator={"servedModelName": "m"})
    assert parse_pipeline(named).served_model_name() == "m"


# --------------------------------------------------------------------------- SpecError


def test_spec_error_text_with_and_without_a_source() -> None:
    """Kills: __str__'s `prefix if self.source else ""` arms and its "" -> "XXXX", the "\\n" join,
    __init__'s `self.source = source` -> `None` and `super().__init__(str(self))` ->
    `__init__(None)`; _rebuild_spec_error's source=source -> None / dropped."""
    errors = [("a", "one"), ("b", "two")]
    bare = SpecError(errors)
    assert str(bare) == "a: one\nb: two" and bare.args == ("a: one\nb: two",)
    named = SpecError(errors, source="p.yaml")
    assert str(named) == "p.yaml: a: one\np.yaml: b: two"
    again = pickle.loads(pickle.dumps(named))
    assert (again.errors, again.source, str(again)) == (errors, "p.yaml", str(named))
    assert pickle.loads(pickle.dumps(bare)).source is None


# --------------------------------------------------------------------------- files


def write(tmp_path: Path, data: str | bytes) -> Path:
    file = tmp_path / "p.yaml"
    if isinstance(data, bytes):
        file.write_bytes(data)
    else:
        file.write_text(data)
    return file


def load_errors(path: Path, loader: Any = load_manifests) -> tuple[str | None, list[Any]]:
    with pytest.raises(SpecError) as info:
        loader(path)
    return info.value.source, info.value.errors


@pytest.mark.parametrize(("data", "expected"), [
    ("apiVersion: [unclosed\n", "invalid YAML at line 2, column 1: expected ',' or ']', but got "
                                "'<stream end>'"),
    ("kind: A\nmetadata: {}\nkind: B\n", "invalid YAML at line 3, column 1: duplicate key 'kind'"),
    ("a: {x: 1,\n     x: 2}\n", "invalid YAML at line 2, column 6: duplicate key 'x'"),
    ("a: b\tc: \x00\n", "invalid YAML: unacceptable character #x0000: special characters are not "
                        "allowed\n  in \"<unicode string>\", position 8"),
])
def test_yaml_errors_name_line_and_column(tmp_path: Path, data: str, expected: str) -> None:
    """Kills: `mark.line + 1` / `mark.column + 1` -> `- 1` / `+ 2`, getattr(exc, "problem_mark",
    None) -> "XX..." / no default, `mark is not None` -> `is None`, `where = ""` -> "XXXX",
    `getattr(exc, "problem", None) or str(exc)` -> `and` / no default, and in
    _construct_mapping `key in mapping` -> `not in` and the ConstructorError's arguments (the
    mark, the problem)."""
    file = write(tmp_path, data)
    assert load_errors(file) == (str(file), [("(file)", expected)])


def test_file_problems_are_named(tmp_path: Path) -> None:
    """Kills: load_manifests' "(file)" / "file not found" / "cannot read file" strings (XX,
    upper), `source = str(path)` -> `None` / `str(None)`, encoding "utf-8" -> "XXutf-8XX"."""
    missing = tmp_path / "missing.yaml"
    assert load_errors(missing) == (str(missing), [("(file)", "file not found")])
    source, errors = load_errors(tmp_path)
    assert source == str(tmp_path)
    assert errors == [("(file)", f"cannot read file: [Errno 21] Is a directory: '{tmp_path}'")]
    latin = write(tmp_path, "name: caf\xe9\n".encode("latin-1"))
    assert load_errors(latin) == (str(latin), [(
        "(file)", "cannot read file: 'utf-8' codec can't decode byte 0xe9 in position 9: "
                  "invalid continuation byte")])
    utf8 = write(tmp_path, "name: caf\xe9\n".encode())
    assert load_manifests(utf8) == [{"name": "caf\xe9"}]


def test_documents_of_a_file(tmp_path: Path) -> None:
    """Empty documents are skipped; merge keys and nested values are built in full. Kills:
    `d is not None` -> `is None`, `mapping[key] = construct_object(...)` -> `= None`,
    flatten_mapping(node) -> flatten_mapping(None)."""
    file = write(tmp_path, "---\n---\nbase: &b {x: 1, l: [1, {y: 2}]}\nother: {<<: *b, z: 3}\n"
                           "---\n- 4\n")
    assert load_manifests(file) == [
        {"base": {"x": 1, "l": [1, {"y": 2}]}, "other": {"x": 1, "l": [1, {"y": 2}], "z": 3}},
        [4],
    ]


@pytest.mark.parametrize(("data", "message"), [
    ("", "file is empty; expected one OmniPipeline"),
    ("---\n", "file is empty; expected one OmniPipeline"),
    ("a: 1\n---\nb: 2\n---\nc: 3\n", "expected exactly one YAML document, found 3"),
])
def test_load_pipeline_wants_exactly_one_document(tmp_path: Path, data: str, message: str) -> None:
    """Kills: `not docs` -> `docs`, `len(docs) > 1` -> `>= 1` / `> 2`, the messages (XX,
    upper)."""
    file = write(tmp_path, data)
    assert load_errors(file, load_pipeline) == (str(file), [("(file)", message)])


def test_load_pipeline_names_the_file(tmp_path: Path) -> None:
    """Kills: load_pipeline's `exc.errors == [...]` -> `!=`, "pipeline file not found",
    `source=source` -> None, `docs[0]` -> `docs[1]`, check_paths default True -> False,
    base_dir -> None."""
    missing = tmp_path / "nope.yaml"
    assert load_errors(missing, load_pipeline) == (str(missing),
                                                   [("(file)", "pipeline file not found")])
    assert load_errors(tmp_path, load_pipeline)[1][0][1].startswith("cannot read file: ")
    file = write(tmp_path, "apiVersion: omnistage.io/v1alpha1\nkind: OmniPipeline\n"
                           "metadata: {name: p}\nspec:\n  stages:\n"
                           "    - {name: a, kind: ar, model: ./w, finalOutput: true}\n")
    assert load_errors(file, load_pipeline) == (
        str(file), [("spec.stages[0].model", "model path './w' does not exist")])
    (tmp_path / "w").mkdir()
    assert load_pipeline(file).spec.stage("a").model == "./w"  # relative to the file


# --------------------------------------------------------------------------- CRD schema


def test_the_json_schema_has_no_null_branches_and_keeps_real_defaults() -> None:
    """Kills: _collapse_nullable's "properties" / "anyOf" / "type" / "null" / "default" strings,
    `len(branches) == 2` -> `!= 2` / `== 3`, `{"type": "null"} in branches` -> `not in`,
    `b != {"type": "null"}` -> `==`, `prop["default"] is None` -> `is not None`, the `and`
    chains -> `or`, `prop.update(other)` -> `update(None)`."""
    engine = EngineOptions.model_json_schema()["properties"]
    assert engine["maxBatchTokens"] == {
        "description": EngineOptions.model_fields["max_batch_tokens"].description,
        "maximum": 2**24, "minimum": 1, "title": "Maxbatchtokens", "type": "integer"}
    assert engine["maxBatchSize"]["default"] == 16 and engine["dtype"]["default"] == "auto"
    toleration = Toleration.model_json_schema()["properties"]
    assert toleration["effect"] == {
        "description": "Taint effect to match; omit to match all effects.",
        "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"], "title": "Effect",
        "type": "string"}
    assert toleration["operator"]["default"] == "Equal"
    cache = ModelCache.model_json_schema()["properties"]
    assert cache["tokenSecret"] == {"$ref": "#/$defs/SecretKeyRef",
                                    "description": ModelCache.model_fields["token_secret"]
                                    .description}
    assert cache["readOnly"]["default"] is False


def test_nullable_branches_collapse_in_either_order() -> None:
    """The CRD hook handles a null branch in either position and a schema without properties
    (pydantic writes [X, null] today; the hook must not depend on that). Kills:
    _collapse_nullable's `b != {"type": "null"}` key and value strings (XX, upper), and
    `schema.get("properties", {})` -> `get("properties", None)` / `get("properties")`."""
    schema = {"properties": {
        "a": {"anyOf": [{"type": "null"}, {"type": "integer"}], "default": None},
        "b": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": "x"},
        "c": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    }}
    spec_fields._collapse_nullable(schema)
    assert schema == {"properties": {
        "a": {"type": "integer"},
        "b": {"type": "string", "default": "x"},
        "c": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    }}
    empty: dict[str, Any] = {"type": "object"}
    spec_fields._collapse_nullable(empty)
    assert empty == {"type": "object"}


@pytest.mark.parametrize(("doc", "expected"), [
    (manifest(stage("a", finalOutput=True), modelCache={"size": "1 GB"}),
     [("spec.modelCache.size", "must be a Kubernetes quantity such as '500m', '2', '1.5' or "
                               "'4Gi' (got '1 GB')")]),
    (manifest(stage("a", finalOutput=True), orchestrator={"chatStage": "Chat"}),
     [("spec.orchestrator.chatStage", "must be a DNS-1123 label: lowercase letters, digits and "
                                      "'-', starting and ending with a letter or digit (got "
                                      "'Chat')")]),
])
def test_optional_constrained_fields_name_their_path(doc: dict[str, Any],
                                                     expected: list[tuple[str, str]]) -> None:
    """An optional field of a constrained type (Quantity | None, StageName | None) keeps its
    annotation nested; its errors still name it. Kills: _unwrap's
    `typing.get_args(annotation)[0]` -> `typing.get_args(None)[0]` for Annotated."""
    assert errors_of(doc) == expected
