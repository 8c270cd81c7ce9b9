"""StageIO, the executor's side of streaming between stages: the window, credits, fed inputs."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from omnistage.admission import DeadlineExceeded, ExecutionCancelled, ExecutionContext
from omnistage.executors.base import BadRequest, InputChunk, StageIO


def producer(window: int, ctx: ExecutionContext | None = None
             ) -> tuple[StageIO, list[tuple[int, str | None, dict[str, Any]]]]:
    sent: list[tuple[int, str | None, dict[str, Any]]] = []
    return StageIO(ctx, send_chunk=lambda *c: sent.append(c), window=window), sent


def test_emit_chunk_does_nothing_when_the_output_does_not_stream() -> None:
    io = StageIO.of(lambda fields: None)
    assert not io.streams_output and not io.fed
    io.emit_chunk(text="x")  # no downstream: the outcome carries everything
    assert io.sent == 0 and list(io.inputs()) == []


def test_a_full_window_blocks_until_credit() -> None:
    io, sent = producer(window=2)
    io.emit_chunk(text="a")
    io.emit_chunk(text="b")
    third = threading.Thread(target=io.emit_chunk, kwargs={"text": "c"})
    third.start()
    third.join(0.2)
    assert third.is_alive() and [s[0] for s in sent] == [1, 2]  # held: two out, window two
    io.credit(1)
    third.join(5)
    assert not third.is_alive() and [s[:2] for s in sent] == [(1, "a"), (2, "b"), (3, "c")]
    assert (io.peak_outstanding, io.window_waits) == (2, 1)
    io.credit(1)  # older and repeated credits change nothing
    io.credit(99)  # nor does credit for chunks never sent
    assert io.acked == 3


@pytest.mark.parametrize(("end", "error"), [("cancel", ExecutionCancelled),
                                            ("deadline", DeadlineExceeded)])
def test_a_request_that_ends_while_waiting_for_credit_raises(end: str, error: type) -> None:
    ctx = ExecutionContext.with_timeout(0.1 if end == "deadline" else None)
    io, _ = producer(window=1, ctx=ctx)
    io.emit_chunk(text="a")
    if end == "cancel":
        threading.Timer(0.05, ctx.cancel).start()
    with pytest.raises(error):
        io.emit_chunk(text="b")


def test_fed_inputs_come_in_order_credit_each_and_end_after_the_last() -> None:
    taken: list[int] = []
    io = StageIO(fed=True, consumed=taken.append)
    assert io.feed(InputChunk(1, "a"), last=False)
    assert not io.feed(InputChunk(1, "a"), last=False)  # a repeat is dropped
    got: list[str | None] = []

    def consume() -> None:
        got.extend(c.text for c in io.inputs())

    reader = threading.Thread(target=consume)
    reader.start()
    assert io.feed(InputChunk(2, "b"), last=False)
    assert io.feed(InputChunk(3), last=True)  # a bare end of input
    reader.join(5)
    assert got == ["a", "b"] and taken == [1, 2]
    assert not io.feed(InputChunk(4, "late"), last=False)  # after the last


def test_a_sender_that_ignores_its_credits_fails_the_request() -> None:
    io = StageIO(fed=True, max_waiting=2)
    for seq in (1, 2, 3):
        io.feed(InputChunk(seq, "x"), last=False)
    with pytest.raises(BadRequest, match="feed: more than 2 chunks waiting"):
        list(io.inputs())


def test_waiting_for_input_stops_when_the_request_is_cancelled() -> None:
    ctx = ExecutionContext()
    io = StageIO(ctx, fed=True)
    threading.Timer(0.05, ctx.cancel).start()
    with pytest.raises(ExecutionCancelled):
        next(iter(io.inputs()))
