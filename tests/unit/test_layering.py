"""Dependency direction: the operator depends on the runtime, never the reverse; and the HTTP
layer's request parsing and stream pump never depend on the web framework (aiohttp).

`omnistage operator` still works: the operator registers it through the `omnistage.commands`
entry point, which the runtime's CLI discovers without naming the operator package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from omnistage.cli import COMMANDS_GROUP, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_MODULE = re.compile(r"^omni_operator(\.|:|$)")


def _references(source: str, module: re.Pattern[str], *, strings: bool
                ) -> list[tuple[int, str]]:
    """(line, name) of every import of a module matching `module`, at module level or inside a
    function, and with `strings` of every string naming one (importlib.import_module(...))."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        found += [(node.lineno, n) for n in names if module.match(n)]  # type: ignore[attr-defined]
    return found


def _operator_references(source: str) -> list[tuple[int, str]]:
    return _references(source, OPERATOR_MODULE, strings=True)


def test_runtime_never_imports_the_operator() -> None:
    files = sorted((ROOT / "runtime").rglob("*.py"))
    assert len(files) > 20  # the scan really covers the runtime package
    offenders = [f"{f.relative_to(ROOT)}:{line}: {name}"
                 for f in files for line, name in _operator_references(f.read_text())]
    assert offenders == [], "the runtime must not depend on omni_operator:\n" + "\n".join(offenders)


def test_the_scan_catches_lazy_and_dynamic_imports() -> None:
    source = ("import omni_operator\n"
              "def f():\n    from omni_operator.main import main\n"
              "import importlib\nimportlib.import_module('omni_operator.builders')\n"
              "x = 'omni_operators are fine'\n")
    assert _operator_references(source) == [
        (1, "omni_operator"), (3, "omni_operator.main"), (5, "omni_operator.builders")]


def _declared_commands() -> list[EntryPoint]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table = meta["project"]["entry-points"][COMMANDS_GROUP]
    return [EntryPoint(name, value, COMMANDS_GROUP) for name, value in table.items()]


def test_operator_command_is_registered_by_entry_point() -> None:
    declared = _declared_commands()
    assert [(ep.name, ep.value) for ep in declared] == [
        ("operator", "omni_operator.command:register"),
        ("drain", "omni_operator.replicas_cli:register_drain"),
        ("status", "omni_operator.replicas_cli:register_status")]
    args = build_parser(plugins=declared).parse_args(
        ["operator", "--kubeconfig", "/k", "--namespace", "a", "--namespace", "b",
         "--resync-seconds", "2"])
    assert (args.kubeconfig, args.namespace, args.resync_seconds) == ("/k", ["a", "b"], 2.0)
    assert args.handler.__module__ == "omni_operator.command"
    with pytest.raises(SystemExit):  # without the plugin there is no such command
        build_parser(plugins=[]).parse_args(["operator"])


def test_a_broken_plugin_fails_only_its_own_command(capsys) -> None:
    broken = EntryPoint("broken", "no_such_module_xyz:register", COMMANDS_GROUP)
    parser = build_parser(plugins=[broken])
    args = parser.parse_args(["broken"])
    assert args.handler(args) == 2
    assert "'broken' command failed to load (ModuleNotFoundError" in capsys.readouterr().err
    assert parser.parse_args(["models", "list"]).handler is not None  # the rest still works
    assert main(["models", "list"]) == 0


def test_drain_and_status_commands_come_from_the_operator_package() -> None:
    """`omnistage drain|status` are the operator's (they know the StagePool's retirement
    state); the runtime's CLI only finds them through the entry points."""
    parser = build_parser(plugins=_declared_commands())
    drain = parser.parse_args(["drain", "p-a-1", "--retire", "-n", "ns", "--no-wait"])
    assert (drain.replica, drain.mode, drain.namespace, drain.wait) == ("p-a-1", "retire", "ns",
                                                                      False)
    assert parser.parse_args(["drain", "p-a-1"]).mode == "replace"
    status = parser.parse_args(["status", "p"])
    assert status.pipeline == "p" and status.handler.__module__ == "omni_operator.replicas_cli"


# The HTTP layer's pure halves: body -> request (request_parsing) and the stream pump with its
# formats (http_streaming) work without the web framework, so they are tested without a server
# and the framework stays a detail of http_api.py.
FRAMEWORK_FREE = ("omnistage.orchestrator.request_parsing",
                  "omnistage.orchestrator.http_streaming")
AIOHTTP_MODULE = re.compile(r"^aiohttp(\.|$)")


def _aiohttp_imports(source: str) -> list[tuple[int, str]]:
    return _references(source, AIOHTTP_MODULE, strings=False)


def test_parsing_and_the_stream_pump_never_import_aiohttp() -> None:
    for module in FRAMEWORK_FREE:
        path = ROOT / "runtime" / Path(*module.split(".")).with_suffix(".py")
        assert _aiohttp_imports(path.read_text()) == [], path
    # Nor through what they import: in a fresh interpreter, importing them loads no aiohttp.
    code = ("import sys\n" + "".join(f"import {m}\n" for m in FRAMEWORK_FREE)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]", f"aiohttp loaded by {FRAMEWORK_FREE}: {out}"


def test_the_aiohttp_scan_catches_lazy_imports() -> None:
    source = "import aiohttp.web\ndef f():\n    from aiohttp import web\nx = 'aiohttp'\n"
    assert _aiohttp_imports(source) == [(1, "aiohttp.web"), (3, "aiohttp")]
