"""Start/stop the test cluster and the local pod runner; helpers shared by cluster and e2e tests.

Why: tests/cluster and tests/e2e both need a real API server. With ``$KUBECONFIG`` set (that is how
hack/kind-e2e.sh selects a kind cluster) we use that cluster as it is and never stop it. Otherwise
we start a private local control plane with hack/cluster.sh (own state dir and free ports, so
concurrent test sessions do not collide) and stop it at the end. The handles are process-wide,
reference-counted singletons so several conftests can share one cluster per pytest session.
The local pod runner runs every pod in its image (OMNISTAGE_POD_MODE=image, the default; the
images are built or reused first) or, with OMNISTAGE_POD_MODE=process, on the checkout's Python.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.kube import condition_status
from omnistage.kubeapi import ApiError, Obj, resource_path
from tests.harness.kubeclient import Kube, wait_until
from tests.harness.podrunner import cluster_pod_cidr, iter_events, kill_leftovers

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack"
MARKER_CONFIGMAP = "omnistage-local-cluster"
LOCAL_POOL = "local"
#: How the local pod runner runs containers: "image" (the default; hack/build-images.sh builds
#: or reuses the images first) or "process" (the checkout's Python; the image is ignored).
POD_MODE = os.environ.get("OMNISTAGE_POD_MODE", "image")
if POD_MODE not in ("image", "process"):
    raise ValueError(f"OMNISTAGE_POD_MODE must be image or process, not {POD_MODE!r}")
#: An image with python3 for test pods: the images' base (hack/build-images.sh indexes it under
#: this name) in image mode; kind-e2e.sh sets OMNISTAGE_TEST_PY_IMAGE to an image it loaded.
PY_IMAGE = os.environ.get("OMNISTAGE_TEST_PY_IMAGE") or (
    "localhost/omnistage-base:bookworm" if POD_MODE == "image" else "python:3.11-slim")


def _versions() -> dict[str, str]:
    out = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("OMNISTAGE_CACHE") or Path.home() / ".cache" / "omnistage")


def free_port_base(count: int = 6) -> int:
    """A base port with ``count`` consecutive free loopback ports, below the ephemeral range."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range found")


@dataclass
class Cluster:
    """A reachable cluster: its kubeconfig, a client, and (when we started it) its state dir."""

    kubeconfig: Path
    kube: Kube
    state_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=_versions)

    @property
    def owned(self) -> bool:
        """True when this session started the local control plane (and will stop it)."""
        return self.state_dir is not None

    @property
    def is_local(self) -> bool:
        """The hack/cluster.sh control plane (no kubelets) rather than kind or another cluster."""
        try:
            self.kube.get(resource_path("v1", "configmaps", "kube-system", MARKER_CONFIGMAP))
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def kubectl_path(self) -> str:
        built = cache_dir() / "bin" / f"kubectl-{self.versions['K8S_VERSION']}"
        return str(built) if built.exists() else "kubectl"

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster; a failure shows its output."""
        cmd = [self.kubectl_path(), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, input=input, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def logs(self, component: str, lines: int = 40) -> str:
        """Tail of a control-plane component's log (local cluster only)."""
        if self.state_dir is None:
            return ""
        path = self.state_dir / "logs" / f"{component}.log"
        if not path.exists():
            return ""
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])


