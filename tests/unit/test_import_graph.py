"""No import cycles between our modules, counting every import statement: top-level, inside
functions and under TYPE_CHECKING, and the implicit import of each parent package (importing
`a.b.c` runs `a/__init__` and `a/b/__init__` first). A cycle hidden in a function, a type-only
import or a package's __init__ still ties the modules into one; the fix is to move the shared
piece, not to import lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"omnistage": ROOT / "runtime" / "omnistage",
            "omni_operator": ROOT / "operator" / "omni_operator"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [pkg, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _parents(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]: the packages whose __init__ runs before a.b.c does."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(path: Path, mods: dict[str, Path], importer: str | None = None) -> set[str]:
    """What the module at path imports. With importer (its dotted name), each import also counts
    the parent packages it initialises, except the importer's own ancestors: those are already
    running when the importer runs, so importing a sibling does not start them again."""
    found: set[str] = set()
    own = set(_parents(importer)) | {importer} if importer else set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` imports the submodule when there is one
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for n in names:
            if importer:
                found |= {a for a in _parents(n) if a in mods and a not in own}
            if n in mods:
                found.add(n)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    return {m: _imports(path, mods, m) - {m} for m, path in mods.items()}


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_parent_packages_count(tmp_path: Path) -> None:
    """A cycle that closes only through a package's __init__ is found (the one that tied the
    spec to the executors' package: spec -> executors.kinds, whose parent's __init__ imported
    executors.base, which imported the spec); a sibling import inside a package is not one."""
    files = {
        "pkg/spec.py": "from pkg.executors.kinds import get\n",
        "pkg/executors/__init__.py": "from pkg.executors.base import Executor\n",
        "pkg/executors/kinds.py": "",
        "pkg/executors/base.py": "import pkg.spec\nfrom pkg.executors.kinds import get\n",
        "pkg/other/__init__.py": "from pkg.other.a import A\n",
        "pkg/other/a.py": "from pkg.other.b import B\n",
        "pkg/other/b.py": "",
    }
    mods = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        mods[name] = path
    mods["pkg"] = tmp_path / "pkg" / "__init__.py"
    mods["pkg"].write_text("")
    assert _cycles(_graph(mods)) == [["pkg.executors", "pkg.executors.base", "pkg.spec"]]
    without_parents = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    assert _cycles(without_parents) == []  # what the test saw before it counted parents


def test_no_import_cycles() -> None:
    assert _cycles(_graph(_modules())) == []


def test_no_import_cycles_between_benches() -> None:
    """The bench scripts import each other by bare name (bench/ is on their sys.path); what two
    of them share lives in a third (bench_operator_scale and lws_baseline: write_counts)."""
    mods = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    graph = {m: _imports(path, mods) - {m} for m, path in mods.items()}
    assert graph["lws_baseline"] and graph["bench_operator_scale"]  # the finder sees bench imports
    assert _cycles(graph) == []


@pytest.mark.parametrize("module", ["omnistage.worker.server", "omnistage.worker.metrics",
                                    "omnistage.sideport", "omnistage.metrics",
                                    "omnistage.orchestrator.metrics", "omni_operator.main"])
def test_module_imports_on_its_own(module: str) -> None:
    """Each module imports first in a fresh interpreter (an order-dependent cycle would fail)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)
