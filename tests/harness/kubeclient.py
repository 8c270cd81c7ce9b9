"""A tiny, dependency-light Kubernetes REST client working on plain dicts.

Why: the local pod runner and the cluster tests need only a handful of verbs (get/list/create/
patch/delete/watch) and must not depend on a particular generated client's model classes. Objects
stay JSON dicts exactly as the API server sends them, so tests compare against the wire format.
Works with client-certificate, token and embedded-data kubeconfigs (ours and kind's).
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import urllib3
import yaml

T = TypeVar("T")
Obj = dict[str, Any]

PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


class ApiError(Exception):
    """A non-2xx answer from the API server, keeping the Status body for assertions."""

    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        self.status = status
        self.body = body
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        self.message = body.get("message", str(body)) if isinstance(body, dict) else str(body)
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.message}")


@dataclass
class KubeConfig:
    """The parts of a kubeconfig context that a REST client needs."""

    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    insecure: bool = False

    @classmethod
    def load(cls, path: str | os.PathLike[str], context: str | None = None) -> KubeConfig:
        """Parse a kubeconfig; embedded *-data fields are written to a private temp dir."""
        doc = yaml.safe_load(Path(path).read_text())
        ctx_name = context or doc.get("current-context")
        ctx = _named(doc.get("contexts", []), ctx_name)["context"]
        cluster = _named(doc["clusters"], ctx["cluster"])["cluster"]
        user = (
            _named(doc.get("users", []), ctx.get("user")).get("user", {}) if ctx.get("user") else {}
        )
        base = Path(path).resolve().parent
        tmp: list[Path] = []

        def file_of(field: str, obj: Obj) -> str | None:
            if obj.get(field + "-data"):
                if not tmp:
                    tmp.append(Path(tempfile.mkdtemp(prefix="kubecfg-")))
                    atexit.register(shutil.rmtree, tmp[0], True)
                out = tmp[0] / field
                out.write_bytes(base64.b64decode(obj[field + "-data"]))
                out.chmod(0o600)
                return str(out)
            if obj.get(field):
                return str(base / obj[field])
            return None

        token = user.get("token")
        if not token and user.get("tokenFile"):
            token = Path(user["tokenFile"]).read_text().strip()
        return cls(
            server=cluster["server"].rstrip("/"),
            ca_file=file_of("certificate-authority", cluster),
            cert_file=file_of("client-certificate", user),
            key_file=file_of("client-key", user),
            token=token,
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
        )


def _named(items: list[Obj], name: str | None) -> Obj:
    for item in items:
        if item.get("name") == name:
            return item
    raise KeyError(f"kubeconfig has no entry named {name!r}")


def resource_path(
    api_version: str,
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """REST path for a resource: ``("apps/v1", "deployments", "ns", "x")`` -> /apis/apps/v1/..."""
    root = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [root]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(resource)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class Kube:
    """Thread-safe JSON client; every call returns the decoded object or raises ApiError."""

    def __init__(self, config: KubeConfig, pool_size: int = 32) -> None:
        self.config = config
        kwargs: dict[str, Any] = {"maxsize": pool_size, "block": False}
        if config.insecure:
            kwargs["cert_reqs"] = "CERT_NONE"
        else:
            kwargs["cert_reqs"] = "CERT_REQUIRED"
            if config.ca_file:
                kwargs["ca_certs"] = config.ca_file
        if config.cert_file:
            kwargs["cert_file"] = config.cert_file
            kwargs["key_file"] = config.key_file
        self.headers = {"Accept": "application/json", "User-Agent": "omnistage-harness"}
        if config.token:
            self.headers["Authorization"] = f"Bearer {config.token}"
        self.http = urllib3.PoolManager(**kwargs)

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str], context: str | None = None) -> Kube:
        return cls(KubeConfig.load(path, context))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
        raw: bool = False,
    ) -> Any:
        """One REST call. ``params`` become the query string (None values dropped).

        ``raw`` returns the body as text instead of decoding JSON (proxy and log endpoints).
        """
        url = self.config.server + path
        if params:
            query = {k: v for k, v in params.items() if v is not None}
            if query:
                url += "?" + urlencode(query)
        headers = dict(self.headers)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        resp = self.http.request(
            method, url, body=data, headers=headers, timeout=timeout, retries=False
        )
        if raw and resp.status < 300:
            return resp.data.decode(errors="replace")
        try:
            payload = json.loads(resp.data) if resp.data else {}
        except ValueError:
            payload = resp.data.decode(errors="replace")
        if resp.status >= 300:
            raise ApiError(resp.status, payload, method, path)
        return payload

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def create(self, path: str, obj: Obj, **params: Any) -> Obj:
        return self.request("POST", path, obj, params=params)

    def replace(self, path: str, obj: Obj) -> Obj:
        return self.request("PUT", path, obj)

    def patch(self, path: str, patch: Any, kind: str = "merge", **params: Any) -> Obj:
        """Patch with ``kind`` in strategic|merge|json."""
        return self.request("PATCH", path, patch, params=params, content_type=PATCH_TYPES[kind])

    def delete(self, path: str, body: Obj | None = None, **params: Any) -> Any:
        return self.request("DELETE", path, body, params=params)

    def delete_ignore_missing(self, path: str, body: Obj | None = None) -> None:
        try:
            self.delete(path, body)
        except ApiError as e:
            if e.status != 404:
                raise

    def apply_yaml(self, text: str, namespace: str | None = None) -> list[Obj]:
        """Create objects from YAML documents (tests use it for fixtures); 409 is an error."""
        out = []
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            out.append(self.create(self.collection_path(doc, namespace), doc))
        return out

    def collection_path(self, obj: Obj, namespace: str | None = None) -> str:
        """Collection path for a typed object, discovering whether its kind is namespaced."""
        api_version, kind = obj["apiVersion"], obj["kind"]
        resource, namespaced = self.discover(api_version, kind)
        ns = obj.get("metadata", {}).get("namespace") or namespace
        return resource_path(api_version, resource, ns if namespaced else None)

    def discover(self, api_version: str, kind: str) -> tuple[str, bool]:
        """(resource plural, namespaced) for a kind, from the server's discovery document."""
        root = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        for res in self.get(root)["resources"]:
            if res["kind"] == kind and "/" not in res["name"]:
                return res["name"], bool(res["namespaced"])
        raise KeyError(f"{api_version} has no kind {kind}")

    def watch(
        self,
        path: str,
        stop: threading.Event,
        resource_version: str | None = None,
        timeout_seconds: int = 60,
        **params: Any,
    ) -> Iterator[tuple[str, Obj]]:
        """Stream watch events (type, object) until the server ends the watch or ``stop`` is set.

        An ERROR event (e.g. 410 Gone) is yielded as-is; the caller relists.
        """
        query = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout_seconds,
            **params,
        }
        url = self.config.server + path + "?" + urlencode({k: v for k, v in query.items() if v})
        resp = self.http.request(
            "GET",
            url,
            headers=self.headers,
            preload_content=False,
            timeout=urllib3.Timeout(connect=10, read=timeout_seconds + 15),
            retries=False,
        )
        try:
            if resp.status >= 300:
                raise ApiError(resp.status, resp.data.decode(errors="replace"), "WATCH", path)
            buf = b""
            for chunk in resp.stream(65536, decode_content=True):
                if stop.is_set():
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        ev = json.loads(line)
                        yield ev["type"], ev["object"]
        finally:
            resp.release_conn()


def wait_until(
    fn: Callable[[], T | None],
    timeout: float,
    desc: str,
    interval: float = 0.25,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``fn`` until it returns a truthy value; fail with ``desc`` (and extra context)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except ApiError as e:  # transient API trouble shows up in the timeout message
            last_exc = e
        if time.monotonic() >= deadline:
            extra = on_timeout() if on_timeout else ""
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {desc}"
                + (f" (last error: {last_exc})" if last_exc else "")
                + (f"\n{extra}" if extra else "")
            )
        time.sleep(interval)
