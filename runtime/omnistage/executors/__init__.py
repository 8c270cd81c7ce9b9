"""Stage executors: what a stage worker runs behind admission control."""

from __future__ import annotations

from typing import Any

from omnistage.executors.base import BadRequest, BatchExecutor, Executor, Outcome
from omnistage.spec import Stage

__all__ = ["BadRequest", "BatchExecutor", "Executor", "Outcome", "create_executor",
           "executor_class"]


def executor_class(kind: str) -> type[Executor]:
    """The executor class of a stage kind. Importing one never imports torch or the model
    libraries (they load in `Executor.load`), so a worker can ask this before it loads."""
    if kind == "echo":
        from omnistage.executors.echo import EchoExecutor

        return EchoExecutor
    if kind == "ar":
        from omnistage.executors.ar import ARExecutor

        return ARExecutor
    if kind == "diffusion":
        from omnistage.executors.diffusion import DiffusionExecutor

        return DiffusionExecutor
    raise ValueError(f"unknown stage kind {kind!r}; expected one of: ar, diffusion, echo")


def create_executor(stage: Stage, device: Any) -> Executor:
    """The executor for a stage's kind; imports the heavy libraries only for the kind in use.

    The stage is already validated, so executors only ever see typed engine options.
    """
    return executor_class(stage.kind)(stage.model, stage.engine, device)
