"""An in-process stand-in for a stage worker, for what a real one cannot be made to do.

It speaks just enough of the wire protocol (hello, ping, submit) over a real ROUTER socket on
loopback, and answers the way a test tells it: another protocol version, an older worker that
does not know hello, or a reply that cannot be decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from omnistage import protocol as p

Frames = list[Any]


class FakeWorker:
    """Answers hello as a worker of protocol `version` would; None is a protocol-1 worker.

    A protocol-1 worker did not know hello: it answered with a malformed-message error.
    `on_submit` builds the reply frames for a submit (none are sent without it, or when it
    returns None: the request stays in flight). Assigning `incarnation` acts out a restart the
    client did not see as a closed connection.
    """

    def __init__(self, version: int | None = p.PROTOCOL_VERSION, *, stage: str = "a",
                 on_submit: Callable[[dict[str, Any]], Frames | None] | None = None,
                 batches: bool = False) -> None:
        """batches: say in the hello reply that it reads batches (an older worker does not)."""
        self.version = version
        self.batches = batches
        self.zmq_messages: list[int] = []  # messages each ZMQ message carried (batches > 1)
        self.stage = stage
        self.incarnation = uuid.uuid4().hex
        self.on_submit = on_submit
        self.received: list[dict[str, Any]] = []
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            parts = p.unbatch(frames) if self.batches else [frames]
            self.zmq_messages.append(len(parts))
            for part in parts:
                await self._answer(ident, part[0])

    async def _answer(self, ident: bytes, header: bytes) -> None:
        msg = msgspec.msgpack.decode(header)
        self.received.append(msg)
        if msg["t"] == "hello":
            frames: Frames | None = self._hello()
        elif msg["t"] == "ping":
            frames = p.encode(p.Pong(cid=msg["cid"], state=self._state()))
        elif msg["t"] == "submit" and self.on_submit is not None:
            frames = self.on_submit(msg)
        else:
            return
        if frames is not None:
            await self.sock.send_multipart([ident, *frames])

    def _hello(self) -> Frames:
        if self.version is None:
            return [msgspec.msgpack.encode({
                "t": "error", "code": "malformed",
                "message": "unknown message type 'hello'; expected ['abort', 'control', "
                           "'ping', 'submit']"})]
        return p.encode(p.HelloReply(version=self.version, replica="fake", stage=self.stage,
                                     kind="echo", incarnation=self.incarnation,
                                     batches=self.batches))

    def _state(self) -> p.WorkerState:
        return p.WorkerState(replica_id="fake", stage=self.stage, kind="echo",
                             incarnation=self.incarnation, ready=True, loaded=True,
                             draining=False, paused=False, asleep=False, in_flight=0,
                             queued=0, pid=0)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close(linger=0)
        self._ctx.term()

