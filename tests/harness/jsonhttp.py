"""A GET-only JSON HTTP server on loopback: the HTTP of tests.harness.fakeload, the one fake of
orchestrator pods' GET /v1/load. HTTP/1.1 keep-alive, as the API server's service proxy and the
operator's reader speak it."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = Callable[[str], tuple[int, Any]]  # request path -> (HTTP status, JSON document)


class JsonServer:
    """Serves `reply(path)` as JSON on (host, port), port 0 for a free one; counts the reads.

    A reader that gives up (its timeout) and closes the connection is not an error here."""

    def __init__(self, reply: Reply, host: str = "127.0.0.1", port: int = 0) -> None:
        self.reads = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with lock:
                    outer.reads += 1
                code, document = reply(self.path)
                body = json.dumps(document).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass

        self._server = Server((host, port), Handler)
        self.host, self.port = host, self._server.server_address[1]
        self.base_url = f"http://{host}:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
