"""The side port over a real loopback socket: probes, metrics, state, and the bound URL."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from omnistage.sideport import add_ops_routes, serve_app, start_side_port
from tests.harness.metrics import sample

Started = list[web.AppRunner]


@pytest.fixture
async def runners() -> AsyncIterator[Started]:
    started: Started = []
    yield started
    for runner in started:
        await runner.cleanup()


async def _get(url: str, **headers: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as resp:
        return resp.status, await resp.text(), resp.headers.get("Content-Type", "")


async def test_probes_metrics_and_state_answer_from_live_callbacks(runners: Started) -> None:
    ready: list[Any] = [False, "loading"]
    registry = CollectorRegistry()
    depth = Gauge("demo_queue_depth", "Requests waiting", registry=registry)
    state = {"in_flight": 0}
    runner, url = await start_side_port("127.0.0.1", 0, readiness=lambda: tuple(ready),
                                        registry=registry, state=lambda: state)
    runners.append(runner)
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")

    assert (await _get(url + "/livez"))[:2] == (200, "ok")
    assert (await _get(url + "/readyz"))[:2] == (503, "loading")
    ready[:] = [True, "ready"]
    assert (await _get(url + "/readyz"))[:2] == (200, "ready")

    status, text, ctype = await _get(url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert sample(text, "demo_queue_depth") == 0
    depth.set(4)
    assert sample((await _get(url + "/metrics"))[1], "demo_queue_depth") == 4
    status, text, ctype = await _get(url + "/metrics", Accept="application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text") and text.endswith("# EOF\n")

    state["in_flight"] = 2
    async with aiohttp.ClientSession() as s, s.get(url + "/state") as resp:
        assert await resp.json() == {"in_flight": 2}


async def test_state_route_exists_only_when_given(runners: Started) -> None:
    runner, url = await start_side_port("127.0.0.1", 0, readiness=lambda: (True, "ready"),
                                        registry=CollectorRegistry())
    runners.append(runner)
    assert (await _get(url + "/state"))[0] == 404
    assert (await _get(url + "/livez"))[0] == 200


async def test_ops_routes_join_an_existing_app(runners: Started) -> None:
    """What an API server does: its own routes plus the ops routes, on one listener."""

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.add_routes([web.get("/v1/hello", hello)])
    add_ops_routes(app, readiness=lambda: (False, "stage 'a' has no ready replica"),
                   registry=CollectorRegistry())
    runner, url = await serve_app(app, "127.0.0.1", 0, handler_cancellation=True)
    runners.append(runner)
    assert (await _get(url + "/v1/hello"))[:2] == (200, "hello")
    assert (await _get(url + "/readyz"))[:2] == (503, "stage 'a' has no ready replica")


async def test_a_port_in_use_raises(runners: Started) -> None:
    runner, url = await start_side_port("127.0.0.1", 0, readiness=lambda: (True, "ready"),
                                        registry=CollectorRegistry())
    runners.append(runner)
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        await start_side_port("127.0.0.1", port, readiness=lambda: (True, "ready"),
                              registry=CollectorRegistry())
    assert (await _get(url + "/livez"))[0] == 200  # the first server is unharmed


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_ipv6_url_is_bracketed(runners: Started) -> None:
    runner, url = await start_side_port("::1", 0, readiness=lambda: (True, "ready"),
                                        registry=CollectorRegistry())
    runners.append(runner)
    assert url.startswith("http://[::1]:")
    assert (await _get(url + "/livez"))[0] == 200


async def test_cleanup_closes_the_port(runners: Started) -> None:
    runner, url = await start_side_port("127.0.0.1", 0, readiness=lambda: (True, "ready"),
                                        registry=CollectorRegistry())
    await runner.cleanup()
    with pytest.raises(aiohttp.ClientConnectionError):
        await _get(url + "/livez")



def _accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the IPv4 listener on `port` (Linux: a
    listening socket's rx_queue in /proc/net/tcp is its accept backlog)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            return int(queues.split(":")[1], 16)
    return 0


async def test_close_gracefully_answers_connections_still_in_the_accept_queue() -> None:
    """A busy event loop leaves new connections in the kernel's accept queue; closing the
    listener would reset them after the client sent its request. close_gracefully takes them in
    and answers them first.

    Kills: closing the listener without draining its accept queue (the client is reset)."""
    import threading

    from omnistage.sideport import close_gracefully
    from tests.harness.waiting import wait

    async def hello(_: web.Request) -> web.Response:
        response = web.Response(text="answered")
        response.force_close()  # as a shutting-down server does: the client reconnects elsewhere
        return response

    app = web.Application()
    app.add_routes([web.get("/", hello)])
    runner, url = await serve_app(app, "127.0.0.1", 0)
    port = int(url.rsplit(":", 1)[1])
    replies: list[bytes | str] = []
    connected = threading.Event()

    def client() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                connected.set()
                data = b""
                while chunk := sock.recv(4096):
                    data += chunk
                replies.append(data)
        except OSError as exc:
            replies.append(repr(exc))
        finally:
            connected.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert connected.wait(60)
    # The loop is blocked (this test holds it): the connection waits in the accept queue.
    wait(lambda: _accept_queue(port) >= 1, "the connection in the listener's accept queue")
    await close_gracefully(runner)
    thread.join(60)
    [reply] = replies
    assert isinstance(reply, bytes) and reply.startswith(b"HTTP/1.1 200"), reply
    assert reply.endswith(b"answered")
