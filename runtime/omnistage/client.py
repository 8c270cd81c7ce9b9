"""Async client side of the wire protocol: one DEALER channel per stage replica.

A channel opens with the hello handshake (protocol version in, replica identity and incarnation
out). Many requests share a channel; replies are routed back by request id, control replies and
heartbeats by correlation id. When the connection closes (the peer process died), the channel
says so at once and handshakes again with whatever process answers at the address next. The
orchestrator, the CLI and the tests all use this.

With a SegmentManager, the hello offers this process's shared-memory segment; when the worker
can read it (and we can read the worker's), large tensors go through shared memory both ways
and only their handles cross the socket (see omnistage.shm for who frees what, and when). Each
handshake (a reconnect included) settles anew which worker segment that is.

With CurveZMQ, a worker's ZAP handler may refuse our key (its mounted key directory does not
hold our generation yet, while keys rotate). libzmq then gives the connection up for good (it
reconnects after a lost connection, not after a refusal), so the channel connects again itself
after REFUSED_RETRY_S, and handshakes again once it is heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omnistage import protocol as p
from omnistage.curve import CurveKeys, secure_client
from omnistage.shm import SegmentManager
from omnistage.zmqio import LoopSocket, Outbox

log = logging.getLogger("omnistage.client")
_cids = itertools.count(1)
#: After a worker refused our CurveZMQ key: how long until the channel connects again (a
#: worker looks at its key directory again once a second).
REFUSED_RETRY_S = 1.0

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
        shm: SegmentManager | None = None,
        curve: CurveKeys | None = None,
        server_key: bytes | None = None,
    ) -> None:
        """curve: the pipeline's CurveZMQ pair, when its workers require it (omnistage.curve);
        server_key: the worker's public key (its generation's, while keys rotate; default: the
        pair's own public key)."""
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
        # A refusal of our key is reported too: libzmq does not reconnect after one.
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.refusals = 0  # connections on which the worker refused our key
        if curve is not None:
            secure_client(self.sock, curve, server_key)
        self.sock.connect(endpoint)
        self._streams: dict[str, asyncio.Queue[Reply]] = {}
        self._calls: dict[str, asyncio.Future[Reply]] = {}
        self.unsolicited: asyncio.Queue[Reply] = asyncio.Queue()
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self.disconnects = 0  # connections to the peer that closed
        self.shm = shm
        self.shm_peer: str | None = None  # the worker's segment, once each side reads the other
        self._sent: dict[str, list[int]] = {}  # request id -> our blocks the worker reads
        self.closed = False
        self._retry: asyncio.TimerHandle | None = None  # the reconnect after a refusal
        loop = asyncio.get_running_loop()
        # The worker answers the hello before anything sent after it, so the first hello_reply
        # or id-less error on this channel settles the handshake.
        self._peer: asyncio.Future[p.HelloReply] = loop.create_future()
        self._peer.add_done_callback(_retrieve)
        self._latest: p.HelloReply | None = None  # the newest accepted hello_reply
        # Both sockets are read and written from the loop directly (zmqio: no futures).
        self._loop = loop
        self._io = LoopSocket(self.sock.underlying, self._on_readable, loop)
        self._io_monitor = LoopSocket(self._monitor.underlying, self._on_readable, loop)
        # Once the worker says it reads batches (hello_reply.batches), what one turn of the
        # loop sends to it waits here and leaves as one message at the turn's end (_flush).
        self._batches = False
        self._outbox = Outbox(self._io, self._unsent)
        self.hello()

    # ---- receiving -----------------------------------------------------------------------

    def _on_readable(self) -> None:
        """Read everything that arrived. Replies first: whatever the peer sent before its
        connection closed is delivered before the loss is reported, so finished requests are
        never counted as lost."""
        if self.closed:
            return
        self._drain_replies()
        self._drain_link_events()

    def _drain_replies(self) -> None:
        while (frames := self._io.recv()) is not None:
            try:
                parts = p.unbatch(frames)
            except p.ProtocolError as exc:
                # Its parts cannot be told apart: end whatever each frame that reads as a
                # header names, rather than let it wait for its deadline.
                log.warning("bad batch from %s: %s", self.name, exc)
                for frame in frames[1:]:
                    self._receive([frame])
                continue
            for part in parts:
                self._receive(part)

    def _receive(self, frames: Any) -> None:
        try:
            msg = p.decode_reply(frames, self.shm.resolve if self.shm else None)
            msg.lender = self.shm_peer
        except p.ProtocolError as exc:
            log.warning("bad reply from %s: %s", self.name, exc)
            rid, cid = p.salvage_ids(frames)
            if rid is None and cid is None:
                return
            # End whatever waits for it, rather than let it wait for its deadline.
            msg = p.Message(p.Error(code="malformed", id=rid, cid=cid,
                                    message=f"unreadable reply from {self.name}: {exc}"))
        try:
            self.deliver(msg)
        except Exception:  # one reply's handler failing must not strand the rest
            log.exception("handling a %s reply from %s failed", msg.type, self.name)

    def _drain_link_events(self) -> None:
        while (frames := self._io_monitor.recv(copy=True)) is not None:
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._link_lost()
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused()

    def _refused(self) -> None:
        """The worker refused our key (its ZAP handler): connect again in a while."""
        self.refusals += 1
        if self.refusals == 1:
            log.warning("%s at %s refused our CurveZMQ key; connecting again every %.0f s",
                        self.name, self.endpoint, REFUSED_RETRY_S)
        if self._retry is None and not self.closed:
            self._retry = self._loop.call_later(REFUSED_RETRY_S, self._reconnect)

    def _reconnect(self) -> None:
        self._retry = None
        if self.closed:
            return
        with contextlib.suppress(zmq.ZMQError):  # the refused connection's endpoint
            self.sock.disconnect(self.endpoint)
        self.sock.connect(self.endpoint)
        self.hello()  # what was queued on the refused connection is gone with it

    def _link_lost(self) -> None:
        """The connection closed: the process that answered is gone (or cut off). ZMQ
        reconnects by itself; a new hello, queued now, asks whoever answers at the address
        next which process (incarnation) it is."""
        self.disconnects += 1
        log.info("connection to %s at %s closed", self.name, self.endpoint)
        self._flush()  # what was queued for the process that left goes as it was meant to
        self._batches = False  # until the next process says it reads them
        self._forget_peer_shm()  # frames until the next process says which segment is its own
        if not self.closed:
            self.hello()
        if self._on_disconnect is not None:
            self._on_disconnect()

    def deliver(self, msg: Reply) -> None:
        h = msg.header
        if not self._peer.done() and self._settle_handshake(h):
            return
        if isinstance(h, p.TERMINAL_REPLIES) and h.id is not None:
            self._free_sent(h.id, msg)
        if isinstance(h, p.HelloReply):  # a later handshake: after a reconnect
            if h.version == p.PROTOCOL_VERSION:
                self._latest = h
                self._peer_shm(h)  # a new process has a new segment (or none)
                self._batches = h.batches
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
                self._peer_shm(h)
                self._batches = h.batches
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

    @property
    def borrower(self) -> str | None:
        """What a submit names as `shm`: our segment, when the worker may lend to us."""
        return self.shm.name if self.shm is not None and self.shm_peer is not None else None

    def _peer_shm(self, h: p.HelloReply) -> None:
        """Use shared memory with this worker when it read our segment and we read its own."""
        self._forget_peer_shm()
        if self.shm is not None and h.shm is not None and self.shm.verify(h.shm):
            self.shm_peer = h.shm.segment
            self.shm.attach_lender(self.shm_peer, self._send_release)

    def _forget_peer_shm(self) -> None:
        """Releases for the worker's segment wait (in the SegmentManager) for a channel again."""
        old, self.shm_peer = self.shm_peer, None
        if old is not None and self.shm is not None:
            self.shm.detach_lender(old, self._send_release)

    def _send_release(self, leases: list[int]) -> None:
        for i in range(0, len(leases), 4096):
            self.send(p.Release(leases=leases[i:i + 4096]))

    def release(self, msg: Reply) -> None:
        """Done with a reply: give the shared-memory blocks it carries back to their owner.

        A reply's tensors are views of the worker's segment; once released they may be reused,
        so copy (WireTensor.detached) whatever must outlive this call.
        """
        if self.shm is not None:
            self.shm.release(msg)

    def _free_sent(self, rid: str, reply: Reply | None = None) -> None:
        """The worker is done with the blocks it was sent for rid (it answered, or is gone);
        those the reply itself carries back are freed when the reply is released."""
        leases = self._sent.pop(rid, None)
        if not leases or self.shm is None:
            return
        if reply is not None:
            kept = {wt.shm.lease for wt in reply.tensors.values()
                    if wt.shm is not None and wt.shm.segment == self.shm.name}
            leases = [lease for lease in leases if lease not in kept]
        self.shm.free(leases)

    async def handshake(self, timeout: float | None = None) -> p.HelloReply:
        """The worker's hello reply; raises VersionMismatch when it speaks another version."""
        return await asyncio.wait_for(asyncio.shield(self._peer), timeout)

    @property
    def peer(self) -> p.HelloReply | None:
        """The newest accepted hello reply (replica identity and incarnation): after a
        reconnect, the new process's once it answered."""
        return self._latest

    # ---- sending -------------------------------------------------------------------------

    def hello(self) -> None:
        """(Re)open the handshake, offering our shared-memory segment when we have one."""
        self.send(p.Hello(version=p.PROTOCOL_VERSION, batches=True,
                          shm=self.shm.probe() if self.shm is not None else None))

    def send(self, header: msgspec.Struct, tensors: Mapping[str, Any] | None = None) -> None:
        """Encode and send at once (raising what encoding raises); sends keep their order."""
        if self.closed:
            raise ChannelClosed(f"channel to {self.name} is closed")
        self._send_frames(p.encode(header, tensors, shm=self.shm_peer is not None))

    def send_raw(self, frames: list[Any]) -> None:
        """Send frames as they are, one ZMQ message of their own after what is queued (tests
        send malformed messages and hand-made batches with it)."""
        self._flush()
        try:
            self._io.send(frames)
        except zmq.ZMQError as exc:
            raise ChannelClosed(f"channel to {self.name}: {exc}") from None

    def _send_frames(self, frames: list[Any]) -> None:
        if self._batches:
            self._outbox.put(frames)
            return
        try:
            self._io.send(frames)
        except zmq.ZMQError as exc:
            raise ChannelClosed(f"channel to {self.name}: {exc}") from None

    def _flush(self) -> None:
        """Send what this turn of the loop queued, now."""
        self._outbox.flush()

    def _unsent(self, exc: zmq.ZMQError, on_fail: Any) -> None:
        """The socket is closing: its peer is lost anyway."""
        log.warning("channel to %s: queued messages not sent: %s", self.name, exc)

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
        if self.borrower is not None and tensors:
            tensors = self._place_now(rid, tensors)
        q: asyncio.Queue[Reply] = asyncio.Queue()
        self._streams[rid] = q
        try:
            self.send(p.Submit(id=rid, params=dict(params), timeout_s=timeout_s,
                               incarnation=incarnation, shm=self.borrower), tensors)
        except BaseException:
            self._streams.pop(rid, None)
            self._free_sent(rid)
            raise
        return q

    def _place_now(self, rid: str, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Large tensors copied into our segment where it has room now (the rest go as frames);
        the blocks are freed when rid's terminal reply arrives."""
        assert self.shm is not None
        out = dict(tensors)
        for name, value in tensors.items():
            if self.shm.wants(value):
                placed = self.shm.try_place(value)
                if placed is not None:
                    out[name] = placed
                    self._sent.setdefault(rid, []).append(placed.shm.lease)  # type: ignore[union-attr]
        return out

    async def _place(self, rid: str, tensors: Mapping[str, Any],
                     timeout_s: float | None) -> dict[str, Any]:
        """As _place_now, but waits for room while our segment is full (back-pressure)."""
        assert self.shm is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out = dict(tensors)
        try:
            for name, value in tensors.items():
                if self.shm.wants(value):
                    placed = await self.shm.place(value, deadline=deadline)
                    if placed is not None:
                        out[name] = placed
                        self._sent.setdefault(rid, []).append(placed.shm.lease)  # type: ignore[union-attr]
        except BaseException:
            self._free_sent(rid)
            raise
        return out

    async def stream(
        self,
        rid: str,
        params: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        incarnation: str | None = None,
    ) -> AsyncIterator[Reply]:
        """Yield every reply for one request, ending with its terminal reply.

        Large tensors wait for room in shared memory when it is full (back-pressure), up to
        timeout_s.
        """
        await self.handshake()
        if tensors and self.shm is not None and self.shm_peer is not None:
            tensors = await self._place(rid, tensors, timeout_s)
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
        if self.shm is not None:
            for rid in list(self._sent):  # the worker answers nothing more on this channel
                self._free_sent(rid)
            self._forget_peer_shm()
        self._flush()  # aborts and releases sent just before closing still leave
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._io.close()
        self._io_monitor.close()
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
