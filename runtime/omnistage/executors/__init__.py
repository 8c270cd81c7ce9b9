"""Stage executors: what a stage worker runs behind admission control."""

from __future__ import annotations

from typing import Any

from omnistage.executors.base import BadRequest, Executor, Outcome

__all__ = ["BadRequest", "Executor", "Outcome", "create_executor"]


def create_executor(kind: str, model: str | None, engine: dict[str, Any], device: Any) -> Executor:
    """The executor for a stage kind; imports the heavy libraries only for the kind in use."""
    if kind == "echo":
        from omnistage.executors.echo import EchoExecutor

        return EchoExecutor(model, engine, device)
    if kind == "ar":
        from omnistage.executors.ar import ARExecutor

        return ARExecutor(model, engine, device)
    if kind == "diffusion":
        from omnistage.executors.diffusion import DiffusionExecutor

        return DiffusionExecutor(model, engine, device)
    raise ValueError(f"unknown stage kind {kind!r}; expected one of: ar, diffusion, echo")
