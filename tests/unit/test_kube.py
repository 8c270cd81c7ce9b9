"""The names and checks the operator and the runtime share (omnistage.kube): one definition of
"draining", of the worker's /state reading and of the API group, used by both sides."""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from omni_operator import readiness
from omnistage import kube

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("runtime/omnistage", "operator/omni_operator")
           for p in (ROOT / d).rglob("*.py")]


def _pod(annotation: str | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p-a-0"}
    if annotation is not None:
        meta["annotations"] = {kube.ANNOTATION_DRAINING: annotation}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta}


@pytest.mark.parametrize(("pod", "marked", "draining"), [
    (_pod(), False, False),
    (_pod("true"), True, True),
    (_pod("True"), False, False),  # the operator writes "true"; nothing else is its mark
    (_pod("false"), False, False),
    (_pod(deleting=True), False, True),
    (_pod("false", deleting=True), False, True),
    ({}, False, False),
    ({"metadata": {"annotations": None}}, False, False),
])
def test_draining_is_the_mark_or_a_deletion(pod: dict[str, Any], marked: bool,
                                             draining: bool) -> None:
    assert kube.marked_draining(pod) is marked
    assert kube.is_draining(pod) is draining


def test_the_operator_gate_uses_the_runtime_check() -> None:
    assert readiness.is_draining is kube.is_draining


@pytest.mark.parametrize(("state", "left"), [
    ({"in_flight": 2, "queued": 3}, 2),  # in_flight counts the queued ones already
    ({"in_flight": 1}, 1),
    ({}, 0),
    ({"in_flight": "x"}, None),
    ([1, 2], None),
    (None, None),
])
def test_work_left_of_a_state_body(state: Any, left: int | None) -> None:
    assert kube.work_left(state) == left


def test_worker_state_url() -> None:
    assert kube.worker_state_url("127.1.0.5") == "http://127.1.0.5:8080/state"
    assert kube.worker_state_url("fd00::5") == "http://[fd00::5]:8080/state"


@pytest.fixture
def serve() -> Iterator[Any]:
    """Start a loopback HTTP server answering GET /state with the given bytes; yields its URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(body: bytes) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != kube.WORKER_STATE_PATH:  # read_work_left: None on a 404
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}{kube.WORKER_STATE_PATH}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_read_work_left_from_a_live_worker(serve: Any) -> None:
    state = {"replica_id": "p-a-0", "in_flight": 2, "queued": 1, "draining": True}
    assert kube.read_work_left(serve(json.dumps(state).encode()), 5.0) == 2
    assert kube.read_work_left(serve(b"not json"), 5.0) is None
    assert kube.read_work_left(serve(b"[1]"), 5.0) is None


def test_read_work_left_when_nothing_listens_is_zero() -> None:
    with socket.socket() as sock:  # bound, not listening: the kernel refuses connections
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}{kube.WORKER_STATE_PATH}"
        assert kube.read_work_left(url, 5.0) == 0


def test_read_work_left_from_a_worker_that_does_not_answer_is_unknown() -> None:
    with socket.socket() as sock:  # listening, never answering: the read times out
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}{kube.WORKER_STATE_PATH}"
        assert kube.read_work_left(url, 0.2) is None


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Name an HTTP proxy in the environment, as an operator pod behind a proxy has it.
    urllib's urlopen reads the environment once and keeps that opener: cleared here, so a read
    that honours the proxy really uses the one named."""

    def name(proxy: str) -> None:
        for var in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(var, proxy)
        for var in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(urllib.request, "_opener", None)

    return name


def test_read_work_left_never_goes_through_a_refusing_proxy(serve: Any, proxy_env: Any) -> None:
    """The worker has a request in flight; the proxy named in the environment refuses.
    Kills: reading through the environment's proxy, whose refusal read as "nothing listens" (0
    in flight) made the operator delete a replica with a request in flight."""
    with socket.socket() as sock:  # bound, not listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        proxy_env(f"http://127.0.0.1:{sock.getsockname()[1]}")
        assert kube.read_work_left(serve(b'{"in_flight": 1}'), 5.0) == 1


def test_read_work_left_reads_the_worker_not_an_answering_proxy(
    serve: Any, proxy_env: Any
) -> None:
    """Kills: reading through the environment's proxy, which answers for itself (here: "idle",
    for any URL it is asked) while the worker has two requests in flight."""

    class AnyPath(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # a proxy is asked for the full URL, not /state
            body = b'{"in_flight": 0}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), AnyPath)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proxy_env(f"http://127.0.0.1:{server.server_address[1]}")
        assert kube.read_work_left(serve(b'{"in_flight": 2}'), 5.0) == 2
    finally:
        server.shutdown()
        server.server_close()


def test_one_source_for_the_mark_the_state_route_and_the_api_group() -> None:
    """Only omnistage.kube reads the draining mark's value, names the /state route or spells
    the API group; everyone else calls it (the operator writes the mark in drain.py)."""
    mark_read = re.compile(r"get\(\s*(?:kube\.)?ANNOTATION_DRAINING\b")
    group = re.compile(r"""["']omnistage\.io(?:["']|/v1)""")
    state_route = re.compile(r"""["'](?:/proxy)?/state["']|\}/(?:proxy/)?state\b""")
    for path in SOURCES:
        if path == ROOT / "runtime/omnistage/kube.py":
            continue
        text = path.read_text()
        rel = path.relative_to(ROOT)
        assert not mark_read.search(text), f"{rel} reads the draining mark itself"
        assert not group.search(text), f"{rel} spells the API group"
        if rel.name not in ("sideport.py",):  # the route's server
            assert not state_route.search(text), f"{rel} builds the /state URL itself"
