"""Property-based fuzzing of the HTTP surfaces with schemathesis, against real processes.

Targets: the orchestrator of a live `omnistage serve` (every route of its /openapi.json, the
pipeline name supplied so the generic routes are reached), the chat and speech routes of a
second one whose pipeline speaks (listen -> tone, the test-only kinds of
tests/harness/speech_kinds.py: audio output, voices, image and audio input parts) and a stage
worker's side port
(/livez /readyz /metrics /state, documented by sideport.ops_document). The operator's side
port is fuzzed in tests/cluster/test_fuzz_operator.py (it needs the local control plane).

Every check schemathesis has is on (`--checks all`); the run must end with 0 failures and 0
errors. CI runs a bounded number of examples per operation with a fixed seed; a longer random
campaign runs locally with, for example:

    OMNISTAGE_FUZZ_EXAMPLES=300 OMNISTAGE_FUZZ_SEED=random \\
        python -m pytest tests/integration/test_fuzz_api.py -q -s

(-s shows schemathesis' report; a failure prints it either way, with the seed and a curl line
to replay each case). What is adjusted, and why, is written here and in
tests/harness/fuzz_hooks.py; nothing else is excluded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from omnistage.procs import spawn_worker
from omnistage.sideport import ops_document
from omnistage.spec import Stage
from tests.harness import speech_kinds
from tests.harness.local import ROOT, Proc, alive, free_port

pytest.importorskip("schemathesis")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

EXAMPLES = int(os.environ.get("OMNISTAGE_FUZZ_EXAMPLES", "20"))
_SEED = os.environ.get("OMNISTAGE_FUZZ_SEED", "20261130")
SEED: int | None = None if _SEED == "random" else int(_SEED)
HOOKS = "tests.harness.fuzz_hooks"
PIPELINE = "text-to-image"
_SUMMARY = re.compile(r"(\d+) generated, (\d+) (?:passed|found)")


def schemathesis(location: str, tmp_path: Path, *args: str, url: str | None = None,
                 parameters: dict[str, str] | None = None) -> tuple[int, str]:
    """`schemathesis run` with every check; returns (generated cases, report) and fails the
    test, with the report, unless every case passed and nothing errored.

    - `--workers 1`: with more, Hypothesis' lambda descriptions call ast.parse from several
      threads, which CPython 3.11 reports as "AST constructor recursion depth mismatch" (a
      schemathesis Runtime Error, not a finding about the server).
    - `--max-response-time 30`: a response slower than that is a failure; the cheapest valid
      request to the tiny models answers in well under a second, so this leaves a loaded
      two-core runner room without hiding a hang.
    """
    config = tmp_path / "schemathesis.toml"
    lines = ["[parameters]"] + [f"{json.dumps(k)} = {json.dumps(v)}"
                                for k, v in (parameters or {}).items()]
    config.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
           location, "--checks", "all", "--max-examples", str(EXAMPLES), "--workers", "1",
           "--max-response-time", "30", "--request-timeout", "60", "--no-color",
           "--generation-database", "none", *args]
    if url is not None:
        cmd += ["--url", url]
    if SEED is not None:
        cmd += ["--seed", str(SEED)]
    started = time.monotonic()
    # Run from tmp_path: schemathesis keeps a cache of crashes in its working directory.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=1100,
                         env={**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "PYTHONPATH": path})
    report = out.stdout + out.stderr
    took = time.monotonic() - started
    summary = _SUMMARY.search(report)
    assert out.returncode == 0 and summary, f"schemathesis exit {out.returncode}:\n{report}"
    generated, passed = int(summary.group(1)), int(summary.group(2))
    assert generated == passed and generated > 0, report
    tested = re.search(r"Selected: (\d+)/\d+\s+Tested: (\d+)", report)
    assert tested and tested.group(1) == tested.group(2), report  # no operation skipped
    for word in ("error", "failure", "warning"):
        assert not re.search(rf"\b\d+ {word}s?\b", report.rsplit("SUMMARY", 1)[-1]), report
    print(f"schemathesis {location}: {generated} cases, all passed, in {took:.0f}s")
    return generated, report


#: The admin listener (control, /v1/load, /metrics) of each served API URL.
ADMIN: dict[str, str] = {}


def _serve(tmp: Path, doc: dict) -> Iterator[str]:
    """`omnistage serve` of doc until the generator is closed; every process stopped after.
    Yields the API's URL; ADMIN[url] is its admin listener's."""
    spec = tmp / "pipeline.yaml"
    spec.write_text(yaml.safe_dump(doc))
    logs = tmp / "logs"
    proc = Proc(["serve", str(spec), "--port", str(free_port()), "--admin-port",
                  str(free_port()), "--log-dir", str(logs)],
                tmp / "serve.log")
    try:
        url = proc.wait_for(r"ready at (http://\S+)", timeout=400).group(1)
        ADMIN[url] = proc.wait_for(r"admin listener at (http://\S+)", timeout=10).group(1)
        yield url
    finally:
        pids = [json.loads(f.read_text())["pid"] for f in logs.glob("*.ports.json")]
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)  # the orderly stop: replicas go too
            try:
                proc.proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.stop()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`omnistage serve` of the text-to-image example (one replica per stage, to spare the
    CPU): an AR stage and a diffusion stage, so chat, images and the generic routes all run
    real models."""
    doc = yaml.safe_load((ROOT / "examples/text-to-image.yaml").read_text())
    for stage in doc["spec"]["stages"]:
        stage["replicas"] = 1
    yield from _serve(tmp_path_factory.mktemp("fuzz-serve"), doc)


