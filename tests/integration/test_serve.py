"""`omnistage serve` as a user runs it: real processes, real signals, the official openai client."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage.executors.echo import HOLD_FILE_ENV
from tests.harness.local import alive, free_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
READY = re.compile(r"ready at (http://\S+)")
ADMIN = re.compile(r"admin listener at (http://\S+)")




def wait_dead(pids: list[int], timeout: float = 60.0) -> list[int]:
    """Poll the process table until every pid is gone; returns the ones still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


class Serve:
    """One `omnistage serve` process; its stdout is collected by a thread."""

    def __init__(self, file: Path, log_dir: Path, cwd: Path, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.cli", "serve", str(file), "--port",
             str(port or free_port()), "--admin-port", str(free_port()), "--log-dir",
             str(log_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env={**os.environ, **(env or {})},  # the replicas inherit it
        )
        self.lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def wait(self, timeout: float) -> int:
        """Exit code, once the process has exited and all its output has been read."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := pattern.search(line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(f"no {pattern.pattern!r} in output:\n{self.output}")
                self._changed.wait(min(left, 0.5))

    def url(self, timeout: float = 120.0) -> str:
        return self.wait_for(READY, timeout).group(1)

    def admin_url(self, timeout: float = 120.0) -> str:
        """The admin listener's URL (control, /v1/load, /metrics), said before "ready at"."""
        return self.wait_for(ADMIN, timeout).group(1)

    def worker_pids(self) -> list[int]:
        """Worker pids, from the port files each worker writes."""
        return [json.loads(f.read_text())["pid"] for f in self.log_dir.glob("*.ports.json")]

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; workers still alive afterwards are
        killed too (a teardown never leaks a process)."""
        pids = self.worker_pids() if self.log_dir.exists() else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    def worker_state(self, replica: str) -> dict[str, Any]:
        """A replica's /state, at the side-port URL its port file names."""
        http = json.loads((self.log_dir / f"{replica}.ports.json").read_text())["http"]
        with urllib.request.urlopen(f"{http}/state", timeout=30) as resp:
            return dict(json.loads(resp.read()))


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """Start `omnistage serve`; every server and worker is killed at teardown."""
    started: list[Serve] = []

    def start(file: Path, cwd: Path | None = None, port: int | None = None,
              env: dict[str, str] | None = None) -> Serve:
        s = Serve(file, tmp_path / f"logs-{len(started)}", cwd or tmp_path, port, env)
        started.append(s)
        return s

    yield start
    for s in started:
        pids = s.worker_pids() if s.log_dir.exists() else []
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def post(url: str, body: dict[str, Any], timeout: float = 30) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_invalid_spec_exits_2_with_field_paths(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLES / "echo.yaml").read_text())
    doc["spec"]["stages"][1]["replicas"] = -1
    doc["spec"]["stages"][0]["finalOuput"] = True
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    out = subprocess.run([sys.executable, "-m", "omnistage.cli", "serve", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "spec.stages[1].replicas" in out.stderr
    assert "spec.stages[0].finalOuput" in out.stderr and "did you mean" in out.stderr


def test_taken_port_fails_cleanly_and_stops_the_replicas(serve) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        s = serve(EXAMPLES / "echo.yaml", port=busy.getsockname()[1])
        assert s.wait(60) == 1, s.output
    assert "cannot serve the API on 127.0.0.1" in s.output
    pids = s.worker_pids()
    assert len(pids) == 2 and wait_dead(pids) == []


def test_signals_drain_orchestrator_first_then_replicas(serve, tmp_path: Path) -> None:
    """SIGINT with a request inside stage a: the orchestrator drains it, then the replicas stop.

    Kills: replicas stopped before (or while) the orchestrator drains (the request fails), and
    a shutdown that does not wait for in-flight requests (no reply, or an error)."""
    # The echo replicas hold the request until the test creates the release file: it is in
    # flight when SIGINT lands, however slow the machine.
    release = tmp_path / "release"
    s = serve(EXAMPLES / "echo.yaml", env={HOLD_FILE_ENV: str(release)})
    url = s.url()
    pids = s.worker_pids()
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    result: dict[str, Any] = {}

    def in_flight() -> None:
        result["reply"] = post(f"{url}/v1/pipelines/echo/requests", {"prompt": "drain me"},
                               timeout=120)

    t = threading.Thread(target=in_flight)
    t.start()
    deadline = time.monotonic() + 60  # hang guard: the request reaches stage a in milliseconds
    while s.worker_state("echo-a-0")["in_flight"] < 1:
        assert time.monotonic() < deadline and t.is_alive(), ("never in stage a", result)
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGINT)
    s.wait_for(re.compile("SIGINT received"), 60)
    assert "reply" not in result  # still in flight when the shutdown began: it is drained
    s.proc.send_signal(signal.SIGINT)  # a second Ctrl-C is harmless
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(re.compile("ignored"), 60)
    assert "reply" not in result and s.proc.poll() is None  # the orchestrator still drains
    release.touch()
    t.join(120)
    # The orchestrator drained the in-flight request before the replicas were stopped.
    status, body = result["reply"]
    assert status == 200 and body["status"] == "ok", body
    assert body["children"][0]["outputs"]["b"]["fields"]["text"] == "drain me"
    assert s.wait(60) == 0, s.output
    assert "ignored" in s.output
    out = s.output
    assert out.index("orchestrator: stopped admitting") < out.index("stopping stage replicas")
    assert wait_dead(pids) == []


def test_kill_9_of_serve_leaves_no_worker(serve) -> None:
    s = serve(EXAMPLES / "echo.yaml")
    url = s.url()
    assert post(f"{url}/v1/pipelines/echo/requests", {"prompt": "x"})[0] == 200
    pids = s.worker_pids()
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    s.proc.kill()
    s.proc.wait()
    assert wait_dead(pids) == []  # PR_SET_PDEATHSIG took them down


def test_text_to_image_with_the_openai_client(serve, tmp_path: Path) -> None:
    """Acceptance: a clean checkout serves the example on the CPU; the openai client works."""
    openai = pytest.importorskip("openai")
    s = serve(EXAMPLES / "text-to-image.yaml", cwd=tmp_path)  # not the repo: no cwd reliance
    url = s.url(timeout=240)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["text-to-image"]

    chat = client.chat.completions.create(
        model="text-to-image", messages=[{"role": "user", "content": "Hello"}], max_tokens=6)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model="text-to-image", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy tiny model: same text streamed or not
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)

    img = client.images.generate(model="text-to-image", prompt="a red square", n=1,
                                 size="32x32", response_format="b64_json")
    png = base64.b64decode(img.data[0].b64_json or "")
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    pids = s.worker_pids()
    assert len(pids) == 3
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(90) == 0, s.output
    assert wait_dead(pids) == []
