"""Async client side of the wire protocol: one DEALER channel per stage replica.

A channel opens with the hello handshake (protocol version in, replica identity and incarnation
out). Many requests share a channel; replies are routed back by request id, control replies and
heartbeats by correlation id. When the connection closes (the peer process died), the channel
says so at once and handshakes again with whatever process answers at the address next. The
orchestrator, the CLI and the tests all use this.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omnistage import protocol as p

log = logging.getLogger("omnistage.client")
_cids = itertools.count(1)

Reply = p.Message[p.Reply]


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
        on_message: Callable[[Reply], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name or endpoint
        self._zctx = zctx or zmq.asyncio.Context.instance()
        self.sock = self._zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"c{os.getpid()}-{next(_cids)}".encode())
        # The socket monitor reports a closed connection the moment the peer process dies, so
        # the loss is seen at once instead of at the next missed heartbeat.
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)
        # Synchronous views of both sockets, for non-blocking reads after a poll.
        self._rx = zmq.Socket.shadow(self.sock.underlying)
        self._rx_monitor = zmq.Socket.shadow(self._monitor.underlying)
        self._streams: dict[str, asyncio.Queue[Reply]] = {}
        self._calls: dict[str, asyncio.Future[Reply]] = {}
        self.unsolicited: asyncio.Queue[Reply] = asyncio.Queue()
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self.disconnects = 0  # connections to the peer that closed
        self.closed = False
        loop = asyncio.get_running_loop()
        # The worker answers the hello before anything sent after it, so the first hello_reply
        # or id-less error on this channel settles the handshake.
        self._peer: asyncio.Future[p.HelloReply] = loop.create_future()
        self._peer.add_done_callback(_retrieve)
        self._latest: p.HelloReply | None = None  # the newest accepted hello_reply
        self.send(p.Hello(version=p.PROTOCOL_VERSION))
        self._recv_task: asyncio.Task[None] | None = asyncio.ensure_future(self._recv_loop())

    # ---- receiving -----------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            await poller.poll()
            # Replies first: whatever the peer sent before its connection closed is delivered
            # before the loss is reported, so finished requests are never counted as lost.
            self._drain_replies()
            self._drain_link_events()

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self._rx.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = p.decode_reply(frames)
            except p.ProtocolError as exc:
                log.warning("bad reply from %s: %s", self.name, exc)
                rid, cid = p.salvage_ids(frames)
                if rid is None and cid is None:
                    continue
                # End whatever waits for it, rather than let it wait for its deadline.
                msg = p.Message(p.Error(code="malformed", id=rid, cid=cid,
                                        message=f"unreadable reply from {self.name}: {exc}"))
            self.deliver(msg)

    def _drain_link_events(self) -> None:
        while True:
            try:
                frames = self._rx_monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
                self._link_lost()

    def _link_lost(self) -> None:
        """The connection closed: the process that answered is gone (or cut off). ZMQ
        reconnects by itself; a new hello, queued now, asks whoever answers at the address
        next which process (incarnation) it is."""
        self.disconnects += 1
        log.info("connection to %s at %s closed", self.name, self.endpoint)
        if not self.closed:
            self.send(p.Hello(version=p.PROTOCOL_VERSION))
        if self._on_disconnect is not None:
            self._on_disconnect()

    def deliver(self, msg: Reply) -> None:
        h = msg.header
        if not self._peer.done() and self._settle_handshake(h):
            return
        if isinstance(h, p.HelloReply):  # a later handshake: after a reconnect
            if h.version == p.PROTOCOL_VERSION:
                self._latest = h
        cid = getattr(h, "cid", None)
        if cid is not None:
            fut = self._calls.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            if isinstance(h, p.Pong) and self._on_message is not None:
                self._on_message(msg)
            if fut is not None or isinstance(h, p.Pong | p.ControlReply):
                return
        if self._on_message is not None:
            self._on_message(msg)
            return
        q = self._streams.get(getattr(h, "id", None) or "")
        if q is None:
            self.unsolicited.put_nowait(msg)
        else:
            q.put_nowait(msg)

    def _settle_handshake(self, h: p.Reply) -> bool:
        if isinstance(h, p.HelloReply):
            if h.version != p.PROTOCOL_VERSION:
                self._peer.set_exception(p.VersionMismatch(
                    f"replica {self.name} at {self.endpoint} speaks protocol version "
                    f"{h.version}; this client speaks {p.PROTOCOL_VERSION}"))
            else:
                self._latest = h
                self._peer.set_result(h)
            return True
        if isinstance(h, p.Error) and h.id is None and h.cid is None:
            hint = "" if h.code == "version_mismatch" else (
                f" (it may speak a protocol version older than {p.PROTOCOL_VERSION})")
            self._peer.set_exception(p.VersionMismatch(
                f"replica {self.name} at {self.endpoint} refused the handshake{hint}: "
                f"{h.code}: {h.message}"))
            return True
        return False

    async def handshake(self, timeout: float | None = None) -> p.HelloReply:
        """The worker's hello reply; raises VersionMismatch when it speaks another version."""
        return await asyncio.wait_for(asyncio.shield(self._peer), timeout)

    @property
    def peer(self) -> p.HelloReply | None:
        """The newest accepted hello reply (replica identity and incarnation): after a
        reconnect, the new process's once it answered."""
        return self._latest

    # ---- sending -------------------------------------------------------------------------

    def send(self, header: msgspec.Struct, tensors: Mapping[str, Any] | None = None) -> None:
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
        incarnation: str | None = None,
    ) -> asyncio.Queue[Reply]:
        """Send a request; replies (deltas, then one terminal) arrive on the returned queue.

        It does not wait for the handshake (the hello goes first anyway), but a refused one
        raises here. With `incarnation`, only that process runs it (see Submit).
        """
        if self._peer.done() and not self._peer.cancelled() and self._peer.exception():
            raise self._peer.exception()  # type: ignore[misc]
        q: asyncio.Queue[Reply] = asyncio.Queue()
        self._streams[rid] = q
        self.send(p.Submit(id=rid, params=dict(params), timeout_s=timeout_s,
                           incarnation=incarnation), tensors)
        return q

    async def stream(
        self,
        rid: str,
        params: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        incarnation: str | None = None,
    ) -> AsyncIterator[Reply]:
        """Yield every reply for one request, ending with its terminal reply."""
        await self.handshake()
        q = self.submit(rid, params, tensors, timeout_s, incarnation)
        try:
            while True:
                msg = await q.get()
                yield msg
                if isinstance(msg.header, p.TERMINAL_REPLIES):
                    return
        finally:
            self._streams.pop(rid, None)

    async def request(
        self,
        rid: str,
        params: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        incarnation: str | None = None,
    ) -> tuple[list[Reply], Reply]:
        """Run one request to completion: (deltas, terminal reply)."""
        deltas: list[Reply] = []
        async for msg in self.stream(rid, params, tensors, timeout_s, incarnation):
            if isinstance(msg.header, p.Delta):
                deltas.append(msg)
            else:
                return deltas, msg
        raise ChannelClosed(f"no terminal reply for {rid}")

    def abort(self, rid: str, incarnation: str | None = None) -> None:
        self.send(p.Abort(id=rid, incarnation=incarnation))

    async def call(self, header: p.Control | p.Ping, timeout: float) -> Reply:
        """Send an RPC and wait for the reply with its correlation id."""
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._calls[header.cid] = fut
        try:
            self.send(header)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(header.cid, None)

    async def control(self, op: p.ControlOp, timeout: float = 30.0) -> dict[str, Any]:
        """Run a control RPC and return the worker's state after it.

        A worker-side exception (or a refused request) is raised here as ControlError.
        """
        reply = (await self.call(p.Control(cid=_cid(), op=op), timeout)).header
        if isinstance(reply, p.ControlReply) and reply.ok and reply.result is not None:
            return msgspec.structs.asdict(reply.result)
        if isinstance(reply, p.ControlReply) and reply.error is not None:
            raise ControlError(self.name, op, reply.error.type, reply.error.message)
        if isinstance(reply, p.Error):
            raise ControlError(self.name, op, reply.code, reply.message)
        raise ControlError(self.name, op, "malformed", f"unexpected reply {reply!r}")

    async def ping(self, timeout: float = 2.0) -> p.Pong:
        reply = (await self.call(p.Ping(cid=_cid()), timeout)).header
        if not isinstance(reply, p.Pong):
            raise p.ProtocolError(f"ping to {self.name} answered with {reply!r}")
        return reply

    async def close(self) -> None:
        self.closed = True
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recv_task
            self._recv_task = None
        if not self._peer.done():
            self._peer.set_exception(ChannelClosed(f"channel to {self.name} closed"))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(f"channel to {self.name} closed"))
        if not self.sock.closed:  # close() may be called again
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)


def _cid() -> str:
    return f"{os.getpid()}-{next(_cids)}"


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a refused handshake as seen: callers that never ask must not get a loop warning."""
    if not fut.cancelled():
        fut.exception()
