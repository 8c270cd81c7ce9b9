"""Where kinds live in the REST API, and views: the part of an object a cache keeps.

Pure functions on strings and dicts: no I/O, so the operator's builders and the tests use them
without a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage import kube

Obj = dict[str, Any]


def resource_path(
    api_version: str,
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """REST path: ``("apps/v1", "deployments", "ns", "x")`` -> /apis/apps/v1/namespaces/ns/..."""
    parts = [f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(resource)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the REST API."""

    kind: str
    group: str
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None,
             sub: str | None = None) -> str:
        return resource_path(self.api_version, self.plural, namespace, name, sub)


RESOURCES: dict[str, Resource] = {r.kind: r for r in (
    Resource("Pod", "", "v1", "pods"),
    Resource("Service", "", "v1", "services"),
    Resource("ConfigMap", "", "v1", "configmaps"),
    Resource("Secret", "", "v1", "secrets"),
    Resource("ServiceAccount", "", "v1", "serviceaccounts"),
    Resource("Event", "", "v1", "events"),
    Resource("Namespace", "", "v1", "namespaces"),
    Resource("Node", "", "v1", "nodes"),
    Resource("Deployment", "apps", "v1", "deployments"),
    Resource("PodDisruptionBudget", "policy", "v1", "poddisruptionbudgets"),
    Resource("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
    Resource("Role", "rbac.authorization.k8s.io", "v1", "roles"),
    Resource("RoleBinding", "rbac.authorization.k8s.io", "v1", "rolebindings"),
    Resource("OmniPipeline", kube.GROUP, kube.VERSION, "omnipipelines"),
    Resource("StagePool", kube.GROUP, kube.VERSION, "stagepools"),
)}


def path(kind: str, namespace: str | None = None, name: str | None = None,
         sub: str | None = None) -> str:
    """REST path of a kind this project uses: ``path("Pod", "ns", "p-0", "status")``."""
    return RESOURCES[kind].path(namespace, name, sub)


# ---- views: the part of an object a cache keeps ----------------------------------------------

#: What a view keeps of an object: each field name maps to True (its whole value) or to the
#: fields to keep of it, applied to every item when the value is a list.
Fields = dict[str, "Fields | bool"]


def project(obj: Any, fields: Fields) -> Any:
    """A copy of `obj` with only `fields` (nested), for caches of thousands of objects: a view
    costs the memory of what its reader uses, not of what the API server sends (a Pod's spec
    and managedFields are most of it). Absent fields stay absent; the input is not changed."""
    if isinstance(obj, list):
        return [project(item, fields) for item in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, keep in fields.items():
        if key in obj:
            out[key] = obj[key] if keep is True else project(obj[key], keep)  # type: ignore[arg-type]
    return out

