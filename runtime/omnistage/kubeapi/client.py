"""The async REST client: JSON dicts in and out, list+watch, server-side apply, counted writes.

Every non-GET is a write: counted (in total and by verb), logged on `omnistage.kubeapi.writes`
and, given a `WriteLimit`, paced. Counting writes is how the operator's idle-resync goal, zero
writes, is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import aiohttp

from omnistage.backoff import Backoff
from omnistage.kubeapi.auth import KubeConfig
from omnistage.kubeapi.errors import ApiError, ConfigError, WatchExpired
from omnistage.kubeapi.resources import Obj

log = logging.getLogger("omnistage.kubeapi")
write_log = logging.getLogger("omnistage.kubeapi.writes")

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}
#: Server-side apply: the body is YAML to the API server, and JSON is YAML.
APPLY_PATCH = "application/apply-patch+yaml"


async def gather_all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await independent calls together; once all have ended, raise the first failure (so
    none is left running unobserved), else return their results in order."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results



class WatchEvent(NamedTuple):
    """One watch event: ADDED, MODIFIED, DELETED or BOOKMARK, and the object."""

    type: str
    object: Obj

    @property
    def resource_version(self) -> str:
        return str((self.object.get("metadata") or {}).get("resourceVersion") or "")


class Listed(NamedTuple):
    """A full list: the state to diff against (after a start, a 410 or a forced relist)."""

    items: list[Obj]
    resource_version: str


class Applied(NamedTuple):
    """A server-side apply's answer: the object, and whether this apply created it (HTTP 201)."""

    object: Obj
    created: bool


