"""A stage's payload revision: one short hash of what changes the payloads it emits or reads.

Why: stages hand each other model-private payloads (hidden states, codec codes, latents). A
request that passes a new encoder and an old denoiser gets silently wrong output, so every hop
of a request must run on one pipeline revision (issue 22, docs/architecture.md "Revisions").
The revision covers the stage's kind, its model and the engine options that change outputs;
it leaves out what only changes how work is scheduled (batching) or how long it takes (the
echo stage's delays), so a change of those is not a release of the pipeline.

One source of truth: the operator labels stage pods with it (LABEL_REVISION), workers stamp it
on what they emit and compare it with what a task expects, and the orchestrator routes by it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omnistage.spec import EngineOptions, Stage, engine_for_kind

__all__ = ["ENGINE_FIELDS_NOT_IN_REVISION", "REVISION_LENGTH", "stage_revision"]

#: Engine options (spec.EngineOptions field names) that never change a stage's payloads.
ENGINE_FIELDS_NOT_IN_REVISION: frozenset[str] = frozenset({
    "max_batch_size", "max_batch_tokens", "echo_delay_ms", "echo_chunk_delay_ms",
})
#: Hex digits kept: short enough for a label value, long enough that two releases of one
#: pipeline never collide in practice.
REVISION_LENGTH = 10


def stage_revision(stage: Stage) -> str:
    """The stage's payload revision: REVISION_LENGTH hex digits, stable across processes."""
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
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LENGTH]
