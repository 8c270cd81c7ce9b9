"""Starting and stopping stage worker processes on this machine.

Each worker runs in its own process group and gets a parent-death signal, so no worker
outlives the process that started it, even when that parent is killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.tuning import worker_env

PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """Runs in the child before exec: own process group, and die with the parent."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class StartupError(RuntimeError):
    """A worker failed to start; the message names it and carries its log tail."""


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port_file: Path
    zmq: str = ""
    http: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self, timeout: float = 120.0, progress: Callable[[str], None] | None = None
    ) -> None:
        """Block until /readyz answers 200; raise StartupError with the log tail if it dies."""
        deadline = time.monotonic() + timeout
        last_note = 0.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartupError(
                    f"replica {self.name} exited with code {self.proc.returncode} during "
                    f"startup; log tail ({self.log_path}):\n{self.log_tail()}"
                )
            if not self.http and self.port_file.exists():
                info = json.loads(self.port_file.read_text())
                self.zmq, self.http = info["zmq"], info["http"]
            if self.http and http_ok(self.http + "/readyz"):
                return
            if progress and time.monotonic() - last_note > 5:
                progress(f"waiting for {self.name} to load its model...")
                last_note = time.monotonic()
            time.sleep(0.05)
        raise StartupError(
            f"replica {self.name} not ready after {timeout:.0f}s; log tail "
            f"({self.log_path}):\n{self.log_tail()}"
        )

    def terminate(self, grace: float = 30.0) -> int | None:
        """SIGTERM (the worker drains), then SIGKILL the group after the grace period."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (it is the group leader) and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def spawn_worker(
    name: str,
    args: Sequence[str],
    *,
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """Start `omnistage stage ARGS` as a child; returns at once (see wait_ready)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="omnistage-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    port_file = log_dir / f"{name}.ports.json"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "omnistage.cli", "stage", *args,
           "--replica-id", name, "--port-file", str(port_file)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **worker_env(), **(env or {})}, preexec_fn=_child_setup,
        )
    return WorkerProcess(name, proc, log_path, port_file)
