"""`omnistage drain` and `omnistage status` answer a person: no library INFO line before their
own output unless -v. Run as the CLI runs (a subprocess through `omnistage`'s entry point)
against a stand-in API server on loopback that answers the calls a drain makes."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnistage import kube

ROOT = Path(__file__).resolve().parents[2]
POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "p-a-1", "namespace": "ns", "uid": "u1",
                    "labels": {kube.LABEL_POOL: "p-a", kube.LABEL_ORDINAL: "1"}}}
POOL = {"apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
        "metadata": {"name": "p-a", "namespace": "ns", "resourceVersion": "7"},
        "spec": {"pipeline": "p", "replicas": 2,
                 "stage": {"name": "a", "kind": "echo", "finalOutput": True}}}


class _Api(http.server.BaseHTTPRequestHandler):
    """GET the pod and its pool; PATCH the pool (the retirement): all a `drain --no-wait` does."""

    def _answer(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200 if body.get("kind") != "Status" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.endswith("/pods/p-a-1"):
            return self._answer(POD)
        if self.path.endswith("/stagepools/p-a"):
            return self._answer(POOL)
        self._answer({"kind": "Status", "code": 404, "reason": "NotFound", "message": self.path})

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(POOL)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({  # JSON is YAML
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "ns"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    }))
    yield path
    server.shutdown()
    server.server_close()


def _drain(kubeconfig: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "runtime"), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")])}
    env.pop("OMNISTAGE_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "drain", "p-a-1", "--no-wait",
         "--kubeconfig", str(kubeconfig), *extra],
        capture_output=True, text=True, timeout=120, env=env, check=False)


def test_drain_prints_only_its_own_lines_unless_verbose(kubeconfig: Path) -> None:
    """Kills: the CLI's INFO default reaching the API client's write log (the drain printed
    `INFO omnistage.kubeapi.writes: PATCH ...` before its own line), and -v not bringing it
    back."""
    quiet = _drain(kubeconfig)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.startswith("p-a-1: replacing"), quiet.stdout
    assert quiet.stderr == "", quiet.stderr
    verbose = _drain(kubeconfig, "-v")
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stdout == quiet.stdout
    assert "INFO omnistage.kubeapi.writes: PATCH /apis/omnistage.io/" in verbose.stderr, \
        verbose.stderr
