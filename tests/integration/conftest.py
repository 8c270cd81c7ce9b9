"""Fixtures that start real stage worker processes and connect real ZMQ channels to them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omnistage.client import ReplicaChannel
from omnistage.procs import WorkerProcess, spawn_worker
from omnistage.spec import Stage

StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[StartWorker]:
    """Start `omnistage stage` processes; every one is killed at teardown.

    start_worker(stage) runs a Stage; start_worker("echo", admission={"maxRequests": 2}) runs
    a stage of that kind (named after it) with those Stage fields; port fixes the ZMQ port, env
    adds to the worker's environment, ipc is a unix socket path it serves too.
    """
    started: list[WorkerProcess] = []

    def start(stage: Stage | str, *, name: str | None = None, ready: bool = True,
              timeout: float = 180.0, port: int = 0, env: dict[str, str] | None = None,
              ipc: Path | None = None, **fields: Any) -> WorkerProcess:
        if isinstance(stage, str):
            stage = Stage.model_validate({"name": stage, "kind": stage, **fields})
        name = name or f"{stage.kind}-{len(started)}"
        w = spawn_worker(name, stage, port=port, log_dir=tmp_path, env=env, ipc=ipc)
        started.append(w)
        if ready:
            w.wait_ready(timeout)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.kill()


@pytest.fixture
async def channels() -> AsyncIterator[Callable[[WorkerProcess], ReplicaChannel]]:
    """Open DEALER channels to workers; all are closed at teardown."""
    opened: list[ReplicaChannel] = []

    def open_(w: WorkerProcess) -> ReplicaChannel:
        ch = ReplicaChannel(w.zmq, name=w.name)
        opened.append(ch)
        return ch

    yield open_
    for ch in opened:
        await ch.close()