def _cluster_env(state_dir: Path, port_base: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    env.update(OMNISTAGE_CLUSTER_DIR=str(state_dir), OMNISTAGE_PORT_BASE=str(port_base))
    return env


STATE_PREFIX = "omnistage-cluster-"


def reap_stale_clusters() -> None:
    """Stop clusters whose pytest session died without teardown (their owner pid is gone)."""
    for state in Path(tempfile.gettempdir()).glob(STATE_PREFIX + "*"):
        owner = state / "owner.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        for runner_dir in state.glob("podrunner-*"):
            kill_leftovers(runner_dir)
        subprocess.run(
            [str(HACK / "cluster.sh"), "down", "--purge"],
            env=_cluster_env(state, 0),
            capture_output=True,
            check=False,
        )


def start_local_cluster(state_dir: Path | None = None) -> Cluster:
    """Run ``hack/cluster.sh up`` in a private state dir on free ports."""
    reap_stale_clusters()
    state_dir = state_dir or Path(tempfile.mkdtemp(prefix=STATE_PREFIX))
    (state_dir / "owner.pid").write_text(f"{os.getpid()}\n")
    env = _cluster_env(state_dir, free_port_base())
    proc = subprocess.run(
        [str(HACK / "cluster.sh"), "up"], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        subprocess.run(
            [str(HACK / "cluster.sh"), "down"], env=env, capture_output=True, check=False
        )
        raise RuntimeError(f"hack/cluster.sh up failed:\n{proc.stdout}\n{proc.stderr}")
    kubeconfig = state_dir / "admin.kubeconfig"
    return Cluster(kubeconfig, Kube.from_kubeconfig(kubeconfig), state_dir, env)


def stop_local_cluster(cluster: Cluster, purge: bool = True) -> None:
    """``hack/cluster.sh down`` by pid; the state dir goes too unless ``purge`` is False."""
    if cluster.state_dir is None:
        return
    args = [str(HACK / "cluster.sh"), "down"] + (["--purge"] if purge else [])
    proc = subprocess.run(args, env=cluster.env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh down failed:\n{proc.stdout}\n{proc.stderr}")


class _Shared:
    """Reference-counted process-wide singleton, so every conftest shares one instance."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.value: Any = None


_cluster = _Shared()
_runner = _Shared()


def acquire_cluster() -> Cluster:
    """$KUBECONFIG's cluster when set, else a private local control plane (first caller starts)."""
    with _cluster.lock:
        if _cluster.value is None:
            if os.environ.get("KUBECONFIG"):
                path = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
                _cluster.value = Cluster(path, Kube.from_kubeconfig(path))
            else:
                _cluster.value = start_local_cluster()
            wait_until(
                lambda: _cluster.value.kube.request("GET", "/readyz") is not None,
                60,
                "API server /readyz",
            )
        _cluster.count += 1
        return _cluster.value  # type: ignore[no-any-return]


def release_cluster() -> None:
    with _cluster.lock:
        _cluster.count -= 1
        if _cluster.count == 0 and _cluster.value is not None:
            cluster, _cluster.value = _cluster.value, None
            stop_local_cluster(cluster, purge=os.environ.get("OMNISTAGE_KEEP_CLUSTER") != "1")


@dataclass
class PodRunner:
    """Where pods really run: the local pod runner, or the real kubelets of a kind cluster."""

    cluster: Cluster
    nodes: list[str]
    local: bool = True  # pods run on this machine with loopback pod IPs (the local pod runner)
    state_dir: Path | None = None  # the runner's logs and events, when known
    proc: subprocess.Popen[bytes] | None = None  # set when this session started the runner
    images: bool = True  # containers run in their images (image mode, or real kubelets)

    def log_path(self, namespace: str, pod: str, container: str) -> Path | None:
        if self.state_dir is None:
            return None
        return self.state_dir / "logs" / namespace / pod / f"{container}.log"

    def log_tail(
        self, namespace: str, pod: str, container: str | None = None, lines: int = 40
    ) -> str:
        """A pod's log tail for failure messages (files here, ``kubectl logs`` on kind)."""
        if self.state_dir is None:
            args = ["logs", "-n", namespace, pod, f"--tail={lines}"]
            if container:
                args.append(f"-c={container}")
            return self.cluster.kubectl(*args, check=False).stdout
        out = []
        base = self.state_dir / "logs" / namespace / pod
        for path in sorted(base.glob(f"{container or '*'}.log")):
            text = path.read_text(errors="replace").splitlines(True)[-lines:]
            out.append(f"==> {path} <==\n{''.join(text)}")
        return "\n".join(out)

    def runner_log(self, lines: int = 60) -> str:
        if self.state_dir is None:
            return ""
        path = self.state_dir / "podrunner.log"
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])

    def events(self) -> list[Obj]:
        """Container terminations (signal sent, exit code) recorded by the local runner."""
        return list(iter_events(self.state_dir)) if self.state_dir else []

    def http_get(self, pod: Obj, port: int, path: str = "/", timeout: float = 5) -> tuple[int, str]:
        """GET from a pod: directly on its loopback pod IP here, via the API server proxy on kind
        (kind pod IPs are not reachable from the host; the proxy refuses loopback pod IPs)."""
        meta = pod["metadata"]
        if self.local:
            url = f"http://{pod['status']['podIP']}:{port}{path}"
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(url, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        proxy = resource_path("v1", "pods", meta["namespace"], f"{meta['name']}:{port}", "proxy")
        return 200, self.cluster.kube.request("GET", proxy + path, timeout=timeout, raw=True)


def build_images(log_path: Path) -> Path:
    """hack/build-images.sh (cached: seconds when no input changed, so the images never lag
    behind the sources); returns this checkout's image index."""
    with open(log_path, "ab") as log:
        proc = subprocess.run([str(HACK / "build-images.sh")], stdout=log,
                              stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
        raise RuntimeError(f"hack/build-images.sh failed ({proc.returncode}):\n{tail}")
    out = subprocess.run([str(HACK / "build-images.sh"), "--print-index"], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def start_podrunner(cluster: Cluster, nodes: tuple[str, ...] = ("local-0", "local-1")) -> PodRunner:
    """Start the local pod runner as a child process and wait until its nodes are Ready.

    In image mode (POD_MODE) the images are built or reused first and the runner runs every
    container in its image; in process mode it runs the checkout's Python."""
    base = cluster.state_dir or Path(tempfile.mkdtemp(prefix="omnistage-podrunner-"))
    state_dir = base / f"podrunner-{uuid.uuid4().hex[:6]}"
    state_dir.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "tests.harness.podrunner",
        f"--kubeconfig={cluster.kubeconfig}",
        f"--state-dir={state_dir}",
        f"--nodes={','.join(nodes)}",
        "--exit-with-parent",
    ]
    if cluster.env.get("OMNISTAGE_PORT_BASE"):  # a cluster we started: its own pod range
        cmd.append(f"--pod-cidr={cluster_pod_cidr(int(cluster.env['OMNISTAGE_PORT_BASE']))}")
    env.pop("OMNISTAGE_IMAGE_INDEX", None)  # the mode is chosen here, never inherited
    if POD_MODE == "image":
        cmd.append(f"--images={build_images(state_dir / 'build-images.log')}")
    log_file = open(state_dir / "podrunner.log", "ab")  # the child keeps its own copy
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    log_file.close()
    runner = PodRunner(cluster, list(nodes), True, state_dir, proc, images=POD_MODE == "image")

    def nodes_ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"podrunner exited ({proc.returncode}):\n{runner.runner_log()}")
        return all(node_ready(cluster.kube, n) for n in nodes)

    wait_until(nodes_ready, 30, "podrunner nodes Ready", on_timeout=runner.runner_log)
    return runner


def stop_podrunner(runner: PodRunner) -> None:
    """SIGTERM the runner (it stops its pods and deletes its nodes); kill any leftovers."""
    if runner.proc is None:
        return
    if runner.proc.poll() is None:
        runner.proc.send_signal(signal.SIGTERM)
        try:
            runner.proc.wait(30)
        except subprocess.TimeoutExpired:
            runner.proc.kill()
            runner.proc.wait()
    if runner.state_dir is not None:
        kill_leftovers(runner.state_dir)


def acquire_podrunner(cluster: Cluster) -> PodRunner:
    """The local pod runner on our control plane; the real kubelets (no runner) elsewhere."""
    with _runner.lock:
        if _runner.value is None:
            existing = ready_pool_nodes(cluster.kube)
            if not cluster.is_local:
                nodes = existing or schedulable_real_nodes(cluster.kube)
                _runner.value = PodRunner(cluster, nodes, local=False)
            elif existing:
                # A runner is already serving this cluster (hack/cluster.sh up --podrunner).
                state = cluster.kubeconfig.parent / "podrunner"
                _runner.value = PodRunner(
                    cluster, existing, True, state if state.is_dir() else None,
                    images=runs_images(cluster.kube, existing[0]),
                )
            else:
                _runner.value = start_podrunner(cluster)
        _runner.count += 1
        return _runner.value  # type: ignore[no-any-return]


def release_podrunner() -> None:
    with _runner.lock:
        _runner.count -= 1
        if _runner.count == 0 and _runner.value is not None:
            runner, _runner.value = _runner.value, None
            stop_podrunner(runner)


def runs_images(kube: Kube, node: str) -> bool:
    """Whether a local pod runner's node runs containers in their images (its nodeInfo says)."""
    info = kube.get(resource_path("v1", "nodes", name=node))["status"].get("nodeInfo", {})
    return str(info.get("containerRuntimeVersion", "")).endswith("-images")


def ready_pool_nodes(kube: Kube) -> list[str]:
    """Ready nodes labelled omnistage.io/node-pool=local (a pod runner's, or kind's workers)."""
    selector = f"omnistage.io/node-pool={LOCAL_POOL}"
    nodes = kube.get(resource_path("v1", "nodes"), labelSelector=selector)["items"]
    return sorted(n["metadata"]["name"] for n in nodes if condition_status(n, "Ready") == "True")


def schedulable_real_nodes(kube: Kube) -> list[str]:
    """Worker nodes of a real cluster without the pool label: the untainted ones."""
    nodes = kube.get(resource_path("v1", "nodes"))["items"]
    return sorted(n["metadata"]["name"] for n in nodes if not n["spec"].get("taints"))


# ---- small helpers used by tests ----------------------------------------------------------------
def node_ready(kube: Kube, name: str) -> bool:
    try:
        node = kube.get(resource_path("v1", "nodes", name=name))
    except ApiError as e:
        if e.status == 404:
            return False
        raise
    return condition_status(node, "Ready") == "True"


def pods(kube: Kube, namespace: str, selector: str | None = None) -> list[Obj]:
    path = resource_path("v1", "pods", namespace)
    return list(kube.get(path, labelSelector=selector)["items"])


@contextlib.contextmanager
def temp_namespace(kube: Kube, prefix: str = "t-", wait: float = 90) -> Iterator[str]:
    """A fresh namespace, deleted (and waited for) afterwards: each test cleans up after itself."""
    ns = kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"generateName": prefix}},
    )["metadata"]["name"]
    # The service account token controller must create "default" before pods can be admitted.
    wait_until(
        lambda: kube.get(resource_path("v1", "serviceaccounts", ns, "default")),
        30,
        f"default service account in {ns}",
    )
    try:
        yield ns
    finally:
        cleanup_namespace(kube, ns, wait)


