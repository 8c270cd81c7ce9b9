"""Stage executors: what a stage worker runs behind admission control."""

from __future__ import annotations

from typing import Any

from omnistage.executors.base import BadRequest, Executor, Outcome
from omnistage.spec import Stage

__all__ = ["BadRequest", "Executor", "Outcome", "create_executor"]


def create_executor(stage: Stage, device: Any) -> Executor:
    """The executor for a stage's kind; imports the heavy libraries only for the kind in use.

    The stage is already validated, so executors only ever see typed engine options.
    """
    kind, model, options = stage.kind, stage.model, stage.engine
    if kind == "echo":
        from omnistage.executors.echo import EchoExecutor

        return EchoExecutor(model, options, device)
    if kind == "ar":
        from omnistage.executors.ar import ARExecutor

        return ARExecutor(model, options, device)
    if kind == "diffusion":
        from omnistage.executors.diffusion import DiffusionExecutor

        return DiffusionExecutor(model, options, device)
    raise ValueError(f"unknown stage kind {kind!r}; expected one of: ar, diffusion, echo")
