"""The autoscaler's reads of GET /v1/load: plain HTTP/1.1 GETs on kept-alive connections.

Why its own client: at 500 pipelines the autoscaler reads 33 loads a second at the default
period, the operator's hottest path once a fleet is at rest. A general client (aiohttp) spends
about 200 us of CPU per GET here; this one, which only needs a GET with a Content-Length
answer from an orchestrator (omnistage.orchestrator.load), about 80 us. Anything it does not
expect (another status, a chunked body, a closed connection) raises LoadReadError, and the
connection is dropped, never reused.

Headers given to a GET (the pipeline's admin key, omnistage.kube.ADMIN_KEY_HEADER) go on the
wire only: no error message, log line or repr shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["LoadClient", "LoadReadError"]

#: Largest body accepted: a load document is a few hundred bytes per stage.
MAX_BODY = 1 << 20
#: Idle connections kept per endpoint.
MAX_IDLE = 32  # as many as the autoscaler reads at once (MAX_READS_IN_FLIGHT)

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LoadReadError(Exception):
    """The GET did not give a JSON document (the message says why)."""


class LoadClient:
    """GET url -> JSON, reusing idle connections per (host, port)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._idle: dict[tuple[str, int], list[Conn]] = {}

    async def get_json(self, url: str, headers: Mapping[str, str] | None = None) -> Any:
        """GET url; `headers` are sent with it (a name or value with a line break, which
        would end the header early, is refused without naming the value)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise LoadReadError(f"not an http:// URL: {url}")
        endpoint = (parts.hostname, parts.port or 80)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        host = f"[{endpoint[0]}]" if ":" in endpoint[0] else endpoint[0]
        extra = ""
        for name, value in (headers or {}).items():
            if any(c in f"{name}{value}" for c in "\r\n\0") or not name or ":" in name:
                raise LoadReadError(f"GET {url}: header {name!r} cannot be sent")
            extra += f"{name}: {value}\r\n"
        request = (f"GET {target or '/'} HTTP/1.1\r\nHost: {host}:{endpoint[1]}\r\n"
                   f"Accept: application/json\r\n{extra}\r\n").encode()
        try:
            async with asyncio.timeout(self.timeout):  # no task per read, as wait_for makes
                return await self._get(endpoint, request)
        except TimeoutError as exc:
            raise LoadReadError(f"GET {url}: no answer in {self.timeout:g}s") from exc
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise LoadReadError(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    async def _get(self, endpoint: tuple[str, int], request: bytes) -> Any:
        idle = self._idle.get(endpoint) or []
        conn = idle.pop() if idle else None
        if conn is not None:
            try:
                return await self._exchange(endpoint, conn, request)
            except (OSError, asyncio.IncompleteReadError):
                pass  # the server closed a kept-alive connection: once more on a new one
        conn = await asyncio.open_connection(*endpoint)
        return await self._exchange(endpoint, conn, request)

    async def _exchange(self, endpoint: tuple[str, int], conn: Conn, request: bytes) -> Any:
        reader, writer = conn
        keep = False
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = lines[0].split(" ", 2)
            if len(status) < 2 or not status[0].startswith("HTTP/1."):
                raise LoadReadError(f"not an HTTP answer: {lines[0]!r}")
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            if "content-length" not in headers:
                raise LoadReadError("answer without Content-Length")
            length = int(headers["content-length"])
            if not 0 <= length <= MAX_BODY:
                raise LoadReadError(f"answer of {length} bytes")
            body = await reader.readexactly(length)
            keep = (headers.get("connection", "").lower() != "close"
                    and status[0] == "HTTP/1.1")
            if status[1] != "200":
                raise LoadReadError(f"HTTP {' '.join(status[1:])}")
            try:
                return json.loads(body)
            except ValueError as exc:
                raise LoadReadError(f"not JSON: {exc}") from exc
        finally:
            idle = self._idle.setdefault(endpoint, [])
            if keep and len(idle) < MAX_IDLE:
                idle.append(conn)
            else:
                writer.close()

    async def close(self) -> None:
        conns = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        for _, writer in conns:
            writer.close()
        for _, writer in conns:
            with contextlib.suppress(Exception):
                await writer.wait_closed()