class WriteLimit:
    """A token bucket over API writes: at most ``burst`` at once, then ``qps`` per second.

    Why: a big fleet's ramp (thousands of pods, ~4 writes each) must not flood the API server
    that every other controller shares. Reservations: a write takes a token at once and waits
    until the bucket would have refilled to it, so concurrent writers queue in call order and
    none is starved. ``clock`` and ``sleep`` are injectable so the maths is testable without time.
    """

    def __init__(self, qps: float, burst: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        if not qps > 0:
            raise ValueError(f"write qps must be > 0, got {qps}")
        if burst < 1:
            raise ValueError(f"write burst must be >= 1, got {burst}")
        self.qps, self.burst = float(qps), int(burst)
        self.clock, self._sleep = clock, sleep
        self._tokens = float(burst)  # may go negative: writes already promised a later slot
        self._at = clock()
        self.waited = 0.0  # seconds writes spent waiting for a token, summed (for /metrics)

    def reserve(self) -> float:
        """Take one token; return how long the caller must wait before it is due."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            self.waited += delay
            await self._sleep(delay)


class KubeApi:
    """Async JSON client. Calls return the decoded object or raise ApiError; a status listed in
    ``ignore`` returns None instead (e.g. create with ignore=(409,): names are deterministic,
    so "already exists" is success)."""

    def __init__(self, config: KubeConfig, *, pool_size: int = 64,
                 user_agent: str = "omnistage", write_limit: WriteLimit | None = None) -> None:
        self.config = config
        self.write_limit = write_limit  # None: writes are not rate limited
        self.writes = 0
        self.writes_by_verb: dict[str, int] = {}
        self.pool_size = pool_size
        self.user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_ctx: ssl.SSLContext | bool = (
                self.config.ssl_context() if self.config.server.startswith("https") else False
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_ctx, limit=self.pool_size),
                headers={"Accept": "application/json", "User-Agent": self.user_agent},
            )
        return self._session

    async def _token(self) -> str | None:
        if self.config.exec_plugin is not None:  # it may run the plugin: not on the loop
            return await asyncio.to_thread(self.config.bearer_token)
        return self.config.bearer_token()

    @contextlib.asynccontextmanager
    async def _response(self, method: str, url_path: str, content_type: str | None = None,
                        extra_headers: dict[str, str] | None = None,
                        **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """One HTTP exchange with the current credentials. A 401 gets new ones where there
        is a way (an exec plugin runs again) and one more try; then the 401 stands.
        extra_headers go along (never in place of the credentials)."""
        for attempt in (1, 2):
            token = await self._token()
            headers = {k: v for k, v in (extra_headers or {}).items()
                       if k.lower() not in ("authorization", "content-type")}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            if content_type:
                headers["Content-Type"] = content_type
            async with self._http().request(method, self.config.server + url_path,
                                            headers=headers, **kwargs) as resp:
                if resp.status == 401 and attempt == 1 and await asyncio.to_thread(
                        self.config.renew, token):
                    log.info("%s %s: HTTP 401; trying again with new credentials",
                             method, url_path)
                    continue
                yield resp
                return

    @staticmethod
    def _query(params: dict[str, Any] | None) -> dict[str, str]:
        out = {}
        for k, v in (params or {}).items():
            if v is None:
                continue
            out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
        return out

    async def request(
        self, method: str, url_path: str, body: Any = None, *,
        params: dict[str, Any] | None = None, content_type: str = "application/json",
        timeout: float = 60.0, raw: bool = False, ignore: tuple[int, ...] = (),
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One REST call. ``params`` become the query string (None values dropped); ``raw``
        returns a 2xx body as text (proxy, log and metrics endpoints); ``headers`` go along
        (a proxied service's own, such as the orchestrator's admin key; never logged)."""
        return (await self._exchange(method, url_path, body, params=params,
                                     content_type=content_type, timeout=timeout, raw=raw,
                                     ignore=ignore, headers=headers))[1]

    async def _exchange(
        self, method: str, url_path: str, body: Any, *, params: dict[str, Any] | None,
        content_type: str, timeout: float, raw: bool, ignore: tuple[int, ...],
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """`request`, with the HTTP status (an ignored status answers None as its body)."""
        if method != "GET":
            if self.write_limit is not None:
                await self.write_limit.acquire()
            self.writes += 1
            self.writes_by_verb[method] = self.writes_by_verb.get(method, 0) + 1
            write_log.info("%s %s", method, url_path)
        data = None if body is None else json.dumps(body)
        async with self._response(
            method, url_path, content_type if body is not None else None, headers, data=data,
            params=self._query(params), timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text(errors="replace")
            if resp.status < 300 and raw:
                return resp.status, text
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = text
            if resp.status >= 300:
                if resp.status in ignore:
                    log.debug("%s %s: HTTP %d, ignored", method, url_path, resp.status)
                    return resp.status, None
                raise ApiError(resp.status, payload, method, url_path)
            return resp.status, payload

    async def get(self, url_path: str, *, ignore: tuple[int, ...] = (), **params: Any) -> Any:
        return await self.request("GET", url_path, params=params, ignore=ignore)

    async def list(self, url_path: str, **params: Any) -> list[Obj]:
        """The items of a collection (``labelSelector=...``, ``fieldSelector=...``)."""
        return list((await self.get(url_path, **params))["items"])

    async def create(self, url_path: str, obj: Obj, *, ignore: tuple[int, ...] = (),
                     **params: Any) -> Any:
        return await self.request("POST", url_path, obj, params=params, ignore=ignore)

    async def replace(self, url_path: str, obj: Obj, *, ignore: tuple[int, ...] = ()) -> Any:
        return await self.request("PUT", url_path, obj, ignore=ignore)

    async def patch(self, url_path: str, patch: Any, kind: str = "merge", *,
                    ignore: tuple[int, ...] = (), **params: Any) -> Any:
        """Patch with ``kind`` in merge|strategic|json."""
        return await self.request("PATCH", url_path, patch, params=params,
                                  content_type=PATCH_TYPES[kind], ignore=ignore)

    async def delete(self, url_path: str, body: Obj | None = None, *,
                     ignore: tuple[int, ...] = (), **params: Any) -> Any:
        return await self.request("DELETE", url_path, body, params=params, ignore=ignore)

    async def apply(self, url_path: str, obj: Obj, *, field_manager: str, force: bool = False,
                    ignore: tuple[int, ...] = ()) -> Applied | None:
        """Server-side apply of ``obj``, the whole intent of ``field_manager``, at the object's
        path: it creates the object or updates it, and fields this manager applied before but
        ``obj`` leaves out are removed (unless another manager owns them too). ``force`` takes
        over fields another manager set (a 409 Conflict without it). A write, counted."""
        status, answer = await self._exchange(
            "PATCH", url_path, obj, params={"fieldManager": field_manager, "force": force or None},
            content_type=APPLY_PATCH, timeout=60.0, raw=False, ignore=ignore)
        return None if answer is None else Applied(answer, status == 201)

    async def watch(self, url_path: str, resource_version: str | None = None, *,
                    timeout_seconds: int = 300, **params: Any) -> AsyncIterator[WatchEvent]:
        """Stream watch events (bookmarks included) from ``resource_version`` until the server
        ends the watch. 410 Gone, as a status or an ERROR event, raises WatchExpired; any other
        ERROR event raises ApiError. Cancel the consuming task to stop at once."""
        query = self._query({
            **params, "watch": True, "allowWatchBookmarks": True,
            "resourceVersion": resource_version or None, "timeoutSeconds": timeout_seconds,
        })
        timeout = aiohttp.ClientTimeout(total=None, connect=15, sock_read=timeout_seconds + 30)
        async with self._response("GET", url_path, params=query, timeout=timeout) as resp:
            if resp.status >= 300:
                text = await resp.text(errors="replace")
                try:
                    body: Any = json.loads(text)
                except ValueError:
                    body = text
                cls = WatchExpired if resp.status == 410 else ApiError
                raise cls(resp.status, body, "WATCH", url_path)
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf.extend(chunk)
                while (nl := buf.find(b"\n")) != -1:
                    line, buf = bytes(buf[:nl]), buf[nl + 1:]
                    if line.strip():
                        yield _event(json.loads(line), url_path)
            if buf.strip():
                yield _event(json.loads(bytes(buf)), url_path)

    async def list_watch(
        self, url_path: str, *, resource_version: str | None = None,
        timeout_seconds: int = 300, backoff: tuple[float, float] = (0.5, 15.0), **params: Any,
    ) -> AsyncIterator[Listed | WatchEvent]:
        """An informer's loop: a Listed, then ADDED/MODIFIED/DELETED events, forever.

        Given ``resource_version`` (the caller has listed already), it watches from there first.
        The watch resumes from the last resourceVersion seen (bookmarks included), so a dropped
        connection or a restarted API server loses no update; 410 Gone relists at once (the
        consumer diffs the Listed against what it knew); other errors retry with exponential
        backoff. Bookmarks only move the resourceVersion and are not yielded.
        """
        rv = resource_version or ""
        retries = Backoff(*backoff)
        while True:
            try:
                if not rv:
                    listing = await self.get(url_path, **params)
                    rv = str((listing.get("metadata") or {}).get("resourceVersion") or "")
                    yield Listed(list(listing.get("items") or []), rv)
                started, events = time.monotonic(), 0
                async for event in self.watch(url_path, rv, timeout_seconds=timeout_seconds,
                                              **params):
                    rv = event.resource_version or rv
                    events += 1
                    if event.type != "BOOKMARK":
                        yield event
                if events or time.monotonic() - started >= 1.0:
                    retries.reset()
                    continue  # the server ended the watch (timeoutSeconds): resume from rv
                raise ConnectionError("watch ended at once without events")
            except WatchExpired:
                log.info("watch of %s expired (410 Gone); listing again", url_path)
                rv = ""
            except (ApiError, ConfigError, aiohttp.ClientError, OSError,  # OSError: timeouts
                    ValueError) as exc:  # ConfigError: an exec plugin failed for now
                delay = retries.failed()
                log.warning("list/watch of %s failed (%s: %s); retrying in %.1fs",
                            url_path, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _event(doc: Obj, url_path: str) -> WatchEvent:
    etype, obj = str(doc.get("type")), doc.get("object") or {}
    if etype == "ERROR":
        code = int(obj.get("code") or 500)
        raise (WatchExpired if code == 410 else ApiError)(code, obj, "WATCH", url_path)
    return WatchEvent(etype, obj)

