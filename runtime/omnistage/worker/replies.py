"""What the worker sends back on its ROUTER socket, and the count of terminal replies by type.

Why apart: every part of the worker answers clients (intake refusals, chunks, control replies,
final outcomes); one place owns the socket's send errors, the lend-back on a failed send and the
reply counts that /metrics reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import zmq

from omnistage import protocol as p
from omnistage.zmqio import LoopSocket, Outbox

log = logging.getLogger("omnistage.worker")


class Replies:
    """Sends to one peer (a ROUTER identity). Used on the event loop only.

    To a client whose hello said it reads batches, what one turn of the loop sends it waits in
    that client's outbox and leaves at the turn's end as one message (protocol.Batch)."""

    def __init__(self) -> None:
        self.io: LoopSocket | None = None  # bound by StageWorker.serve
        self.outcomes: dict[str, int] = {}  # terminal replies by type, read by /metrics
        self._batching: set[bytes] = set()  # clients that read batches
        self._outboxes: dict[bytes, Outbox] = {}  # of those clients, once they were sent to

    def batching(self, ident: bytes, reads: bool) -> None:
        """What the client's (newest) hello said about batches."""
        if reads:
            self._batching.add(ident)
        else:
            self._forget(ident)

    def count(self, reply_type: str) -> None:
        self.outcomes[reply_type] = self.outcomes.get(reply_type, 0) + 1

    def reply(self, ident: bytes, reply: msgspec.Struct) -> None:
        """Send a terminal reply and count it by type (for /metrics)."""
        self.count(p.tag(reply))
        self.send(ident, reply)

    def send(self, ident: bytes, header: msgspec.Struct) -> None:
        try:
            frames = p.encode(header)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            log.exception("cannot encode a %s reply; dropped", p.tag(header))
            return
        self.send_frames(ident, frames)

    def send_frames(self, ident: bytes, frames: list[Any],
                    on_fail: Callable[[], None] | None = None) -> None:
        """Send encoded frames; ``on_fail`` runs when they never leave (the peer is gone)."""
        assert self.io is not None
        if ident in self._batching:
            box = self._outboxes.get(ident)
            if box is None:
                box = self._outboxes[ident] = Outbox(
                    self.io, partial(self._refused, ident), prefix=[ident])
            box.put(frames, on_fail)
            return
        try:
            self.io.send([ident, *frames], on_fail=on_fail)
        except zmq.ZMQError as exc:
            self._refused(ident, exc, on_fail)

    def _refused(self, ident: bytes, exc: zmq.ZMQError,
                 on_fail: Callable[[], None] | None) -> None:
        """The peer went away; its requests are its problem."""
        log.warning("dropping reply for gone peer %r: %s", ident, exc)
        self._forget(ident)
        if on_fail is not None:
            on_fail()

    def _forget(self, ident: bytes) -> None:
        self._batching.discard(ident)
        self._outboxes.pop(ident, None)
