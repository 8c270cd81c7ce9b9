"""Starting stage worker processes on this machine and waiting until they are ready.

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
from dataclasses import dataclass
from pathlib import Path

from omnistage.spec import Stage
from omnistage.tuning import worker_env
from omnistage.worker.config import worker_args

PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """Runs in the child before exec: own process group, and die with the parent."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class StartupError(RuntimeError):
    """A worker failed to start: names the replica, says why, and carries its log tail."""

    aftermath = ""  # what the caller did about it, appended to the message

    def __init__(self, replica: str, reason: str, log_tail: str, log_path: Path) -> None:
        self.replica, self.reason = replica, reason
        self.log_tail, self.log_path = log_tail, log_path
        super().__init__(
            f"replica {replica} failed to start: {reason}{self.aftermath}.\n"
            f"log tail ({log_path}):\n{log_tail}"
        )


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port_file: Path
    zmq: str = ""
    http: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def startup_error(self, reason: str) -> StartupError:
        return StartupError(self.name, reason, self.log_tail(), self.log_path)

    def poll_ready(self) -> bool:
        """One non-blocking check: True once /readyz answers 200; StartupError if it exited."""
        code = self.proc.poll()
        if code is not None:
            raise self.startup_error(f"exited with code {code}")
        if not self.http and self.port_file.exists():
            info = json.loads(self.port_file.read_text())
            self.zmq, self.http = info["zmq"], info["http"]
        return bool(self.http) and http_ok(self.http + "/readyz")

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until /readyz answers 200; StartupError with the log tail if it never does."""
        wait_all_ready([self], timeout)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (it is the group leader) and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def wait_all_ready(
    workers: Sequence[WorkerProcess],
    timeout: float,
    *,
    on_ready: Callable[[WorkerProcess], None] | None = None,
    progress: Callable[[str], None] | None = None,
    note_every: float = 10.0,
) -> None:
    """Poll the workers until each answers /readyz, calling on_ready(w) as each gets there.

    Raises StartupError for the first that exits, or for the first still loading at the
    timeout; progress(msg) hears which ones are still loading every note_every seconds.
    """
    pending = list(workers)
    deadline = time.monotonic() + timeout
    last_note = time.monotonic()
    while pending:
        for w in list(pending):
            if w.poll_ready():
                pending.remove(w)
                if on_ready is not None:
                    on_ready(w)
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            raise pending[0].startup_error(f"not ready after {timeout:.0f}s")
        if progress is not None and now - last_note > note_every:
            progress("waiting for " + ", ".join(w.name for w in pending) + " to load...")
            last_note = now
        time.sleep(0.05)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def spawn_worker(
    name: str,
    stage: Stage,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
    append_log: bool = False,
) -> WorkerProcess:
    """Start replica name of stage as `omnistage stage` (worker_args); returns at once.

    It logs to <log_dir>/<name>.log (appended to with append_log, as a restart does, so the
    crash stays readable) and reports its bound addresses in <name>.ports.json; port 0 binds
    any free port. See wait_ready / wait_all_ready.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="omnistage-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    port_file = log_dir / f"{name}.ports.json"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "omnistage.cli",
           *worker_args(stage, replica_id=name, host=host, port=port, port_file=port_file)]
    with open(log_path, "ab" if append_log else "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **worker_env(), **(env or {})}, preexec_fn=_child_setup,
        )
    return WorkerProcess(name, proc, log_path, port_file)
