"""A stage's payload revision: one short hash of what changes the payloads it emits or reads.

Why: stages hand each other model-private payloads (hidden states, codec codes, latents). A
request that passes a new encoder and an old denoiser gets silently wrong output, so every hop
of a request must run on one pipeline revision (issue 22, docs/architecture.md "Revisions").
The revision covers the stage's kind, its model and the engine options that change outputs;
it leaves out what only changes how work is scheduled (batching) or how long it takes (the
echo stage's delays), so a change of those is not a release of the pipeline.

One source of truth: the operator labels stage pods with it (LABEL_REVISION), workers stamp it
on what they emit and compare it with what a task expects, and the orchestrator routes by it.

Two things outside the spec change payloads too (issue 37): the image (a runtime upgrade with
the same spec) and, for a hub id, the commit it resolved to (an id without a pinned commit
follows its branch). The image is part of the revision wherever one is known: the operator
takes the pool's `spec.image`, and the worker reads it from $OMNISTAGE_IMAGE, which the
operator sets on the container (`omnistage serve` has none). The commit only the worker knows
(from the hub cache it loads from): it appends it to its revision, `<revision>+<commit>`
(`worker_revision`), so replicas of one spec that loaded different commits are different
revisions to the orchestrator (routing, pins, the refusals), while `base_revision` gives back the
revision the pod is labelled with (what the operator's release gate compares).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from omnistage.spec import EngineOptions, Stage, engine_for_kind

__all__ = ["COMMIT_LENGTH", "COMMIT_SEPARATOR", "ENGINE_FIELDS_NOT_IN_REVISION", "IMAGE_ENV",
           "REVISION_LENGTH", "base_revision", "stage_revision", "worker_revision"]

#: Engine options (spec.EngineOptions field names) that never change a stage's payloads.
ENGINE_FIELDS_NOT_IN_REVISION: frozenset[str] = frozenset({
    "max_batch_size", "max_batch_tokens", "echo_delay_ms", "echo_chunk_delay_ms",
})
#: Hex digits kept: short enough for a label value, long enough that two releases of one
#: pipeline never collide in practice.
REVISION_LENGTH = 10
#: The worker's environment variable that names its image (set by the operator's pod builder).
IMAGE_ENV = "OMNISTAGE_IMAGE"
#: Between a revision and the resolved commit a worker appends to it; hex digits of the commit
#: kept (a label-free string: 10 + 1 + 12 characters, within the wire's 64).
COMMIT_SEPARATOR = "+"
COMMIT_LENGTH = 12


def stage_revision(stage: Stage, image: str | None = None) -> str:
    """The stage's payload revision: REVISION_LENGTH hex digits, stable across processes.
    image: the container image the stage runs (None: no image, as under `omnistage serve`)."""
    # Only the options the kind reads: a StagePool stores no others (spec.engine_for_kind), so
    # a pipeline's stage and its pool's stage give one revision.
    engine = engine_for_kind(stage.engine, stage.kind)
    left_out = {(EngineOptions.model_fields[name].alias or name)
                for name in ENGINE_FIELDS_NOT_IN_REVISION}
    doc: dict[str, Any] = {
        "kind": stage.kind,
        "model": stage.model,
        "engine": {k: v for k, v in sorted(engine.items()) if k not in left_out},
    }
    if image:
        doc["image"] = image  # absent otherwise, so a revision without one keeps its value
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LENGTH]


def worker_revision(stage: Stage, commit: str | None = None) -> str:
    """What a worker is: the stage's revision with its image ($OMNISTAGE_IMAGE), and the
    commit its hub model resolved to (`models.resolved_commit`, read from the hub cache it
    loads from; given here for tests), when the reference does not name that commit itself."""
    revision = stage_revision(stage, os.environ.get(IMAGE_ENV) or None)
    if commit is None and stage.model:
        from omnistage.models import resolved_commit

        commit = resolved_commit(stage.model)
    if commit is None or stage.model is None or stage.model.endswith(f"@{commit}"):
        return revision  # no hub model, not in the cache yet, or pinned to this very commit
    return f"{revision}{COMMIT_SEPARATOR}{commit[:COMMIT_LENGTH]}"


def base_revision(revision: str) -> str:
    """The revision without the commit a worker appended: the one its pod is labelled with."""
    return revision.split(COMMIT_SEPARATOR, 1)[0]
