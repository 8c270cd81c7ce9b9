"""What the worker sends back on its ROUTER socket, and the count of terminal replies by type.

Why apart: every part of the worker answers clients (intake refusals, chunks, control replies,
final outcomes); one place owns the socket's send errors, the lend-back on a failed send and the
reply counts that /metrics reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from omnistage import protocol as p

log = logging.getLogger("omnistage.worker")


class Replies:
    """Sends to one peer (a ROUTER identity). Used on the event loop only."""

    def __init__(self) -> None:
        self.sock: zmq.asyncio.Socket | None = None  # bound by StageWorker.serve
        self.outcomes: dict[str, int] = {}  # terminal replies by type, read by /metrics

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
        assert self.sock is not None
        try:
            fut = self.sock.send_multipart([ident, *frames], copy=False)
        except zmq.ZMQError as exc:  # the peer went away; its requests are its problem
            log.warning("dropping reply for gone peer %r: %s", ident, exc)
            if on_fail is not None:
                on_fail()
            return
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(partial(_log_send_failure, on_fail=on_fail))


def _log_send_failure(fut: asyncio.Future[Any], on_fail: Callable[[], None] | None) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("reply not delivered: %s", fut.exception())
        if on_fail is not None:
            on_fail()
