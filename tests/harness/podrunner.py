"""A small local "kubelet": runs the pods bound to its nodes as local processes.

Why: the local test cluster (hack/cluster.sh) has no container runtime and no Docker, but the
operator's functional e2e tests need pods that really run, answer on their pod IP, become Ready,
honour readiness gates and terminate gracefully under ``kubectl drain``. This runner registers its
own Nodes, keeps their Leases and Ready condition fresh, and for every pod bound to them:

* runs each container as a local process in its own process group, in one of two modes:

  - image mode (``--images INDEX``, what the e2e suite uses): the container runs in its image's
    root filesystem, as built by hack/build-images.sh (tests/harness/sandbox.py): the image's
    ENTRYPOINT/CMD/USER/WORKDIR/Env combined with the pod's by Kubernetes' rules, only the
    pod's volumes (tests/harness/podvolumes.py; the service-account token as a projected
    volume), read-only root when asked. An image that was not built is ErrImagePull, a command
    missing from the image is RunContainerError: never a fallback to the checkout;
  - process mode (no index): ``command`` + ``args`` run with the checkout's Python and the host's
    environment; the image is ignored, and a container without a command idles like a pause
    container. Volumes are made as in image mode, and env values naming a mount path point at
    the volume's host directory (there is no mount namespace), so only the volumes an env
    value names are made;
* keeps configMap, secret, downwardAPI and projected volumes up to date while the pod runs, in
  both modes, as a kubelet does: the atomic writer's layout (``..data`` -> a timestamped
  folder, ``key -> ..data/key``), a look every ~1 s (one GET per object), a changed object
  swapped in atomically, a deleted one keeping the old content (tests/harness/podvolumes.py);
* resolves env (value with $(VAR) expansion, fieldRef, resourceFieldRef, configMapKeyRef,
  secretKeyRef, envFrom), and gives the pod a unique loopback IP (``status.podIP``);
* runs startup, readiness and liveness probes (httpGet, tcpSocket, exec), restarts containers per
  restartPolicy with the kubelet's crash-loop back-off scaled down (``restart_delay``: at once,
  then 1 s doubling to 10 s; forgotten after a 20 s run), and sets the Ready condition only when
  all containers are ready AND every ``readinessGates`` condition is True (conditions owned by
  others are never overwritten);
* on deletion runs preStop hooks, sends SIGTERM, waits up to the deletion grace period, sends
  SIGKILL, then removes the pod (grace 0), so eviction and PDB-aware drains work as on a kubelet.

Logs go to ``<state-dir>/logs/<namespace>/<pod>/<container>.log``; every container termination is
recorded as a JSON line in ``<state-dir>/events.jsonl`` (signal used, exit code, duration).

Run: ``python -m tests.harness.podrunner --kubeconfig K --nodes local-0,local-1 --state-dir D
[--images INDEX]``.
SIGTERM/SIGINT stop all pod processes and delete the runner's Nodes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from omnistage import backoff
from omnistage.kube import condition_status
from omnistage.kubeapi import ApiError, Listed, Obj, resource_path
from tests.harness.images import (
    INDEX_ENV,
    ImageError,
    LocalImages,
    container_argv,
    container_user,
)
from tests.harness.kubeclient import Kube
from tests.harness.podvolumes import PodVolumes
from tests.harness.sandbox import START_ERROR_EXIT, Mount, SandboxSpec, launcher_argv

log = logging.getLogger("podrunner")

POOL_LABEL = "omnistage.io/node-pool"
#: Pod IPs of the runners of local clusters (hack/cluster.sh, and the harness's own): one /20
#: per cluster, picked by its port base. Outside kwok's 127.192.0.0/10 and the random
#: 127.2-126.0.0/16 a runner takes without --pod-cidr.
CLUSTER_POD_SPACE = ipaddress.ip_network("127.128.0.0/10")
CLUSTER_POD_PREFIX = 20
PORTS_PER_CLUSTER = 6  # hack/cluster.sh: OMNISTAGE_PORT_BASE and the five ports after it
RUNNER_ENV = "OMNISTAGE_PODRUNNER_ID"
OWNED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
PAUSE_CMD = [
    sys.executable,
    "-c",
    "import signal,sys,time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "while True: time.sleep(3600)",
]
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")
#: The kubelet's CrashLoopBackOff, scaled down: it restarts a container at once after its first
#: exit, then waits 10 s doubling to 300 s; here 1 s doubling to 10 s, so tests see crash loops
#: in seconds. It forgets a streak once the container ran long enough (here STABLE_RUN_S).
RESTART_BASE_S, RESTART_CAP_S = 1.0, 10.0
STABLE_RUN_S = 20.0


def restart_delay(streak: int) -> float:
    """The wait before restarting a container that exited `streak` times in a row (1: its
    first exit): none, then 1 s, 2 s, 4 s ... at most 10 s."""
    return 0.0 if streak <= 1 else backoff.delay(streak - 2, RESTART_BASE_S, RESTART_CAP_S)


def next_streak(streak: int, ran_s: float) -> int:
    """The crash streak after an exit, given how long the run that ended lasted: a run of
    STABLE_RUN_S or more starts a new streak."""
    return 1 if ran_s >= STABLE_RUN_S else streak + 1


def now_iso() -> str:
    """RFC 3339 timestamp in the format the API server stores."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known vars substituted, $$ escapes, unknown refs kept."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return VAR_REF.sub(sub, text)


