"""orchestrator.tasks.Mailbox: a request's events, in order, for its one reader."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.orchestrator.requests import Outcome
from omnistage.orchestrator.tasks import Mailbox


def _outcome(n: int) -> Outcome:
    return Outcome(request_id=f"r{n}", status="ok")


async def test_events_come_out_in_order_and_a_waiting_reader_wakes() -> None:
    box = Mailbox()
    assert box.empty()
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()
    box.put_nowait(first := _outcome(1))
    assert await box.get() is first
    reader = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)  # the reader is parked on its waiter
    assert not reader.done()
    box.put_nowait(second := _outcome(2))
    box.put_nowait(third := _outcome(3))
    assert await asyncio.wait_for(reader, 5) is second
    assert box.get_nowait() is third and box.empty()


async def test_a_cancelled_reader_leaves_no_waiter_and_a_second_reader_is_refused() -> None:
    box = Mailbox()
    reader = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one reader"):
        await box.get()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    box.put_nowait(event := _outcome(4))  # nobody waits: it stays queued
    assert await asyncio.wait_for(box.get(), 5) is event