def cleanup_namespace(kube: Kube, ns: str, wait: float = 90) -> None:
    """Delete a namespace, first removing its workloads so no pod process outlives the test.

    The namespace controller alone is slow (it walks every API group); deleting the workloads
    directly and waiting only for the pods makes cleanup take about a second. The namespace
    object itself is then finalized in the background.
    """
    opts = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
    for api, resource in (
        ("apps/v1", "deployments"),
        ("apps/v1", "statefulsets"),
        ("apps/v1", "replicasets"),
        ("batch/v1", "jobs"),
        ("v1", "pods"),
    ):
        with contextlib.suppress(ApiError):
            kube.delete(resource_path(api, resource, ns), opts)
    kube.delete_ignore_missing(resource_path("v1", "namespaces", name=ns))
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        # Late-created pods (a controller racing the deletes) are caught here too.
        left = pods(kube, ns)
        if not left:
            return
        time.sleep(0.3)
    raise AssertionError(
        f"pods in namespace {ns} not gone after {wait}s: "
        + ", ".join(p["metadata"]["name"] for p in left[:10])
    )


def which(binary: str) -> str | None:
    """A built binary from the cache if present, else from PATH."""
    versions = _versions()
    version = {
        "kubectl": versions["K8S_VERSION"],
        "helm": versions["HELM_VERSION"],
        "kwok": versions["KWOK_VERSION"],
    }.get(binary)
    if version:
        built = cache_dir() / "bin" / f"{binary}-{version}"
        if built.exists():
            return str(built)
    return shutil.which(binary)
