"""Local StageRuntime: every stage replica of a pipeline as a worker process on this machine.

This is the placement backend behind `omnistage serve`. It turns each logical stage into a pool
of ready `omnistage stage` processes named `<pipeline>-<stage>-<ordinal>` (the identity the
operator gives pods), publishes them through a StaticMembership, and tears them all down again.

Workers are spawned from the thread that calls start(): the parent-death signal set in
procs._child_setup fires when that *thread* exits, so call start() from the main thread or
another thread that lives as long as the replicas (never from asyncio.to_thread).

Everything is on one host, so each worker also serves a unix socket (ipc://), which the
membership publishes; with a ShmConfig, workers and the orchestrator exchange large tensors
through shared memory, and a reaper process sweeps the session's segments once this process is
gone, however it goes (see omnistage.shm).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.orchestrator.membership import ReplicaInfo, ReplicaState, StaticMembership
from omnistage.procs import StartupError, WorkerProcess, spawn_worker, wait_all_ready
from omnistage.shm import ENV_DIR, ShmConfig, spawn_reaper
from omnistage.spec import OmniPipeline, Stage
from omnistage.worker.config import resolve_model

__all__ = [
    "LocalStageRuntime",
    "PlacementError",
    "ReplicaPlan",
    "ReplicaStartupError",
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


@dataclass
class _Replica:
    plan: ReplicaPlan
    worker: WorkerProcess
    started: float = field(default_factory=time.monotonic)
    state: ReplicaState = "joining"


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
        ipc: bool = True,
        shm: ShmConfig | None = None,
    ) -> None:
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
        self.shm = shm  # the orchestrator of this runtime uses the same (serve passes it on)
        self.ipc = ipc
        self._ipc_dir: Path | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self.membership = StaticMembership()
        self.replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = False
        self._watcher: threading.Thread | None = None

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
        shm_env = self.shm.env() if self.shm is not None else {ENV_DIR: ""}
        if self.shm is not None:
            self._reaper = spawn_reaper(self.shm)
        if self.ipc:  # short: a unix socket path has at most 107 bytes
            self._ipc_dir = Path(tempfile.mkdtemp(prefix="omnistage-ipc-"))
        try:
            for i, plan in enumerate(plans):
                ipc = self._ipc_dir / f"{i}.sock" if self._ipc_dir is not None else None
                worker = spawn_worker(plan.name, plan.stage, host=self.host,
                                      log_dir=self.log_dir, env={**plan.env, **shm_env}, ipc=ipc)
                with self._lock:
                    self.replicas[plan.name] = _Replica(plan, worker)
            self._wait_all_ready()
        except BaseException:
            self._rollback()
            raise
        self.progress(f"all {len(plans)} replica(s) ready in {time.monotonic() - t0:.1f}s")
        self._watcher = threading.Thread(target=self._watch, name="omnistage-replica-watch",
                                         daemon=True)
        self._watcher.start()

    def _wait_all_ready(self) -> None:
        """Publish each replica as it gets ready; the first failure names its replica."""
        done = 0

        def ready(w: WorkerProcess) -> None:
            nonlocal done
            rep = self.replicas[w.name]
            done += 1
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
        self._cleanup()

    def _cleanup(self) -> None:
        """The replicas are gone: remove their sockets, and let the reaper sweep and exit."""
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._reaper is not None and self._reaper.stdin is not None:
            self._reaper.stdin.close()

    # ---- liveness --------------------------------------------------------------------------

    def _watch(self) -> None:
        """Publish a replica that exits on its own as gone, so its bound requests fail."""
        while not self._stopping.wait(self.watch_interval):
            with self._lock:
                reps = [r for r in self.replicas.values() if r.state != "gone"]
            for rep in reps:
                code = rep.worker.proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                self._publish(rep, "gone")
                self.progress(f"replica {rep.plan.name} exited unexpectedly (code {code}); "
                              f"log tail:\n{rep.worker.log_tail(10)}")

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

    def endpoints(self) -> dict[str, str]:
        """Replica name -> ZMQ endpoint of every replica that got as far as binding."""
        with self._lock:
            return {n: r.worker.zmq for n, r in self.replicas.items() if r.worker.zmq}

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self, grace: float | None = None) -> None:
        """SIGTERM every replica (each drains), wait, SIGKILL leftovers. Idempotent.

        grace defaults to the longest stage drain timeout plus a margin; a second call (also
        from another thread) waits for the first and returns.
        """
        with self._shutdown_lock:
            if self._stopped:
                return
            self._stopping.set()
            with self._lock:
                reps = list(self.replicas.values())
            if grace is None:
                grace = max((r.plan.stage.drain_timeout_seconds for r in reps), default=0) + 5.0
            for rep in reps:
                self._publish(rep, "draining")
                if rep.worker.proc.poll() is None:
                    try:
                        rep.worker.proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            for rep in reps:
                try:
                    rep.worker.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.progress(f"replica {rep.plan.name} did not exit within {grace:.0f}s; "
                                  "killing it")
                rep.worker.kill()  # also reaps stragglers left in its process group
                self._publish(rep, "gone")
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            self._stopped = True
            self._cleanup()

    def __enter__(self) -> LocalStageRuntime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
