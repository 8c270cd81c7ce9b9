"""The operator's API group and the StagePool resource.

Both kinds' models live in omnistage.spec, because `omnistage validate` checks StagePools too and
the runtime never imports the operator; the operator reconciles them and generates the CRDs.
"""

from __future__ import annotations

from omnistage.spec import StagePool, StagePoolSpec

__all__ = ["API_VERSION", "GROUP", "VERSION", "StagePool", "StagePoolSpec"]

GROUP = "omnistage.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
