"""`omnistage orchestrator`: the pipeline's API front door, as the orchestrator pod runs it.

Unlike `omnistage serve`, it starts no replicas: it only routes. Replicas come from Kubernetes
membership (a watch of the pipeline's stage Pods) or, for tests and hand-made setups, from a
static list. The pipeline comes from a file or, in the operator's Deployment, from the
OMNISTAGE_PIPELINE environment variable (the resolved manifest as JSON).

serve_orchestrator is the one orchestrator lifecycle; `omnistage serve` runs it too, over the
local runtime's membership. Shutdown on SIGTERM/SIGINT refuses nothing a load balancer could have
sent elsewhere:
1. /readyz fails at once, every response from now on carries `Connection: close`, and requests
   are still admitted for the shutdown delay, so endpoints drop this instance first;
2. then it stops admitting (503 shutting_down) and drains in-flight requests;
3. the HTTP listener closes only when none is left (or at the drain timeout), after taking in
   the connections the kernel already accepted; then the membership watch stops.
Repeated signals are ignored, so a second SIGTERM from the kubelet does not cut anything short.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from prometheus_client.registry import Collector

from omnistage import eventloop, kube
from omnistage.curve import CURVE_KEYS_ENV, CurveKeyError, CurveKeyring, keyring_from_env
from omnistage.orchestrator.auth import ApiKeyError, ApiKeys
from omnistage.orchestrator.auth import resolve_both as resolve_keys
from omnistage.orchestrator.membership import Membership, ReplicaInfo, StaticMembership
from omnistage.orchestrator.shutdown import drain_timeout
from omnistage.orchestrator.wake import Waker, waker_for
from omnistage.shm import ShmConfig, ShmError
from omnistage.spec import OmniPipeline, SpecError, load_pipeline, parse_pipeline
from omnistage.spec.pipeline import admin_port_beside

log = logging.getLogger("omnistage.orchestrator")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Say = Callable[[str], None]


class UsageError(ValueError):
    """Bad command-line input: reported on stderr with exit status 2."""


class ApiBindError(OSError):
    """The HTTP API could not listen (typically: the port is taken)."""


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


def api_routes(pipeline: OmniPipeline) -> list[str]:
    """The routes this pipeline's API surface enables, for the startup banner."""
    api = pipeline.spec.orchestrator.api
    routes = ["/v1/models"]
    routes += ["/v1/chat/completions"] if "chat" in api else []
    # The speech route is there only where a stage's kind emits audio.
    from omnistage.orchestrator.request_parsing import speech_plan
    routes += ["/v1/audio/speech"] if "speech" in api and speech_plan(pipeline.spec) else []
    routes += ["/v1/images/generations"] if "images" in api else []
    routes += [f"/v1/pipelines/{pipeline.metadata.name}/requests"] if "generic" in api else []
    return [*routes, "/readyz", "/openapi.json"]


def admin_routes(pipeline: OmniPipeline) -> list[str]:
    """The admin listener's routes, for the startup banner."""
    return [f"/v1/pipelines/{pipeline.metadata.name}/control", kube.LOAD_PATH, "/metrics"]


def admin_port_for(pipeline: OmniPipeline, port: int | None, admin_port: int | None) -> int:
    """The admin listener's port: as given, else spec.orchestrator.adminPort (default the API's
    port + 1), except that an API on any free port (0) puts the admin listener on any free
    port too. Raises UsageError when it would be the API's port."""
    orch = pipeline.spec.orchestrator
    api_port = orch.port if port is None else port
    if admin_port is None:
        if api_port == 0:
            admin_port = 0
        elif orch.admin_port is not None:
            admin_port = orch.admin_port
        else:
            admin_port = admin_port_beside(api_port)
    if admin_port != 0 and admin_port == api_port:
        raise UsageError(f"admin port {admin_port} is the API's port: give the admin listener "
                         "its own (--admin-port, spec.orchestrator.adminPort)")
    return admin_port


