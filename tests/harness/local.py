"""Small helpers about this machine's processes and ports, shared by every test suite."""

from __future__ import annotations

import socket
from pathlib import Path


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
