"""`omnistage serve FILE`: a whole pipeline on this machine behind the HTTP API.

Startup: stage replicas (LocalStageRuntime), then the orchestrator, then the HTTP front door.
Shutdown runs the other way round, as the orchestration contract requires: the orchestrator
stops admitting and drains in-flight requests first, then the HTTP listener closes, then the
replicas drain and exit. Repeated SIGINT/SIGTERM during shutdown are noted and ignored.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from omnistage.local_runtime import LocalStageRuntime, PlacementError, ReplicaStartupError
from omnistage.spec import OmniPipeline, SpecError, load_pipeline

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupted(BaseException):
    """A signal arrived while replicas were starting (raised from the signal handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _say(msg: str) -> None:
    print(f"omnistage: {msg}", flush=True)


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def _note_ignored(signum: int, _frame: FrameType | None) -> None:
    _say(f"already shutting down; {signal.Signals(signum).name} ignored")


def _install(handler: Callable[[int, FrameType | None], Any]) -> None:
    for sig in _SIGNALS:
        signal.signal(sig, handler)


def run_serve(
    file: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: str | Path | None = None,
) -> int:
    """Serve the pipeline in file until SIGINT/SIGTERM; returns the process exit code.

    Must run on the main thread: it owns the signal handlers, and the replicas' parent-death
    signal is tied to the thread that spawned them.
    """
    try:
        pipeline = load_pipeline(file)
    except SpecError as exc:
        print(f"error: invalid pipeline {file}:", file=sys.stderr)
        for path, message in exc.errors:
            print(f"  {path}: {message}", file=sys.stderr)
        return 2
    runtime = LocalStageRuntime(pipeline, base_dir=Path(file).resolve().parent, log_dir=log_dir,
                                host=host, progress=_say)
    t0 = time.monotonic()
    _install(_raise_interrupted)  # a signal during startup rolls every replica back
    try:
        try:
            runtime.start()
        except (PlacementError, ReplicaStartupError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, PlacementError) else 1
        return asyncio.run(_serve_async(pipeline, runtime, host, port, t0))
    except _Interrupted as exc:
        _say(f"{exc} during startup; all replicas stopped")
        return 128 + exc.signum
    finally:
        _install(_note_ignored)
        runtime.shutdown()
        _install(signal.SIG_DFL)


async def _serve_async(
    pipeline: OmniPipeline, runtime: LocalStageRuntime, host: str, port: int | None, t0: float
) -> int:
    from omnistage.orchestrator.engine import Orchestrator
    from omnistage.orchestrator.http_api import serve_http

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            _say(f"already shutting down; {sig.name} ignored")
            return
        _say(f"{sig.name} received: shutting down (orchestrator drains first)")
        stop.set()

    for sig in _SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    drain = float(max((s.drain_timeout_seconds for s in pipeline.spec.stages), default=30))
    orch = Orchestrator(pipeline, runtime.membership)
    runner: Any = None
    try:
        await orch.start()
        api_port = pipeline.spec.orchestrator.port if port is None else port
        try:
            runner, url = await serve_http(orch, host, api_port)
        except OSError as exc:  # typically the port is taken: say so instead of a traceback
            print(f"error: cannot serve the API on {host}:{api_port}: {exc}", file=sys.stderr)
            return 1
        _say(f"API at {url} (routes: {', '.join(_routes(pipeline))})")
        ok, reason = await _wait_orchestrator_ready(orch)
        if ok:
            _say(f"pipeline {pipeline.metadata.name} ready at {url} "
                 f"({len(runtime.replicas)} replicas, {time.monotonic() - t0:.1f}s)")
        else:  # e.g. a stage with replicas: 0; keep serving, /readyz says the same
            _say(f"pipeline {pipeline.metadata.name} is serving at {url} but NOT ready: {reason}")
        await stop.wait()
    finally:
        _say(f"orchestrator: stopped admitting, draining (up to {drain:.0f}s)")
        await orch.stop(drain)
        if runner is not None:
            await runner.cleanup()
        _say("stopping stage replicas")
    return 0


def _routes(pipeline: OmniPipeline) -> list[str]:
    """The routes this pipeline's API surface enables, for the startup banner."""
    api = pipeline.spec.orchestrator.api
    routes = ["/v1/models"]
    routes += ["/v1/chat/completions"] if "chat" in api else []
    routes += ["/v1/images/generations"] if "images" in api else []
    routes += [f"/v1/pipelines/{pipeline.metadata.name}/requests"] if "generic" in api else []
    return [*routes, "/readyz", "/metrics", "/openapi.json"]


async def _wait_orchestrator_ready(orch: Any, timeout: float = 5.0) -> tuple[bool, str]:
    """Membership reaches the orchestrator via the loop; give it a moment to see every replica."""
    for _ in range(int(timeout / 0.05)):
        if orch.ready:
            break
        await asyncio.sleep(0.05)
    return orch.readiness()
