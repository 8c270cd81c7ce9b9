"""`omnistage orchestrator`: the pipeline's API front door, as the orchestrator pod runs it.

Unlike `omnistage serve`, it starts no replicas: it only routes. Replicas come from Kubernetes
membership (a watch of the pipeline's stage Pods) or, for tests and hand-made setups, from a
static list. The pipeline comes from a file or, in the operator's Deployment, from the
OMNISTAGE_PIPELINE environment variable (the resolved manifest as JSON).

Shutdown order on SIGTERM/SIGINT: stop admitting and drain in-flight requests, then close the
HTTP listener, then the membership watch. Repeated signals while draining are ignored, so a
second SIGTERM from the kubelet does not cut requests short.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omnistage import kube
from omnistage.orchestrator.membership import Membership, ReplicaInfo, StaticMembership
from omnistage.spec import OmniPipeline, SpecError, load_pipeline, parse_pipeline

log = logging.getLogger("omnistage.orchestrator")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class UsageError(ValueError):
    """Bad command-line input: reported on stderr with exit status 2."""


def parse_replica(text: str) -> ReplicaInfo:
    """`stage=name@tcp://host:port` -> a ready ReplicaInfo (static membership)."""
    stage, sep, rest = text.partition("=")
    name, at, endpoint = rest.partition("@")
    if not (sep and at and stage and name and endpoint.startswith("tcp://")):
        raise UsageError(f"--replica {text!r}: expected stage=name@tcp://host:port")
    return ReplicaInfo(stage.strip(), name.strip(), endpoint.strip(), "ready")


def read_pipeline(file: str | None, env: Mapping[str, str] | None = None) -> OmniPipeline:
    """The pipeline from FILE, else from $OMNISTAGE_PIPELINE (JSON); model paths are not checked
    because they name files inside the stage pods, not here."""
    if file:
        return load_pipeline(file, check_paths=False)
    text = (os.environ if env is None else env).get(kube.PIPELINE_ENV)
    if not text:
        raise UsageError(f"no pipeline: pass --pipeline-file or set ${kube.PIPELINE_ENV}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"${kube.PIPELINE_ENV} is not valid JSON: {exc}") from None
    return parse_pipeline(doc, check_paths=False)


def make_membership(
    kind: str,
    pipeline: OmniPipeline,
    *,
    namespace: str | None = None,
    replicas: Sequence[str] = (),
    zmq_port: int = kube.WORKER_ZMQ_PORT,
) -> Membership:
    """Kubernetes (watch the pipeline's Pods) or static (the --replica list)."""
    if kind == "static":
        return StaticMembership([parse_replica(r) for r in replicas])
    if kind != "kubernetes":
        raise UsageError(f"unknown membership {kind!r}")
    if replicas:
        raise UsageError("--replica is only for --membership static")
    from omnistage.orchestrator.k8s_membership import KubernetesMembership, default_namespace

    return KubernetesMembership(namespace or default_namespace(), pipeline.metadata.name,
                                zmq_port=zmq_port)


def _log_ignored(signum: int, _frame: Any) -> None:
    log.info("already shutting down; %s ignored", signal.Signals(signum).name)


def _drain_timeout(pipeline: OmniPipeline) -> float:
    return float(max((s.drain_timeout_seconds for s in pipeline.spec.stages), default=30))


async def serve_orchestrator(
    pipeline: OmniPipeline,
    membership: Membership,
    host: str,
    port: int,
    stop: asyncio.Event | None = None,
    on_ready: Any = None,
    ignore_late_signals: bool = False,
) -> int:
    """Run until SIGINT/SIGTERM (or `stop` is set), then drain; returns the exit status.

    on_ready(url) is called once the API listens (tests use it to learn the bound port).
    ignore_late_signals (the CLI) keeps signals harmless until the process has exited;
    otherwise the previous handlers come back (an embedding program keeps its own).
    """
    from omnistage.orchestrator.engine import Orchestrator
    from omnistage.orchestrator.http_api import serve_http

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.info("already shutting down; %s ignored", sig.name)
            return
        log.info("%s received: stop admitting, drain, exit", sig.name)
        stop.set()

    installed = []
    previous = {sig: signal.getsignal(sig) or signal.SIG_DFL for sig in _SIGNALS}
    for sig in _SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests): `stop` is the only way out
    orch = Orchestrator(pipeline, membership)
    runner: Any = None
    started = False
    drain = _drain_timeout(pipeline)
    try:
        await orch.start()
        started = True
        runner, url = await serve_http(orch, host, port)
        log.info("orchestrator for pipeline %s listening at %s", pipeline.metadata.name, url)
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
    finally:
        stop.set()  # from here on every signal is "already shutting down"
        if started:
            log.info("orchestrator: stopped admitting, draining (up to %.0fs)", drain)
            await orch.stop(drain)
        if runner is not None:
            await runner.cleanup()
        await membership.stop()  # idempotent; covers a failed orch.start()
        for sig in installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, _log_ignored if ignore_late_signals else previous[sig])
    return 0


def run_orchestrator(
    *,
    pipeline_file: str | None,
    membership: str,
    namespace: str | None,
    host: str | None,
    port: int | None,
    replicas: Sequence[str] = (),
    zmq_port: int = kube.WORKER_ZMQ_PORT,
) -> int:
    """The `omnistage orchestrator` command; returns the process exit status."""
    try:
        pipeline = read_pipeline(pipeline_file)
        members = make_membership(membership, pipeline, namespace=namespace,
                                  replicas=replicas, zmq_port=zmq_port)
    except SpecError as exc:
        print(f"error: invalid pipeline {pipeline_file or '$' + kube.PIPELINE_ENV}:",
              file=sys.stderr)
        for path, message in exc.errors:
            print(f"  {path}: {message}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bind = host or os.environ.get("POD_IP") or "127.0.0.1"
    try:
        return asyncio.run(serve_orchestrator(
            pipeline, members, bind, pipeline.spec.orchestrator.port if port is None else port,
            ignore_late_signals=True))
    except Exception as exc:  # startup failures: a message, exit 1
        log.error("orchestrator failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


__all__ = [
    "UsageError",
    "make_membership",
    "parse_replica",
    "read_pipeline",
    "run_orchestrator",
    "serve_orchestrator",
]
