"""Stage executors: what a stage worker runs behind admission control.

Which executor runs which kind is the kind table's (omnistage.kinds, which imports nothing of
this package). Importing an executor never imports torch or the model libraries: they load in
`Executor.load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import omnistage.kinds as stage_kinds
from omnistage.executors.base import BadRequest, BatchExecutor, Executor, Outcome

if TYPE_CHECKING:
    from omnistage.spec import Stage

__all__ = ["BadRequest", "BatchExecutor", "Executor", "Outcome", "create_executor",
           "executor_class"]


def executor_class(kind: str) -> type[Executor]:
    """The executor class of a stage kind, from the kind table. Importing one never imports
    torch or the model libraries (they load in `Executor.load`), so a worker can ask this
    before it loads."""
    row = stage_kinds.get(kind)
    cls = row.executor_class()
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise stage_kinds.KindError(f"stage kind {kind!r}: {row.executor} is not an Executor "
                                    "subclass")
    return cls


def create_executor(stage: Stage, device: Any) -> Executor:
    """The executor for a stage's kind; imports the heavy libraries only for the kind in use.

    The stage is already validated, so executors only ever see typed engine options.
    """
    return executor_class(stage.kind)(stage.model, stage.engine, device)
