"""No import cycles between our modules, counting every import statement: top-level, inside
functions and under TYPE_CHECKING. A cycle hidden in a function or a type-only import still ties
two modules into one; the fix is to move the shared piece, not to import lazily."""

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


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` imports the submodule when there is one
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found |= {n for n in names if n in mods}
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


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _imports(path, mods) - {m} for m, path in mods.items()}
    assert _cycles(graph) == []


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
