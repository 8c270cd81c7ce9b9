"""kube-scheduler places GPU pods on the fake (kwok) GPU nodes, honouring GPU requests."""

from __future__ import annotations

from collections import Counter

from omnistage.kube import condition, condition_status
from omnistage.kubeapi import Obj, resource_path
from tests.harness.cluster import Cluster, pods
from tests.harness.kubeclient import wait_until

GPU_POOL = {"omnistage.io/node-pool": "kwok-gpu"}
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def gpu_nodes(kube: Cluster) -> dict[str, int]:
    nodes = kube.kube.get(
        resource_path("v1", "nodes"), labelSelector="omnistage.io/node-pool=kwok-gpu"
    )
    return {
        n["metadata"]["name"]: int(n["status"]["allocatable"]["nvidia.com/gpu"])
        for n in nodes["items"]
    }


def pod_spec(gpus: int) -> Obj:
    res = {"nvidia.com/gpu": str(gpus), "cpu": "100m", "memory": "64Mi"}
    return {
        "nodeSelector": GPU_POOL,
        "tolerations": [KWOK_TOLERATION],
        "containers": [
            {"name": "main", "image": "fake", "resources": {"requests": res, "limits": res}}
        ],
    }


def test_deployment_fills_gpu_nodes_exactly(kube: Cluster, namespace: str) -> None:
    capacity = gpu_nodes(kube)
    assert capacity, "no kwok GPU nodes (hack/cluster.sh creates them)"
    per_pod = 4
    slots = {n: c // per_pod for n, c in capacity.items()}
    replicas = sum(slots.values())
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "gpu"}},
            "template": {"metadata": {"labels": {"app": "gpu"}}, "spec": pod_spec(per_pod)},
        },
    }
    kube.kube.create(resource_path("apps/v1", "deployments", namespace), deploy)

    def all_running() -> list[Obj] | None:
        ps = pods(kube.kube, namespace, "app=gpu")
        ok = len(ps) == replicas and all(p["status"].get("phase") == "Running" for p in ps)
        return ps if ok else None

    ps = wait_until(all_running, 90, f"{replicas} GPU pods Running on kwok nodes")
    placed = Counter(p["spec"]["nodeName"] for p in ps)
    # Every GPU node is filled to capacity, never beyond.
    assert placed == Counter(slots), placed
    # One more replica cannot fit anywhere: it stays Pending, Unschedulable for GPUs.
    kube.kube.patch(
        resource_path("apps/v1", "deployments", namespace, "gpu"),
        {"spec": {"replicas": replicas + 1}},
    )
    extra = wait_until(
        lambda: next((p for p in pods(kube.kube, namespace, "app=gpu") if _unschedulable(p)), None),
        60,
        "the extra replica to be Unschedulable",
    )
    assert "nvidia.com/gpu" in _scheduled_condition(extra)["message"]


def _scheduled_condition(pod: Obj) -> Obj:
    cond = condition(pod, "PodScheduled")
    assert cond is not None, pod.get("status")
    return cond


def _unschedulable(pod: Obj) -> bool:
    if condition_status(pod, "PodScheduled") != "False":
        return False
    return _scheduled_condition(pod).get("reason") == "Unschedulable"


def test_pod_wanting_more_gpus_than_any_node_stays_pending(kube: Cluster, namespace: str) -> None:
    most = max(gpu_nodes(kube).values())
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "huge"},
        "spec": pod_spec(most + 1),
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)

    def pending() -> Obj | None:
        p = kube.kube.get(f"{path}/huge")
        return p if _unschedulable(p) else None

    got = wait_until(
        pending,
        60,
        "PodScheduled=False reason Unschedulable",
    )
    assert got["status"]["phase"] == "Pending"
    assert not got["spec"].get("nodeName")
    assert "Insufficient nvidia.com/gpu" in _scheduled_condition(got)["message"]
