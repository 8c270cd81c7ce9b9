"""`omnistage serve FILE`: a whole pipeline on this machine behind the HTTP API.

Startup: stage replicas (LocalStageRuntime), then the orchestrator and its HTTP front door
(orchestrator.main.serve_orchestrator, the same lifecycle the orchestrator pod runs). Shutdown
runs the other way round, as the orchestration contract requires: the orchestrator stops
admitting and drains in-flight requests first, then the HTTP listener closes, then the replicas
drain and exit. Repeated SIGINT/SIGTERM during shutdown are noted and ignored.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from omnistage import eventloop, models, validate
from omnistage.curve import CurveKeyring
from omnistage.curve import generate as generate_curve_keys
from omnistage.local_runtime import (
    LocalAutoscaler,
    LocalStageRuntime,
    PlacementError,
    ReplicaStartupError,
)
from omnistage.orchestrator.auth import ApiKeyError
from omnistage.orchestrator.auth import resolve_both as resolve_keys
from omnistage.orchestrator.main import (
    ApiBindError,
    UsageError,
    admin_port_for,
    serve_orchestrator,
)
from omnistage.orchestrator.wake import CallbackWaker
from omnistage.shm import ShmConfig, ShmError
from omnistage.spec import KIND, SpecError, load_pipeline

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
    shutdown_delay: float = 0.0,
    api_key_file: str | None = None,
    no_auth: bool = False,
    curve: bool = True,
    admin_host: str = "127.0.0.1",
    admin_port: int | None = None,
    admin_key_file: str | None = None,
) -> int:
    """Serve the pipeline in file until SIGINT/SIGTERM; returns the process exit code.

    shutdown_delay: how long /readyz fails before the orchestrator stops admitting (see
    orchestrator.main); locally nothing routes by readiness unless the user put a load balancer
    in front, so it defaults to 0 rather than to spec.orchestrator.shutdownDelaySeconds.
    curve: the workers hear only this run's orchestrator (CurveZMQ, a keypair made now).
    admin_*: the admin listener (control, load, metrics), on loopback by default.

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
    try:  # before anything starts: a server that would listen without keys says so first
        auth = pipeline.spec.orchestrator.auth
        api_keys, admin_keys, lines = resolve_keys(
            api_key_file, admin_key_file, no_auth=no_auth, host=host, admin_host=admin_host,
            secret=auth.api_key_secret, disabled=auth.disabled)
        admin_at = admin_port_for(pipeline, port, admin_port)
    except (ApiKeyError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        _say(line)
    problems = models.prepare(pipeline.spec.stages, say=_say)
    if problems:  # before any worker starts
        print("error: models unavailable:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    try:
        shm = ShmConfig.local()  # one machine: tensors go through shared memory
    except ShmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keys = generate_curve_keys() if curve else None
    _say("stage workers: CurveZMQ with a keypair made for this run" if keys else
         "stage workers: plain ZMQ (--no-curve): any process that reaches them is heard")
    runtime = LocalStageRuntime(pipeline, base_dir=Path(file).resolve().parent, log_dir=log_dir,
                                host=host, progress=_say, shm=shm, curve=keys)
    t0 = time.monotonic()
    _install(_raise_interrupted)  # a signal during startup rolls every replica back
    try:
        try:
            runtime.start()
        except (PlacementError, ReplicaStartupError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, PlacementError) else 1
        # Stages with autoscaling: sized by the local autoscaler on the orchestrator's load,
        # woken from zero in process (see architecture.md, "The load signal and hold-and-wake").
        autoscaler = LocalAutoscaler(runtime)
        try:
            return eventloop.run(serve_orchestrator(
                pipeline, runtime.membership, host, port, say=_say, started=t0,
                ignore_late_signals=True, shutdown_delay=shutdown_delay,
                notes=runtime.notes, collectors=[runtime.collector], shm=runtime.shm,
                waker=CallbackWaker(autoscaler.wake),
                background=[lambda orch: autoscaler.run(orch.load)], api_keys=api_keys,
                curve=CurveKeyring.fixed(keys) if keys is not None else None,
                admin_host=admin_host, admin_port=admin_at,
                admin_keys=admin_keys))
        except ApiBindError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            _say("stopping stage replicas")
    except _Interrupted as exc:
        _say(f"{exc} during startup; all replicas stopped")
        return 128 + exc.signum
    finally:
        _install(_note_ignored)
        runtime.shutdown()
        _install(signal.SIG_DFL)


def dry_run(file: str | Path, *, output: str = "text") -> int:
    """`omnistage serve --dry-run FILE`: every check serve makes before starting anything.

    That is `omnistage validate` with local model paths checked, plus the GPU placement plan,
    plus (with HF_HUB_OFFLINE) hub models present in the cache.
    Exit 0 when serve would start, 2 when it would refuse.
    """
    report = validate.Report(str(file), 0, kind=KIND)
    try:
        pipeline = load_pipeline(file)
        report.name = pipeline.metadata.name
        LocalStageRuntime(pipeline, base_dir=Path(file).resolve().parent,
                          log_dir=Path(tempfile.gettempdir())).plan()
        if models.offline():  # a dry run downloads nothing; offline, a missing model is fatal
            report.errors = [("(models)", problem) for problem in models.prepare(
                pipeline.spec.stages, say=lambda _msg: None)]
    except SpecError as exc:
        report.errors = [(path, message) for path, message in exc.errors]
    except PlacementError as exc:
        report.errors = [("(placement)", str(exc))]
    return validate.emit([report], output)
