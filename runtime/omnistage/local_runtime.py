"""Local StageRuntime: every stage replica of a pipeline as a worker process on this machine.

This is the placement backend behind `omnistage serve`. It turns each logical stage into a pool
of ready `omnistage stage` processes named `<pipeline>-<stage>-<ordinal>` (the identity the
operator gives pods), publishes them through a StaticMembership, supervises them (a replica that
exits on its own is started again under the same name, with exponential backoff, as a kubelet
restarts a container), and tears them all down again.

Workers are spawned from the thread that calls start(), and restarts from the supervisor thread:
the parent-death signal set in procs._child_setup fires when the spawning *thread* exits, so
call start() from the main thread or another thread that lives as long as the replicas (never
from asyncio.to_thread); the supervisor thread lives until shutdown has reaped every replica.

Everything is on one host, so each worker also serves a unix socket (ipc://), which the
membership publishes; with a ShmConfig, workers and the orchestrator exchange large tensors
through shared memory, and a reaper process sweeps the session's segments once this process is
gone, however it goes (see omnistage.shm). A restarted replica gets the same shared-memory
settings and a new unix socket (a new address, as it gets new ports).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from omnistage import backoff
from omnistage.autoscaling import AutoscalerState, Decision, decide
from omnistage.curve import CURVE_GENERATION_ENV, CURVE_KEYS_ENV, CurveKeys
from omnistage.curve import write as write_curve_keys
from omnistage.metrics import family
from omnistage.orchestrator.load import PipelineLoad
from omnistage.orchestrator.membership import ReplicaInfo, ReplicaState, StaticMembership
from omnistage.procs import StartupError, WorkerProcess, spawn_worker, wait_all_ready
from omnistage.shm import ENV_DIR, ShmConfig, release_reaper, spawn_reaper
from omnistage.spec import OmniPipeline, Stage
from omnistage.worker.config import resolve_model

__all__ = [
    "CRASH_LOOP_AFTER",
    "LocalAutoscaler",
    "LocalStageRuntime",
    "PlacementError",
    "ReplicaPlan",
    "ReplicaStartupError",
    "RestartPolicy",
    "RuntimeCollector",
    "detect_gpus",
    "replica_name",
]

Progress = Callable[[str], None]


class PlacementError(RuntimeError):
    """The pipeline cannot be placed on this machine (e.g. more GPUs than exist)."""


class ReplicaStartupError(StartupError):
    """A replica failed to start; everything was rolled back. Names the replica and its log."""

    aftermath = "; all replicas were stopped"


def replica_name(pipeline: str, stage: str, ordinal: int) -> str:
    """Stable replica identity, the same scheme as the operator's pod names."""
    return f"{pipeline}-{stage}-{ordinal}"


def _ordinal(name: str) -> int:
    """The ordinal a replica name ends with (replica_name's scheme)."""
    return int(name.rsplit("-", 1)[1])


