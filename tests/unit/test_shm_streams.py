"""Streamed chunks and shared memory (issue 37, defect 3), without processes: a chunk's block
goes back to its upstream once the downstream credits it (a copy stays for a resend after
failover), and a sender with patience stops waiting for room and sends frames instead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from omnistage import protocol as p
from omnistage import shm as S
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.orchestrator.streams import Streams
from omnistage.orchestrator.tasks import Child, Request, Stream, Task
from tests.harness.waiting import HANG_GUARD, until
from tests.unit.test_shm import manager
from tests.unit.test_shm import shm_dir as shm_dir  # the fixture

MiB = 1 << 20


@pytest.fixture
def managers() -> Iterator[list[S.SegmentManager]]:
    made: list[S.SegmentManager] = []
    yield made
    for m in made:
        m.close()


# ---- patience: frames after a short wait -----------------------------------------------------


async def test_a_patient_sender_goes_as_frames_instead_of_waiting_on_others(managers,
                                                                            shm_dir) -> None:
    m = manager(managers, shm_dir, cap_bytes=MiB)
    x = np.ones(MiB, np.uint8)
    held = m.try_place(x)  # someone else's block fills the segment
    deadline = time.monotonic() + HANG_GUARD
    patient = await asyncio.wait_for(m.place(x, deadline=deadline, patience=0.05), HANG_GUARD)
    assert patient is None  # frames, long before its deadline
    assert m.stats()["fallbacks"] == 1 and m.stats()["waits"] == 1
    # Patience never outlives the deadline: that still ends the wait with TimeoutError.
    with pytest.raises(TimeoutError, match="no room in shared memory"):
        await m.place(x, deadline=time.monotonic() + 0.05, patience=HANG_GUARD)
    # A sender without patience still waits (back-pressure for whole outputs), first in line,
    # and a patient one behind it gives up without taking the room that comes back.
    waiter = asyncio.ensure_future(m.place(x))
    await until(lambda: m.stats()["waits"] == 3 or waiter.done(), "the sender waiting")
    assert await m.place(x, patience=0.05) is None and not waiter.done()
    m.free([held.shm.lease])
    placed = await asyncio.wait_for(waiter, HANG_GUARD)
    assert placed is not None and m.segment.live == 1


# ---- the orchestrator: a credited chunk's block goes back -------------------------------------


class _Channel:
    def __init__(self, copies_fed: bool = True) -> None:
        self.sent: list[tuple[Any, dict[str, p.WireTensor]]] = []
        self.peer = p.HelloReply(version=p.PROTOCOL_VERSION, replica="r", stage="s",
                                 kind="echo", incarnation="i1", copies_fed=copies_fed)

    def send(self, header: Any, tensors: dict[str, p.WireTensor] | None = None) -> None:
        self.sent.append((header, dict(tensors or {})))


def _replica(name: str, copies_fed: bool = True) -> Any:
    return SimpleNamespace(name=name, incarnation="i1", channel=_Channel(copies_fed),
                           alive=True)


def _stream(managers: list[S.SegmentManager], shm_dir: Path, window: int,
            copies_fed: bool = True) -> tuple[Any, ...]:
    """An upstream worker lending to the orchestrator, one request whose stage a streams to b
    (tasks up and down, running), and the orchestrator's Streams over them."""
    worker = manager(managers, shm_dir)  # the upstream replica: it lends chunk tensors
    orch = manager(managers, shm_dir)
    worker.verify(orch.probe())
    orch.attach_lender(worker.name, worker.free)  # releases reach the lender at once
    request = Request("r", PipelineRequest(prompt="x"), ["b"], ["a", "b"], set(),
                      time.monotonic() + 60)
    child = Child(request, 0)
    stream = child.streams["a"] = Stream("a", "b", window=window)
    up = Task("r/0/a", child, "a", replica=_replica("up"))
    down = Task("r/0/b", child, "b", fed=stream, replica=_replica("down", copies_fed))
    child.running = {("a", False): up, ("b", False): down}
    child.started = {("a", False), ("b", False)}
    streams = Streams({"late_messages": 0}, {up.wire_id: up, down.wire_id: down},
                      release=orch.release, start=lambda *a: None, fail=lambda *a: None)
    return worker, orch, request, stream, up, down, streams


