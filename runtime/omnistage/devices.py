"""Device selection: CUDA when visible (honouring CUDA_VISIBLE_DEVICES), else the CPU."""

from __future__ import annotations

import os
from typing import Any


def select_device(requested: str | None = None) -> Any:
    """The torch device a worker should load onto.

    torch itself honours CUDA_VISIBLE_DEVICES, so "cuda" means the first GPU this process was
    given. An empty CUDA_VISIBLE_DEVICES means the process was given no GPU.
    """
    import torch

    choice = requested or os.environ.get("OMNISTAGE_DEVICE") or "auto"
    if choice == "auto":
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
            return torch.device("cpu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(choice)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {choice!r} requested but CUDA is not available "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return dev


def configure_threads() -> None:
    """Keep CPU workers from oversubscribing: several replicas share few cores."""
    import torch

    n = int(os.environ.get("OMNISTAGE_TORCH_THREADS", "1"))
    if n > 0:
        torch.set_num_threads(n)
