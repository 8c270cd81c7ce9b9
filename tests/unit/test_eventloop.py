"""omnistage.eventloop: which loop a process runs, and a bad choice refused in one line."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from omnistage import eventloop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(("value", "module"), [
    (None, "uvloop"), ("auto", "uvloop"), ("UVLOOP", "uvloop"), (" asyncio ", "asyncio")])
def test_run_uses_the_loop_the_variable_picks(
        monkeypatch: pytest.MonkeyPatch, value: str | None, module: str) -> None:
    pytest.importorskip("uvloop")
    if value is None:
        monkeypatch.delenv(eventloop.ENV, raising=False)
    else:
        monkeypatch.setenv(eventloop.ENV, value)
    name, _ = eventloop.loop_factory()
    assert name == module
    assert eventloop.run(_loop_module()).split(".")[0] == module


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    monkeypatch.setenv(eventloop.ENV, "auto")
    assert eventloop.loop_factory()[0] == "asyncio"
    assert eventloop.run(_loop_module()) == "asyncio.unix_events"
    monkeypatch.setenv(eventloop.ENV, "uvloop")
    with pytest.raises(eventloop.EventLoopError, match="uvloop is not installed"):
        eventloop.loop_factory()


def test_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "trio")
    with pytest.raises(eventloop.EventLoopError,
                       match=r"OMNISTAGE_EVENT_LOOP='trio': expected one of auto, uvloop, asyncio"):
        eventloop.loop_factory()


def test_the_cli_refuses_a_bad_value_in_one_line_before_any_work() -> None:
    out = subprocess.run([sys.executable, "-m", "omnistage.cli", "validate", "/nonexistent.yaml"],
                         env={"OMNISTAGE_EVENT_LOOP": "nope", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: OMNISTAGE_EVENT_LOOP='nope': expected one of auto, "
                                  "uvloop, asyncio"), out.stderr
