"""The operator's API group and the StagePool resource.

Both kinds' models live in omnistage.spec, because `omnistage validate` checks StagePools too and
the runtime never imports the operator; the operator reconciles them and generates the CRDs.
"""

from __future__ import annotations

from typing import Any

from omnistage.kube import API_VERSION, GROUP, VERSION
from omnistage.spec import StagePool, StagePoolSpec

__all__ = ["API_VERSION", "GROUP", "VERSION", "StagePool", "StagePoolSpec", "desired_replicas"]


def desired_replicas(pool: dict[str, Any]) -> int:
    """A stored pool's spec.replicas; when absent, StagePoolSpec's default, the one the CRD
    documents (the CRD carries no defaults: the runtime models own them)."""
    value = (pool.get("spec") or {}).get("replicas")
    return int(StagePoolSpec.model_fields["replicas"].default if value is None else value)
