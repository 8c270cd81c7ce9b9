"""The harness' Kubernetes client: the runtime's one client (`omnistage.kubeapi`), used from
synchronous test code, plus conveniences only tests need (YAML fixtures, discovery, polling).

Objects stay JSON dicts exactly as the API server sends them, so tests compare against the wire
format. Works with client-certificate, token and embedded-data kubeconfigs (ours and kind's).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import yaml

from omnistage.kubeapi import ApiError, KubeConfig, Obj, SyncKubeApi, resource_path

T = TypeVar("T")


class Kube(SyncKubeApi):
    """`SyncKubeApi` with the test-only helpers."""

    def __init__(self, config: KubeConfig) -> None:
        super().__init__(config, user_agent="omnistage-harness")

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str], context: str | None = None) -> Kube:
        return cls(KubeConfig.from_kubeconfig(path, context))

    def delete_ignore_missing(self, path: str, body: Obj | None = None) -> None:
        self.delete(path, body, ignore=(404,))

    def apply_yaml(self, text: str, namespace: str | None = None) -> list[Obj]:
        """Create objects from YAML documents (tests use it for fixtures); 409 is an error."""
        return [
            self.create(self.collection_path(doc, namespace), doc)
            for doc in yaml.safe_load_all(text)
            if doc
        ]

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
