"""Stage executors: what a stage worker runs behind admission control."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnistage.executors.base import BadRequest, Executor, Outcome
from omnistage.spec import EngineOptions

__all__ = ["BadRequest", "Executor", "Outcome", "create_executor"]


def create_executor(kind: str, model: str | None, engine: EngineOptions | Mapping[str, Any],
                    device: Any) -> Executor:
    """The executor for a stage kind; imports the heavy libraries only for the kind in use.

    `engine` is the stage's EngineOptions; a mapping (the camelCase JSON a worker gets on its
    command line) is validated into one here, so executors only ever see typed options.
    """
    options = engine if isinstance(engine, EngineOptions) else EngineOptions.model_validate(engine)
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