def detect_gpus() -> list[str]:
    """Device ids this process may hand out: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`.

    Cheap on purpose (no torch import): it runs before anything starts.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids: list[str] = []
        for token in (t.strip() for t in env.split(",")):
            if not token or token == "-1":  # CUDA ignores everything from an invalid id on
                break
            ids.append(token)
        return ids
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
    return [str(i) for i in range(len(lines))]


@dataclass
class ReplicaPlan:
    """What one replica will run: its identity, its stage (model path resolved) and extra env."""

    name: str
    stage: Stage
    env: dict[str, str]


@dataclass(frozen=True)
class RestartPolicy:
    """How a crashed replica is started again: after `base` seconds, doubling with each crash
    in a row up to `cap`; a replica that stays ready for `stable` seconds starts afresh."""

    base: float = 1.0
    cap: float = 60.0
    stable: float = 60.0

    def delay(self, crashes: int) -> float:
        """The wait before the restart that follows the `crashes`-th crash in a row."""
        return backoff.delay(crashes - 1, self.base, self.cap)


CRASH_LOOP_AFTER = 2
"""Crashes in a row (without a stable run between them) that make a replica crash-looping."""


@dataclass
class _Replica:
    plan: ReplicaPlan
    worker: WorkerProcess
    started: float = field(default_factory=time.monotonic)
    state: ReplicaState = "joining"
    ipc: Path | None = None  # the unix socket its current process serves
    # Supervision: `worker` is the current process (None-like once it exited, until restarted).
    restarts: int = 0
    crashes: int = 0  # in a row, without a stable run between them
    last_exit: int | None = None
    restart_at: float | None = None  # set while waiting to restart
    ready_at: float | None = None  # when the current process became ready
    retire_by: float | None = None  # scaled away: draining, killed if still there by then

    @property
    def crash_looping(self) -> bool:
        return self.crashes >= CRASH_LOOP_AFTER


class LocalStageRuntime:
    """Places a pipeline's stages as local worker processes and publishes their membership."""

    def __init__(
        self,
        pipeline: OmniPipeline,
        *,
        base_dir: str | Path | None = None,
        log_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        progress: Progress | None = None,
        gpus: Sequence[str] | None = None,
        ready_timeout: float = 300.0,
        watch_interval: float = 0.2,
        restart: RestartPolicy | None = None,
        ipc: bool = True,
        shm: ShmConfig | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        """curve: the pair every worker requires of its peers (written to a private directory
        the workers are pointed at; removed at shutdown)."""
        self.pipeline = pipeline
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
        self.log_dir = Path(log_dir) if log_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"omnistage-{pipeline.metadata.name}-")
        )
        self.host = host
        self.progress: Progress = progress or (lambda _msg: None)
        self._gpus = list(gpus) if gpus is not None else None
        self.ready_timeout = ready_timeout
        self.watch_interval = watch_interval
        self.restart = restart or RestartPolicy()
        self.shm = shm  # the orchestrator of this runtime uses the same (serve passes it on)
        self.ipc = ipc
        self._ipc_dir: Path | None = None
        self._worker_env: dict[str, str] = {}  # what every worker (restarts too) is given
        self.curve = curve
        self._curve_dir: Path | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self.membership = StaticMembership()
        self.replicas: dict[str, _Replica] = {}
        self.collector = RuntimeCollector(self)
        self._lock = threading.Lock()
        self._supervising = threading.Lock()  # one supervision pass, or shutdown's start
        self._shutdown_lock = threading.Lock()
        self._stopping = threading.Event()  # no more restarts
        self._closed = threading.Event()  # every replica reaped: the supervisor thread may end
        self._stopped = False
        self._watcher: threading.Thread | None = None
        # The size each stage's pool heads for: the spec's replicas until scale() changes it;
        # the supervisor starts and retires processes to match.
        self.desired: dict[str, int] = {s.name: s.replicas for s in pipeline.spec.stages}
        # Replicas scaled away through the drain path, by stage: planned, never restarts.
        self.retired: dict[str, int] = dict.fromkeys(self.desired, 0)
        self._sockets = itertools.count()
        self._gpu_list: list[str] = []  # the visible GPUs plan() found, for scaled-up replicas

    # ---- placement -------------------------------------------------------------------------

    def plan(self) -> list[ReplicaPlan]:
        """Every replica to start, with GPUs assigned; raises PlacementError before any start."""
        gpus = self._gpus if self._gpus is not None else detect_gpus()
        name = self.pipeline.metadata.name
        plans: list[ReplicaPlan] = []
        cursor = 0
        shared = False
        for stage in self.pipeline.spec.stages:
            want = stage.resources.gpus
            if want > len(gpus):
                raise PlacementError(
                    f"stage {stage.name!r} asks for {want} GPU(s) per replica but this machine "
                    f"has {len(gpus)} visible"
                    + (f" ({', '.join(gpus)})" if gpus else "")
                    + "; lower spec.stages[].resources.gpus or set CUDA_VISIBLE_DEVICES"
                )
            resolved = resolve_model(stage, self.base_dir)
            for ordinal in range(stage.replicas):
                if want == 0:
                    env = {"CUDA_VISIBLE_DEVICES": ""}  # the worker falls back to the CPU
                else:
                    ids = []
                    for _ in range(want):  # wrap around: locally, replicas may share GPUs
                        if cursor >= len(gpus):
                            cursor, shared = 0, True
                        ids.append(gpus[cursor])
                        cursor += 1
                    env = {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
                plans.append(ReplicaPlan(replica_name(name, stage.name, ordinal), resolved, env))
        self._gpu_list = gpus
        if shared:
            self.progress(f"note: GPU requests exceed the {len(gpus)} visible GPU(s); "
                          "some replicas share a GPU")
        return plans

    # ---- startup ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start every replica and wait until all are ready; on any failure, roll back all."""
        if self.replicas or self._stopped:
            raise RuntimeError("LocalStageRuntime.start() may be called once")
        plans = self.plan()
        t0 = time.monotonic()
        self.progress(f"starting {len(plans)} replica(s) of pipeline "
                      f"{self.pipeline.metadata.name} (logs: {self.log_dir})")
        self._worker_env = self.shm.env() if self.shm is not None else {ENV_DIR: ""}
        # Set either way: a worker never picks up keys (or a key generation) from the
        # environment serve ran in. The pair made for the run is generation 0.
        self._worker_env[CURVE_KEYS_ENV] = ""
        self._worker_env[CURVE_GENERATION_ENV] = ""
        if self.curve is not None:
            self._curve_dir = write_curve_keys(self.curve)
            self._worker_env[CURVE_KEYS_ENV] = str(self._curve_dir)
        if self.shm is not None:
            self._reaper = spawn_reaper(self.shm)
        if self.ipc:  # short: a unix socket path has at most 107 bytes
            self._ipc_dir = Path(tempfile.mkdtemp(prefix="omnistage-ipc-"))
        try:
            for i, plan in enumerate(plans):
                ipc = self._ipc_dir / f"{i}.sock" if self._ipc_dir is not None else None
                worker = spawn_worker(plan.name, plan.stage, host=self.host, log_dir=self.log_dir,
                                      env={**plan.env, **self._worker_env}, ipc=ipc)
                with self._lock:
                    self.replicas[plan.name] = _Replica(plan, worker, ipc=ipc)
            self._wait_all_ready()
        except BaseException:
            self._rollback()
            raise
        self.progress(f"all {len(plans)} replica(s) ready in {time.monotonic() - t0:.1f}s")
        self._watcher = threading.Thread(target=self._watch, name="omnistage-supervisor",
                                         daemon=True)
        self._watcher.start()

    def _wait_all_ready(self) -> None:
        """Publish each replica as it gets ready; the first failure names its replica."""
        done = 0

        def ready(w: WorkerProcess) -> None:
            nonlocal done
            rep = self.replicas[w.name]
            done += 1
            rep.ready_at = time.monotonic()
            self._publish(rep, "ready")
            self.progress(f"[{done}/{len(self.replicas)}] {w.name} ready "
                          f"({time.monotonic() - rep.started:.1f}s)")

        try:
            wait_all_ready([rep.worker for rep in self.replicas.values()], self.ready_timeout,
                           on_ready=ready, progress=self.progress)
        except StartupError as err:
            raise ReplicaStartupError(err.replica, err.reason, err.log_tail,
                                      err.log_path) from None

    def _rollback(self) -> None:
        """Kill every replica started so far; startup failed, so there is nothing to drain."""
        with self._lock:
            reps = list(self.replicas.values())
        for rep in reps:
            rep.worker.kill()
        for rep in reps:
            rep.worker.proc.wait()
            if rep.state != "joining":
                self._publish(rep, "gone")
        self._stopped = True
        self._stopping.set()
        self._closed.set()
        self._cleanup()

    def _cleanup(self) -> None:
        """The replicas are gone: remove their sockets, and let the reaper sweep and exit."""
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._curve_dir is not None:
            shutil.rmtree(self._curve_dir, ignore_errors=True)
        if self._reaper is not None:
            release_reaper(self._reaper)

    # ---- supervision -----------------------------------------------------------------------

    def _watch(self) -> None:
        """The supervisor: notice replicas that exit on their own, restart them with backoff,
        and publish each as it gets ready again. It spawns the restarts, so it lives until
        shutdown has reaped every replica (see the module docstring)."""
        while not self._closed.wait(self.watch_interval):
            with self._supervising:
                if self._stopping.is_set():
                    continue
                with self._lock:
                    reps = list(self.replicas.values())
                for rep in reps:
                    try:
                        if rep.retire_by is not None:
                            self._retiring(rep)
                        else:
                            self._supervise(rep)
                    except Exception as exc:  # one replica's trouble must not stop the others
                        self.progress(f"supervising replica {rep.plan.name} failed: {exc!r}")
                for stage in self.desired:
                    try:
                        self._reconcile(stage)
                    except Exception as exc:
                        self.progress(f"scaling stage {stage} failed: {exc!r}")

    def _supervise(self, rep: _Replica) -> None:
        now = time.monotonic()
        if rep.restart_at is not None:  # waiting out the backoff
            if now >= rep.restart_at:
                self._respawn(rep)
            return
        if rep.state == "joining":  # a restarted process loading its model
            try:
                ready = rep.worker.poll_ready()
            except StartupError as err:
                return self._crashed(rep, err.reason)
            if ready:
                rep.ready_at = now
                self._publish(rep, "ready")
                if rep.restarts:
                    self.progress(f"replica {rep.plan.name} is back (restart {rep.restarts}, "
                                  f"ready in {now - rep.started:.1f}s)")
                else:
                    self.progress(f"replica {rep.plan.name} ready ({now - rep.started:.1f}s)")
            elif now - rep.started > self.ready_timeout:
                rep.worker.kill()
                self._crashed(rep, f"not ready after {self.ready_timeout:.0f}s")
            return
        code = rep.worker.proc.poll()
        if code is None:
            if rep.crashes and rep.ready_at is not None and now - rep.ready_at >= \
                    self.restart.stable:
                rep.crashes = 0  # a stable run: the next crash starts the backoff afresh
            return
        self._crashed(rep, f"exited unexpectedly (code {code})")

    def _crashed(self, rep: _Replica, why: str) -> None:
        """The replica's process is gone: publish it gone (its bound requests fail) and plan
        its restart under the same name."""
        rep.worker.kill()  # reap it and anything left in its process group
        rep.last_exit = rep.worker.proc.returncode
        if rep.state == "ready":
            self._publish(rep, "gone")
        else:  # a restart that never got ready was never published
            with self._lock:
                rep.state = "gone"
        rep.crashes += 1
        delay = self.restart.delay(rep.crashes)
        rep.restart_at = time.monotonic() + delay
        loop_note = (f"; crash-looping ({rep.crashes} crashes in a row)"
                     if rep.crash_looping else "")
        self.progress(f"replica {rep.plan.name} {why}; restarting in {delay:.1f}s{loop_note}; "
                      f"log tail:\n{rep.worker.log_tail(10)}")

    def _respawn(self, rep: _Replica) -> None:
        plan = rep.plan
        ipc = None
        if rep.ipc is not None:  # the dead process left its socket file
            rep.ipc.unlink(missing_ok=True)
            ordinal = rep.ipc.name.split(".")[0]  # start() named it <ordinal>.sock
            ipc = rep.ipc.with_name(f"{ordinal}.{rep.restarts + 1}.sock")
        worker = spawn_worker(plan.name, plan.stage, host=self.host, log_dir=self.log_dir,
                              env={**plan.env, **self._worker_env}, ipc=ipc, append_log=True)
        with self._lock:
            rep.worker = worker
            rep.ipc = ipc
            rep.restarts += 1
            rep.restart_at = None
            rep.ready_at = None
            rep.started = time.monotonic()
            rep.state = "joining"  # a new process: published once it is ready

    # ---- scaling (the local autoscaler) ----------------------------------------------------

    def scale(self, stage: str, replicas: int) -> None:
        """Head the stage's pool for this many processes (thread-safe); the supervisor starts
        new ones (published once ready) and retires extra ones by draining them first."""
        if stage not in self.desired:
            raise ValueError(f"stage: unknown stage {stage!r}; pipeline has {list(self.desired)}")
        if replicas < 0:
            raise ValueError(f"replicas: must be >= 0, got {replicas}")
        with self._lock:
            self.desired[stage] = replicas

    def live(self, stage: str) -> list[str]:
        """The stage's replicas that are not retiring (starting, ready or restarting)."""
        with self._lock:
            return sorted(n for n, r in self.replicas.items()
                          if r.plan.stage.name == stage and r.retire_by is None)

    def _reconcile(self, stage: str) -> None:
        """Start or retire processes until the stage has `desired` that are not retiring.
        New replicas take the lowest free ordinals; the highest ordinals retire first."""
        with self._lock:
            want = self.desired[stage]
            mine = [r for r in self.replicas.values() if r.plan.stage.name == stage]
        live = sorted((r for r in mine if r.retire_by is None),
                      key=lambda r: _ordinal(r.plan.name))
        for rep in live[want:][::-1]:
            self._retire(rep)
        if len(live) >= want:
            return
        taken = {_ordinal(r.plan.name) for r in mine}
        ordinals = (o for o in itertools.count() if o not in taken)
        spec = next(s for s in self.pipeline.spec.stages if s.name == stage)
        for ordinal in itertools.islice(ordinals, want - len(live)):
            self._spawn_new(spec, ordinal)

    def _spawn_new(self, stage: Stage, ordinal: int) -> None:
        name = replica_name(self.pipeline.metadata.name, stage.name, ordinal)
        want = stage.resources.gpus
        gpus = self._gpu_list
        if want == 0 or not gpus:
            env = {"CUDA_VISIBLE_DEVICES": ""}
        else:  # round-robin by ordinal: locally, replicas may share GPUs
            env = {"CUDA_VISIBLE_DEVICES": ",".join(
                gpus[(ordinal * want + i) % len(gpus)] for i in range(want))}
        plan = ReplicaPlan(name, resolve_model(stage, self.base_dir), env)
        ipc = (self._ipc_dir / f"s{next(self._sockets)}.sock"
               if self._ipc_dir is not None else None)
        worker = spawn_worker(name, plan.stage, host=self.host, log_dir=self.log_dir,
                              env={**plan.env, **self._worker_env}, ipc=ipc, append_log=True)
        with self._lock:
            self.replicas[name] = _Replica(plan, worker, ipc=ipc)  # joining until ready
        self.progress(f"scaling stage {stage.name} up: starting replica {name}")

    def _retire(self, rep: _Replica) -> None:
        """Scale down one replica through the one drain path; the supervisor ends it."""
        self.progress(f"scaling stage {rep.plan.stage.name} down: draining replica "
                      f"{rep.plan.name}")
        self._drain(rep, time.monotonic() + rep.plan.stage.drain_timeout_seconds + 5.0)

    def _retiring(self, rep: _Replica) -> None:
        """A retiring replica: once its process has exited (or its time is up), it is gone."""
        assert rep.retire_by is not None
        if rep.worker.proc.poll() is None and time.monotonic() < rep.retire_by:
            return
        self._drained(rep)
        with self._lock:
            self.replicas.pop(rep.plan.name, None)
            self.retired[rep.plan.stage.name] += 1
        if rep.ipc is not None:
            rep.ipc.unlink(missing_ok=True)
        self.progress(f"replica {rep.plan.name} stopped (scaled down)")

    # ---- the one drain path (scale-down and shutdown) --------------------------------------

    def _drain(self, rep: _Replica, deadline: float) -> None:
        """Routed to no more (published draining if it was ready), then SIGTERM: the worker
        finishes what it has and exits; `_drained` kills it if it is still there at deadline."""
        rep.retire_by = deadline
        rep.restart_at = None
        if rep.state == "ready":
            self._publish(rep, "draining")
        if rep.worker.proc.poll() is None:
            try:
                rep.worker.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _drained(self, rep: _Replica) -> None:
        """The drain is over (exited, or out of time): kill what is left, publish it gone."""
        if rep.worker.proc.poll() is None:
            self.progress(f"replica {rep.plan.name} did not drain in time; killing it")
        rep.worker.kill()  # reaps it and anything left in its process group
        if rep.state in ("ready", "draining"):
            self._publish(rep, "gone")
        with self._lock:
            rep.state = "gone"

    def notes(self) -> list[str]:
        """One line per replica that is not simply running: restarting or crash-looping."""
        out = []
        now = time.monotonic()
        with self._lock:
            reps = list(self.replicas.values())
        for rep in reps:
            if rep.restart_at is not None:
                what = "crash-looping" if rep.crash_looping else "restarting"
                out.append(f"replica {rep.plan.name} {what}: {rep.crashes} crash(es) in a row, "
                           f"last exit code {rep.last_exit}, next start in "
                           f"{max(0.0, rep.restart_at - now):.1f}s")
            elif rep.state == "joining" and rep.restarts:
                what = "crash-looping" if rep.crash_looping else "restarting"
                out.append(f"replica {rep.plan.name} {what}: restart {rep.restarts} is loading")
        return out

    def _publish(self, rep: _Replica, state: ReplicaState) -> None:
        with self._lock:
            if rep.state == state or rep.state == "gone":
                return
            rep.state = state
        info = ReplicaInfo(rep.plan.stage.name, rep.plan.name, rep.worker.endpoint, state)
        try:
            self.membership.publish(info)
        except RuntimeError:  # the subscriber's event loop is already closed: nobody to tell
            pass

    @property
    def pids(self) -> dict[str, int]:
        """Replica name -> worker pid (for diagnostics and tests)."""
        with self._lock:
            return {name: rep.worker.pid for name, rep in self.replicas.items()}

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self, grace: float | None = None) -> None:
        """SIGTERM every replica (each drains), wait, SIGKILL leftovers. Idempotent.

        grace defaults to the longest stage drain timeout plus a margin; a second call (also
        from another thread) waits for the first and returns.
        """
        with self._shutdown_lock:
            if self._stopped:
                return
            with self._supervising:  # after a pass in progress; none starts from now on
                self._stopping.set()
            with self._lock:
                reps = list(self.replicas.values())
            if grace is None:
                grace = max((r.plan.stage.drain_timeout_seconds for r in reps), default=0) + 5.0
            deadline = time.monotonic() + grace
            for rep in reps:
                self._drain(rep, deadline)
            for rep in reps:
                try:
                    rep.worker.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass  # _drained says so and kills it
                self._drained(rep)
            self._closed.set()
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            self._stopped = True
            self._cleanup()

    def __enter__(self) -> LocalStageRuntime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class LocalAutoscaler:
    """`omnistage serve`'s autoscaler: for each stage with `autoscaling`, once per its period,
    omnistage.autoscaling.decide on the orchestrator's load signal, applied as processes
    (LocalStageRuntime.scale: new ones join when ready, extra ones drain before they stop).

    wake() is the orchestrator's in-process waker: a stage at zero gets its first replica at
    once, not at the next period.
    """

    def __init__(self, runtime: LocalStageRuntime, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runtime = runtime
        self.clock = clock
        self.specs = {s.name: s.autoscaling for s in runtime.pipeline.spec.stages
                      if s.autoscaling is not None}
        self.states = {stage: AutoscalerState() for stage in self.specs}
        self.decisions: dict[str, Decision] = {}  # the last one per stage, for diagnostics
        self._due = dict.fromkeys(self.specs, 0.0)

    def wake(self, stage: str) -> None:
        """A request is held for a stage at zero: start its first replica(s) now."""
        spec = self.specs.get(stage)
        if spec is None or self.runtime.desired[stage] > 0:
            return
        want = max(1, spec.min_replicas)
        self.runtime.progress(f"autoscaler: waking stage {stage} (a request is held): 0 -> "
                              f"{want}")
        self.runtime.scale(stage, want)
        self.states[stage] = AutoscalerState(1, self.clock(), None)

    def step(self, load: PipelineLoad) -> None:
        """Decide every stage whose period is due, and apply the changes."""
        now = self.clock()
        for stage, spec in self.specs.items():
            figures = load.stages.get(stage)
            if figures is None or now < self._due[stage]:
                continue
            self._due[stage] = now + spec.period_seconds
            current = self.runtime.desired[stage]
            decision = decide(spec, figures, current, self.states[stage], now,
                              load_now=load.now)
            self.states[stage] = decision.state
            self.decisions[stage] = decision
            if decision.desired != current:
                self.runtime.progress(f"autoscaler: stage {stage}: {decision.reason}")
                self.runtime.scale(stage, decision.desired)

    async def run(self, load: Callable[[], PipelineLoad]) -> None:
        """Step on the orchestrator's load until cancelled (at shutdown)."""
        if not self.specs:
            return
        tick = min(spec.period_seconds for spec in self.specs.values())
        while True:
            await asyncio.sleep(tick)
            self.step(load())


class RuntimeCollector:
    """The local runtime's supervision, for the orchestrator's /metrics under `omnistage serve`.

    Every family carries the labels pipeline, stage and replica; values are read at scrape time.
    """

    def __init__(self, runtime: LocalStageRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        rt = self.runtime
        common = {"pipeline": rt.pipeline.metadata.name}
        with rt._lock:
            reps = sorted(rt.replicas.values(), key=lambda r: r.plan.name)
        rows = [((r.plan.stage.name, r.plan.name), r) for r in reps]
        labels = ["stage", "replica"]
        yield family(CounterMetricFamily, "omnistage_runtime_replica_restarts_total",
                     "Times a replica was started again after its process exited", common,
                     [(k, r.restarts) for k, r in rows], labels)
        with rt._lock:
            retired = sorted(rt.retired.items())
        yield family(CounterMetricFamily, "omnistage_runtime_replicas_retired_total",
                     "Replicas scaled away and stopped through the drain path: planned, not "
                     "restarts", common, [((stage,), n) for stage, n in retired], ["stage"])
        yield family(GaugeMetricFamily, "omnistage_runtime_replica_crash_looping",
                     f"1 while a replica has crashed {CRASH_LOOP_AFTER} or more times in a row",
                     common, [(k, 1 if r.crash_looping else 0) for k, r in rows], labels)
        yield family(GaugeMetricFamily, "omnistage_runtime_replica_up",
                     "1 while a replica's process runs and is published ready", common,
                     [(k, 1 if r.state == "ready" else 0) for k, r in rows], labels)
