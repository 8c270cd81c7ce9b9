"""The controller's work queue shares the event loop: reconciles that make no API call (a
converged fleet on resync) must not hold it."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_operator.controller import Controller


async def test_workers_yield_to_the_loop_between_reconciles() -> None:
    """A resync of a converged fleet: every reconcile returns without suspending. The /metrics
    handler, the watches and the probes run on the same loop and must get turns while the
    queue drains, not after it.

    Kills: removing the `await asyncio.sleep(0)` at the end of WorkQueue._worker's loop (the
    side task then first runs after all 2000 reconciles)."""
    class NoApi:  # the reconciles below make no call; stop() closes the client
        async def close(self) -> None:
            pass

    controller = Controller(api=NoApi(), workers=8)  # type: ignore[arg-type]
    done: list[Any] = []
    drained = asyncio.Event()

    async def converged(key: Any) -> None:  # no await: nothing to write
        done.append(key)
        if len(done) == 2000:
            drained.set()

    controller.reconcile = converged  # type: ignore[method-assign]
    for i in range(2000):
        controller.enqueue(("StagePool", "ns", f"pool-{i}"))
    seen_at: list[int] = []

    async def probe() -> None:
        for _ in range(5):
            seen_at.append(len(done))
            await asyncio.sleep(0)

    controller.start()
    try:
        await probe()
        await asyncio.wait_for(drained.wait(), 60)  # the queue still drains completely
    finally:
        await controller.stop()
    assert len(done) == 2000
    assert seen_at[-1] < 2000, f"the loop was held until the queue was empty: {seen_at}"
    assert seen_at == sorted(seen_at) and len(set(seen_at)) > 1, seen_at
