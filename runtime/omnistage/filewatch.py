"""Files a process reads again when they change: one file, or a Secret-shaped directory.

Why one module: the API keys (orchestrator/auth.py) and the CurveZMQ keyring (curve_keys.py)
both follow a mounted Secret, which a kubelet updates by swapping a hidden `..data` symlink (the
visible entries are symlinks into it). Both look for a change the same way: the visible files'
(name, mtime, size, inode), followed through the symlinks, at most once per interval, on a call
(no timer, no thread). Stdlib only: the operator image imports curve_keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["Signature", "Throttle", "signature", "visible_files"]

Signature = tuple[tuple[str, int, int, int], ...]


def visible_files(path: Path) -> list[Path]:
    """The file itself, or a directory's visible regular files, sorted (a Secret volume's
    `..data` and timestamped folders are hidden; its entries are followed to the files)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
    return [path]


def signature(files: Iterable[Path]) -> Signature:
    """What changes when any of the files does (an atomic swap changes the inode too)."""
    out = []
    for f in files:
        st = f.stat()  # follows a Secret volume's symlinks to the file in force
        out.append((f.name, st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class Throttle:
    """due() is true at most once per `interval` seconds of `clock` (first: after one)."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._looked = clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self._looked < self.interval:
            return False
        self._looked = now
        return True