async def serve_orchestrator(
    pipeline: OmniPipeline,
    membership: Membership,
    host: str,
    port: int | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], object] | None = None,
    ignore_late_signals: bool = False,
    say: Say | None = None,
    started: float | None = None,
    shutdown_delay: float | None = None,
    notes: Callable[[], Sequence[str]] | None = None,
    collectors: Sequence[Collector] = (),
    shm: ShmConfig | None = None,
    waker: Waker | None = None,
    background: Sequence[Callable[[Any], Awaitable[None]]] = (),
    api_keys: ApiKeys | None = None,
    curve: CurveKeyring | None = None,
    admin_host: str | None = None,
    admin_port: int | None = None,
    admin_keys: ApiKeys | None = None,
    on_admin_ready: Callable[[str], object] | None = None,
) -> int:
    """Run the orchestrator and its API until SIGINT/SIGTERM (or `stop`), then shut down as
    the module docstring says; returns 0.

    port None means spec.orchestrator.port, shutdown_delay None its shutdownDelaySeconds.
    say(msg) hears every progress line (default: the log); started (a time.monotonic() value)
    dates the "ready" line. on_ready(url) is called once the API listens (tests use it to learn
    the bound port). ignore_late_signals (the CLI) keeps signals harmless until the process has
    exited; otherwise the previous handlers come back (an embedding program keeps its own).
    notes and collectors come from the placement (`omnistage serve`'s supervised replicas):
    notes() lines join /readyz's reason, and the collectors' metrics /metrics. shm: exchange
    tensors with replicas on this machine through shared memory. waker: asked to start a
    stage at zero replicas (autoscaling) while requests are held for it. background: each is
    called with the Orchestrator once it started and runs until shutdown begins (`omnistage
    serve`'s autoscaler). api_keys: the keys the API's keyed routes need (None: open).
    curve: the pipeline's CurveZMQ keys its workers require (omnistage.curve; None: plain).
    admin_host/admin_port/admin_keys: the admin listener (control, load, metrics; default the
    API's host and admin_port_for's port; keys None: open); on_admin_ready(url) as on_ready.
    It closes after the API's listener: the operator reads the load of a draining orchestrator.
    Raises ApiBindError if a listener cannot listen.
    """
    from omnistage.orchestrator.engine import Orchestrator
    from omnistage.orchestrator.http_api import API_KEY, serve_http
    from omnistage.sideport import close_gracefully

    say = say or log.info
    t0 = time.monotonic() if started is None else started
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            say(f"already shutting down; {sig.name} ignored")
            return
        say(f"{sig.name} received: shutting down (orchestrator drains first)")
        stop.set()

    def late_signal(signum: int, _frame: Any) -> None:
        say(f"already shutting down; {signal.Signals(signum).name} ignored")

    installed = []
    previous = {sig: signal.getsignal(sig) or signal.SIG_DFL for sig in _SIGNALS}
    for sig in _SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests): `stop` is the only way out
    api_port = pipeline.spec.orchestrator.port if port is None else port
    delay = (pipeline.spec.orchestrator.shutdown_delay_seconds if shutdown_delay is None
             else shutdown_delay)
    admin_bind = host if admin_host is None else admin_host
    admin_at = admin_port_for(pipeline, port, admin_port)
    orch = Orchestrator(pipeline, membership, notes=notes, shm=shm, waker=waker, curve=curve)
    for collector in collectors:
        orch.registry.register(collector)
    runner: Any = None
    admin_runner: Any = None
    loops: list[asyncio.Future[None]] = []
    started_ok = serving = False
    drain = drain_timeout(pipeline)
    try:
        await orch.start()
        started_ok = True
        loops = [asyncio.ensure_future(run(orch)) for run in background]
        try:
            admin_runner, admin_url = await serve_http(orch, admin_bind, admin_at, admin_keys,
                                                       listener="admin")
        except OSError as exc:
            raise ApiBindError(f"cannot serve the admin listener on {admin_bind}:{admin_at}: "
                               f"{exc}") from exc
        try:
            runner, url = await serve_http(orch, host, api_port, api_keys)
        except OSError as exc:
            raise ApiBindError(f"cannot serve the API on {host}:{api_port}: {exc}") from exc
        say(f"admin listener at {admin_url} (routes: {', '.join(admin_routes(pipeline))})")
        say(f"API at {url} (routes: {', '.join(api_routes(pipeline))})")
        if on_admin_ready is not None:
            on_admin_ready(admin_url)
        if on_ready is not None:
            on_ready(url)
        ok, reason = await _wait_ready(orch, stop)
        name = pipeline.metadata.name
        if ok:
            replicas = sum(len(r) for r in orch.status().values())
            say(f"pipeline {name} ready at {url} "
                f"({replicas} replicas, {time.monotonic() - t0:.1f}s)")
        else:  # e.g. a stage with replicas: 0; keep serving, /readyz says the same
            say(f"pipeline {name} is serving at {url} but NOT ready: {reason}")
        serving = True
        await stop.wait()
    finally:
        stop.set()  # from here on every signal is "already shutting down"
        for loop_task in loops:
            loop_task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for listening in (runner, admin_runner):
            if listening is not None:
                listening.app[API_KEY].begin_shutdown()
        if serving and delay > 0:
            say(f"orchestrator: /readyz fails now; still serving for {delay:g}s "
                "(shutdown delay) so endpoints drop this instance")
            await asyncio.sleep(delay)
        if started_ok:
            say(f"orchestrator: stopped admitting, draining (up to {drain:.0f}s)")
            await orch.stop(drain)
        if runner is not None:
            await close_gracefully(runner)
            say("orchestrator: drained; HTTP listener closed")
        if admin_runner is not None:
            await close_gracefully(admin_runner)
        await membership.stop()  # idempotent; covers a failed orch.start()
        for sig in installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, late_signal if ignore_late_signals else previous[sig])
    return 0


