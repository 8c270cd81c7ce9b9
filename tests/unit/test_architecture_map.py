"""docs/architecture.md opens with a map of the tree: every module with its job, and the layers
that say which way imports go. A newcomer reads the map first, so it must match the tree: a
module added, moved or removed, or an import that goes up a layer, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_import_graph import _graph, _modules

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {"omnistage/": ROOT / "runtime" / "omnistage",
            "omni_operator/": ROOT / "operator" / "omni_operator"}


def _map() -> str:
    text = DOC.read_text()
    start = text.index("\n## Map\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _files(package: str) -> set[str]:
    """The modules of a package (`omnistage/`, `omnistage/spec/`) by file name, no __init__."""
    top, _, sub = package.partition("/")
    root = PACKAGES[top + "/"] / sub
    return {p.name for p in root.glob("*.py") if p.name != "__init__.py"}


def _subpackages() -> set[str]:
    return {f"{top}{p.parent.relative_to(root).as_posix()}/"
            for top, root in PACKAGES.items() for p in root.glob("*/__init__.py")}


def _table() -> dict[str, set[str]]:
    """Package -> the module names its rows of the map's table list (`name.py`)."""
    rows: dict[str, set[str]] = {}
    for line in _map().splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        package = re.match(r"\s*`([\w/]+/)`", cells[1])
        assert package, f"a row of the map names no package: {line!r}"
        rows.setdefault(package.group(1), set()).update(re.findall(r"`(\w+\.py)`", cells[2]))
    return rows


def _layers() -> list[set[str]]:
    """The layers block, bottom first: each a set of `x.py` (a module of omnistage/) and
    `pkg/` (every module of that package) entries."""
    block = re.search(r"```text\nlayer.*?\n(.*?)```", _map(), re.S)
    assert block, "the map has no layers block"
    layers = []
    for line in block.group(1).splitlines():
        number, _, rest = line.partition("  ")
        assert number.strip().isdigit(), line
        layers.append(set(re.findall(r"\b[\w]+(?:\.py|/)", rest)))
    return layers[::-1]


def _key(module: str) -> str | None:
    """The layers block's entry for a dotted module name: `x.py` for a module of omnistage/,
    `pkg/` for anything in a subpackage or in the operator; None for omnistage's own __init__."""
    parts = module.split(".")
    if parts[0] == "omni_operator":
        return "omni_operator/"
    if len(parts) == 1:
        return None
    if len(parts) > 2 or (PACKAGES["omnistage/"] / parts[1]).is_dir():
        return f"{parts[1]}/"
    return f"{parts[1]}.py"


def _layer_of(module: str, layers: list[set[str]]) -> int:
    """omnistage's __init__ is the bottom layer: every import of a submodule runs it first."""
    key = _key(module)
    if key is None:
        return 0
    found = [i for i, layer in enumerate(layers) if key in layer]
    assert len(found) == 1, f"{module} ({key}) is in {len(found)} layers of the map"
    return found[0]


def test_the_table_lists_every_module_and_only_those() -> None:
    rows = _table()
    packages = {*PACKAGES, *_subpackages()}
    assert set(rows) == packages, "packages in the map's table != packages in the tree"
    for package in sorted(packages):
        assert rows[package] == _files(package), package


def test_every_module_is_in_one_layer() -> None:
    layers = _layers()
    for module in _modules():
        _layer_of(module, layers)


def test_imports_go_down_the_layers_only() -> None:
    layers = _layers()
    up = [f"{m} (layer {_layer_of(m, layers)}) imports {t} (layer {_layer_of(t, layers)})"
          for m, targets in _graph(_modules()).items() for t in targets
          if _layer_of(t, layers) > _layer_of(m, layers)]
    assert up == []


def test_the_checks_see_a_wrong_map() -> None:
    """The parsing finds rows and layers; a module missing from a layer is caught."""
    layers = _layers()
    assert len(layers) >= 5 and "kinds.py" in layers[0] and "omni_operator/" in layers[-1]
    assert "engine.py" in _table()["omnistage/orchestrator/"]
    without = [layer - {"kinds.py"} for layer in layers]
    with pytest.raises(AssertionError, match=r"omnistage\.kinds"):
        _layer_of("omnistage.kinds", without)
