"""Small helpers about this machine's processes and ports, shared by every test suite."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """True while pid is a live process; a zombie awaiting its reaper runs nothing, so is dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Proc:
    """An `omnistage` command run from the repository root; its output goes to a file the test
    can search."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "omnistage.cli", *args],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         stdin=subprocess.DEVNULL)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            if m := re.search(pattern, self.output):
                return m
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} (rc={self.proc.poll()}):\n{self.output}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