def field_value(pod: Obj, path: str) -> str:
    """Downward API fieldRef (the subset a kubelet supports for env)."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", [])),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", [])),
    }
    if path not in simple:
        raise ValueError(f"unsupported fieldRef {path}")
    return str(simple[path] or "")


@dataclass
class Probe:
    """Runtime state of one probe (startup, readiness or liveness)."""

    spec: Obj
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    ok: bool = False


@dataclass
class Container:
    """One container's process and the state the status report is built from."""

    spec: Obj
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    restart_count: int = 0  # restartCount: every restart, never reset
    crash_streak: int = 0  # exits since the last stable run (next_streak): the back-off step
    last_run_s: float = 0.0  # how long the run that ended last lasted (0: it never started)
    last_terminated: Obj | None = None
    terminated: Obj | None = None
    backoff_until: float = 0.0
    ready: bool = False
    started: bool = False  # startup probe passed (or none)
    probes: dict[str, Probe] = field(default_factory=dict)
    kill_signal: str = ""
    waiting: tuple[str, str] | None = None  # (reason, message) when it cannot start
    sandbox: SandboxSpec | None = None  # image mode: how the current process was started
    log_offset: int = 0  # where this run's output starts in the log (FallbackToLogsOnError)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PodWorker(threading.Thread):
    """Owns one pod from first sight to removal; all its processes die with it."""

    def __init__(self, runner: PodRunner, pod: Obj) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.kube = runner.kube
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.path = resource_path("v1", "pods", self.ns, self.pod_name)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.gone = False  # DELETED event seen: kill now, nothing to report
        self.ip = ""
        self.inits = [Container(c, init=True) for c in pod["spec"].get("initContainers", [])]
        self.containers = [Container(c) for c in pod["spec"]["containers"]]
        self.transitions: dict[str, tuple[str, str]] = {}
        self.last_status: Obj | None = None
        self.phase = "Pending"
        self.start_time = pod.get("status", {}).get("startTime") or now_iso()
        self.log_dir = runner.state_dir / "logs" / self.ns / self.pod_name
        self.pod_dir = runner.state_dir / "pods" / self.uid  # volumes, writable layers
        self.volumes = PodVolumes(runner.kube, pod, self.pod_dir / "volumes",
                                  lambda _pod, path: field_value(self._pod_with_ip(), path),
                                  claims=runner.state_dir / "claims")
        self.exec_count = 0
        self.done = threading.Event()

    # ---- event input -------------------------------------------------------------------------
    def update(self, pod: Obj) -> None:
        with self.lock:
            self.pod = pod
        self.wake.set()

    def mark_gone(self) -> None:
        self.gone = True
        self.wake.set()

    # ---- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod %s/%s: worker crashed", self.ns, self.pod_name)
        finally:
            self._kill_all(grace=2.0, reason="runner stopping")
            # Like a kubelet, remove the pod's volumes and writable layers once nothing runs.
            shutil.rmtree(self.pod_dir, ignore_errors=True)
            self.done.set()

    def _run(self) -> None:
        self.ip = self.runner.allocate_ip(self.uid, self.pod.get("status", {}).get("podIP"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._push_status()
        init_index = 0
        while not self.runner.stopping.is_set():
            with self.lock:
                pod = self.pod
            if self.gone:
                self._kill_all(grace=2.0, reason="pod deleted")
                return
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(pod)
                return
            if init_index < len(self.inits):
                init_index = self._step_init(init_index)
            elif self.phase in ("Pending", "Running"):
                self._step_main()
            if self.phase in ("Pending", "Running"):
                # As a kubelet's sync: changed ConfigMaps and Secrets reach the pod's volumes
                # (at most one GET per object every podvolumes.SYNC_S; never raises).
                self.volumes.sync()
            self._push_status()
            if (
                self.phase in ("Succeeded", "Failed")
                and (self.last_status or {}).get("phase") == self.phase
            ):
                return  # terminal and reported; the runner completes a later deletion
            self.wake.wait(0.2)
            self.wake.clear()

    def _step_init(self, index: int) -> int:
        """Init containers run one at a time, each to successful completion."""
        c = self.inits[index]
        if c.proc is None and time.monotonic() >= c.backoff_until:
            self._start(c)
        elif c.proc is not None and not c.running:
            code = self._reap(c)
            if code == 0:
                return index + 1
            if self.pod["spec"].get("restartPolicy", "Always") == "Never":
                self.phase = "Failed"
            else:
                self._schedule_restart(c)
        return index

    def _step_main(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.containers:
            if c.proc is None and c.terminated is None and time.monotonic() >= c.backoff_until:
                self._start(c)
            elif c.proc is not None and not c.running:
                code = self._reap(c)
                if policy == "Always" or (policy == "OnFailure" and code != 0):
                    self._schedule_restart(c)
            elif c.running:
                self._probe(c)
        if all(c.terminated is not None for c in self.containers):
            failed = any(c.terminated.get("exitCode") != 0 for c in self.containers)  # type: ignore[union-attr]
            self.phase = "Failed" if failed else "Succeeded"
        elif any(c.running for c in self.containers):
            self.phase = "Running"

    # ---- processes ---------------------------------------------------------------------------
    def _env(self, spec: Obj) -> dict[str, str]:
        pod = self._pod_with_ip()
        env: dict[str, str] = {}
        for src in spec.get("envFrom", []):
            prefix = src.get("prefix", "")
            for key, value in self._env_source(src).items():
                env[prefix + key] = value
        for item in spec.get("env", []):
            name = item["name"]
            if "value" in item:
                env[name] = expand_vars(str(item["value"]), env)
            elif "valueFrom" in item:
                value = self._value_from(pod, spec, item["valueFrom"])
                if value is not None:
                    env[name] = value
            else:
                env[name] = ""
        return env

    def _service_account_env(self) -> dict[str, str]:
        """In-cluster credentials, emulated: a kubeconfig holding the pod's own SA token.

        A kubelet mounts a bound token at /var/run/secrets/...; here the process gets
        KUBECONFIG pointing at a file with a TokenRequest token bound to this pod, so the API
        server applies the service account's RBAC exactly as in a real cluster.
        """
        spec = self.pod.get("spec", {})
        if spec.get("automountServiceAccountToken") is False:
            return {}
        sa = spec.get("serviceAccountName") or "default"
        meta = self.pod["metadata"]
        req = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600 * 6,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                   "uid": meta["uid"]},
            },
        }
        path = resource_path("v1", "serviceaccounts", self.ns, sa) + "/token"
        token = self.kube.create(path, req)["status"]["token"]
        cfg = self.kube.config
        cluster: Obj = {"server": cfg.server}
        if cfg.ca_file:
            cluster["certificate-authority"] = cfg.ca_file
        if cfg.insecure:
            cluster["insecure-skip-tls-verify"] = True
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "local", "cluster": cluster}],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "local", "user": sa,
                                                     "namespace": self.ns}}],
        }
        out = self.pod_dir / "serviceaccount.kubeconfig"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(doc))
        out.chmod(0o600)
        return {"KUBECONFIG": str(out)}

    def _pod_with_ip(self) -> Obj:
        pod = dict(self.pod)
        status = dict(pod.get("status", {}))
        status.update(podIP=self.ip, podIPs=[{"ip": self.ip}], hostIP=self.runner.host_ip)
        status["hostIPs"] = [{"ip": self.runner.host_ip}]
        pod["status"] = status
        return pod

    def _env_source(self, src: Obj) -> dict[str, str]:
        if "configMapRef" in src:
            ref, resource = src["configMapRef"], "configmaps"
        else:
            ref, resource = src["secretRef"], "secrets"
        try:
            obj = self.kube.get(resource_path("v1", resource, self.ns, ref["name"]))
        except ApiError as e:
            if e.status == 404 and ref.get("optional"):
                return {}
            raise
        return _decoded(obj, resource)

    def _value_from(self, pod: Obj, spec: Obj, vf: Obj) -> str | None:
        if "fieldRef" in vf:
            return field_value(pod, vf["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in vf:
            ref = vf["resourceFieldRef"]
            kind, _, res = ref["resource"].partition(".")
            return str(spec.get("resources", {}).get(kind, {}).get(res, "0"))
        key_ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
        resource = "configmaps" if "configMapKeyRef" in vf else "secrets"
        if key_ref is None:
            raise ValueError(f"unsupported valueFrom {vf}")
        try:
            data = _decoded(
                self.kube.get(resource_path("v1", resource, self.ns, key_ref["name"])), resource
            )
        except ApiError as e:
            if e.status == 404 and key_ref.get("optional"):
                return None
            raise
        if key_ref["key"] not in data and key_ref.get("optional"):
            return None
        return data[key_ref["key"]]

    def _start(self, c: Container) -> None:
        spec = c.spec
        try:
            env = self._env(spec)
        except (ApiError, KeyError, ValueError) as e:
            log.warning(
                "pod %s/%s: cannot resolve env of %s: %s", self.ns, self.pod_name, c.name, e
            )
            c.backoff_until = time.monotonic() + 2.0
            return
        try:
            if self.runner.images is not None:
                argv, proc_env, workdir = self._image_launch(c, env)
            else:
                argv, proc_env, workdir = self._process_launch(c, env)
        except ImageError as e:
            self._cannot_start(c, e.reason, e.message)
            return
        except (ApiError, OSError) as e:
            log.warning("pod %s/%s: cannot start %s: %s", self.ns, self.pod_name, c.name, e)
            c.backoff_until = time.monotonic() + 2.0
            return
        logfile = self.log_dir / f"{c.name}.log"
        with open(logfile, "ab") as out:
            shown = c.sandbox.argv if c.sandbox is not None else argv
            out.write(f"--- {now_iso()} podrunner: starting {shlex.join(shown)}\n".encode())
            out.flush()
            c.log_offset = out.tell()
            try:
                c.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=proc_env,
                    cwd=workdir,
                    start_new_session=True,
                )
            except OSError as e:
                out.write(f"podrunner: cannot start: {e}\n".encode())
                c.proc = None
                c.terminated = {"exitCode": 128, "reason": "StartError", "message": str(e)}
                c.last_terminated, c.last_run_s = c.terminated, 0.0
                if self.pod["spec"].get("restartPolicy", "Always") != "Never":
                    self._schedule_restart(c)
                return
        c.waiting = None
        self.runner.track(c.proc.pid)
        c.started_at, c.started_mono = now_iso(), time.monotonic()
        c.terminated, c.ready, c.kill_signal = None, False, ""
        c.probes = {
            kind: Probe(
                spec[f"{kind}Probe"],
                next_at=time.monotonic() + spec[f"{kind}Probe"].get("initialDelaySeconds", 0),
            )
            for kind in ("startup", "readiness", "liveness")
            if spec.get(f"{kind}Probe")
        }
        c.started = "startup" not in c.probes
        if "readiness" not in c.probes:
            c.ready = c.started
        log.info("pod %s/%s: started %s pid %d", self.ns, self.pod_name, c.name, c.proc.pid)

    def _process_launch(self, c: Container, env: dict[str, str]
                        ) -> tuple[list[str], dict[str, str], str]:
        """Process mode: the container's command with the checkout's Python and the host's
        environment (the image is ignored)."""
        spec = c.spec
        command = [expand_vars(a, env) for a in spec.get("command", [])]
        args = [expand_vars(a, env) for a in spec.get("args", [])]
        argv = (command + args) or PAUSE_CMD
        proc_env = dict(os.environ)
        proc_env.pop("KUBECONFIG", None)  # a pod sees the API only as its service account
        proc_env.update(self._service_account_env())
        proc_env.update(self._mounted_paths(spec, env))
        proc_env.setdefault("HOSTNAME", self.pod_name)
        proc_env[RUNNER_ENV] = self.runner.runner_id
        workdir = spec.get("workingDir")
        if not workdir or not Path(workdir).is_dir():
            workdir_path = self.pod_dir / c.name
            workdir_path.mkdir(parents=True, exist_ok=True)
            workdir = str(workdir_path)
        return argv, proc_env, workdir

    def _mounted_paths(self, spec: Obj, env: dict[str, str]) -> dict[str, str]:
        """Process mode has no mount namespace: an env value at or under a volumeMount's path
        is pointed at that volume's host directory instead (so HF_HOME=/var/cache/... in a
        pod spec reaches the pod's cache volume). Only volumes an env value names are made; one
        that cannot be (a missing claim) fails the container as a kubelet would."""
        out = dict(env)
        mounts = sorted(spec.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
        for name, value in env.items():
            for m in mounts:
                mount = m["mountPath"].rstrip("/")
                if value == mount or value.startswith(mount + "/"):
                    out[name] = str(self.volumes.path(m["name"])) + value[len(mount):]
                    break
        return out

    def _image_launch(self, c: Container, env: dict[str, str]
                      ) -> tuple[list[str], dict[str, str], str]:
        """Image mode: the container runs in its image's rootfs (tests/harness/sandbox.py) as
        the pod's user, with the image's environment plus the pod's, and only its volumes.
        Raises ImageError with the kubelet's reason when it cannot be created."""
        spec = c.spec
        assert self.runner.images is not None
        image = self.runner.images.lookup(spec.get("image", ""))
        pod_sc = self.pod["spec"].get("securityContext") or {}
        sc = spec.get("securityContext") or {}
        uid, gid, groups = container_user(image, pod_sc, sc)
        expanded = {**spec,
                    "command": [expand_vars(a, env) for a in spec.get("command") or []],
                    "args": [expand_vars(a, env) for a in spec.get("args") or []]}
        argv = container_argv(image, expanded)
        proc_env = {**image.env, **self.runner.kubelet_env(), "HOSTNAME": self.pod_name, **env,
                    RUNNER_ENV: self.runner.runner_id}
        mounts = [*self._etc_mounts()]
        for m in spec.get("volumeMounts", []):
            source = self.volumes.path(m["name"])
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)
                    source.chmod(0o777)
            mounts.append(Mount(str(source), m["mountPath"], bool(m.get("readOnly"))))
        scratch = self.pod_dir / "containers" / c.name
        shutil.rmtree(scratch, ignore_errors=True)  # a restarted container gets a fresh layer
        scratch.mkdir(parents=True)
        c.sandbox = SandboxSpec(
            rootfs=image.rootfs,
            scratch=str(scratch / "fs"),
            argv=argv,
            env=proc_env,
            uid=uid,
            gid=gid,
            groups=groups,
            workdir=spec.get("workingDir") or image.config.get("WorkingDir") or "/",
            read_only_root=bool(sc.get("readOnlyRootFilesystem")),
            no_new_privs=sc.get("allowPrivilegeEscalation") is False,
            mounts=mounts,
            error_file=str(scratch / "start-error.json"),
        )
        spec_file = scratch / "sandbox.json"
        c.sandbox.write(spec_file)
        return launcher_argv(spec_file), self.runner.launcher_env(), str(scratch)

    def _etc_mounts(self) -> list[Mount]:
        """/etc/hosts and /etc/hostname as a kubelet writes them; the host's resolver."""
        etc = self.pod_dir / "etc"
        if not etc.is_dir():
            etc.mkdir(parents=True)
            hostname = self.pod["spec"].get("hostname") or self.pod_name
            (etc / "hosts").write_text(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                f"{self.ip}\t{hostname}\n")
            (etc / "hostname").write_text(hostname + "\n")
        mounts = [Mount(str(etc / "hosts"), "/etc/hosts", True),
                  Mount(str(etc / "hostname"), "/etc/hostname", True)]
        if Path("/etc/resolv.conf").is_file():
            mounts.append(Mount("/etc/resolv.conf", "/etc/resolv.conf", True))
        return mounts

    def _cannot_start(self, c: Container, reason: str, message: str) -> None:
        """The container could not be created: a waiting reason, a back-off, no process."""
        if reason == "ErrImagePull" and c.waiting and c.waiting[0] in (
                "ErrImagePull", "ImagePullBackOff"):
            reason = "ImagePullBackOff"
        if c.waiting != (reason, message):
            log.info("pod %s/%s: %s: %s: %s", self.ns, self.pod_name, c.name, reason, message)
            with open(self.log_dir / f"{c.name}.log", "ab") as out:
                out.write(f"--- {now_iso()} podrunner: {reason}: {message}\n".encode())
        c.waiting = (reason, message)
        c.backoff_until = time.monotonic() + 5.0

    def _exec_argv(self, c: Container, command: list[str]) -> tuple[list[str], dict[str, str]]:
        """argv and env for an exec probe or preStop hook: inside the container's image in
        image mode (its own writable layer, the same volumes), else a host process."""
        if c.sandbox is None:
            env = dict(os.environ)
            env.update(self._env(c.spec))
            return command, env
        self.exec_count += 1
        scratch = self.pod_dir / "exec" / f"{c.name}-{self.exec_count}"
        scratch.mkdir(parents=True)
        spec = SandboxSpec(**{**c.sandbox.__dict__, "argv": list(command),
                              "scratch": str(scratch / "fs"), "error_file": ""})
        spec.write(scratch / "sandbox.json")
        return launcher_argv(scratch / "sandbox.json"), self.runner.launcher_env()

    def _reap(self, c: Container) -> int:
        assert c.proc is not None
        code = c.proc.wait()
        # Like a container's cgroup, the whole process group goes with its main process.
        _signal_group(c.proc, signal.SIGKILL)
        self.runner.untrack(c.proc.pid)
        exit_code = code if code >= 0 else 128 - code
        reason = "Completed" if code == 0 else ("Error" if code > 0 else "Killed")
        c.terminated = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": c.started_at,
            "finishedAt": now_iso(),
            "containerID": f"local://{c.proc.pid}",
        }
        if code < 0:
            c.terminated["signal"] = -code
        start_error = self._start_error(c) if code == START_ERROR_EXIT else None
        if start_error is not None:
            c.terminated.update(reason="StartError", message=start_error["message"])
            c.waiting = (start_error["reason"], start_error["message"])
        elif code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            c.terminated["message"] = self._log_tail_since(c)
        c.last_terminated = c.terminated
        c.ready = False
        c.last_run_s = time.monotonic() - c.started_mono
        self.runner.record(
            {
                "namespace": self.ns,
                "pod": self.pod_name,
                "uid": self.uid,
                "container": c.name,
                "exitCode": exit_code,
                "signal": signal.Signals(-code).name if code < 0 else None,
                "sentSignal": c.kill_signal or None,
                "runSeconds": round(c.last_run_s, 3),
            }
        )
        c.proc = None
        return code

    @staticmethod
    def _start_error(c: Container) -> Obj | None:
        """What the sandbox launcher reported when it could not exec the command."""
        if c.sandbox is None or not c.sandbox.error_file:
            return None
        try:
            return dict(json.loads(Path(c.sandbox.error_file).read_text()))
        except (OSError, ValueError):
            return None

    def _log_tail_since(self, c: Container, limit: int = 2048, lines: int = 80) -> str:
        """The end of this run's output, as a kubelet fills a termination message from logs."""
        try:
            with open(self.log_dir / f"{c.name}.log", "rb") as f:
                f.seek(c.log_offset)
                data = f.read()
        except OSError:
            return ""
        text = "\n".join(data.decode(errors="replace").splitlines()[-lines:])
        return text[-limit:]

    def _schedule_restart(self, c: Container) -> None:
        """Restart after the crash-loop back-off (restart_delay), which the last run's length
        may reset."""
        c.restart_count += 1
        c.crash_streak = next_streak(c.crash_streak, c.last_run_s)
        c.backoff_until = time.monotonic() + restart_delay(c.crash_streak)
        c.terminated = None

    # ---- probes ------------------------------------------------------------------------------
    def _probe(self, c: Container) -> None:
        now = time.monotonic()
        order = ["startup"] if not c.started else ["readiness", "liveness"]
        for kind in order:
            p = c.probes.get(kind)
            if p is None or now < p.next_at:
                continue
            ok = self._run_probe(c, p.spec)
            p.next_at = now + p.spec.get("periodSeconds", 10)
            if ok:
                p.successes, p.failures = p.successes + 1, 0
                if p.successes >= p.spec.get("successThreshold", 1):
                    p.ok = True
            else:
                p.successes, p.failures = 0, p.failures + 1
                if p.failures >= p.spec.get("failureThreshold", 3):
                    p.ok = False
            if kind == "startup":
                if p.ok:
                    c.started = True
                    c.ready = "readiness" not in c.probes
                elif p.failures >= p.spec.get("failureThreshold", 3):
                    self._restart_unhealthy(c, "startup probe failed")
                    return
            elif kind == "readiness":
                c.ready = p.ok
            elif kind == "liveness" and p.failures >= p.spec.get("failureThreshold", 3):
                self._restart_unhealthy(c, "liveness probe failed")
                return

    def _restart_unhealthy(self, c: Container, why: str) -> None:
        log.info("pod %s/%s: %s: %s; killing", self.ns, self.pod_name, c.name, why)
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        self._stop_containers([c], time.monotonic() + grace)

    def _run_probe(self, c: Container, spec: Obj) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                h = spec["httpGet"]
                host = h.get("host") or self.ip
                port = self._port(c, h["port"])
                url = f"{h.get('scheme', 'HTTP').lower()}://{host}:{port}{h.get('path', '/')}"
                headers = {x["name"]: x["value"] for x in h.get("httpHeaders", [])}
                req = urllib.request.Request(url, headers=headers)
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(req, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                with socket.create_connection(
                    (t.get("host") or self.ip, self._port(c, t["port"])), timeout
                ):
                    return True
            if "exec" in spec:
                argv, env = self._exec_argv(c, spec["exec"]["command"])
                res = subprocess.run(
                    argv,
                    env=env,
                    timeout=timeout,
                    capture_output=True,
                    check=False,
                )
                return res.returncode == 0
        except (OSError, ValueError, subprocess.TimeoutExpired, ApiError):
            return False
        return False

    @staticmethod
    def _port(c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no container port named {port}")

    # ---- termination -------------------------------------------------------------------------
    def _terminate(self, pod: Obj) -> None:
        """Graceful deletion: preStop, SIGTERM, wait up to the grace period, SIGKILL, remove."""
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        deadline = time.monotonic() + float(grace)
        log.info("pod %s/%s: terminating (grace %ss)", self.ns, self.pod_name, grace)
        running = [c for c in self.inits + self.containers if c.running]
        for c in running:
            c.ready = False
        self._push_status()
        self._stop_containers(running, deadline, pre_stop=True)
        self._push_status()
        try:
            self.kube.delete(
                self.path,
                {
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        except ApiError as e:
            if e.status not in (404, 409):
                log.warning("pod %s/%s: final delete failed: %s", self.ns, self.pod_name, e)
        log.info("pod %s/%s: removed", self.ns, self.pod_name)

    def _stop_containers(
        self, containers: list[Container], deadline: float, pre_stop: bool = False
    ) -> None:
        if pre_stop:
            hooks = [
                threading.Thread(target=self._pre_stop, args=(c, deadline), daemon=True)
                for c in containers
            ]
            for t in hooks:
                t.start()
            for t in hooks:
                t.join(max(0.0, deadline - time.monotonic()))
        for c in containers:
            if c.running:
                c.kill_signal = "SIGTERM"
                _signal_group(c.proc, signal.SIGTERM)  # type: ignore[arg-type]
        while time.monotonic() < deadline and any(c.running for c in containers):
            time.sleep(0.05)
        for c in containers:
            if c.running:
                c.kill_signal = "SIGKILL"
                _signal_group(c.proc, signal.SIGKILL)  # type: ignore[arg-type]
        for c in containers:
            if c.proc is not None:
                code = self._reap(c)
                policy = self.pod["spec"].get("restartPolicy", "Always")
                if not pre_stop and (policy == "Always" or (policy == "OnFailure" and code != 0)):
                    self._schedule_restart(c)

    def _pre_stop(self, c: Container, deadline: float) -> None:
        hook = c.spec.get("lifecycle", {}).get("preStop")
        if not hook:
            return
        timeout = max(0.1, deadline - time.monotonic())
        try:
            if "exec" in hook:
                argv, env = self._exec_argv(c, hook["exec"]["command"])
                subprocess.run(
                    argv,
                    env=env,
                    timeout=timeout,
                    capture_output=True,
                    check=False,
                )
            elif "httpGet" in hook:
                h = hook["httpGet"]
                host, port = h.get("host") or self.ip, self._port(c, h["port"])
                url = f"http://{host}:{port}{h.get('path', '/')}"
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                opener.open(url, timeout=timeout).close()
            elif "sleep" in hook:
                time.sleep(min(timeout, float(hook["sleep"]["seconds"])))
        except (OSError, ValueError, subprocess.TimeoutExpired, ApiError) as e:
            log.info("pod %s/%s: preStop of %s failed: %s", self.ns, self.pod_name, c.name, e)

    def _kill_all(self, grace: float, reason: str) -> None:
        procs = [c for c in self.inits + self.containers if c.running]
        if procs:
            log.info(
                "pod %s/%s: stopping %d process(es): %s", self.ns, self.pod_name, len(procs), reason
            )
            self._stop_containers(procs, time.monotonic() + grace)

    # ---- status ------------------------------------------------------------------------------
    def _condition(self, ctype: str, ok: bool, reason: str = "", message: str = "") -> Obj:
        status = "True" if ok else "False"
        prev = self.transitions.get(ctype)
        if prev is None or prev[0] != status:
            self.transitions[ctype] = (status, now_iso())
        cond: Obj = {
            "type": ctype,
            "status": status,
            "lastTransitionTime": self.transitions[ctype][1],
            "lastProbeTime": None,
        }
        # null deletes a stale reason/message in the strategic merge of the condition
        cond["reason"] = reason or None
        cond["message"] = message or None
        return cond

    def _container_status(self, c: Container) -> Obj:
        st: Obj = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "ready": c.ready and c.running,
            "started": c.running and c.started,
            "restartCount": c.restart_count,
        }
        if c.running:
            st["state"] = {"running": {"startedAt": c.started_at}}
            st["containerID"] = f"local://{c.proc.pid}"  # type: ignore[union-attr]
        elif c.terminated is not None:
            st["state"] = {"terminated": c.terminated}
        elif c.waiting is not None:
            st["state"] = {"waiting": {"reason": c.waiting[0], "message": c.waiting[1]}}
        else:
            reason = "CrashLoopBackOff" if c.restart_count else "ContainerCreating"
            st["state"] = {"waiting": {"reason": reason}}
        if c.last_terminated is not None and c.restart_count:
            st["lastState"] = {"terminated": c.last_terminated}
        return st

    def _push_status(self) -> None:
        with self.lock:
            pod = self.pod
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates", [])]
        missing = [g for g in gates if condition_status(pod, g) != "True"]
        inits_done = all(
            c.terminated is not None and c.terminated.get("exitCode") == 0 for c in self.inits
        )
        unready = [c.name for c in self.containers if not (c.ready and c.running)]
        containers_ready = not unready
        if unready:
            reason, msg = (
                "ContainersNotReady",
                f"containers with unready status: [{' '.join(unready)}]",
            )
        elif missing:
            reason = "ReadinessGatesNotReady"
            msg = f"corresponding condition of pod readiness gate {missing[0]!r} is not True"
        else:
            reason, msg = "", ""
        if self.phase in ("Succeeded", "Failed"):
            reason = "PodCompleted"
        conditions = [
            self._condition("PodReadyToStartContainers", True),
            self._condition(
                "Initialized", inits_done, "" if inits_done else "ContainersNotInitialized"
            ),
            self._condition(
                "ContainersReady",
                containers_ready,
                "" if containers_ready else reason,
                "" if containers_ready else msg,
            ),
            self._condition("Ready", containers_ready and not missing, reason, msg),
        ]
        status: Obj = {
            "phase": self.phase,
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "hostIP": self.runner.host_ip,
            "hostIPs": [{"ip": self.runner.host_ip}],
            "startTime": self.start_time,
            "qosClass": pod.get("status", {}).get("qosClass", "BestEffort"),
            "conditions": conditions,
            "containerStatuses": [self._container_status(c) for c in self.containers],
        }
        if self.inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.inits]
        if status == self.last_status:
            return
        try:
            self.kube.patch(self.path + "/status", {"status": status}, kind="strategic")
            self.last_status = status
        except ApiError as e:
            if e.status == 404:
                self.gone = True
            else:
                log.warning("pod %s/%s: status update failed: %s", self.ns, self.pod_name, e)
        except OSError as e:
            log.warning("pod %s/%s: status update failed: %s", self.ns, self.pod_name, e)


def _decoded(obj: Obj, resource: str) -> dict[str, str]:
    """String data of a ConfigMap or Secret (Secret values arrive base64-encoded)."""
    if resource == "secrets":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return dict(obj.get("data") or {})


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the container's whole process group (it is its own session leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class PodRunner:
    """Registers nodes, watches their pods and runs one PodWorker per pod."""

    def __init__(
        self,
        kube: Kube,
        nodes: list[str],
        state_dir: Path,
        pod_cidr: str | None = None,
        gpus: int = 8,
        labels: dict[str, str] | None = None,
        keep_nodes: bool = False,
        images: LocalImages | None = None,
    ) -> None:
        self.kube = kube
        self.images = images  # image mode when set: containers run in their images' rootfs
        self.nodes = nodes
        self.state_dir = state_dir
        self.gpus = gpus
        self.labels = {POOL_LABEL: "local", "type": "local", **(labels or {})}
        self.keep_nodes = keep_nodes
        self.host_ip = "127.0.0.1"
        net = ipaddress.ip_network(pod_cidr or f"127.{random.randint(2, 126)}.0.0/16")
        if not net.subnet_of(ipaddress.ip_network("127.0.0.0/8")):
            raise ValueError(f"pod CIDR {net} must be inside 127.0.0.0/8")
        self.pod_net = net
        self.runner_id = f"{os.getpid()}-{random.getrandbits(32):08x}"
        self.started_at = now_iso()
        self.stopping = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()
        self.ips: dict[str, str] = {}
        self.lock = threading.Lock()
        self.pids: set[int] = set()
        self.events_file = state_dir / "events.jsonl"
        self.threads: list[threading.Thread] = []

    # ---- bookkeeping shared with workers -----------------------------------------------------
    def kubelet_env(self) -> dict[str, str]:
        """What a kubelet adds to every container: where the API server is. Here that is the
        API server's own loopback address, not the `kubernetes` Service's ClusterIP (nothing
        routes ClusterIPs on this machine)."""
        url = urllib.parse.urlsplit(self.kube.config.server)
        port = str(url.port or 443)
        return {"KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": port, "KUBERNETES_SERVICE_PORT_HTTPS": port}

    def launcher_env(self) -> dict[str, str]:
        """The environment of the sandbox launcher itself (host Python); the container gets
        only its SandboxSpec's env."""
        root = str(Path(__file__).resolve().parents[2])
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": root,
                RUNNER_ENV: self.runner_id}

    def allocate_ip(self, uid: str, current: str | None) -> str:
        """A unique loopback IP per pod; reuses the pod's own IP after a runner restart."""
        with self.lock:
            if uid in self.ips:
                return self.ips[uid]
            used = set(self.ips.values())
            if current and ipaddress.ip_address(current) in self.pod_net and current not in used:
                ip = current
            else:
                ip = next(
                    str(h)
                    for h in self.pod_net.hosts()
                    if str(h) not in used and not str(h).endswith(".0")
                )
            self.ips[uid] = ip
            return ip

    def release_ip(self, uid: str) -> None:
        with self.lock:
            self.ips.pop(uid, None)

    def track(self, pid: int) -> None:
        with self.lock:
            self.pids.add(pid)
            self._write_pids()

    def untrack(self, pid: int) -> None:
        with self.lock:
            self.pids.discard(pid)
            self._write_pids()

    def _write_pids(self) -> None:
        """Process groups still alive; the harness kills leftovers if the runner itself dies."""
        tmp = self.state_dir / "pgids.tmp"
        tmp.write_text("".join(f"{p}\n" for p in sorted(self.pids)))
        tmp.replace(self.state_dir / "pgids")

    def record(self, event: Obj) -> None:
        event["time"] = now_iso()
        with self.lock, open(self.events_file, "a") as f:
            f.write(json.dumps(event) + "\n")

    # ---- nodes -------------------------------------------------------------------------------
    def node_status(self) -> Obj:
        now = now_iso()
        res = {
            "cpu": "16",
            "memory": "64Gi",
            "pods": "110",
            "nvidia.com/gpu": str(self.gpus),
            "ephemeral-storage": "100Gi",
        }

        def cond(t: str, ok: bool, reason: str, msg: str) -> Obj:
            return {
                "type": t,
                "status": "True" if ok else "False",
                "reason": reason,
                "message": msg,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self.started_at,  # the runner's conditions never flip
            }

        return {
            "capacity": res,
            "allocatable": res,
            "addresses": [{"type": "InternalIP", "address": self.host_ip}],
            "conditions": [
                cond("MemoryPressure", False, "KubeletHasSufficientMemory", "podrunner"),
                cond("DiskPressure", False, "KubeletHasNoDiskPressure", "podrunner"),
                cond("PIDPressure", False, "KubeletHasSufficientPID", "podrunner"),
                cond("Ready", True, "KubeletReady", "omnistage podrunner is posting ready status"),
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "v0.0.0-omnistage-podrunner",
                "containerRuntimeVersion": "local://podrunner-"
                                           + ("images" if self.images else "processes"),
                "kernelVersion": os.uname().release,
                "osImage": "local images" if self.images else "local processes",
                "bootID": self.runner_id,
                "machineID": "",
                "systemUUID": "",
                "kubeProxyVersion": "",
            },
        }

    def register_nodes(self) -> None:
        for name in self.nodes:
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **self.labels,
            }
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "status": self.node_status(),
            }
            path = resource_path("v1", "nodes")
            try:
                self.kube.create(path, node)
            except ApiError as e:
                if e.status != 409:
                    raise
                self.kube.patch(
                    resource_path("v1", "nodes", name=name), {"metadata": {"labels": labels}}
                )
            self.heartbeat(name)
        log.info("registered nodes %s (pod CIDR %s)", ",".join(self.nodes), self.pod_net)

    def heartbeat(self, name: str) -> None:
        """Node Lease renewal plus a Ready status post, like a kubelet with leases enabled."""
        self.kube.patch(
            resource_path("v1", "nodes", name=name, subresource="status"),
            {"status": self.node_status()},
            kind="strategic",
        )
        lease_path = resource_path("coordination.k8s.io/v1", "leases", "kube-node-lease", name)
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            self.kube.patch(
                lease_path,
                {"spec": {"renewTime": now, "holderIdentity": name, "leaseDurationSeconds": 40}},
            )
        except ApiError as e:
            if e.status != 404:
                raise
            node = self.kube.get(resource_path("v1", "nodes", name=name))
            owner = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": name,
                "uid": node["metadata"]["uid"],
            }
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": name,
                    "namespace": "kube-node-lease",
                    "ownerReferences": [owner],
                },
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now},
            }
            self.kube.create(
                resource_path("coordination.k8s.io/v1", "leases", "kube-node-lease"), lease
            )

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(5.0):
            for name in self.nodes:
                try:
                    self.heartbeat(name)
                except (ApiError, OSError) as e:
                    log.warning("heartbeat for %s failed: %s", name, e)

    # ---- pods --------------------------------------------------------------------------------
    def _watch_node(self, node: str) -> None:
        """List+watch pods bound to ``node`` and hand each to its worker (the shared client
        resumes dropped watches and relists after 410 Gone)."""
        selector = f"spec.nodeName={node}"
        while not self.stopping.is_set():
            try:
                for item in self.kube.list_watch(resource_path("v1", "pods"), self.stopping,
                                                 timeout_seconds=60, backoff=(1.0, 5.0),
                                                 fieldSelector=selector):
                    if isinstance(item, Listed):
                        self._on_list(node, item.items)
                    else:
                        self._on_pod(item.type, item.object)
            except Exception as e:  # a bug in handling one pod must not stop the kubelet
                if not self.stopping.is_set():
                    log.warning("pod watch on %s broke: %r; retrying", node, e)
                    self.stopping.wait(1.0)

    def _on_list(self, node: str, items: list[Obj]) -> None:
        seen = set()
        for pod in items:
            seen.add(pod["metadata"]["uid"])
            self._on_pod("ADDED", pod)
        with self.lock:
            workers = list(self.workers.items())
        for uid, worker in workers:
            if worker.pod["spec"].get("nodeName") == node and uid not in seen:
                worker.mark_gone()

    def _on_pod(self, etype: str, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
        if etype == "DELETED":
            if worker is not None:
                worker.mark_gone()
            self.finished.discard(uid)
            return
        if worker is not None:
            worker.update(pod)
            return
        phase = pod.get("status", {}).get("phase", "Pending")
        done = uid in self.finished or phase in ("Succeeded", "Failed")
        if done and pod["metadata"].get("deletionTimestamp"):
            # Nothing runs any more: complete the deletion as a kubelet would.
            self.finished.add(uid)
            meta = pod["metadata"]
            path = resource_path("v1", "pods", meta["namespace"], meta["name"])
            body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
            with contextlib.suppress(ApiError, OSError):
                self.kube.delete(path, body)
            return
        if done:
            self.finished.add(uid)
            return
        worker = PodWorker(self, pod)
        with self.lock:
            self.workers[uid] = worker
        worker.start()
        threading.Thread(target=self._reap_worker, args=(worker,), daemon=True).start()

    def _reap_worker(self, worker: PodWorker) -> None:
        worker.done.wait()
        with self.lock:
            self.workers.pop(worker.uid, None)
        if not worker.gone:
            # Terminated or terminal: later events for this uid must not start it again.
            self.finished.add(worker.uid)
        self.release_ip(worker.uid)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        self.register_nodes()
        targets = [self._heartbeat_loop] + [lambda n=n: self._watch_node(n) for n in self.nodes]
        for fn in targets:
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self.threads.append(t)
        (self.state_dir / "ready").write_text(self.runner_id + "\n")

    def stop(self) -> None:
        """Kill every pod process (SIGTERM, 2s, SIGKILL) and deregister the nodes."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.wake.set()
        for w in workers:
            w.done.wait(10)
        with self.lock:
            leftover = set(self.pids)
        for pid in leftover:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if not self.keep_nodes:
            for name in self.nodes:
                for path in (
                    resource_path("coordination.k8s.io/v1", "leases", "kube-node-lease", name),
                    resource_path("v1", "nodes", name=name),
                ):
                    with contextlib.suppress(ApiError, OSError):
                        self.kube.delete_ignore_missing(path)
        (self.state_dir / "ready").unlink(missing_ok=True)
        log.info("podrunner stopped")


def kill_leftovers(state_dir: Path) -> list[int]:
    """Kill pod process groups a dead runner left behind (only groups carrying its marker env)."""
    killed = []
    pgids = state_dir / "pgids"
    if not pgids.exists():
        return killed
    for line in pgids.read_text().split():
        pid = int(line)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if RUNNER_ENV.encode() + b"=" in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def cluster_pod_cidr(port_base: int) -> str:
    """The pod range of the local cluster on ``port_base``: two clusters running on one host
    use disjoint port ranges, so their bases differ by at least PORTS_PER_CLUSTER, and bases
    closer than 1024 slots (6,144 ports) get disjoint ranges; the state dir needs no part in it
    (two state dirs on one port base cannot run at once)."""
    if not 0 < port_base < 65536:
        raise ValueError(f"port base {port_base} is not a TCP port")
    slots = 2 ** (CLUSTER_POD_PREFIX - CLUSTER_POD_SPACE.prefixlen)
    slot = (port_base // PORTS_PER_CLUSTER) % slots
    first = int(CLUSTER_POD_SPACE.network_address) + slot * 2 ** (32 - CLUSTER_POD_PREFIX)
    return str(ipaddress.ip_network((first, CLUSTER_POD_PREFIX)))


def iter_events(state_dir: Path) -> Iterator[Obj]:
    """Container termination records written by a runner (for test assertions)."""
    path = state_dir / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run pods bound to local nodes as processes.")
    parser.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        required=not os.environ.get("KUBECONFIG"),
    )
    parser.add_argument("--nodes", default="local-0,local-1", help="comma-separated node names")
    parser.add_argument("--state-dir", type=Path, required=True, help="logs, events, pgids")
    parser.add_argument(
        "--pod-cidr", default=None, help="loopback CIDR for pod IPs (default random 127.N.0.0/16)"
    )
    parser.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity per node")
    parser.add_argument("--label", action="append", default=[], help="extra node label k=v")
    parser.add_argument("--keep-nodes", action="store_true", help="do not delete nodes on exit")
    parser.add_argument(
        "--images", type=Path, default=os.environ.get(INDEX_ENV) or None,
        help="image mode: run containers in the images of this index (hack/build-images.sh "
        f"--print-index; default ${INDEX_ENV}); without it, containers run the checkout's Python",
    )
    parser.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the parent process dies"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(threadName)s: %(message)s",
    )
    logging.getLogger("omnistage.kubeapi.writes").setLevel(logging.WARNING)
    if args.images and os.geteuid() != 0:
        parser.error("image mode needs root: it mounts overlays in private mount namespaces")
    labels = dict(item.split("=", 1) for item in args.label)
    runner = PodRunner(
        Kube.from_kubeconfig(args.kubeconfig),
        [n for n in args.nodes.split(",") if n],
        args.state_dir.resolve(),
        pod_cidr=args.pod_cidr,
        gpus=args.gpus,
        labels=labels,
        keep_nodes=args.keep_nodes,
        images=LocalImages(args.images) if args.images else None,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    kill_leftovers(runner.state_dir)
    runner.start()
    mode = f"images from {args.images}" if args.images else "processes (the image is ignored)"
    print(f"podrunner ready: nodes={','.join(runner.nodes)} cidr={runner.pod_net} mode={mode}",
          flush=True)
    parent = os.getppid()
    try:
        # A killed test session must not leave pod processes behind: follow the parent.
        while not stop.wait(1.0):
            if args.exit_with_parent and os.getppid() != parent:
                log.warning("parent %d died; stopping", parent)
                break
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
