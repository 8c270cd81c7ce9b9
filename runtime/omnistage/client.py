"""Async client side of the wire protocol: one DEALER channel per stage replica.

Many requests share a channel; replies are routed back by request id, control replies and
heartbeats by correlation id. The orchestrator, the CLI and the tests all use this.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import zmq
import zmq.asyncio

from omnistage import protocol as p

log = logging.getLogger("omnistage.client")
_cids = itertools.count(1)


class ControlError(RuntimeError):
    """A control RPC failed inside the worker; carries the worker's exception type."""

    def __init__(self, replica: str, op: str, type_: str, message: str) -> None:
        super().__init__(f"{op} on {replica} failed: {type_}: {message}")
        self.replica, self.op, self.type, self.message = replica, op, type_, message


class ChannelClosed(ConnectionError):
    """The channel was closed (replica lost or client shutting down) before a reply came."""


class ReplicaChannel:
    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "",
        zctx: zmq.asyncio.Context | None = None,
        on_message: Callable[[p.Message], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name or endpoint
        self._zctx = zctx or zmq.asyncio.Context.instance()
        self.sock = self._zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"c{os.getpid()}-{next(_cids)}".encode())
        self.sock.connect(endpoint)
        self._streams: dict[str, asyncio.Queue[p.Message]] = {}
        self._calls: dict[str, asyncio.Future[p.Message]] = {}
        self.unsolicited: asyncio.Queue[p.Message] = asyncio.Queue()
        self._on_message = on_message
        self._recv_task: asyncio.Task[None] | None = asyncio.ensure_future(self._recv_loop())
        self.closed = False

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = p.decode(frames)
            except p.ProtocolError as exc:
                log.warning("bad reply from %s: %s", self.name, exc)
                continue
            self.deliver(msg)

    def deliver(self, msg: p.Message) -> None:
        t = msg.type
        if t in (p.CONTROL_REPLY, p.PONG):
            fut = self._calls.pop(str(msg.header.get("cid")), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            if self._on_message is not None and t == p.PONG:
                self._on_message(msg)
            return
        if self._on_message is not None:
            self._on_message(msg)
            return
        q = self._streams.get(str(msg.header.get("id")))
        if q is None:
            self.unsolicited.put_nowait(msg)
        else:
            q.put_nowait(msg)

    def send(self, header: Mapping[str, Any], tensors: Mapping[str, Any] | None = None) -> None:
        if self.closed:
            raise ChannelClosed(f"channel to {self.name} is closed")
        self.sock.send_multipart(p.encode(header, tensors), copy=False)

    def send_raw(self, frames: list[Any]) -> None:
        """Send frames as they are (used by tests to send malformed messages)."""
        self.sock.send_multipart(frames)

    def submit(
        self,
        rid: str,
        params: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> asyncio.Queue[p.Message]:
        """Send a request; replies (deltas, then one terminal) arrive on the returned queue."""
        q: asyncio.Queue[p.Message] = asyncio.Queue()
        self._streams[rid] = q
        header: dict[str, Any] = {"t": p.SUBMIT, "id": rid, "params": dict(params)}
        if timeout_s is not None:
            header["timeout_s"] = timeout_s
        self.send(header, tensors)
        return q

    async def stream(
        self,
        rid: str,
        params: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[p.Message]:
        """Yield every reply for one request, ending with its terminal reply."""
        q = self.submit(rid, params, tensors, timeout_s)
        try:
            while True:
                msg = await q.get()
                yield msg
                if msg.type in p.TERMINAL_REPLIES:
                    return
        finally:
            self._streams.pop(rid, None)

    async def request(
        self,
        rid: str,
        params: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[list[p.Message], p.Message]:
        """Run one request to completion: (deltas, terminal reply)."""
        deltas: list[p.Message] = []
        async for msg in self.stream(rid, params, tensors, timeout_s):
            if msg.type == p.DELTA:
                deltas.append(msg)
            else:
                return deltas, msg
        raise ChannelClosed(f"no terminal reply for {rid}")

    def abort(self, rid: str) -> None:
        self.send({"t": p.ABORT, "id": rid})

    async def call(self, header: dict[str, Any], timeout: float) -> p.Message:
        cid = header.setdefault("cid", f"{os.getpid()}-{next(_cids)}")
        fut: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            self.send(header)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(cid, None)

    async def control(self, op: str, timeout: float = 30.0) -> dict[str, Any]:
        """Run a control RPC; a worker-side exception is raised here as ControlError."""
        reply = await self.call({"t": p.CONTROL, "op": op}, timeout)
        if not reply.header.get("ok"):
            err = reply.header.get("error") or {}
            raise ControlError(self.name, op, str(err.get("type")), str(err.get("message")))
        return dict(reply.header.get("result") or {})

    async def ping(self, timeout: float = 2.0) -> dict[str, Any]:
        return (await self.call({"t": p.PING}, timeout)).header

    async def close(self) -> None:
        self.closed = True
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recv_task
            self._recv_task = None
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(f"channel to {self.name} closed"))
        self.sock.close(linger=0)
