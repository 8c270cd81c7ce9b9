"""A ZMQ socket driven straight from the event loop: non-blocking reads and sends, no futures.

Why not zmq.asyncio: on the request path every message pays for its futures and callbacks,
about a third of what handling the message costs (issue 42's profile, docs/benchmarks.md). This
watches the socket's file descriptor with the loop and reads until the socket is empty; sends
are non-blocking calls that keep their order.

The one subtlety: a ZMQ descriptor is edge-like. It signals that the socket's state changed,
and any call on the socket (a send too) may consume that signal while processing the socket's
pending commands, leaving messages that no signal announces. So after every send a read is
scheduled for the loop's next turn (at most one pending), and nothing that arrived waits for a
signal that never comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from omnistage import protocol as p

log = logging.getLogger("omnistage.zmqio")


class LoopSocket:
    """One ZMQ socket (a shadow of `underlying`, so the owner keeps closing it) on the loop.

    on_readable: called when messages may be waiting; it reads with recv(), which returns None
    once the socket is empty. send() sends at once; what the socket cannot take now (EAGAIN)
    waits in order in a backlog sent as the socket takes it. A send the socket refuses
    otherwise (ZMQError: ROUTER_MANDATORY's unknown peer) raises to the caller.
    """

    def __init__(self, underlying: Any, on_readable: Callable[[], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.sock = zmq.Socket.shadow(underlying)
        self._on_readable = on_readable
        self.loop = self._loop = loop or asyncio.get_running_loop()
        self._fd = self.sock.FD
        self._pending = False
        self._backlog: list[tuple[list[Any], Callable[[], None] | None]] = []
        self.closed = False
        self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        self._pending = False
        if not self.closed:
            self._on_readable()

    def read_soon(self) -> None:
        """Have on_readable run on the loop's next turn (once, however often asked)."""
        if not self._pending and not self.closed:
            self._pending = True
            self._loop.call_soon(self._readable)

    def recv(self, copy: bool = False) -> list[Any] | None:
        """The next message's frames, or None when none is waiting."""
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return None

    def send(self, frames: list[Any], on_fail: Callable[[], None] | None = None) -> None:
        """Send now, or after what waits before it. on_fail: run if a waiting message can
        never leave (the socket closed first, or refused it)."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        if not self._backlog:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            else:
                self.read_soon()
                return
        self._backlog.append((frames, on_fail))
        if len(self._backlog) == 1:
            self._loop.add_writer(self._fd, self._send_backlog)

    def _send_backlog(self) -> None:
        while self._backlog and not self.closed:
            frames, on_fail = self._backlog[0]
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.read_soon()
                return
            except zmq.ZMQError as exc:
                log.warning("dropping a queued message: %s", exc)
                if on_fail is not None:
                    on_fail()
            self._backlog.pop(0)
        self._loop.remove_writer(self._fd)
        self.read_soon()

    @property
    def waiting(self) -> int:
        """Messages in the backlog (sent once the socket takes them)."""
        return len(self._backlog)

    def close(self) -> None:
        """Stop watching the socket (the owner closes it); a backlog left is given up."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        for _, on_fail in self._backlog:
            if on_fail is not None:
                on_fail()
        self._backlog.clear()


class Outbox:
    """What one turn of the loop sends one peer that reads batches: it leaves at the turn's end
    as one message (protocol.batch). prefix: frames sent before each message (a ROUTER's peer
    identity). on_error: told when the socket refuses a message, with the message's on_fail
    (which it runs), so the owner decides what a refused peer means."""

    def __init__(self, io: LoopSocket, on_error: Callable[[zmq.ZMQError,
                                                          Callable[[], None] | None], None],
                 prefix: list[Any] | None = None) -> None:
        self.io = io
        self.prefix = prefix or []
        self.on_error = on_error
        self._queued: list[tuple[list[Any], Callable[[], None] | None]] = []

    def put(self, frames: list[Any], on_fail: Callable[[], None] | None = None) -> None:
        if not self._queued:
            self.io.loop.call_soon(self.flush)
        self._queued.append((frames, on_fail))

    def flush(self) -> None:
        """Send what is queued now (a batch when several)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        fails = [f for _, f in queued if f is not None]
        on_fail = (lambda: [f() for f in fails]) if fails else None
        for message in p.batch([frames for frames, _ in queued]):
            try:
                self.io.send([*self.prefix, *message], on_fail=on_fail)
            except zmq.ZMQError as exc:
                self.on_error(exc, on_fail)
                return
