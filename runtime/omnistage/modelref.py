"""What a stage's `model` names: a built-in, a local path, or a Hugging Face hub id.

This is the grammar only (pure, no I/O), shared by the spec validator, the CRD's CEL rules
(omni_operator.crd, which reuse HUB_ID_PATTERN), the operator's pod builders and the resolver
(omnistage.models), so every mode reads a reference the same way:

- a local path starts with one of LOCAL_PATH_PREFIXES (`/`, `./`, `../`, `~`);
- a built-in is one the kind table lists (omnistage.kinds, `builtin_models()`);
- anything else must be a hub id `org/name`, optionally `@revision` (a branch, tag or commit).

Hub names follow the hub's rules, slightly tightened so one regular expression (Python's and
RE2's) says it all: letters, digits, `_`, and single `.` or `-` between them, each part at most
96 characters (the hub forbids `--` and `..`; this also refuses mixes such as `.-`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from omnistage.kinds import builtin_models

LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")

_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_]|[.-][A-Za-z0-9_]){0,95}"
#: org/name[@revision]; RE2-compatible, so the CRD's CEL rule uses it as it is.
HUB_ID_PATTERN = rf"^{_HUB_PART}/{_HUB_PART}(@[A-Za-z0-9_][A-Za-z0-9_./-]{{0,127}})?$"
HUB_ID_GRAMMAR = "a Hugging Face id org/name[@revision]"

RefKind = Literal["builtin", "path", "hub"]


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference; for a hub id, source is `org/name` and revision is separate."""

    kind: RefKind
    source: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.source}@{self.revision}" if self.revision else self.source

    @property
    def is_hub(self) -> bool:
        return self.kind == "hub"


def is_local_path(value: str) -> bool:
    return value.startswith(LOCAL_PATH_PREFIXES)


def reference_error(value: str, stage_kind: str) -> str | None:
    """Why value is not a model reference for a stage of stage_kind, or None when it is one."""
    if is_local_path(value):
        return None
    builtin_kind = builtin_models().get(value)
    if builtin_kind is not None:
        if builtin_kind != stage_kind:
            return (f"built-in model {value!r} is a {builtin_kind!r} model, not {stage_kind!r} "
                    f"(built-ins for {stage_kind!r}: {builtins_for(stage_kind)})")
        return None
    if re.fullmatch(HUB_ID_PATTERN, value):
        return None
    return (f"model {value!r} is not a built-in for kind {stage_kind!r} "
            f"(built-ins: {builtins_for(stage_kind)}), {HUB_ID_GRAMMAR}, or a local path "
            "starting with / or ./")


def parse_model_ref(value: str) -> ModelRef:
    """Classify a reference the validator accepted (no kind check here: that is the spec's)."""
    if is_local_path(value):
        return ModelRef("path", value)
    if value in builtin_models():
        return ModelRef("builtin", value)
    if not re.fullmatch(HUB_ID_PATTERN, value):
        raise ValueError(f"model {value!r} is not a built-in, {HUB_ID_GRAMMAR}, or a local path")
    repo, _, revision = value.partition("@")
    return ModelRef("hub", repo, revision or None)


def builtins_for(kind: str) -> str:
    names = [name for name, k in builtin_models().items() if k == kind]
    return ", ".join(names) or "none"
