"""Releases across stages: which revision a pool's replicas should run, its release order, and
the gate that keeps a change of several stages one release (issue 22, docs/architecture.md
"Releases across stages").

Why: stages hand each other model-private payloads, so a change of two stages' revisions must
never leave a request with only a new encoder and an old denoiser to choose from. The rule:

- each changed pool (live replicas of a revision other than its spec's) surges ONE replica of
  the new revision (`ANNOTATION_SURGE`), so no stage drops below its routable count;
- NO changed pool retires a Ready old-revision replica until EVERY changed pool of the pipeline
  has at least one Ready new-revision replica (`gate_open`); then each replaces its old ones
  one at a time, drain before delete, while all its replicas are Ready;
- a revert is the same rule the other way: the old revision is the target again, with the
  release order it had, so every pool's replicas of one revision carry one order.

The release order (`kube.ANNOTATION_REVISION_ORDER`) is the OmniPipeline's metadata.generation
at which a pool's template got its revision. It is stored on the StagePool as
"<revision>=<order>[,<revision>=<order>...]", the spec's revision first, then the ones before
it (HISTORY in all; so a restarted operator reads it back and writes nothing), and copied onto
each stage pod with the revision label, where the orchestrator reads both. Why a revision keeps
its order, a revert included: the orchestrator's pipeline revisions are releases by order (the
revision of the highest order not above it, at each stage), so the replicas of one release must
carry one order in every pool, those that ran through the revert and those created for it.

Pure functions over objects as the API server returns them: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_operator.readiness import is_ready
from omnistage import kube
from omnistage.revision import REVISION_LENGTH, stage_revision
from omnistage.spec import Stage

Obj = Mapping[str, Any]

#: On a stage pod: "true" when the operator created it as a release's extra replica (outside
#: the pool's wanted ordinals). It leaves once no replica of another revision is left.
ANNOTATION_SURGE = "omnistage.io/surge"

__all__ = [
    "ANNOTATION_SURGE",
    "PoolRelease",
    "doc_revision",
    "format_order",
    "gate_open",
    "is_surge",
    "outdated",
    "parse_order",
    "parse_orders",
    "pipeline_revision",
    "pod_order",
    "pod_revision",
    "pool_order",
    "pool_revision",
    "release_order",
    "routable_by_revision",
    "stored_orders",
]


def doc_revision(stage_doc: Obj, image: str | None) -> str:
    """The revision of a stage as a StagePool stores it (spec.stage), run in `image`: what its
    workers compute from the same document and $OMNISTAGE_IMAGE, so the pod label and the
    worker's stamp agree (the worker adds its resolved hub commit: revision.worker_revision)."""
    return stage_revision(Stage.model_validate(dict(stage_doc)), image)


def pool_revision(pool: Obj) -> str:
    """The revision the pool's replicas should run: its spec's stage in its spec's image."""
    return doc_revision(pool["spec"]["stage"], pool["spec"].get("image"))


#: Revisions (with their orders) a StagePool remembers: the spec's and the ones before it.
HISTORY = 4


def format_order(revision: str, order: int, before: Sequence[tuple[str, int]] = ()) -> str:
    """The annotation: the spec's revision first, then up to HISTORY - 1 earlier ones."""
    entries = [(revision, order), *[(r, o) for r, o in before if r != revision]][:HISTORY]
    return ",".join(f"{r}={o}" for r, o in entries)


def parse_orders(text: str | None) -> list[tuple[str, int]]:
    """[(revision, order), ...] from a stored annotation; unreadable entries are left out."""
    out = []
    for entry in (text or "").split(","):
        revision, sep, order = entry.strip().partition("=")
        if sep and revision and order.isdigit():
            out.append((revision, int(order)))
    return out


def parse_order(text: str | None) -> tuple[str, int] | None:
    """The first (the spec's) (revision, order) of a stored annotation; None when absent or
    unreadable."""
    entries = parse_orders(text)
    return entries[0] if entries else None


def stored_orders(obj: Obj | None) -> list[tuple[str, int]]:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return parse_orders(annotations.get(kube.ANNOTATION_REVISION_ORDER))


def release_order(current_pool: Obj | None, revision: str, generation: int) -> int:
    """The order of `revision` for a pool whose live object is `current_pool`: the one it
    has (or had: a revert gets its earlier order back; a resync or a restarted operator writes
    nothing), else the pipeline's `generation`: a new release."""
    for stored, order in stored_orders(current_pool):
        if stored == revision:
            return order
    return generation


def pool_order(pool: Obj) -> int:
    """The release order of the pool's spec revision; 0 when the pool does not carry it (a
    StagePool written by hand)."""
    stored = parse_order(((pool.get("metadata") or {}).get("annotations") or {}).get(
        kube.ANNOTATION_REVISION_ORDER))
    if stored is not None and stored[0] == pool_revision(pool):
        return stored[1]
    return 0


def pod_revision(pod: Obj) -> str | None:
    """The revision a replica runs; None for a pod created before pods carried it."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(kube.LABEL_REVISION)


def pod_order(pod: Obj) -> int:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(
        kube.ANNOTATION_REVISION_ORDER, "")
    return int(text) if str(text).isdigit() else 0


def is_surge(pod: Obj) -> bool:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SURGE) == "true"


def outdated(target: str, pod: Obj) -> bool:
    """A replica that runs another revision than `target` and still serves (not retiring).
    A pod without the label (an older operator's) is not counted: it rolls, if its spec
    changed, the way every spec change rolls, one at a time."""
    revision = pod_revision(pod)
    return revision is not None and revision != target and not kube.is_draining(pod)


@dataclass(frozen=True)
class PoolRelease:
    """One pool of a pipeline, as the gate sees it: its target revision and its replicas."""

    target: str
    pods: Sequence[Obj]

    @property
    def changed(self) -> bool:
        """Some replica that still serves runs another revision: the pool is in a release."""
        return any(outdated(self.target, p) for p in self.pods)

    @property
    def ready_new(self) -> int:
        """Ready (routable) replicas of the target revision."""
        return sum(1 for p in self.pods if is_ready(p) and pod_revision(p) == self.target)


def gate_open(pools: Iterable[PoolRelease]) -> bool:
    """Whether a changed pool may retire a Ready old-revision replica: only once every changed
    pool of the pipeline has at least one Ready replica of its new revision, so requests can
    run the new revision end to end before any old capacity goes."""
    return all(p.ready_new >= 1 for p in pools if p.changed)


def routable_by_revision(pods: Iterable[Obj]) -> dict[str, int]:
    """Routable replicas per revision (pods without the label left out)."""
    out: dict[str, int] = {}
    for pod in pods:
        revision = pod_revision(pod)
        if revision is not None and is_ready(pod):
            out[revision] = out.get(revision, 0) + 1
    return dict(sorted(out.items()))


def pipeline_revision(stage_revisions: Mapping[str, str]) -> str:
    """One name for a pipeline revision: a short digest of every stage's revision."""
    text = json.dumps(dict(sorted(stage_revisions.items())), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LENGTH]
