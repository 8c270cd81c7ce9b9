"""The real API server enforces what the operator relies on: CEL rules, RBAC, owner-reference GC."""

from __future__ import annotations

import pytest

from omnistage.kube import condition_status
from omnistage.kubeapi import ApiError, resource_path
from tests.harness.cluster import Cluster
from tests.harness.kubeclient import wait_until


def test_readyz_and_pinned_version(kube: Cluster) -> None:
    assert kube.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    version = kube.kube.get("/version")
    if kube.owned:
        assert version["gitVersion"] == kube.versions["K8S_VERSION"]


def _crd(group: str) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas", "maxReplicas", "mode"],
                                    "properties": {
                                        "replicas": {"type": "integer"},
                                        "maxReplicas": {"type": "integer"},
                                        "mode": {
                                            "type": "string",
                                            "x-kubernetes-validations": [
                                                {
                                                    "rule": "self == oldSelf",
                                                    "message": "mode is immutable",
                                                }
                                            ],
                                        },
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.replicas <= self.maxReplicas",
                                            "message": "replicas must not exceed maxReplicas",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def test_crd_cel_rule_rejects_bad_object(kube: Cluster, namespace: str) -> None:
    group = f"{namespace}.test.omnistage.io"
    crd_path = resource_path("apiextensions.k8s.io/v1", "customresourcedefinitions")
    kube.kube.create(crd_path, _crd(group))
    try:
        wait_until(
            lambda: condition_status(kube.kube.get(f"{crd_path}/widgets.{group}"),
                                     "Established") == "True",
            30,
            "CRD Established",
        )
        widgets = resource_path(f"{group}/v1", "widgets", namespace)

        def widget(name: str, replicas: int, mode: str = "a") -> dict:
            spec = {"replicas": replicas, "maxReplicas": 3, "mode": mode}
            return {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": spec,
            }

        # The CRD is served a moment after Established; retry the good create until it is.
        wait_until(lambda: kube.kube.create(widgets, widget("good", 2)), 30, "good widget created")
        with pytest.raises(ApiError) as bad:
            kube.kube.create(widgets, widget("bad", 5))
        assert bad.value.status == 422
        assert "replicas must not exceed maxReplicas" in bad.value.message
        assert "bad" not in [w["metadata"]["name"] for w in kube.kube.get(widgets)["items"]]
        # Transition rule: oldSelf is only available on update.
        with pytest.raises(ApiError) as immutable:
            kube.kube.patch(f"{widgets}/good", {"spec": {"mode": "b"}})
        assert immutable.value.status == 422
        assert "mode is immutable" in immutable.value.message
        kube.kube.patch(f"{widgets}/good", {"spec": {"replicas": 3}})
    finally:
        kube.kube.delete_ignore_missing(f"{crd_path}/widgets.{group}")


def _configmap(name: str, owner: dict | None = None) -> dict:
    meta: dict = {"name": name}
    if owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "blockOwnerDeletion": True,
            }
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}}


@pytest.mark.parametrize("policy", ["Background", "Foreground"])
def test_owner_reference_gc_deletes_children(kube: Cluster, namespace: str, policy: str) -> None:
    cms = resource_path("v1", "configmaps", namespace)
    parent = kube.kube.create(cms, _configmap("parent"))
    for i in range(3):
        kube.kube.create(cms, _configmap(f"child-{i}", parent))
    kube.kube.create(cms, _configmap("unrelated"))
    kube.kube.delete(
        f"{cms}/parent", {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": policy}
    )

    def names() -> set[str]:
        return {c["metadata"]["name"] for c in kube.kube.get(cms)["items"]}

    # kube-root-ca.crt is published into every namespace by the controller-manager.
    wait_until(
        lambda: names() - {"kube-root-ca.crt"} == {"unrelated"},
        60,
        f"GC ({policy}) to delete the children",
        on_timeout=lambda: f"left: {sorted(names())}",
    )


def test_rbac_is_enforced(kube: Cluster, namespace: str) -> None:
    """A service account without bindings is forbidden; the token signer and RBAC are live."""
    can = kube.kubectl(
        "auth",
        "can-i",
        "list",
        "pods",
        "-n",
        namespace,
        f"--as=system:serviceaccount:{namespace}:default",
        check=False,
    )
    assert can.stdout.strip() == "no", can.stdout + can.stderr
    admin = kube.kubectl("auth", "can-i", "list", "pods", "-n", namespace)
    assert admin.stdout.strip() == "yes"
