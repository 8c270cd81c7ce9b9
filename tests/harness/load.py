"""Bounded loopback load for lifecycle tests: closed-loop clients on keep-alive connections, with
every request counted and classified.

Why its own module: the restart, crash and shutdown tests all need the same accounting (total,
ok, refused, failed, resets, durations) and the same client behaviour (one aiohttp session per
client, so connections are reused exactly as a keep-alive client would).

A request ends as exactly one of:
- ok: 200;
- aborted: 200 whose body says `"status": "abort"` (the pipeline route's terminal abort; a
  request cut by a replica's drain timeout is not one: it fails with 503 `drain_timeout`);
- refused: 503 with a code that says it was never admitted (`shutting_down`, `no_replica`,
  `draining`, `not_ready`), so the client may retry it anywhere;
- failed: any other status (for example 502 `replica_lost`);
- reset: the connection broke after the request was sent, without a response, so the client
  cannot tell whether it was admitted;
- unreachable: the connection could not be opened (nothing was sent);
- hung: no answer within the client's timeout;
- unavailable: the client found no ready backend and sent nothing (see `Endpoints`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

REFUSED_CODES = frozenset({"shutting_down", "no_replica", "draining", "not_ready"})


@dataclass
class Result:
    kind: str
    sent: float  # time.monotonic() when the request left
    seconds: float
    target: str = ""
    status: int | None = None
    code: str | None = None
    connection_close: bool = False  # the response said Connection: close
    detail: str = ""


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """Counts by kind plus total and the latency figures of the ok requests."""
    kinds = Counter(r.kind for r in results)
    ok = sorted(r.seconds for r in results if r.kind == "ok")
    out: dict[str, Any] = {"total": len(results), **{k: kinds.get(k, 0) for k in (
        "ok", "aborted", "refused", "failed", "reset", "unreachable", "hung", "unavailable")}}
    if ok:
        out["ok_p50_s"] = round(ok[len(ok) // 2], 3)
        out["ok_max_s"] = round(ok[-1], 3)
    bad = [r.seconds for r in results if r.kind in ("failed", "reset")]
    if bad:
        out["failed_max_s"] = round(max(bad), 3)
    return out


def _aborted(payload: bytes) -> bool:
    try:
        doc = json.loads(payload)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("status") == "abort"


def longest_gap(results: Sequence[Result]) -> float:
    """The longest time between two consecutive ok responses (completion times)."""
    done = sorted(r.sent + r.seconds for r in results if r.kind == "ok")
    return max((b - a for a, b in itertools.pairwise(done)), default=0.0)


def ready(url: str, timeout: float = 1.0) -> bool:
    return probe(url, timeout) is True


def probe(url: str, timeout: float = 1.0) -> bool | None:
    """GET /readyz: True on 200, False when the backend answered otherwise or refused the
    connection, None when it did not answer within `timeout` (a busy machine, not an answer)."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=timeout) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False
    except urllib.error.URLError as exc:
        return None if isinstance(exc.reason, TimeoutError) else False
    except TimeoutError:
        return None
    except OSError:
        return False


#: Polls in a row without an answer before a ready backend is dropped, as a readiness probe's
#: failureThreshold: a loaded machine's slow answer is not a "not ready".
SILENT_POLLS = 3


class Endpoints:
    """A Service's endpoints, emulated: a poller checks each backend's /readyz every `period`
    seconds, and `pick()` returns a ready one at random (None when none is). Like kube-proxy,
    it only decides where new connections go; a client keeps using its open connection until
    the server closes it. A backend that answers not ready (or refuses) leaves at once; one that
    was ready and does not answer in time stays until SILENT_POLLS polls in a row go unanswered,
    as the kubelet's probe would keep it."""

    def __init__(self, backends: Callable[[], Sequence[str]], period: float = 0.1) -> None:
        self.backends = backends
        self.period = period
        self.ready: list[str] = []
        self._silent: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="endpoints")

    def __enter__(self) -> Endpoints:
        self._refresh()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _refresh(self) -> None:
        before, ready, silent = set(self.ready), [], {}
        for backend in list(self.backends()):
            answer = probe(backend, timeout=1.0)
            if answer is None:
                silent[backend] = self._silent.get(backend, 0) + 1
                if backend in before and silent[backend] < SILENT_POLLS:
                    ready.append(backend)
            elif answer:
                ready.append(backend)
        self._silent, self.ready = silent, ready

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            self._refresh()

    def pick(self) -> str | None:
        current = self.ready
        return random.choice(current) if current else None


@dataclass
class Load:
    """`clients` closed-loop clients POSTing `body` to `path` on the backend `pick()` returns,
    each on its own keep-alive session, pausing `pause` seconds between requests."""

    pick: Callable[[], str | None]
    path: str
    body: dict[str, Any]
    clients: int = 4
    pause: float = 0.02
    timeout: float = 60.0
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True,
                                        name="load")
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 10)

    def snapshot(self) -> list[Result]:
        with self._lock:
            return list(self.results)

    def count(self, kind: str = "ok") -> int:
        return sum(1 for r in self.snapshot() if r.kind == kind)

    def wait_for(self, n: int, kind: str = "ok", timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count(kind) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"load: fewer than {n} {kind} in {timeout}s: "
                                     f"{summary(self.snapshot())}")
            time.sleep(0.05)

    async def _main(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(self.clients)))

    async def _client(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                result = await self._one(session)
                with self._lock:
                    self.results.append(result)
                await asyncio.sleep(self.pause if result.kind == "ok" else max(self.pause, 0.05))

    async def _one(self, session: aiohttp.ClientSession) -> Result:
        target = self.pick()
        sent = time.monotonic()
        if target is None:
            return Result("unavailable", sent, 0.0)
        try:
            async with session.post(target + self.path, json=self.body) as resp:
                payload = await resp.read()
                closing = resp.headers.get("Connection", "").lower() == "close"
                code = None
                if resp.status != 200:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        code = (await resp.json(content_type=None))["error"]["code"]
                kind = ("ok" if resp.status == 200 else
                        "refused" if resp.status == 503 and code in REFUSED_CODES else "failed")
                if kind == "ok" and _aborted(payload):
                    kind = "aborted"
                return Result(kind, sent, time.monotonic() - sent, target, resp.status, code,
                              closing, payload[:200].decode(errors="replace") if kind != "ok"
                              else "")
        except aiohttp.ClientConnectorError as exc:  # could not connect: nothing was sent
            return Result("unreachable", sent, time.monotonic() - sent, target,
                          detail=repr(exc))
        except TimeoutError:
            return Result("hung", sent, time.monotonic() - sent, target)
        except (aiohttp.ClientError, ConnectionError) as exc:
            return Result("reset", sent, time.monotonic() - sent, target, detail=repr(exc))
