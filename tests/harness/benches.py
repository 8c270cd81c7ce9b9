"""Import a bench/ module in a unit test: the benches import each other by bare name, so
bench/ is on sys.path while one is imported, and only then."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py as a module (imported once; later calls return the same module)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