async def _wait_ready(orch: Any, stop: asyncio.Event, timeout: float = 5.0) -> tuple[bool, str]:
    """Membership reaches the orchestrator via the loop; give it a moment to see every replica."""
    for _ in range(int(timeout / 0.05)):
        if orch.ready or stop.is_set():
            break
        await asyncio.sleep(0.05)
    return orch.readiness()


def run_orchestrator(
    *,
    pipeline_file: str | None,
    membership: str,
    namespace: str | None,
    host: str | None,
    port: int | None,
    replicas: Sequence[str] = (),
    zmq_port: int = kube.WORKER_ZMQ_PORT,
    shutdown_delay: float | None = None,
    api_key_file: str | None = None,
    no_auth: bool = False,
    admin_port: int | None = None,
    admin_key_file: str | None = None,
) -> int:
    """The `omnistage orchestrator` command; returns the process exit status.

    shutdown_delay None means the pipeline's spec.orchestrator.shutdownDelaySeconds.
    """
    bind = host or os.environ.get("POD_IP") or "127.0.0.1"
    try:
        pipeline = read_pipeline(pipeline_file)
        members = make_membership(membership, pipeline, namespace=namespace,
                                  replicas=replicas, zmq_port=zmq_port)
        shm = ShmConfig.from_env()  # the opt-in: a shared directory with the node's replicas
        # The pipeline's Secret, mounted by the operator, at this pod's key generation.
        curve = keyring_from_env()
        admin_at = admin_port_for(pipeline, port, admin_port)
    except SpecError as exc:
        print(f"error: invalid pipeline {pipeline_file or '$' + kube.PIPELINE_ENV}:",
              file=sys.stderr)
        for path, message in exc.errors:
            print(f"  {path}: {message}", file=sys.stderr)
        return 2
    except (UsageError, ShmError, CurveKeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("stage workers: %s", f"CurveZMQ with the pipeline's key (generation "
             f"{curve.generation})" if curve is not None else
             f"plain ZMQ (no ${CURVE_KEYS_ENV}): any peer that reaches a worker is heard")
    try:
        auth = pipeline.spec.orchestrator.auth
        api_keys, admin_keys, lines = resolve_keys(
            api_key_file, admin_key_file, no_auth=no_auth, host=bind, admin_host=bind,
            secret=auth.api_key_secret, disabled=auth.disabled)
    except ApiKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        log.info("%s", line)
    try:
        return eventloop.run(serve_orchestrator(pipeline, members, bind, port,
                                                ignore_late_signals=True,
                                                shutdown_delay=shutdown_delay, shm=shm,
                                                waker=waker_for(members), api_keys=api_keys,
                                                curve=curve, admin_port=admin_at,
                                                admin_keys=admin_keys))
    except Exception as exc:  # startup failures: a message, exit 1
        log.error("orchestrator failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


__all__ = [
    "ApiBindError",
    "UsageError",
    "admin_port_for",
    "admin_routes",
    "api_routes",
    "make_membership",
    "parse_replica",
    "read_pipeline",
    "run_orchestrator",
    "serve_orchestrator",
]
