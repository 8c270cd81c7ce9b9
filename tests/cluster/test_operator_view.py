"""The operator's view against the real API server: objects that vanish between the priming list
and the watch must not leave the controller waiting (and retrying) forever.

The session operator is paused, so only the Controller under test acts on these objects; no kopf
watch runs, which is exactly the gap: nothing ever reports the deletions below.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from omni_operator.controller import FINALIZER, Controller
from omnistage import kube as k
from omnistage.kubeapi import KubeApi, KubeConfig, path
from tests.harness.cluster import Cluster
from tests.harness.operator import Operator

ECHO = {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}


def _pipeline(name: str) -> dict[str, Any]:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": name, "finalizers": [FINALIZER]}, "spec": ECHO}


async def _until(pred: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await pred():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


async def _shutdown_finishes(kube: Cluster, ns: str, name: str, stale: tuple[str, str],
                             delete_stale: Callable[[KubeApi], Awaitable[None]]) -> Controller:
    """Prime, make `stale` vanish unseen, delete the pipeline, and let the controller finish."""
    api = KubeApi(KubeConfig.load(kube.kubeconfig))
    controller = Controller(KubeApi(KubeConfig.load(kube.kubeconfig)), resync_seconds=1.0)
    await controller.prime([ns])
    assert controller.view.get(stale[0], ns, stale[1]) is not None
    await delete_stale(api)  # the gap: gone after the list, and no watch will say so
    await api.delete(path("OmniPipeline", ns, name))  # the finalizer keeps it, terminating
    controller.view.observe("OmniPipeline", "MODIFIED",
                            await api.get(path("OmniPipeline", ns, name)))
    controller.start()
    try:
        async def gone() -> bool:
            return await api.get(path("OmniPipeline", ns, name), ignore=(404,)) is None

        await _until(gone, 30, f"pipeline {name} to finish its ordered shutdown")
        assert controller.view.get(stale[0], ns, stale[1]) is None
        assert len(controller.queue._timers) <= 1
    finally:
        await controller.stop()
        await api.close()
    return controller


async def test_pool_deleted_before_the_watch_does_not_block_shutdown(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    """The pool's DELETE answers 404: that alone drops it from the view."""
    with operator.paused():
        api = KubeApi(KubeConfig.load(kube.kubeconfig))
        created = await api.create(path("OmniPipeline", namespace), _pipeline("gap"))
        pool = {"apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
                "metadata": {"name": "gap-a", "ownerReferences": [{
                    "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "name": "gap",
                    "uid": created["metadata"]["uid"]}]},
                "spec": {"pipeline": "gap", "stage": {"name": "a", "kind": "echo"},
                         "replicas": 0, "image": "ghcr.io/omnistage/omnistage:0.1.0"}}
        await api.create(path("StagePool", namespace), pool)
        await api.close()

        async def delete_pool(client: KubeApi) -> None:
            await client.delete(path("StagePool", namespace, "gap-a"))

        controller = await _shutdown_finishes(kube, namespace, "gap", ("StagePool", "gap-a"),
                                              delete_pool)
        # A handful of writes (delete, finalizer, status), not a retry storm.
        assert controller.api.writes < 10, controller.api.writes_by_verb


async def test_pod_deleted_before_the_watch_is_read_back_and_dropped(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    """Nothing writes to a stale orchestrator pod; the primed-entry check reads it back."""
    with operator.paused():
        api = KubeApi(KubeConfig.load(kube.kubeconfig))
        await api.create(path("OmniPipeline", namespace), _pipeline("gone"))
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gone-orchestrator-x",
               "labels": {k.LABEL_MANAGED_BY: k.MANAGED_BY, k.LABEL_PIPELINE: "gone",
                          k.LABEL_COMPONENT: "orchestrator"}},
               # Unschedulable here (no node matches), so a delete removes it at once.
               "spec": {"nodeSelector": {"omnistage.io/node-pool": "none"},
                        "containers": [{"name": "c", "image": "x"}]}}
        await api.create(path("Pod", namespace), pod)
        await api.close()

        async def delete_pod(client: KubeApi) -> None:
            await client.delete(path("Pod", namespace, "gone-orchestrator-x"),
                                {"gracePeriodSeconds": 0})
            await _until(lambda: _absent(client, namespace, "gone-orchestrator-x"), 30,
                         "pod removed")

        await _shutdown_finishes(kube, namespace, "gone", ("Pod", "gone-orchestrator-x"),
                                 delete_pod)


async def _absent(api: KubeApi, ns: str, name: str) -> bool:
    return await api.get(path("Pod", ns, name), ignore=(404,)) is None
