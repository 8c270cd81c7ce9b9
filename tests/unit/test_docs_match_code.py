"""Docs that name a flag, a version or a path say what the code has: a newcomer copies them."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

from omnistage.protocol import PROTOCOL_VERSION
from omnistage.worker.config import add_arguments

ROOT = Path(__file__).resolve().parents[2]


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end != -1 else None]


def test_readme_names_only_flags_omnistage_stage_has() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    known = {flag for action in parser._actions for flag in action.option_strings}
    section = _section((ROOT / "README.md").read_text(), "## Running one stage replica")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", section))
    assert {"--stage-json", "--port"} <= named  # the section is the one that lists the flags
    assert named - known == set()


def test_protocol_doc_states_the_current_version() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    assert f"Protocol version: **{PROTOCOL_VERSION}**" in doc
    # The worker's version_mismatch message as the doc quotes it names the worker's version.
    spoken = re.findall(r"replica R\s+speaks version (\d+)", doc)
    assert spoken == [str(PROTOCOL_VERSION)]


def test_ruff_excludes_only_folders_that_exist() -> None:
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    for folder in ruff.get("exclude", []) + ruff.get("extend-exclude", []):
        assert (ROOT / folder).exists(), folder
