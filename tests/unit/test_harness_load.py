"""The emulated Service endpoints of tests/harness/load.py: a backend that answers not ready
leaves at once, one that is slow to answer stays until several polls in a row go unanswered
(as a readiness probe's failureThreshold keeps it), so a loaded machine's slow /readyz does not
read as an outage in the lifecycle tests and benches."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from tests.harness.load import SILENT_POLLS, Endpoints, probe


class _Backend(http.server.BaseHTTPRequestHandler):
    mode = "ready"  # ready | not-ready | silent
    release = threading.Event()

    def do_GET(self) -> None:
        if type(self).mode == "silent":
            type(self).release.wait(5)  # no answer within the poll's timeout
        status = 200 if type(self).mode == "ready" else 503
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def backend() -> Iterator[tuple[str, type[_Backend]]]:
    handler = type("Handler", (_Backend,), {"mode": "ready", "release": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    handler.release.set()
    server.shutdown()
    server.server_close()


def test_probe_tells_an_answer_from_silence(backend: tuple[str, type[_Backend]]) -> None:
    url, handler = backend
    assert probe(url) is True
    handler.mode = "not-ready"
    assert probe(url) is False
    handler.mode = "silent"
    assert probe(url, timeout=0.2) is None
    assert probe("http://127.0.0.1:9") is False  # refused: nothing listens there


def test_a_slow_backend_stays_until_it_is_silent_several_polls_in_a_row(
        backend: tuple[str, type[_Backend]]) -> None:
    url, handler = backend
    endpoints = Endpoints(lambda: [url])
    endpoints._refresh()
    assert endpoints.ready == [url]
    handler.mode = "silent"
    for _ in range(SILENT_POLLS - 1):
        endpoints._refresh()
        assert endpoints.ready == [url]
    endpoints._refresh()
    assert endpoints.ready == []
    handler.mode = "ready"
    endpoints._refresh()
    assert endpoints.ready == [url]


def test_a_backend_that_answers_not_ready_leaves_at_once(
        backend: tuple[str, type[_Backend]]) -> None:
    url, handler = backend
    endpoints = Endpoints(lambda: [url])
    endpoints._refresh()
    handler.mode = "not-ready"
    endpoints._refresh()
    assert endpoints.ready == []


def test_a_backend_never_seen_ready_is_not_picked_while_silent(
        backend: tuple[str, type[_Backend]]) -> None:
    url, handler = backend
    handler.mode = "silent"
    endpoints = Endpoints(lambda: [url])
    endpoints._refresh()
    assert endpoints.ready == [] and endpoints.pick() is None
