"""zmqio.LoopSocket over real sockets on loopback: nothing that arrives waits for a signal that
never comes (a send may take the descriptor's signal), order is kept, a closed one says so."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq
import zmq.asyncio

from omnistage.zmqio import LoopSocket


@pytest.fixture
def echo_peer() -> tuple[str, threading.Event]:
    """A ROUTER on a thread that sends each message straight back, twice (so replies arrive
    while the loop side is sending)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                ident, *frames = sock.recv_multipart()
                sock.send_multipart([ident, *frames])
                sock.send_multipart([ident, *frames])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{port}", stop
    stop.set()
    thread.join(5)
    sock.close(0)
    ctx.term()


async def test_ping_pong_never_stalls_and_keeps_order(echo_peer: tuple[str, threading.Event]
                                                      ) -> None:
    """Each reply triggers the next send from inside the read callback, the pattern where a
    send takes the signal of replies already there: all 2 x N come, in order."""
    endpoint, _ = echo_peer
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    n, got = 2000, []
    done = asyncio.get_running_loop().create_future()

    def readable() -> None:
        while (frames := io.recv(copy=True)) is not None:
            got.append(int(frames[0]))
            if len(got) % 2 == 0 and len(got) < 2 * n:
                io.send([str(len(got) // 2).encode()])
            if len(got) == 2 * n and not done.done():
                done.set_result(None)

    io = LoopSocket(dealer.underlying, readable)
    try:
        io.send([b"0"])
        await asyncio.wait_for(done, 30)
        assert got == [i // 2 for i in range(2 * n)]
    finally:
        io.close()
        dealer.close(0)
        ctx.term()


async def test_a_closed_socket_refuses_sends_and_runs_the_backlog_s_failures() -> None:
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IMMEDIATE, 1)  # no peer: a non-blocking send cannot go yet
    dealer.connect("tcp://127.0.0.1:9")
    failed: list[str] = []
    io = LoopSocket(dealer.underlying, lambda: None)
    try:
        io.send([b"first"], on_fail=lambda: failed.append("first"))
        io.send([b"second"], on_fail=lambda: failed.append("second"))
        assert io.waiting == 2  # kept, in order, for when the socket takes them
        io.close()
        assert failed == ["first", "second"] and io.waiting == 0
        with pytest.raises(zmq.ZMQError):
            io.send([b"late"])
    finally:
        dealer.close(0)
        ctx.term()
