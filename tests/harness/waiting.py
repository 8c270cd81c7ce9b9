"""Waits on observable state for the unit and integration suites.

A test waits for the thing it needs (a worker's /state, a membership event, a process exit),
never for a wall-clock window. The timeout only bounds a hang: it is far from both the expected
and the wrong behaviour, so a loaded machine cannot make a passing test fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

HANG_GUARD = 60.0
"""Seconds: what every wait here allows by default (the thing waited for takes milliseconds)."""


def wait(pred: Callable[[], T], what: str = "the condition", timeout: float = HANG_GUARD,
         interval: float = 0.02) -> T:
    """Poll `pred` until it returns a truthy value (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
    return value


async def until(pred: Callable[[], Any], what: str = "the condition", timeout: float = HANG_GUARD,
                interval: float = 0.01) -> Any:
    """`wait` for state the running event loop updates (it keeps running meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := pred()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)
    return value
