"""omni_operator.loadclient against a real aiohttp server (the orchestrator's own server
library): JSON on a kept-alive connection, a fresh connection when the server closed the idle
one, and clear errors for what it does not accept."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web

from omni_operator.loadclient import LoadClient, LoadReadError


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, keepalive_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def test_json_on_kept_alive_connections_and_errors_that_say_why() -> None:
    async def main() -> None:
        peers: list[Any] = []

        async def load(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
            return web.json_response({"stages": {"a": {"inflight": 2}}, "q": request.query_string})

        async def missing(_: web.Request) -> web.Response:
            return web.json_response({"error": "no"}, status=503)

        async def chunked(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(b"{}")
            await resp.write_eof()
            return resp

        async def text(_: web.Request) -> web.Response:
            return web.Response(text="not json")

        app = web.Application()
        app.add_routes([web.get("/v1/load", load), web.get("/down", missing),
                        web.get("/chunked", chunked), web.get("/text", text)])
        runner, port = await _serve(app)
        client = LoadClient(2.0)
        try:
            base = f"http://127.0.0.1:{port}"
            assert await client.get_json(f"{base}/v1/load?x=1") == {
                "stages": {"a": {"inflight": 2}}, "q": "x=1"}
            assert await client.get_json(f"{base}/v1/load") is not None
            assert peers[0] == peers[1]  # the same connection, kept alive
            await asyncio.sleep(0.6)  # the server closes the idle connection
            assert (await client.get_json(f"{base}/v1/load"))["q"] == ""
            assert peers[2] != peers[0]  # a new one, without an error
            with pytest.raises(LoadReadError, match="HTTP 503"):
                await client.get_json(f"{base}/down")
            with pytest.raises(LoadReadError, match="without Content-Length"):
                await client.get_json(f"{base}/chunked")
            with pytest.raises(LoadReadError, match="not JSON"):
                await client.get_json(f"{base}/text")
            with pytest.raises(LoadReadError, match="not an http:// URL"):
                await client.get_json(f"https://127.0.0.1:{port}/v1/load")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            with pytest.raises(LoadReadError, match="ConnectionRefusedError"):
                await client.get_json(f"http://127.0.0.1:{closed}/v1/load")
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_server_that_never_answers_times_out() -> None:
    async def main() -> None:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1000)
            await asyncio.sleep(5)
            writer.close()

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = LoadClient(0.3)
        try:
            with pytest.raises(LoadReadError, match=r"no answer in 0.3s"):
                await client.get_json(f"http://127.0.0.1:{port}/v1/load")
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


def test_headers_go_on_the_wire_and_never_into_a_message() -> None:
    """The admin key header reaches the server on every GET, the kept-alive connection's
    too; a 401 says HTTP 401 and nothing of the key; a header that would break the request
    (a line break in it) is refused before anything is sent, without naming its value."""
    key = "0123456789abcdef" * 4

    async def main() -> None:
        seen: list[str | None] = []

        async def load(request: web.Request) -> web.Response:
            seen.append(request.headers.get("X-Omnistage-Admin-Key"))
            if request.headers.get("X-Omnistage-Admin-Key") != key:
                return web.json_response({"error": "invalid admin key"}, status=401)
            return web.json_response({"stages": {}})

        app = web.Application()
        app.add_routes([web.get("/v1/load", load)])
        runner, port = await _serve(app)
        client = LoadClient(2.0)
        url = f"http://127.0.0.1:{port}/v1/load"
        try:
            assert await client.get_json(url, {"X-Omnistage-Admin-Key": key}) == {"stages": {}}
            assert await client.get_json(url, {"X-Omnistage-Admin-Key": key}) == {"stages": {}}
            with pytest.raises(LoadReadError, match="HTTP 401") as refused:
                await client.get_json(url, {"X-Omnistage-Admin-Key": "not-" + key})
            assert key not in str(refused.value)
            with pytest.raises(LoadReadError, match="HTTP 401"):
                await client.get_json(url)  # no header at all
            assert seen == [key, key, "not-" + key, None]
            for bad in ({"X-Omnistage-Admin-Key": key + "\r\nX-Evil: 1"},
                        {"X-Evil\r\n": key}, {"": key}, {"A:B": key}):
                with pytest.raises(LoadReadError, match="cannot be sent") as caught:
                    await client.get_json(url, bad)
                assert key not in str(caught.value)
            assert len(seen) == 4  # nothing was sent for those
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())
