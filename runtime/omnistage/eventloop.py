"""The event loop every Omnistage process runs on: uvloop where it is installed.

Why: the request path is loop-bound (a message is a few callbacks and a socket read or write),
and uvloop runs those callbacks and the HTTP transport at a fraction of the stdlib loop's cost
(docs/benchmarks.md, "The hot path"). OMNISTAGE_EVENT_LOOP=asyncio picks the stdlib loop, for
debugging or to compare.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "OMNISTAGE_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


class EventLoopError(ValueError):
    """OMNISTAGE_EVENT_LOOP names no loop this process can run."""


def loop_factory() -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop's name and factory for OMNISTAGE_EVENT_LOOP (auto: uvloop if importable)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise EventLoopError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise EventLoopError(f"{ENV}=uvloop but uvloop is not installed "
                                     "(pip install 'omnistage[runtime]')") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the chosen loop."""
    _, factory = loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
