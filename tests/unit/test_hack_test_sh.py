"""hack/test.sh's side_by_side (the CI's steps): each step's time and outcome reach the summary,
and the first step that fails stops the others at once, SIGINT first so that pytest can tear
its control planes down. The functions are sourced from the real script and run on small
shell steps, so the test runs in a second."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "test.sh"


def _functions(tmp_path: Path) -> Path:
    """The script's definitions (from `started=` up to its first phase), without running it."""
    lines = SCRIPT.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("started=$SECONDS"))
    end = next(i for i, line in enumerate(lines) if line.startswith('phase "installing'))
    out = tmp_path / "functions.sh"
    out.write_text("".join(lines[start:end]))
    return out


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "run.sh"
    script.write_text(f"set -euo pipefail\nsource {_functions(tmp_path)}\n{body}\n")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    return proc, time.monotonic() - t0


def test_steps_run_at_once_and_each_reaches_the_summary(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, """
phase "both"
side_by_side --stream "first=sleep 1; echo streamed-line" "second=sleep 1; echo logged-line"
""")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.index("second: started") < out.index("streamed-line")  # started together
    assert "---- second (passed in" in out and "logged-line" in out
    assert out.index("streamed-line") < out.index("logged-line")  # the log after the stream
    summary = out[out.index("==> summary"):]
    assert "ok" in summary and "step first" in summary and "step second" in summary
    assert "hack/test.sh: all phases passed" in out


def test_a_failed_step_stops_the_others_with_sigint_and_is_named(tmp_path: Path) -> None:
    marker = tmp_path / "interrupted"
    proc, took = _run(tmp_path, f"""
phase "set-up"
side_by_side --stream "tests=python3 -c 'import time
try:
    time.sleep(40)
except KeyboardInterrupt:
    open(\\"{marker}\\", \\"w\\").write(\\"torn down\\")'" \\
  "images=sleep 0.5; echo canary said no; exit 7"
echo "never reached"
""")
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert took < 30  # the 40 s step was stopped, not waited out (far guard)
    assert marker.read_text() == "torn down"  # SIGINT reached python: its teardown ran
    assert "never reached" not in proc.stdout
    assert "canary said no" in proc.stdout  # the failed step's log is shown
    assert 'step "images" failed (exit 7); stopping tests' in proc.stderr
    summary = proc.stdout[proc.stdout.index("==> summary"):]
    assert "FAILED (exit 7)" in summary and "step images" in summary
    assert "stopped" in summary and "step tests" in summary
    assert 'FAILED in phase "set-up", step "images" (exit 7)' in proc.stderr
