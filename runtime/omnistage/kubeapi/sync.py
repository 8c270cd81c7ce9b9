"""The same client for synchronous code (tests, benches): `KubeApi` on a private event loop in
a daemon thread, not a second HTTP implementation."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from omnistage.kubeapi.auth import KubeConfig
from omnistage.kubeapi.client import Applied, KubeApi, Listed, WatchEvent
from omnistage.kubeapi.resources import Obj

T = TypeVar("T")


class SyncKubeApi:
    """`KubeApi` for threads and scripts: each call runs on a private event loop in a daemon
    thread and blocks for its answer. Safe to call from many threads at once."""

    def __init__(self, config: KubeConfig, **kwargs: Any) -> None:
        self.config = config
        self.api = KubeApi(config, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubeapi",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def load(cls, kubeconfig: str | os.PathLike[str] | None = None,
             context: str | None = None, **kwargs: Any) -> SyncKubeApi:
        return cls(KubeConfig.load(kubeconfig, context), **kwargs)

    @property
    def writes(self) -> int:
        return self.api.writes

    def call(self, coro: Awaitable[T]) -> T:
        """Run one coroutine of the async client on its loop and wait for the result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def request(self, method: str, url_path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.call(self.api.request(method, url_path, body, **kwargs))

    def get(self, url_path: str, **params: Any) -> Any:
        return self.call(self.api.get(url_path, **params))

    def list(self, url_path: str, **params: Any) -> list[Obj]:
        return self.call(self.api.list(url_path, **params))

    def create(self, url_path: str, obj: Obj, **params: Any) -> Any:
        return self.call(self.api.create(url_path, obj, **params))

    def replace(self, url_path: str, obj: Obj, **kwargs: Any) -> Any:
        return self.call(self.api.replace(url_path, obj, **kwargs))

    def patch(self, url_path: str, patch: Any, kind: str = "merge", **params: Any) -> Any:
        return self.call(self.api.patch(url_path, patch, kind, **params))

    def delete(self, url_path: str, body: Obj | None = None, **params: Any) -> Any:
        return self.call(self.api.delete(url_path, body, **params))

    def apply(self, url_path: str, obj: Obj, **kwargs: Any) -> Applied | None:
        return self.call(self.api.apply(url_path, obj, **kwargs))

    def watch(self, url_path: str, stop: threading.Event, resource_version: str | None = None,
              **kwargs: Any) -> Iterator[WatchEvent]:
        """`KubeApi.watch` as a blocking iterator; it ends when the server ends the watch or
        ``stop`` is set."""
        return self._iterate(lambda: self.api.watch(url_path, resource_version, **kwargs), stop)

    def list_watch(self, url_path: str, stop: threading.Event,
                   **kwargs: Any) -> Iterator[Listed | WatchEvent]:
        """`KubeApi.list_watch` as a blocking iterator, until ``stop`` is set."""
        return self._iterate(lambda: self.api.list_watch(url_path, **kwargs), stop)

    def _iterate(self, make: Callable[[], AsyncIterator[T]], stop: threading.Event) -> Iterator[T]:
        items: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def pump() -> None:
            try:
                async with contextlib.aclosing(make()) as stream:  # type: ignore[type-var]
                    async for item in stream:
                        items.put(("item", item))
            except Exception as exc:
                items.put(("error", exc))
            finally:
                items.put(("end", None))

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while not stop.is_set():
                try:
                    what, value = items.get(timeout=0.1)
                except queue.Empty:
                    continue
                if what == "end":
                    return
                if what == "error":
                    raise value
                yield value
        finally:
            future.cancel()

    def close(self) -> None:
        """Close the HTTP session and stop the loop thread (idempotent)."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.api.close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        with contextlib.suppress(RuntimeError):
            self._loop.close()
        atexit.unregister(self.close)
