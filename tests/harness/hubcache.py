"""Hugging Face hub models without the network: a cache in the standard layout, and a hub.

- ``add_to_cache`` writes a saved model directory into a hub cache exactly as huggingface_hub
  lays one out (``models--org--name/blobs/<etag>``, ``snapshots/<commit>/<file>`` symlinks to
  the blobs, ``refs/<revision>`` holding the commit), so from_pretrained and
  snapshot_download(local_files_only=True) find it as they would a real download.
- ``FakeHub`` serves model directories over HTTP on loopback with the few routes
  snapshot_download uses (repo info, HEAD/GET of /resolve/), optionally only to a bearer
  token, so `omnistage models pull` really downloads (with progress) from HF_ENDPOINT.

The models themselves are the built-in tiny ones (random-initialised, save_pretrained).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import urllib.parse
from pathlib import Path

from omnistage.models import save_builtin


def repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def commit_of(model_dir: Path) -> str:
    """A stable 40-hex "commit" for a model directory: the hash of its files."""
    digest = hashlib.sha1()
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(model_dir)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def add_to_cache(cache: Path, repo_id: str, model_dir: Path, revision: str = "main") -> str:
    """Put model_dir into the hub cache at ``cache`` as repo_id@revision; returns the commit."""
    commit = commit_of(model_dir)
    repo = cache / repo_folder(repo_id)
    snapshot = repo / "snapshots" / commit
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / f.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def tiny_models(root: Path) -> dict[str, Path]:
    """The built-in tiny models saved under root, by stage kind (what a hub repo would hold)."""
    out = {}
    for name, kind in (("tiny-llama", "ar"), ("tiny-unet", "diffusion")):
        dest = root / name
        if not dest.exists():
            save_builtin(name, dest)
        out[kind] = dest
    return out


class FakeHub:
    """A loopback hub serving {repo_id: model_dir}; with token set, only to that bearer."""

    def __init__(self, repos: dict[str, Path], token: str | None = None) -> None:
        self.repos = repos
        self.token = token
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Authorization)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._serve(self, body=True)

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _repo(self, parts: list[str]) -> tuple[str, Path] | None:
        repo_id = "/".join(parts[:2])
        return (repo_id, self.repos[repo_id]) if repo_id in self.repos else None

    def _serve(self, req: http.server.BaseHTTPRequestHandler, *, body: bool) -> None:
        auth = req.headers.get("Authorization", "")
        path = urllib.parse.unquote(urllib.parse.urlsplit(req.path).path)
        self.requests.append((req.command, path, auth))
        parts = [p for p in path.split("/") if p]
        if self.token is not None and auth != f"Bearer {self.token}":
            return self._send(req, 401, b'{"error":"gated"}', {"X-Error-Code": "GatedRepo",
                                                               "X-Error-Message": "gated"})
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            found = self._repo(parts[2:4])
            if found is None:
                return self._send(req, 404, b"{}", {"X-Error-Code": "RepoNotFound"})
            repo_id, root = found
            files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
            if parts[4] == "tree":  # the file listing snapshot_download asks for
                tree = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                         "oid": hashlib.sha256((root / f).read_bytes()).hexdigest()}
                        for f in files]
                return self._send(req, 200, json.dumps(tree).encode(),
                                  {"Content-Type": "application/json"}, body=body)
            info = {"id": repo_id, "modelId": repo_id, "sha": commit_of(root),
                    "siblings": [{"rfilename": f} for f in files], "private": False}
            return self._send(req, 200, json.dumps(info).encode(),
                              {"Content-Type": "application/json"}, body=body)
        if len(parts) >= 5 and parts[2] == "resolve":
            found = self._repo(parts[:2])
            if found is None:
                return self._send(req, 404, b"{}", {"X-Error-Code": "RepoNotFound"})
            _, root = found
            file = root.joinpath(*parts[4:])
            if not file.is_file():
                return self._send(req, 404, b"{}", {"X-Error-Code": "EntryNotFound"})
            data = file.read_bytes()
            etag = hashlib.sha256(data).hexdigest()
            return self._send(req, 200, data, {"X-Repo-Commit": commit_of(root),
                                               "ETag": f'"{etag}"'}, body=body)
        return self._send(req, 404, b"{}", {})

    @staticmethod
    def _send(req: http.server.BaseHTTPRequestHandler, status: int, data: bytes,
              headers: dict[str, str], body: bool = True) -> None:
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body and req.command != "HEAD":
            req.wfile.write(data)
