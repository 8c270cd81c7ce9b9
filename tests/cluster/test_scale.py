"""kwok nodes carry hundreds of fake pods: the control plane copes with operator-sized fleets."""

from __future__ import annotations

import time

from omnistage.kubeapi import resource_path
from tests.harness.cluster import Cluster
from tests.harness.kubeclient import wait_until

REPLICAS = 500


def test_kwok_nodes_run_500_pods(kube: Cluster, namespace: str) -> None:
    nodes = kube.kube.get(
        resource_path("v1", "nodes"), labelSelector="omnistage.io/node-pool=kwok-scale"
    )
    capacity = sum(int(n["status"]["allocatable"]["pods"]) for n in nodes["items"])
    assert capacity >= REPLICAS, f"kwok scale nodes hold only {capacity} pods"
    spec = {
        "nodeSelector": {"omnistage.io/node-pool": "kwok-scale"},
        "tolerations": [
            {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
        ],
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {"name": "main", "image": "fake", "resources": {"requests": {"cpu": "10m"}}}
        ],
    }
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "fleet"},
        "spec": {
            "replicas": REPLICAS,
            "selector": {"matchLabels": {"app": "fleet"}},
            "template": {"metadata": {"labels": {"app": "fleet"}}, "spec": spec},
        },
    }
    path = resource_path("apps/v1", "deployments", namespace)
    started = time.monotonic()
    kube.kube.create(path, deploy)

    def ready() -> int | None:
        n = kube.kube.get(f"{path}/fleet").get("status", {}).get("readyReplicas", 0)
        return n if n == REPLICAS else None

    wait_until(ready, 120, f"{REPLICAS} pods Ready", interval=1.0)
    pods = kube.kube.get(resource_path("v1", "pods", namespace))["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running"]
    assert len(running) == REPLICAS
    assert {p["spec"]["nodeName"] for p in running} <= {
        n["metadata"]["name"] for n in nodes["items"]
    }
    # kwok hands out pod IPs from its loopback CIDR only.
    assert all(p["status"]["podIP"].startswith("127.") for p in running)
    print(f"{REPLICAS} pods Running in {time.monotonic() - started:.1f}s")
    # Scale to zero here so namespace cleanup does not have to wait on 500 graceful deletions.
    kube.kube.patch(f"{path}/fleet", {"spec": {"replicas": 0}})