@pytest.fixture(scope="module")
def served_speech(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`omnistage serve` of listen -> tone: chat with audio and media parts, and speech."""
    with speech_kinds.kinds_env():
        server = _serve(tmp_path_factory.mktemp("fuzz-speech"),
                        speech_kinds.manifest("speak", True))
        url = next(server)  # the server (and its workers) started inside the block
    yield url
    server.close()


def test_fuzz_orchestrator_api(served: str, tmp_path: Path) -> None:
    """Every route of the public listener, with the pipeline name supplied for the generic
    route; then the admin listener's routes but control."""
    _, report = schemathesis(f"{served}/openapi.json", tmp_path,
                             parameters={"path.name": PIPELINE})
    assert "Missing test data" not in report, report  # the generic route got past its path
    (tmp_path / "admin").mkdir()
    schemathesis(f"{ADMIN[served]}/openapi.json", tmp_path / "admin", "--exclude-operation-id",
                 "pipeline_control")


def test_fuzz_orchestrator_control(served: str, tmp_path: Path) -> None:
    """The control route on its own, after the other routes: pause and sleep (which it must
    be able to send) stop the stages, so every request sent after them would wait for its
    deadline. Run last on the module's server for that reason, not excluded."""
    _, report = schemathesis(
        f"{ADMIN[served]}/openapi.json", tmp_path, "--include-operation-id",
        "pipeline_control", parameters={"path.name": PIPELINE})
    assert "Missing test data" not in report, report


def test_fuzz_speech_routes(served_speech: str, tmp_path: Path) -> None:
    """The routes whose bodies carry audio, voices and media parts, on a pipeline that takes
    them all (the text-to-image one refuses them in its document, fuzzed above)."""
    schemathesis(f"{served_speech}/openapi.json", tmp_path, "--include-operation-id",
                 "chat_completions", "--include-operation-id", "audio_speech",
                 "--include-operation-id", "list_models")


def test_fuzz_worker_side_port(tmp_path: Path) -> None:
    """A stage worker's side port, from the document of the routes sideport serves."""
    stage = Stage.model_validate({"name": "echo", "kind": "echo"})
    worker = spawn_worker("fuzz-echo-0", stage, port=0, log_dir=tmp_path)
    try:
        worker.wait_ready(180)
        doc = tmp_path / "sideport.json"
        doc.write_text(json.dumps(ops_document(state=True, title="stage worker side port")))
        schemathesis(str(doc), tmp_path, url=worker.http)
    finally:
        worker.kill()
