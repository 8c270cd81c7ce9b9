"""Wakers: the StagePool annotation patch (the cluster waker) and the in-process callback."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omnistage import kube
from omnistage.kubeapi import KubeApi, KubeConfig
from omnistage.orchestrator.k8s_membership import KubernetesMembership
from omnistage.orchestrator.membership import StaticMembership
from omnistage.orchestrator.wake import CallbackWaker, StagePoolWaker, waker_for


class FakeApi:
    def __init__(self) -> None:
        self.patches: list[tuple[str, Any, str]] = []

    async def patch(self, url: str, body: Any, kind: str = "merge") -> Any:
        self.patches.append((url, body, kind))
        return {}


async def test_stage_pool_waker_merge_patches_the_pools_wake_annotation() -> None:
    """Through the real KubeApi to an HTTP server standing in for the API server."""
    seen: list[tuple[str, str, str, Any]] = []

    async def patch(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, request.content_type, await request.json()))
        return web.json_response({"kind": "StagePool"})

    app = web.Application()
    app.router.add_route("PATCH", "/{tail:.*}", patch)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    api = KubeApi(KubeConfig(server=str(server.make_url("")).rstrip("/")))
    when = datetime(2026, 12, 1, 13, 40, 5, 123000, tzinfo=UTC)
    try:
        await StagePoolWaker(lambda: api, "ns1", "chat", now=lambda: when).wake("vocoder")
    finally:
        await api.close()
        await server.close()
    assert seen == [("PATCH", "/apis/omnistage.io/v1alpha1/namespaces/ns1/stagepools/chat-vocoder",
                     "application/merge-patch+json",
                     {"metadata": {"annotations": {
                         "omnistage.io/wake-requested-at": "2026-12-01T13:40:05.123Z"}}})]
    assert kube.ANNOTATION_WAKE_REQUESTED == "omnistage.io/wake-requested-at"


async def test_stage_pool_waker_before_the_client_exists_says_so() -> None:
    with pytest.raises(RuntimeError, match="no Kubernetes client"):
        await StagePoolWaker(lambda: None, "ns", "p").wake("a")


async def test_callback_waker_takes_plain_and_async_functions() -> None:
    seen: list[str] = []

    async def later(stage: str) -> None:
        seen.append(f"async {stage}")

    await CallbackWaker(seen.append).wake("a")
    await CallbackWaker(later).wake("b")
    assert seen == ["a", "async b"]


def test_the_waker_follows_the_membership() -> None:
    members = KubernetesMembership("ns", "p", api=FakeApi())  # type: ignore[arg-type]
    waker = waker_for(members)
    assert isinstance(waker, StagePoolWaker)
    assert (waker.namespace, waker.pipeline, waker.api()) == ("ns", "p", members.api)
    assert waker_for(StaticMembership()) is None
