"""The kind table (omnistage.kinds) is the one place a stage kind is described.

These checks keep it so: the docs show the table as it is, every row builds its executor and its
built-in models, reading the table stays free of torch, and no other module names the kinds.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import omnistage.kinds as stage_kinds
from omnistage.executors import executor_class
from omnistage.kinds import Payload, StageKind
from omnistage.models import _SAVERS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "pipeline-spec.md"


def test_the_docs_show_the_kind_table_as_it_is() -> None:
    """docs/pipeline-spec.md's table between its markers is markdown_table()'s output; to update
    it, paste `python3 -c "from omnistage.kinds import markdown_table as t;
    print(t())"` there."""
    text = DOC.read_text()
    start = text.index("<!-- kind table:")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end of kind table -->")
    assert text[start:end].strip() == stage_kinds.markdown_table()


def test_the_table_lists_each_kind_once_with_the_documented_behaviour() -> None:
    assert stage_kinds.names() == ("ar", "diffusion", "echo", "thinker", "talker", "vocoder")
    assert stage_kinds.builtin_models() == {
        "tiny-llama": "ar", "tiny-unet": "diffusion", "tiny-omni-thinker": "thinker",
        "tiny-omni-talker": "talker", "tiny-omni-vocoder": "vocoder"}
    assert stage_kinds.chat_kinds() == ("ar", "thinker")
    assert stage_kinds.image_kinds() == ("diffusion",)
    assert [k.name for k in stage_kinds.kinds() if k.needs_model] == [
        "ar", "diffusion", "thinker", "talker", "vocoder"]


@pytest.mark.parametrize("name", ["ar", "diffusion", "echo", "thinker", "talker", "vocoder"])
def test_every_row_builds_its_executor_and_its_builtins(name: str) -> None:
    row = stage_kinds.get(name)
    assert executor_class(name).kind == name
    assert all(model in _SAVERS for model in row.builtin_models)


def test_unknown_kinds_and_bad_rows_are_refused_naming_the_value() -> None:
    with pytest.raises(stage_kinds.KindError,
                       match="unknown stage kind 'tts'; expected one of: ar, diffusion, "
                             "echo, thinker, talker, vocoder"):
        stage_kinds.get("tts")
    with pytest.raises(stage_kinds.KindError, match="'Bad Name' must be 1-32 lowercase"):
        StageKind(name="Bad Name", executor="m:C", summary="", needs_model=False)
    with pytest.raises(stage_kinds.KindError, match="executor 'nocolon' must be 'module:Class'"):
        StageKind(name="x", executor="nocolon", summary="", needs_model=False)
    with pytest.raises(stage_kinds.KindError, match="takes no model but lists built-in"):
        StageKind(name="x", executor="m:C", summary="", needs_model=False,
                  builtin_models=("tiny-x",))
    with pytest.raises(stage_kinds.KindError, match="must hold Payload values"):
        StageKind(name="x", executor="m:C", summary="", needs_model=False,
                  consumes=frozenset({"text"}))  # type: ignore[arg-type]
    with pytest.raises(stage_kinds.KindError, match=r"model\(s\) \['tiny-llama'\] already"):
        stage_kinds.register(StageKind(name="x", executor="m:C", summary="", needs_model=True,
                                       builtin_models=("tiny-llama",)))
    with pytest.raises(stage_kinds.KindError, match="'ar' is built in and cannot be removed"):
        stage_kinds.unregister("ar")
    assert "x" not in stage_kinds.names()


def test_a_registered_kind_is_in_every_view_until_it_is_removed() -> None:
    row = StageKind(name="probe", executor="m:C", summary="", needs_model=False,
                    consumes=frozenset({Payload.TEXT}), emits=frozenset({Payload.IMAGE}))
    with stage_kinds.registered(row):
        assert stage_kinds.get("probe") is row and stage_kinds.names()[-1] == "probe"
        assert stage_kinds.image_kinds() == ("diffusion", "probe")
        assert "| `probe` |" in stage_kinds.markdown_table()
    assert "probe" not in stage_kinds.names()


def test_reading_the_table_the_spec_and_the_crds_never_imports_torch() -> None:
    """The spec, the CRD generator and the webhook read the table: it must stay cheap."""
    code = ("import sys, omnistage.kinds as k, omnistage.spec, omni_operator.crd as c;"
            "c.crd_files(); k.names(); print(sorted(m for m in ('torch', 'transformers', "
            "'diffusers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "runtime"), str(ROOT / "operator")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out


def test_no_module_but_the_executors_names_a_kind() -> None:
    """The kinds are the table's: no string equal to a kind's name anywhere else in the runtime
    or the operator (the table, omnistage/kinds.py, and each kind's own executor module)."""
    names = set(stage_kinds.names())
    found = []
    for root in (ROOT / "runtime" / "omnistage", ROOT / "operator" / "omni_operator"):
        for path in sorted(root.rglob("*.py")):
            if path.parent.name == "executors" or path == ROOT / "runtime/omnistage/kinds.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []
    assert len(names) == 6  # the scan looked for the real kinds
