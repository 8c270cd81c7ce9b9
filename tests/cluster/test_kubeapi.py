"""The one Kubernetes client (`omnistage.kubeapi`) against the real kube-apiserver: writes and
ignored statuses, list+watch across server-ended watches, and in-cluster service-account
credentials with least-privilege RBAC and a rotating token. (410 Gone cannot be forced on a
fresh control plane, whose etcd has not compacted yet: tests/unit covers it.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from omnistage import kubeapi
from omnistage.kubeapi import (
    ApiError,
    KubeApi,
    KubeConfig,
    Listed,
    WatchEvent,
    path,
)
from omnistage.kubeapi import auth as kubeauth
from tests.harness.cluster import Cluster
from tests.harness.waiting import HANG_GUARD, until


def _configmap(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


async def test_writes_ignored_statuses_and_errors(kube: Cluster, namespace: str) -> None:
    api = KubeApi(KubeConfig.from_kubeconfig(kube.kubeconfig))
    cms = path("ConfigMap", namespace)
    try:
        created = await api.create(cms, _configmap("a", k="1"))
        assert created["metadata"]["uid"]
        assert await api.create(cms, _configmap("a"), ignore=(409,)) is None
        with pytest.raises(ApiError) as exists:
            await api.create(cms, _configmap("a"))
        assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
        patched = await api.patch(f"{cms}/a", {"data": {"k": "2"}})
        assert patched["data"] == {"k": "2"}
        assert "a" in [c["metadata"]["name"] for c in await api.list(cms)]
        assert await api.delete(f"{cms}/a") is not None
        assert await api.get(f"{cms}/a", ignore=(404,)) is None
        assert await api.delete(f"{cms}/a", ignore=(404,)) is None
        with pytest.raises(ApiError) as invalid:
            await api.create(cms, {"apiVersion": "v1", "kind": "ConfigMap",
                                   "metadata": {"name": "Not_Valid"}})
        assert invalid.value.status == 422 and "Not_Valid" in invalid.value.message
    finally:
        await api.close()
    assert api.writes_by_verb == {"POST": 4, "PATCH": 1, "DELETE": 2}
    assert api.writes == 7


async def test_list_watch_resumes_when_the_server_ends_the_watch(
    kube: Cluster, namespace: str
) -> None:
    """The server ends each watch after timeoutSeconds; list_watch resumes from the last
    resourceVersion, so a change made between two watches arrives, with no second list."""
    api = KubeApi(KubeConfig.from_kubeconfig(kube.kubeconfig))
    cms = path("ConfigMap", namespace)
    watches = 0
    watch = api.watch

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal watches
        watches += 1
        return watch(*args, **kwargs)

    api.watch = counted  # type: ignore[method-assign]
    items: asyncio.Queue[Listed | WatchEvent] = asyncio.Queue()
    stream = api.list_watch(cms, timeout_seconds=1)

    async def consume() -> None:  # the stream runs on while the test waits
        async for item in stream:
            await items.put(item)

    consumer: asyncio.Task[None] | None = None
    try:
        await api.create(cms, _configmap("before"))
        consumer = asyncio.create_task(consume())
        async with asyncio.timeout(HANG_GUARD):
            first = await items.get()
            assert isinstance(first, Listed)
            assert "before" in [c["metadata"]["name"] for c in first.items]
            await until(lambda: watches >= 2, "the first watch to end and a second to begin")
            await api.create(cms, _configmap("after"))
            while True:
                item = await items.get()
                assert isinstance(item, WatchEvent), "resuming needs no relist"
                if item.object["metadata"]["name"] == "after":
                    assert item.type == "ADDED"
                    break
    finally:
        if consumer is not None:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
        await stream.aclose()
        await api.close()
    assert api.writes == 2


async def test_in_cluster_service_account(
    kube: Cluster, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials as a kubelet mounts them: the token file (re-read as it rotates), the CA and
    the namespace. The account may list ConfigMaps in its namespace and nothing else."""
    k, ns = kube.kube, namespace
    rbac = "rbac.authorization.k8s.io/v1"
    k.create(f"/apis/{rbac}/namespaces/{ns}/roles", {
        "apiVersion": rbac, "kind": "Role", "metadata": {"name": "cm-reader"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]})
    k.create(f"/apis/{rbac}/namespaces/{ns}/rolebindings", {
        "apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "cm-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]})

    def token() -> str:
        req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"expirationSeconds": 600}}
        return str(k.create(f"/api/v1/namespaces/{ns}/serviceaccounts/default/token",
                            req)["status"]["token"])

    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token())
    (sa / "namespace").write_text(ns)
    assert k.config.ca_file
    shutil.copy(k.config.ca_file, sa / "ca.crt")
    server = urlparse(k.config.server)
    monkeypatch.setattr(kubeauth, "SA_DIR", sa)  # read where it is used
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", server.hostname or "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))  # in a pod, in-cluster wins

    config = KubeConfig.load()
    assert (config.namespace, config.cert_file) == (ns, None)
    assert kubeapi.default_namespace() == ns
    api = KubeApi(config)
    try:
        deadline = time.monotonic() + 10  # RBAC reaches the authorizer's cache shortly
        while True:
            try:
                assert await api.list(path("ConfigMap", ns)) is not None
                break
            except ApiError as exc:
                if exc.status != 403 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        with pytest.raises(ApiError) as denied:
            await api.list(path("Pod", ns))
        assert denied.value.status == 403 and "serviceaccount" in denied.value.message
        # The token rotates on disk: the next call uses the new one.
        (sa / "token").write_text("not-a-token")
        os.utime(sa / "token", (time.time() + 10, time.time() + 10))
        with pytest.raises(ApiError) as unauthorized:
            await api.list(path("ConfigMap", ns))
        assert unauthorized.value.status == 401
        (sa / "token").write_text(token())
        os.utime(sa / "token", (time.time() + 20, time.time() + 20))
        assert await api.list(path("ConfigMap", ns)) is not None
    finally:
        await api.close()