def test_a_credited_chunk_gives_its_block_back_and_stays_for_a_resend(managers,
                                                                     shm_dir) -> None:
    worker, orch, request, _, up, down, streams = _stream(managers, shm_dir, window=4)

    sent = [np.full(4096, seq, np.uint8) for seq in (1, 2, 3)]
    for seq, data in enumerate(sent, 1):
        lent = worker.try_place(data, borrower=orch.name)
        assert lent is not None
        streams.on_chunk(up, p.Message(p.Chunk(id=up.wire_id, seq=seq), {"x": lent},
                                       lender=worker.name))
    assert worker.segment.live == 3 and len(down.replica.channel.sent) == 3  # fed as handles

    streams.on_credit(down, p.Credit(id=down.wire_id, seq=2))
    assert worker.segment.live == 1  # chunks 1 and 2 went back at their credit, not the end
    assert [h.seq for h, _ in up.replica.channel.sent] == [2]  # the upstream's window opens
    # A resent downstream (failover) is fed every chunk again: the credited ones from memory
    # (frames), the other as its handle, every byte as sent.
    again = _replica("again")
    streams.resend(down, again)
    fed = again.channel.sent
    assert [h.seq for h, _ in fed] == [1, 2, 3]
    assert [t["x"].shm is None for _, t in fed] == [True, True, False]
    for (_, t), data in zip(fed, sent, strict=True):
        assert bytes(t["x"].numpy()) == data.tobytes()
    # The request's end gives back what is left, once: nothing leaks, nothing is freed twice.
    for msg in request.held:
        orch.release(msg)
    assert worker.segment.live == 0 and not worker.stats()["lent"]
    streams.on_credit(down, p.Credit(id=down.wire_id, seq=3))  # a late credit: nothing left
    assert worker.segment.live == 0


def test_a_credit_never_gives_back_a_chunk_not_yet_taken(managers, shm_dir: Path) -> None:
    """Only chunks up to the credited seq go back, whatever else the stream holds."""
    worker, orch, request, stream, up, down, streams = _stream(managers, shm_dir, window=8)
    for seq in range(1, 6):
        lent = worker.try_place(np.zeros(4096, np.uint8), borrower=orch.name)
        streams.on_chunk(up, p.Message(p.Chunk(id=up.wire_id, seq=seq), {"x": lent},
                                       lender=worker.name))
    for credit, live in ((1, 4), (1, 4), (0, 4), (4, 1)):  # repeats and older credits: no-ops
        streams.on_credit(down, p.Credit(id=down.wire_id, seq=credit))
        assert worker.segment.live == live, credit
    assert [m.tensors["x"].shm is None for m in stream.chunks] == [True] * 4 + [False]
    for msg in request.held:
        orch.release(msg)
    assert worker.segment.live == 0


def test_a_downstream_that_reads_fed_blocks_in_place_keeps_them_lent(managers,
                                                                     shm_dir: Path) -> None:
    """A worker whose hello does not say copies_fed (an older one, in a rollout) may still be
    reading a credited chunk's block: its credit opens the window but gives nothing back."""
    worker, orch, request, _, up, down, streams = _stream(managers, shm_dir, window=8,
                                                          copies_fed=False)
    for seq in (1, 2):
        lent = worker.try_place(np.zeros(4096, np.uint8), borrower=orch.name)
        streams.on_chunk(up, p.Message(p.Chunk(id=up.wire_id, seq=seq), {"x": lent},
                                       lender=worker.name))
    streams.on_credit(down, p.Credit(id=down.wire_id, seq=2))
    assert [h.seq for h, _ in up.replica.channel.sent] == [2]  # the window opens
    assert worker.segment.live == 2  # but both blocks stay lent until the request ends
    for msg in request.held:
        orch.release(msg)
    assert worker.segment.live == 0
