"""The operator at scale on kwok nodes: 50 pipelines x 3 stages x 4 replicas (600 stage pods).

Why: issue 5's last acceptance point. A reconcile loop that is fine for one pipeline can fall over
at fleet size (queue storms, status ping-pong, write amplification), and the idle-resync goal
(a resync of an unchanged world makes ZERO API writes) only means something with many objects.

What it does:
  1. starts a private local control plane (hack/cluster.sh, own state dir and ports, kwok scale
     nodes sized for the fleet) or reuses one given with --kubeconfig;
  2. applies crds/, starts `omnistage operator` as a subprocess (log in the work dir) with
     --resync-seconds 10;
  3. creates N OmniPipelines (echo stages a -> b -> c, c final; stages and orchestrator pinned to
     the kwok scale nodes, tiny requests) in one namespace, as fast as the API takes them;
  4. measures:
     - apply_to_ready: first create -> every pipeline Ready=True (observedGeneration current) and
       every stage pod Running and Ready;
     - writes_total: the operator's API writes (omnistage_operator_api_writes_total on /metrics)
       from just before the first create until everything is Ready and the write counter is quiet;
     - idle_writes_60s / idle_reconciles_60s: the same counters across a 60 s idle window in
       which several resyncs run (goal: 0 writes);
  5. cleans up everything it started (operator, cluster), also on Ctrl-C or failure.

Run from the repository root:  python bench/bench_operator_scale.py
    [--pipelines 50] [--replicas 4] [--idle-seconds 60] [--resync-seconds 10]
    [--kubeconfig K] [--port-base 29440] [--timeout 900] [--json OUT] [--keep]

It prints progress every ~5 s, ONE line starting with `operator_scale:` with the figures and a
`summary:` line with each goal and PASS/MISS (`--check` exits 1 on a MISS):
  - idle writes 0, restart writes 0 and restart Ready flips 0 (when measured);
  - the operator's writes per stage pod <= 4 (issue 24);
  - with --raw-baseline: apply_to_ready <= 1.5x the bare pods', and (with the teardown)
    delete_to_gone <= 1.5x the bare pods' delete (issue 24);
  - at 6,000 stage pods or more (the tenfold fleet of issue 13): apply_to_ready <= 60 s, and
    the operator's peak RSS <= 300 MiB (issue 24);
  - with --lws: Omnistage's apply_to_ready and controller writes per pod <= LWS's.

--tenfold runs the growth ladder of issue 24 in one invocation: 600, 2,004 and 6,000 stage
pods (--sizes to change the pipeline counts), each on a fresh control plane with its bare-pod
baseline, LWS on the largest with --lws. Each size prints its line and `summary[N pods]:`;
then an `operator_ladder:` line (per-pod figures size by size) and the ladder's `summary:`:
each size's ratios to its bare pods and the ratio's growth from the smallest to the largest
(goal <= 1.25: flat). --json then holds {"ladder": [one result per size]}.

--raw-baseline first measures the physical limit of this control plane: the same number of bare
pods (same placement, no controller, no readiness gate), created by the bench itself 64 at a
time, until kwok has them all Running and Ready; then it deletes them (delete-collections with
the pods' own grace period, as `kubectl delete pods` does and as the operator's teardown does;
`--raw-grace-period 0` removes them at once instead, without kwok) and runs the fleet.
Everything listens on and connects to 127.0.0.1 only (kwok pod IPs are never contacted).

Every process of this machine's control plane shares its CPUs, so the ramps are bound by the
CPU seconds they cost: the bench logs them by process (kube-apiserver, etcd, kwok, the
scheduler, the controller-manager, the operator, the bench) for the bare pods and for the fleet
(`cpu_s` and `cpu_s_to_ready_by_process` in --json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))  # the tree under test, like the operator it starts

from omnistage.kube import GROUP, VERSION, condition, condition_status  # noqa: E402
from omnistage.kubeapi import ApiError, SyncKubeApi, path, resource_path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import Goal, add_check_flag, exit_status, verdicts  # noqa: E402
from lws_baseline import LwsBaseline, proc_cpu  # noqa: E402
from write_counts import Obj, apiserver_writes, controller_writes, write_delta  # noqa: E402

HACK = REPO / "hack"
# How often both deletes (the bare pods' and the fleet's) count what is left: the same
# granularity on both sides of the ratio, fine enough for a 3-second delete.
TEARDOWN_POLL_S = 0.25
PLURAL = "omnipipelines"
STAGES = ("a", "b", "c")
SCALE_POOL = {"omnistage.io/node-pool": "kwok-scale"}
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
PODS_PER_SCALE_NODE = 250  # hack/cluster.sh node_yaml ... kwok-scale 0 250
LABEL_COMPONENT = "omnistage.io/component"
WRITES = "omnistage_operator_api_writes_total"
RECONCILES = "omnistage_operator_reconciles_total"
# Resources the operator reads with single GETs. During the idle window nothing else GETs them one
# by one: this bench lists, kube-controller-manager and the scheduler use informers. Owners
# (omnipipelines, stagepools, deployments) are left out: the garbage collector GETs those too.
OPERATOR_GET_RESOURCES = {
    "configmaps",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "services",
    "poddisruptionbudgets",
    "pods",
}
APISERVER_METRIC = re.compile(
    r"^(?P<name>apiserver_request_total|apiserver_request_duration_seconds_(?:sum|count))"
    r"\{(?P<labels>[^}]*)\} (?P<value>\S+)$"
)
# Requests whose mean API-server latency during the ramp is reported: they bound the operator,
# whose reconciles await them one after another.
LATENCY_KEYS = (
    "POST pods",
    "POST stagepools",
    "APPLY stagepools",  # server-side apply: the operator's creates and spec updates
    "PATCH stagepools/status",
    "GET poddisruptionbudgets",
)
WRITE_LINE = re.compile(r"omnistage\.kubeapi\.writes: (?P<verb>[A-Z]+) (?P<path>/\S+)")
ERROR_RE = re.compile(r"Traceback|\bERROR\b|\bWARNING\b|failed|Error", re.IGNORECASE)


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ports_free(base: int, count: int = 6) -> bool:
    for port in range(base, base + count):
        with socket.socket() as s:
            # Like the Go servers: a port whose old connections linger in TIME_WAIT is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pipeline_doc(name: str, replicas: int) -> Obj:
    """An echo pipeline a -> b -> c whose pods (stages and orchestrator) all land on kwok nodes."""
    placement = {"nodeSelector": dict(SCALE_POOL), "tolerations": [dict(KWOK_TOLERATION)]}
    stages = []
    for i, stage in enumerate(STAGES):
        st: Obj = {
            "name": stage,
            "kind": "echo",
            "replicas": replicas,
            # kwok scale nodes have 64 CPUs and 250 pod slots: keep requests tiny so pod slots,
            # not CPU, bound the fleet.
            "resources": {"gpus": 0, "cpu": "10m", "memory": "16Mi"},
            "placement": placement,
        }
        if i:
            st["inputs"] = [STAGES[i - 1]]
        if i == len(STAGES) - 1:
            st["finalOutput"] = True
        stages.append(st)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OmniPipeline",
        "metadata": {"name": name, "labels": {"bench": "operator-scale"}},
        "spec": {
            "orchestrator": {
                "api": ["generic"],
                "resources": {"cpu": "10m", "memory": "32Mi"},
                "nodeSelector": dict(SCALE_POOL),
                "tolerations": [dict(KWOK_TOLERATION)],
            },
            "stages": stages,
        },
    }


def tree_state() -> str:
    """The commit measured, marked dirty when operator/ or runtime/ has local changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "operator", "runtime")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head or 'unknown'}{'+dirty' if dirty else ''}"


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-process CPU seconds between two `component_cpu` readings, largest first."""
    delta = {k: round(after[k] - before.get(k, 0.0), 1) for k in after}
    return dict(sorted(delta.items(), key=lambda kv: -kv[1]))


def pipeline_ready(obj: Obj) -> bool:
    c = condition(obj, "Ready")
    gen = obj["metadata"].get("generation")
    return bool(
        c
        and c.get("status") == "True"
        and (obj.get("status") or {}).get("observedGeneration") == gen
    )


def pod_ready(pod: Obj) -> bool:
    st = pod.get("status") or {}
    return (
        st.get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
        and condition_status(pod, "Ready") == "True"
    )


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="bench-operator-scale-"))
        self.cluster_dir: Path | None = None
        self.cluster_env: dict[str, str] = {}
        self.kubeconfig: str = args.kubeconfig or ""
        self.kubectl = "kubectl"
        self.op: subprocess.Popen[bytes] | None = None
        self.op_log = self.work / "operator.log"
        self.metrics_port = free_port()
        self.ns = args.namespace
        self.kube: SyncKubeApi | None = None
        self.torn_down = False

    # ---- setup ---------------------------------------------------------------------------

    def _find_kubectl(self) -> str:
        cache = Path(os.environ.get("OMNISTAGE_CACHE") or Path.home() / ".cache" / "omnistage")
        for cand in (cache / "bin" / "kubectl", shutil.which("kubectl")):
            if cand and Path(cand).exists():
                return str(cand)
        raise BenchError("kubectl not found (run hack/build-k8s.sh or put kubectl on PATH)")

    def start_cluster(self) -> None:
        total = self.args.pipelines * (len(STAGES) * self.args.replicas + 1)
        # Keep every node under ~80% of its pod slots; hack/cluster.sh's default is 4.
        nodes = max(4, math.ceil(total / (PODS_PER_SCALE_NODE * 0.8)))
        base = self.args.port_base
        while not _ports_free(base):
            base += 10
            if base > self.args.port_base + 500:
                raise BenchError(f"no 6 free loopback ports from {self.args.port_base}")
        self.cluster_dir = Path(f"/tmp/bench-cluster-{os.getpid()}")
        self.cluster_env = {
            **os.environ,
            "OMNISTAGE_CLUSTER_DIR": str(self.cluster_dir),
            "OMNISTAGE_PORT_BASE": str(base),
            "OMNISTAGE_SCALE_NODES": str(nodes),
            "OMNISTAGE_GPU_NODES": "0",
            # kwok's pod IPs are loopback, which Endpoints and EndpointSlices refuse: their
            # controllers would retry each orchestrator Service's update (and patch an Event)
            # for good, a cost of this fake cluster that no real one has (measured at 600
            # pods: about 1,660 requests, nearly all refused updates and Event patches,
            # within a minute of the first create). Off for every run here: the bare pods',
            # the fleet's and LWS's. The variable set outside wins (an experiment turning a
            # controller off).
            "OMNISTAGE_KCM_CONTROLLERS": os.environ.get(
                "OMNISTAGE_KCM_CONTROLLERS", "*,-endpoints-controller,-endpointslice-controller"),
        }
        log(
            f"starting local control plane in {self.cluster_dir} (ports {base}..{base + 5}, "
            f"{nodes} kwok scale nodes x {PODS_PER_SCALE_NODE} pods)"
        )
        cluster_log = self.work / "cluster-up.log"
        for attempt in (1, 2):
            with open(cluster_log, "ab") as out:
                try:
                    rc = subprocess.run(
                        [str(HACK / "cluster.sh"), "up"],
                        env=self.cluster_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        timeout=600,
                        cwd=REPO,
                    ).returncode
                except subprocess.TimeoutExpired as exc:
                    raise BenchError(f"hack/cluster.sh up timed out; see {cluster_log}") from exc
            if rc == 0:
                break
            tail = cluster_log.read_text(errors="replace")[-3000:]
            if attempt == 2:
                raise BenchError(f"hack/cluster.sh up failed (rc={rc}):\n{tail}")
            # `up` is idempotent; a component can lose a start-up race on a loaded machine.
            log(
                f"hack/cluster.sh up failed (rc={rc}); retrying once. Last lines:\n"
                + "\n".join(tail.splitlines()[-4:])
            )
        self.kubeconfig = str(self.cluster_dir / "admin.kubeconfig")

    def stop_cluster(self) -> None:
        if self.cluster_dir is None:
            return
        if self.args.keep:
            log(
                f"--keep: cluster left running; stop it with OMNISTAGE_CLUSTER_DIR="
                f"{self.cluster_dir} hack/cluster.sh down --purge"
            )
            return
        log("stopping the local control plane")
        subprocess.run(
            [str(HACK / "cluster.sh"), "down", "--purge"],
            env=self.cluster_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=180,
            check=False,
        )
        self.cluster_dir = None

    def connect(self) -> None:
        kube = SyncKubeApi.load(self.kubeconfig, pool_size=16, user_agent="omnistage-bench")
        server = kube.config.server
        if not re.match(r"https?://(127\.\d+\.\d+\.\d+|localhost)(:\d+)?$", server):
            kube.close()
            raise BenchError(f"refusing a non-loopback API server: {server}")
        self.kube = kube

    @property
    def k(self) -> SyncKubeApi:
        if self.kube is None:
            raise BenchError("not connected")
        return self.kube

    def pipelines_path(self, plural: str = PLURAL) -> str:
        return resource_path(f"{GROUP}/{VERSION}", plural, self.ns)

    def kctl(self, *args: str, timeout: float = 120) -> str:
        proc = subprocess.run(
            [self.kubectl, f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise BenchError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def check_capacity(self) -> None:
        nodes = self.k.list(path("Node"), labelSelector="omnistage.io/node-pool=kwok-scale")
        ready = [n for n in nodes if condition_status(n, "Ready") == "True"]
        slots = sum(int(n["status"]["allocatable"].get("pods", "0")) for n in ready)
        want = self.args.pipelines * (len(STAGES) * self.args.replicas + 1)
        log(f"{len(ready)} ready kwok scale nodes, {slots} pod slots for {want} pods")
        if slots < want:
            raise BenchError(f"kwok scale nodes hold {slots} pods, the fleet needs {want}")

    def apply_crds(self) -> None:
        self.kctl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        self.kctl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            f"crd/omnipipelines.{GROUP}",
            f"crd/stagepools.{GROUP}",
            timeout=90,
        )
        # Established is not yet served: wait until both resources list, so the operator's first
        # watches do not meet 'storage is (re)initializing'.
        deadline = time.monotonic() + 60
        for plural in (PLURAL, "stagepools"):
            while True:
                try:
                    self.k.get(resource_path(f"{GROUP}/{VERSION}", plural), limit=1)
                    break
                except ApiError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)

    def make_namespace(self) -> None:
        if self.k.get(path("Namespace", name=self.ns), ignore=(404,)) is None:
            self.k.create(path("Namespace"), {"metadata": {"name": self.ns}})
            return
        if self.k.list(self.pipelines_path()):
            raise BenchError(f"namespace {self.ns} already holds OmniPipelines; use --namespace")

    def start_operator(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "omnistage.cli",
            "operator",
            f"--kubeconfig={self.kubeconfig}",
            f"--metrics-port={self.metrics_port}",
            f"--resync-seconds={self.args.resync_seconds}",
        ]
        if self.cluster_dir is None:  # a shared cluster: watch only our namespace
            cmd.append(f"--namespace={self.ns}")
        for flag in ("workers", "write_qps", "write_burst"):  # else the operator's defaults
            if getattr(self.args, flag) is not None:
                cmd.append(f"--{flag.replace('_', '-')}={getattr(self.args, flag)}")
        cmd.extend(getattr(self.args, "operator_args", None) or [])  # e.g. --no-autoscaler
        log(f"starting operator (log: {self.op_log}, metrics on 127.0.0.1:{self.metrics_port})")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "runtime"), str(REPO / "operator"), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        with open(self.op_log, "ab") as out:
            # Own session: a terminal Ctrl-C reaches us, and we stop it in order.
            self.op = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.op.poll() is not None:
                raise BenchError(f"operator exited (rc={self.op.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.metrics_port}/livez", timeout=1
                ):
                    return
            except OSError:
                time.sleep(0.3)
        raise BenchError(f"operator /livez not up in 60 s:\n{self.log_tail()}")

    def stop_operator(self) -> None:
        if self.op is None or self.op.poll() is not None:
            return
        self.op.send_signal(signal.SIGTERM)
        try:
            self.op.wait(20)
        except subprocess.TimeoutExpired:
            self.op.kill()
            self.op.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "".join(self.op_log.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        if self.op is not None and self.op.poll() is not None:
            raise BenchError(f"operator died (rc={self.op.returncode}):\n{self.log_tail()}")
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=60
        ) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def counters(self) -> tuple[int, int]:
        m = self.metrics()
        return int(m.get(WRITES, 0)), int(m.get(RECONCILES, 0))

    def apiserver_metrics(self) -> tuple[dict[str, int], dict[str, tuple[float, int]]]:
        """From the API server's own /metrics: GETs served for the operator's resources, by
        resource; and (latency sum, count) by "VERB resource[/sub]" for every request."""
        text = self.k.request("GET", "/metrics", raw=True, timeout=20)
        gets: dict[str, int] = {}
        lat: dict[str, list[float]] = {}
        for line in text.splitlines():
            m = APISERVER_METRIC.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
            res = labels.get("resource", "") + (
                f"/{labels['subresource']}" if labels.get("subresource") else ""
            )
            value = float(m.group("value"))
            if m.group("name") == "apiserver_request_total":
                if labels.get("verb") == "GET" and labels.get("resource") in OPERATOR_GET_RESOURCES:
                    gets[res] = gets.get(res, 0) + int(value)
            else:
                slot = lat.setdefault(f"{labels.get('verb')} {res}", [0.0, 0])
                slot[0 if m.group("name").endswith("_sum") else 1] += value
        return gets, {k: (v[0], int(v[1])) for k, v in lat.items()}

    def apiserver_gets(self) -> dict[str, int]:
        return self.apiserver_metrics()[0]

    def count(self, url_path: str) -> int:
        """How many objects a collection holds, without listing them all: one item and the API
        server's remainingItemCount (which it leaves out when a selector is given)."""
        doc = self.k.get(url_path, limit=1)
        return len(doc.get("items") or []) + int(
            (doc.get("metadata") or {}).get("remainingItemCount") or 0)

    def operator_cpu(self) -> float:
        """CPU seconds (user + system) the operator process has used so far."""
        try:
            return 0.0 if self.op is None else proc_cpu(self.op.pid)
        except OSError:
            return 0.0

    def component_cpu(self) -> dict[str, float]:
        """CPU seconds so far of each control-plane process (hack/cluster.sh's pid files), the
        operator and this bench: where a ramp's CPU goes on a machine its API server shares."""
        out: dict[str, float] = {}
        if self.cluster_dir is not None:
            for pidfile in sorted((self.cluster_dir / "pids").glob("*.pid")):
                try:
                    out[pidfile.stem] = proc_cpu(int(pidfile.read_text().split()[0]))
                except (OSError, ValueError, IndexError):
                    continue
        if self.op is not None:
            out["operator"] = self.operator_cpu()
        t = os.times()
        out["bench"] = t.user + t.system
        return out

    def operator_memory(self) -> dict[str, float]:
        """The operator's resident memory now and at its peak (VmRSS, VmHWM), in MiB."""
        out: dict[str, float] = {}
        if self.op is None:
            return out
        try:
            for line in Path(f"/proc/{self.op.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    mib = int(value.split()[0]) / 1024
                    out["rss" if key == "VmRSS" else "peak"] = round(mib, 1)
        except OSError:
            pass
        return out

    def by_verb(self) -> dict[str, int]:
        out = {}
        for k, v in self.metrics().items():
            if m := re.match(r'omnistage_operator_api_writes_by_verb_total\{verb="(\w+)"\}', k):
                out[m.group(1)] = int(v)
        return out

    # ---- the measured run ----------------------------------------------------------------

    def create_pipelines(self) -> float:
        names = [f"scale-{i:03d}" for i in range(self.args.pipelines)]

        def create(name: str) -> None:
            self.k.create(self.pipelines_path(), pipeline_doc(name, self.args.replicas))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(create, names))
        return time.monotonic()

    def observe(self, pods: bool = True) -> tuple[int, int, int, int]:
        """(ready pipelines, ready stage pods, stage pods, ready orchestrator pods); the pod
        figures are -1 when pods=False (listing 650 pods is the expensive part of polling)."""
        pipes = self.k.list(self.pipelines_path())
        ready_pipes = sum(1 for p in pipes if pipeline_ready(p))
        if not pods:
            return ready_pipes, -1, -1, -1
        # Served from the API server's watch cache (resourceVersion=0).
        items = self.k.list(path("Pod", self.ns), labelSelector=LABEL_COMPONENT,
                            resourceVersion="0")
        stage = [p for p in items if p["metadata"]["labels"].get(LABEL_COMPONENT) == "stage"]
        orch = [p for p in items if p["metadata"]["labels"].get(LABEL_COMPONENT) == "orchestrator"]
        return (
            ready_pipes,
            sum(1 for p in stage if pod_ready(p)),
            len(stage),
            sum(1 for p in orch if pod_ready(p)),
        )

    def wait_ready(self, t0: float) -> float:
        """Poll until every pipeline is Ready and every stage pod Running+Ready: pipelines every
        second, pods every 5 s for progress and every second once all pipelines are Ready (the
        pod check is independent of the operator's own status roll-up)."""
        want_pipes = self.args.pipelines
        want_pods = self.args.pipelines * len(STAGES) * self.args.replicas
        deadline = t0 + self.args.timeout
        last_print = 0.0
        rp = rpods = 0
        while True:
            now = time.monotonic()
            progress = now - last_print >= 5
            rp = self.observe(pods=False)[0]
            if progress or rp == want_pipes:
                rp, rpods, npods, rorch = self.observe()
                now = time.monotonic()
                if rp == want_pipes and rpods == want_pods and npods == want_pods:
                    log(
                        f"  t={now - t0:6.1f}s pipelines Ready {rp}/{want_pipes}  stage pods "
                        f"Ready {rpods}/{want_pods}  orchestrators Ready {rorch}/{want_pipes}"
                    )
                    return now
                if progress:
                    w, r = self.counters()
                    log(
                        f"  t={now - t0:6.1f}s pipelines Ready {rp}/{want_pipes}  stage pods "
                        f"Ready {rpods}/{want_pods} (exist {npods})  orchestrators Ready "
                        f"{rorch}/{want_pipes}  operator writes={w} reconciles={r}"
                    )
                    last_print = now
            if now - t0 > 60 and self.counters()[1] == 0:
                raise BenchError(
                    "the operator has not reconciled anything 60 s after the "
                    f"first create\noperator log tail:\n{self.log_tail()}"
                )
            if now > deadline:
                raise BenchError(
                    f"not Ready after {self.args.timeout:.0f}s: pipelines {rp}/{want_pipes}, "
                    f"stage pods {rpods}/{want_pods}\noperator log tail:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def settle(self, quiet: float = 3.0, limit: float = 60.0) -> float:
        """Wait until the write counter stops moving (trailing status writes), bounded."""
        start = time.monotonic()
        last, since = self.counters()[0], time.monotonic()
        while time.monotonic() - start < limit:
            time.sleep(0.5)
            w = self.counters()[0]
            if w != last:
                last, since = w, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
        return time.monotonic() - start

    def snapshot(self, fresh: bool = False) -> Obj:
        """Counters to diff against; fresh: a new operator process whose counters start at 0."""
        w, r = (0, 0) if fresh else self.counters()
        return {
            "writes": w,
            "reconciles": r,
            "verbs": {} if fresh else self.by_verb(),
            "gets": self.apiserver_gets(),
            "cpu": 0.0 if fresh else self.operator_cpu(),
            "log_offset": self.op_log.stat().st_size if self.op_log.exists() else 0,
        }

    def log_since(self, offset: int) -> str:
        """The operator's log from byte `offset` on ("" when it cannot be read)."""
        try:
            with open(self.op_log, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def write_log(self, offset: int) -> dict[str, int]:
        """Writes the operator logged since `offset`, by verb and resource.

        Parsed from its omnistage.operator.writes lines, when the log has them: it tells WHICH
        writes an idle window or a restart made.
        """
        out: dict[str, int] = {}
        for m in WRITE_LINE.finditer(self.log_since(offset)):
            res = re.sub(r"^/apis?/(?:[^/]+/)?v\w+/namespaces/[^/]+/", "", m.group("path"))
            parts = res.split("/")
            key = f"{m.group('verb')} {parts[0]}" + (f"/{parts[2]}" if len(parts) > 2 else "")
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def window(self, seconds: float, what: str, base: Obj | None = None) -> Obj:
        """Deltas over `seconds` from `base` (default: now): operator writes and reconciles,
        API-server GETs of the operator's resources, operator CPU."""
        base = base or self.snapshot()
        start = time.monotonic()
        log(f"{what}: {seconds:.0f}s with --resync-seconds {self.args.resync_seconds}")
        while (left := start + seconds - time.monotonic()) > 0:
            time.sleep(min(5.0, left))
            w, r = self.counters()
            log(
                f"  {what} t={time.monotonic() - start:5.1f}s writes +{w - base['writes']} "
                f"reconciles +{r - base['reconciles']}"
            )
        now = self.snapshot()
        gets = {
            k: now["gets"].get(k, 0) - base["gets"].get(k, 0)
            for k in now["gets"]
            if now["gets"].get(k, 0) != base["gets"].get(k, 0)
        }
        v0, v1 = base["verbs"], now["verbs"]
        return {
            "writes": now["writes"] - base["writes"],
            "writes_by_verb": {
                k: v1.get(k, 0) - v0.get(k, 0) for k in v1 if v1.get(k, 0) != v0.get(k, 0)
            },
            "writes_logged": self.write_log(base["log_offset"]),
            "reconciles": now["reconciles"] - base["reconciles"],
            "apiserver_gets": sum(gets.values()),
            "apiserver_gets_by_resource": dict(sorted(gets.items())),
            "operator_cpu_s": round(now["cpu"] - base["cpu"], 2),
        }

    def ready_since(self) -> dict[str, str]:
        """Ready condition lastTransitionTime of every pipeline and pool (flap detection)."""
        out = {}
        for plural in (PLURAL, "stagepools"):
            for obj in self.k.list(self.pipelines_path(plural)):
                c = condition(obj, "Ready") or {}
                out[f"{plural}/{obj['metadata']['name']}"] = f"{c.get('status')}@" + str(
                    c.get("lastTransitionTime")
                )
        return out

    def restart_check(self, seconds: float) -> Obj:
        """Restart the operator on the converged fleet: its first sync must write nothing and
        must not flip any Ready condition."""
        log("restart check: stopping the operator and starting a fresh one on the Ready fleet")
        before = self.ready_since()
        self.stop_operator()
        self.metrics_port = free_port()
        base = self.snapshot(fresh=True)
        self.start_operator()
        out = self.window(seconds, "after restart", base)
        after = self.ready_since()
        flapped = sorted(k for k in before if after.get(k) != before[k])
        rp, rpods, npods, rorch = self.observe()
        # The restarted process primed its view from lists of the whole fleet: its own peak.
        out["operator_memory_mib"] = self.operator_memory()
        out["ready_conditions_changed"] = len(flapped)
        out["ready_conditions_changed_examples"] = flapped[:5]
        out["still_ready"] = {
            "pipelines": rp,
            "stage_pods": rpods,
            "stage_pods_exist": npods,
            "orchestrators": rorch,
        }
        if out["writes"] or flapped:
            detail = out["writes_logged"] or out["writes_by_verb"]
            log(
                f"restart made {out['writes']} writes ({detail}) and changed {len(flapped)} "
                f"Ready conditions, e.g. {flapped[:3]}"
            )
        return out

    def teardown(self) -> Obj:
        """Delete all pipelines; time the ordered shutdown until no pipeline, pool, pod is left."""
        w0 = self.counters()[0]
        log(f"teardown: deleting {self.args.pipelines} pipelines")
        cpu0 = self.component_cpu()
        api0 = apiserver_writes(self.k)
        t0 = time.monotonic()
        self.k.delete(self.pipelines_path())
        deadline = t0 + self.args.teardown_timeout
        last_print = 0.0
        while True:
            # Counted, not listed: decoding 6,000 pods a second was most of this loop's CPU.
            # The namespace holds only the fleet's objects, so no selector is needed.
            pipes = self.count(self.pipelines_path())
            pools = self.count(self.pipelines_path("stagepools"))
            pods = self.count(path("Pod", self.ns))
            now = time.monotonic()
            if pipes == pools == pods == 0:
                break
            if now - last_print >= 5:
                log(
                    f"  teardown t={now - t0:6.1f}s pipelines {pipes} pools {pools} pods {pods} "
                    f"operator writes +{self.counters()[0] - w0}"
                )
                last_print = now
            if now > deadline:
                raise BenchError(
                    f"teardown not done after {self.args.teardown_timeout:.0f}s: "
                    f"{pipes} pipelines, {pools} pools, {pods} pods left\n"
                    f"operator log tail:\n{self.log_tail()}"
                )
            time.sleep(TEARDOWN_POLL_S)
        took = time.monotonic() - t0
        cpu = cpu_delta(cpu0, self.component_cpu())
        writes = self.counters()[0] - w0
        # Everyone's: the operator's deletes and the collector's, kwok's final deletes, events.
        api = write_delta(api0, apiserver_writes(self.k))
        log(f"teardown done in {took:.1f}s, operator writes {writes}; CPU seconds by process "
            f"{cpu}; API writes by everyone {sum(api.values())} {api}")
        return {"delete_to_gone_s": round(took, 1), "writes": writes, "cpu_s": cpu,
                "apiserver_writes_by_verb_resource": api}

    def log_problems(self) -> list[str]:
        try:
            lines = self.op_log.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [ln for ln in lines if ERROR_RE.search(ln)]

    def delete_pipelines(self) -> None:
        """On a reused cluster: delete what we made while the operator still runs (finalizers)."""
        if self.kube is None:
            return
        try:
            self.k.delete(self.pipelines_path())
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if not self.k.list(self.pipelines_path()):
                    break
                time.sleep(2)
            self.k.delete(path("Namespace", name=self.ns))
        except Exception as exc:  # cleanup is best effort; say what is left
            log(f"cleanup of namespace {self.ns} incomplete: {exc}")

    def raw_pods_baseline(self, count: int) -> Obj:
        """The control plane's own limit: `count` bare pods on the same kwok nodes, created
        64 at a time with no controller in between, timed until all are Running and Ready."""
        ns = f"{self.ns}-raw"
        if self.k.get(path("Namespace", name=ns), ignore=(404,)) is None:
            self.k.create(path("Namespace"), {"metadata": {"name": ns}})
        selector = "omnistage.io/bench=raw"

        def doc(i: int) -> Obj:
            return {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"raw-{i:05d}",
                             "labels": {"omnistage.io/bench": "raw",
                                        "omnistage.io/chunk": str(i // 200)}},
                "spec": {
                    "nodeSelector": dict(SCALE_POOL), "tolerations": [dict(KWOK_TOLERATION)],
                    "containers": [{"name": "stage", "image": "omnistage-raw-baseline",
                                    "resources": {"requests": {"cpu": "10m",
                                                               "memory": "16Mi"}}}],
                },
            }

        log(f"raw baseline: creating {count} bare pods in namespace {ns}, 64 at a time")
        writes0 = apiserver_writes(self.k)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            list(pool.map(lambda i: self.k.create(path("Pod", ns), doc(i)), range(count)))
        t_created = time.monotonic()
        deadline, last_print = t0 + self.args.timeout, 0.0
        while True:
            pods = self.k.list(path("Pod", ns), labelSelector=selector, resourceVersion="0")
            ready, now = sum(1 for p in pods if pod_ready(p)), time.monotonic()
            if ready == count:
                break
            if now - last_print >= 5:
                log(f"  t={now - t0:6.1f}s raw pods Ready {ready}/{count} (exist {len(pods)})")
                last_print = now
            if now > deadline:
                raise BenchError(f"raw baseline: {ready}/{count} pods Ready after "
                                 f"{self.args.timeout:.0f}s")
            time.sleep(1.0)
        t_ready = time.monotonic()
        writes = write_delta(writes0, apiserver_writes(self.k))
        log(f"raw baseline: {count} pods Ready after {t_ready - t0:.1f}s "
            f"(created in {t_created - t0:.1f}s); API writes by everyone "
            f"{sum(writes.values())} {writes}; deleting them")
        # In chunks: one delete-collection of thousands of pods outlasts the client's timeout.
        grace = self.args.raw_grace_period
        body = None if grace is None else {"gracePeriodSeconds": grace}
        cpu0 = self.component_cpu()
        writes0 = apiserver_writes(self.k)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda c: self.k.delete(
                path("Pod", ns), body,
                labelSelector=f"{selector},omnistage.io/chunk={c}"), range(count // 200 + 1)))
        while self.count(path("Pod", ns)):  # its namespace holds only these pods
            if time.monotonic() > t_ready + self.args.timeout:
                raise BenchError("raw baseline: its pods were not deleted in time")
            time.sleep(TEARDOWN_POLL_S)
        t_gone = time.monotonic()
        delete_cpu = cpu_delta(cpu0, self.component_cpu())
        delete_writes = write_delta(writes0, apiserver_writes(self.k))
        log(f"raw baseline: deleted in {t_gone - t_ready:.1f}s; CPU seconds by process "
            f"{delete_cpu}; API writes by everyone {sum(delete_writes.values())} {delete_writes}")
        return {"pods": count, "create_s": round(t_created - t0, 1),
                "apply_to_ready_s": round(t_ready - t0, 1),
                "delete_s": round(t_gone - t_ready, 1),
                "grace": "default" if grace is None else f"{grace}s",
                "delete_cpu_s": delete_cpu,
                "delete_writes_by_verb_resource": delete_writes,
                # Everyone's writes to Ready (the bench's creates, binds, kwok's statuses...).
                "apiserver_writes_to_ready": sum(writes.values()),
                "apiserver_writes_by_verb_resource": writes}

    def run(self) -> Obj:
        self.kubectl = self._find_kubectl()
        if not self.kubeconfig:
            self.start_cluster()
        self.connect()
        self.check_capacity()
        self.apply_crds()
        self.make_namespace()
        raw = None
        if self.args.raw_baseline:
            cpu0 = self.component_cpu()
            raw = self.raw_pods_baseline(
                self.args.pipelines * len(STAGES) * self.args.replicas)
            raw["cpu_s"] = cpu_delta(cpu0, self.component_cpu())
            log(f"raw baseline: CPU seconds by process, create to Ready and deleted: "
                f"{raw['cpu_s']}")
        tree = tree_state()
        log(f"operator under test: this tree at {tree}")
        self.start_operator()
        time.sleep(2)  # let kopf finish its initial (empty) listings
        w_start, r_start = self.counters()
        (g_start, lat_start), c_start = self.apiserver_metrics(), self.operator_cpu()
        p, st, rep = self.args.pipelines, len(STAGES), self.args.replicas
        pods = p * st * rep
        log(
            f"creating {p} pipelines x {st} stages x {rep} replicas = {pods} stage pods "
            f"(+{p} orchestrator pods) in namespace {self.ns}"
        )
        api_w0 = apiserver_writes(self.k)
        cpu0 = self.component_cpu()
        t0 = time.monotonic()
        t_created = self.create_pipelines()
        log(f"  {p} OmniPipelines created in {t_created - t0:.2f}s")
        t_ready = self.wait_ready(t0)
        ramp_cpu = cpu_delta(cpu0, self.component_cpu())
        log(f"CPU seconds by process, apply to Ready: {ramp_cpu}")
        w_ready, _ = self.counters()
        settle_s = self.settle()
        w_settled, r_settled = self.counters()
        api_w1 = apiserver_writes(self.k)
        api_writes = controller_writes(api_w0, api_w1)
        all_writes = write_delta(api_w0, api_w1)
        (g_settled, lat_settled), c_settled = self.apiserver_metrics(), self.operator_cpu()
        latency = {}
        for key in LATENCY_KEYS:
            s0, n0 = lat_start.get(key, (0.0, 0))
            s1, n1 = lat_settled.get(key, (0.0, 0))
            if n1 > n0:
                latency[key] = {"n": n1 - n0, "mean_ms": round(1000 * (s1 - s0) / (n1 - n0), 1)}
        verbs_total = self.by_verb()
        # Seconds writes waited for the operator's write rate limit (absent: no limit).
        limit_wait = self.metrics().get("omnistage_operator_write_limit_wait_seconds_total")
        load_at_ready = [round(x, 1) for x in os.getloadavg()]
        writes_total = w_settled - w_start
        log(
            f"all Ready after {t_ready - t0:.1f}s; writes at Ready {w_ready - w_start}, "
            f"+{w_settled - w_ready} while settling ({settle_s:.1f}s); by verb {verbs_total}; "
            f"operator CPU {c_settled - c_start:.1f}s"
        )
        log(
            "API-server mean latency during the ramp: "
            + ", ".join(f"{k} {v['mean_ms']}ms (n={v['n']})" for k, v in latency.items())
            + f"; load average {load_at_ready} on {os.cpu_count()} CPUs"
        )
        api_idle0 = apiserver_writes(self.k)
        idle = self.window(self.args.idle_seconds, "idle")
        idle["controller_writes_by_verb_resource"] = controller_writes(
            api_idle0, apiserver_writes(self.k))
        idle["controller_writes"] = sum(idle["controller_writes_by_verb_resource"].values())
        if idle["writes"]:
            log(f"idle writes: {idle['writes_logged'] or idle['writes_by_verb']}")
        result: Obj = {
            "pipelines": p,
            "stages": st,
            "replicas": rep,
            "pods": pods,
            "create_s": round(t_created - t0, 2),
            "apply_to_ready_s": round(t_ready - t0, 1),
            "writes_at_ready": w_ready - w_start,
            "writes_total": writes_total,
            "writes_per_pod": round(writes_total / pods, 2),
            "writes_by_verb": verbs_total,
            # Counted by the API server, as for the LWS baseline (see bench/lws_baseline.py).
            "controller_writes_total": sum(api_writes.values()),
            "controller_writes_per_pod": round(sum(api_writes.values()) / pods, 2),
            "controller_writes_by_verb_resource": api_writes,
            # Everyone's, as for the bare pods: the control plane's bill for the fleet.
            "apiserver_writes_total": sum(all_writes.values()),
            "apiserver_writes_by_verb_resource": all_writes,
            "reconciles_to_ready": r_settled - r_start,
            "apiserver_gets_to_ready": sum(g_settled.values()) - sum(g_start.values()),
            "operator_cpu_to_ready_s": round(c_settled - c_start, 2),
            "cpu_s_to_ready_by_process": ramp_cpu,
            "operator_memory_mib": self.operator_memory(),
            "apiserver_latency_to_ready": latency,
            "loadavg_at_ready": load_at_ready,
            "idle_seconds": self.args.idle_seconds,
            "resync_seconds": self.args.resync_seconds,
            "idle": idle,
            "shared_cluster": self.cluster_dir is None,
            "tree": tree,
            "operator_flags": {f: getattr(self.args, f)
                               for f in ("workers", "write_qps", "write_burst")},
            "write_limit_wait_s": None if limit_wait is None else round(limit_wait, 2),
        }
        if raw is not None:
            result["raw_baseline"] = raw
        if self.args.restart_seconds > 0:
            result["restart"] = self.restart_check(self.args.restart_seconds)
        if not self.args.keep and self.args.teardown_timeout > 0:
            result["teardown"] = self.teardown()
            self.torn_down = True
        if self.args.lws:
            result["lws"] = self.run_lws()
        problems = self.log_problems()
        result["operator_log_problem_lines"] = len(problems)
        result["operator_log"] = str(self.op_log)
        if problems:
            log(f"operator log: {len(problems)} warning/error lines, first ones:")
            for line in problems[:10]:
                print("    " + line[:300], flush=True)
        secs = int(self.args.idle_seconds)
        line = (
            f"operator_scale: pipelines={p} pods={pods} apply_to_ready={t_ready - t0:.1f}s "
            f"writes_total={writes_total} writes_per_pod={writes_total / pods:.2f} "
            f"idle_writes_{secs}s={idle['writes']} idle_reconciles_{secs}s={idle['reconciles']} "
            f"idle_api_gets_{secs}s={idle['apiserver_gets']} "
            f"operator_peak_rss={result['operator_memory_mib'].get('peak', 0):.0f}MiB"
            f" workers={self.args.workers or 'default'}"
            f" write_limit_wait={result['write_limit_wait_s']}s"
        )
        if "restart" in result:
            rs = result["restart"]
            line += (
                f" restart_writes_{int(self.args.restart_seconds)}s={rs['writes']}"
                f" restart_ready_flips={rs['ready_conditions_changed']}"
                f" restart_peak_rss={rs['operator_memory_mib'].get('peak', 0):.0f}MiB"
            )
        if "teardown" in result:
            line += f" delete_to_gone={result['teardown']['delete_to_gone_s']:.1f}s"
        if raw is not None:
            line += (f" raw_pods_to_ready={raw['apply_to_ready_s']:.1f}s"
                     f" ratio_to_raw={(t_ready - t0) / raw['apply_to_ready_s']:.2f}x"
                     f" raw_delete={raw['delete_s']:.1f}s(grace={raw['grace']})")
        print(line, flush=True)
        if "lws" in result:
            print(lws_summary(result, secs), flush=True)
        goals = scale_goals(result, secs)
        result["goals"] = [g.__dict__ for g in goals]
        # In a --tenfold ladder each size's goals are labelled; the ladder's own line is last.
        label = f"[{pods} pods]" if getattr(self.args, "ladder", False) else ""
        print(f"summary{label}: " + verdicts(goals), flush=True)
        return result

    def run_lws(self) -> Obj:
        """The LWS baseline on the same cluster and kwok nodes, after the Omnistage fleet is
        gone (the nodes are sized for one fleet): one LeaderWorkerSet per stage pool."""
        version = read_versions()["LWS_VERSION"]
        cache = Path(os.environ.get("OMNISTAGE_CACHE") or Path.home() / ".cache" / "omnistage")
        binary = cache / "bin" / f"lws-controller-{version}"
        if not binary.exists():
            raise BenchError(f"{binary} is missing: run hack/build-k8s.sh lws")
        placement = {"nodeSelector": dict(SCALE_POOL), "tolerations": [dict(KWOK_TOLERATION)]}
        lws = LwsBaseline(self, binary, version, placement=placement, pod_ready=pod_ready,
                          log=log, free_port=free_port)
        try:
            lws.start()
            return lws.run(self.args.pipelines * len(STAGES), self.args.replicas,
                           self.args.idle_seconds, self.args.timeout)
        except RuntimeError as exc:
            raise BenchError(f"LWS baseline: {exc}") from None
        finally:
            lws.stop()

    def cleanup(self) -> None:
        if self.cluster_dir is None and not self.args.keep and not self.torn_down:
            self.delete_pipelines()
        self.stop_operator()
        if self.kube is not None:
            self.kube.close()
        self.stop_cluster()


def read_versions() -> dict[str, str]:
    """hack/versions.env, the pins shared with the build scripts."""
    out = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            out[key] = value
    return out


TENFOLD_PODS = 6000  # issue 13: the tenfold fleet's apply -> Ready goal
TENFOLD_LADDER = (50, 167, 500)  # pipelines: 600, 2,004 and 6,000 stage pods (issue 24)
FLAT_GROWTH = 1.25  # the largest fleet's ratio to the bare pods over the smallest's: "flat"
TENFOLD_READY_S = 60.0
RAW_RATIO = 1.5  # issue 24: apply -> Ready at most this many times the bare pods' (any size)
TENFOLD_PEAK_RSS_MIB = 300.0  # issue 24: the operator's peak RSS at 6,000 pods
WRITES_PER_POD = 4.0  # issue 24: the operator's writes per stage pod, apply to settled
DELETE_RATIO = 1.5  # issue 24: delete -> gone at most this many times the bare pods' delete


def raw_ratio(result: Obj) -> float | None:
    """apply_to_ready over the bare pods' (None: no baseline ran)."""
    raw = result.get("raw_baseline")
    return result["apply_to_ready_s"] / raw["apply_to_ready_s"] if raw else None


def scale_goals(result: Obj, idle_s: int) -> list[Goal]:
    """The goals this run measured (see the module docstring)."""
    goals = [Goal(f"idle_writes_{idle_s}s", result["idle"]["writes"], 0, at_least=False,
                  unit="", digits=0),
             Goal("writes_per_pod", result["writes_per_pod"], WRITES_PER_POD, at_least=False,
                  unit="", digits=2)]
    if "restart" in result:
        rs = result["restart"]
        goals += [Goal("restart_writes", rs["writes"], 0, at_least=False, unit="", digits=0),
                  Goal("restart_ready_flips", rs["ready_conditions_changed"], 0,
                       at_least=False, unit="", digits=0)]
    if "raw_baseline" in result:
        goals.append(Goal("apply_to_ready/raw_pods", raw_ratio(result), RAW_RATIO,
                          at_least=False))
    raw_delete = result.get("raw_baseline", {}).get("delete_s")
    if "teardown" in result and raw_delete:
        goals.append(Goal("delete_to_gone/raw_pods",
                          result["teardown"]["delete_to_gone_s"] / raw_delete, DELETE_RATIO,
                          at_least=False))
    if result["pods"] >= TENFOLD_PODS:
        goals.append(Goal("apply_to_ready", result["apply_to_ready_s"], TENFOLD_READY_S,
                          at_least=False, unit="s", digits=1))
        goals.append(Goal("operator_peak_rss", result["operator_memory_mib"].get("peak"),
                          TENFOLD_PEAK_RSS_MIB, at_least=False, unit="MiB", digits=0))
    if "lws" in result:
        lws = result["lws"]
        goals += [
            Goal("apply_to_ready omnistage/lws",
                 result["apply_to_ready_s"] / lws["apply_to_ready_s"], 1.0, at_least=False),
            Goal("controller_writes_per_pod omnistage/lws",
                 result["controller_writes_per_pod"] / lws["controller_writes_per_pod"], 1.0,
                 at_least=False),
        ]
    return goals


def ladder_goals(results: list[Obj]) -> list[Goal]:
    """The ladder's own goals: each size's ratios to its bare pods, and how the ratio grows.

    A flat ratio is the point of issue 24: a cost that grows faster than the fleet shows as
    the largest fleet's ratio above the smallest's. FLAT_GROWTH leaves room for run-to-run
    noise (the 600-pod ratio moved by about 15% between quiet runs here)."""
    goals: list[Goal] = []
    ratios = []
    for r in results:
        raw = r.get("raw_baseline") or {}
        ratio = raw_ratio(r)
        ratios.append(ratio)
        goals.append(Goal(f"apply_to_ready/raw_pods@{r['pods']}", ratio, RAW_RATIO,
                          at_least=False))
        if "teardown" in r and raw.get("delete_s"):
            goals.append(Goal(f"delete_to_gone/raw_pods@{r['pods']}",
                              r["teardown"]["delete_to_gone_s"] / raw["delete_s"], DELETE_RATIO,
                              at_least=False))
    if len(results) > 1:
        first, last = ratios[0], ratios[-1]
        growth = last / first if first and last else None
        goals.append(Goal(f"ratio_growth_{results[0]['pods']}_to_{results[-1]['pods']}",
                          growth, FLAT_GROWTH, at_least=False))
    return goals


def _per_pod(count: int | None, pods: int) -> str:
    return "n/a" if count is None else f"{count / pods:.2f}"


def ladder_line(results: list[Obj]) -> str:
    """One line with what the ladder is for: each figure per stage pod, size by size."""
    parts = []
    for r in results:
        raw = r.get("raw_baseline") or {}
        ratio = "n/a" if (x := raw_ratio(r)) is None else f"{x:.2f}x"
        cpu = sum((r.get("cpu_s_to_ready_by_process") or {}).values())
        part = (f"{r['pods']}: apply_to_ready={r['apply_to_ready_s']:.1f}s"
                f" raw={raw.get('apply_to_ready_s', float('nan')):.1f}s ratio={ratio}"
                f" cpu_per_pod={1000 * cpu / r['pods']:.0f}ms"
                f" operator_cpu_per_pod={1000 * r['operator_cpu_to_ready_s'] / r['pods']:.1f}ms"
                f" writes_per_pod={r['writes_per_pod']:.2f}"
                f" api_writes_per_pod={_per_pod(r.get('apiserver_writes_total'), r['pods'])}"
                f"(raw {_per_pod(raw.get('apiserver_writes_to_ready'), r['pods'])})"
                f" peak_rss={r['operator_memory_mib'].get('peak', 0):.0f}MiB")
        if "restart" in r:
            part += f" restart_peak_rss={r['restart']['operator_memory_mib'].get('peak', 0):.0f}MiB"
        if "teardown" in r and raw.get("delete_s"):
            part += (f" delete_to_gone={r['teardown']['delete_to_gone_s']:.1f}s"
                     f" raw_delete={raw['delete_s']:.1f}s")
        parts.append(part)
    return "operator_ladder: " + "; ".join(parts)


def lws_summary(result: Obj, idle_s: int) -> str:
    """The comparison line: Omnistage against LWS, same cluster, same run."""
    lws = result["lws"]
    omni_t, lws_t = result["apply_to_ready_s"], lws["apply_to_ready_s"]
    omni_w, lws_w = result["controller_writes_per_pod"], lws["controller_writes_per_pod"]
    faster = "PASS" if omni_t <= lws_t else "MISS"
    fewer = "PASS" if omni_w <= lws_w else "MISS"
    return (
        f"operator_vs_lws: pods omnistage={result['pods']} lws={lws['pods']} "
        f"apply_to_ready omnistage={omni_t:.1f}s lws={lws_t:.1f}s "
        f"ratio={omni_t / lws_t:.2f}x (goal <= 1: {faster}) "
        f"controller_writes_per_pod omnistage={omni_w:.2f} lws={lws_w:.2f} "
        f"ratio={omni_w / lws_w:.2f}x (goal <= 1: {fewer}) "
        f"idle_controller_writes_{idle_s}s omnistage={result['idle']['controller_writes']} "
        f"lws={lws['idle_controller_writes']} (operator's own: {result['idle']['writes']})"
    )


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pipelines", type=int, default=50)
    ap.add_argument("--replicas", type=int, default=4, help="replicas per stage (3 stages)")
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--resync-seconds", type=float, default=10.0)
    ap.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="fail if not all Ready within this many seconds of the first create",
    )
    ap.add_argument(
        "--restart-seconds",
        type=float,
        default=30.0,
        help="after the idle window, restart the operator and count its writes for "
        "this long (goal: 0); 0 skips the check",
    )
    ap.add_argument(
        "--teardown-timeout",
        type=float,
        default=300.0,
        help="finally delete all pipelines and time the ordered shutdown, failing "
        "after this long; 0 skips it",
    )
    ap.add_argument(
        "--kubeconfig",
        default=None,
        help="reuse this cluster (loopback API server, kwok scale nodes) instead of "
        "starting one; the operator then watches only --namespace",
    )
    ap.add_argument("--namespace", default="omnistage-scale")
    ap.add_argument("--workers", type=int, default=None,
                    help="the operator's --workers (reconciles at once); default: its own")
    ap.add_argument("--write-qps", type=float, default=None,
                    help="the operator's --write-qps (0: no limit); default: its own")
    ap.add_argument("--write-burst", type=int, default=None,
                    help="the operator's --write-burst; default: its own")
    ap.add_argument(
        "--port-base",
        type=int,
        default=29440,
        help="first of 6 loopback ports for the private control plane",
    )
    ap.add_argument("--json", default=None, help="also write the figures here as JSON")
    ap.add_argument(
        "--lws",
        action="store_true",
        help="then run the LeaderWorkerSet controller baseline on the same cluster "
        "(bench/lws_baseline.py; build it with hack/build-k8s.sh lws)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="leave the cluster and pipelines in place (the operator is stopped)",
    )
    ap.add_argument(
        "--raw-baseline",
        action="store_true",
        help="first time the same number of bare pods (no controller) to Ready: the control "
        "plane's own limit on this machine",
    )
    ap.add_argument(
        "--raw-grace-period",
        type=int,
        default=None,
        metavar="S",
        help="the bare pods' delete with this grace period (0: the API server removes them "
        "at once, kwok takes no part); default: the pods' own, as `kubectl delete` does",
    )
    ap.add_argument(
        "--tenfold",
        action="store_true",
        help="the growth ladder in one run: 50, 167 and 500 pipelines (600, 2,004 and 6,000 "
        "stage pods), each on a fresh control plane with --raw-baseline, --lws (when given) "
        "on the largest; ends with an operator_ladder line and the ladder's summary",
    )
    ap.add_argument("--sizes", default=None, metavar="P,P,...",
                    help="with --tenfold: these pipeline counts instead of 50,167,500")
    add_check_flag(ap)
    args = ap.parse_args()
    sizes = [args.pipelines]
    if args.sizes and not args.tenfold:
        ap.error("--sizes: only with --tenfold")
    if args.tenfold:
        try:
            sizes = [int(x) for x in (args.sizes or ",".join(map(str, TENFOLD_LADDER))).split(",")]
        except ValueError:
            ap.error(f"--sizes: expected pipeline counts like 50,167,500, got {args.sizes!r}")
        if not sizes or min(sizes) < 1 or sizes != sorted(sizes):
            ap.error(f"--sizes: expected increasing pipeline counts >= 1, got {args.sizes!r}")
        if args.kubeconfig:
            ap.error("--tenfold starts a fresh control plane per size: drop --kubeconfig")
        if args.keep:
            ap.error("--tenfold cleans up after every size: drop --keep")

    signal.signal(signal.SIGTERM, _interrupt)
    results: list[Obj] = []
    goals: list[Goal] = []
    rc = 0
    try:
        for i, pipelines in enumerate(sizes):
            run_args = args
            if args.tenfold:
                run_args = argparse.Namespace(**{
                    **vars(args), "pipelines": pipelines, "raw_baseline": True, "ladder": True,
                    "lws": args.lws and i == len(sizes) - 1})
                log(f"ladder: size {i + 1} of {len(sizes)}: {pipelines} pipelines")
            result = run_one(run_args)
            results.append(result)
            goals += scale_goals(result, int(args.idle_seconds))
        if args.tenfold:
            print(ladder_line(results), flush=True)
            ladder = ladder_goals(results)
            print("summary: " + verdicts(ladder), flush=True)
            goals += ladder
        if args.json:
            out = {"ladder": results} if args.tenfold else results[0]
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        rc = exit_status(goals, args.check)
    except BenchError as exc:
        log(f"FAILED: {exc}")
        rc = 1
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        rc = 130
    return rc


def run_one(args: argparse.Namespace) -> Obj:
    """One fleet size on its own cluster, cleaned up whatever happens (not interruptibly)."""
    bench = Bench(args)
    try:
        return bench.run()
    finally:
        handlers = (signal.signal(signal.SIGINT, signal.SIG_IGN),
                    signal.signal(signal.SIGTERM, signal.SIG_IGN))
        try:
            bench.cleanup()
        finally:
            log(f"operator log kept at {bench.op_log}")
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])


if __name__ == "__main__":
    sys.exit(main())
