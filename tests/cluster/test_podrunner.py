"""Pods really run: HTTP on the pod IP, readiness probes and gates, env, and a PDB-aware drain.

Here the pods run under the local pod runner (tests/harness/podrunner.py); on kind the same tests
run on real kubelets with a Python image.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from omnistage.kube import condition, condition_status
from omnistage.kubeapi import Obj, resource_path
from tests.harness.cluster import PY_IMAGE, Cluster, PodRunner, pods
from tests.harness.kubeclient import wait_until
from tests.harness.local import alive

# A pod-side HTTP server that drains gracefully on SIGTERM and leaves a marker proving it did.
SERVER = r"""
import http.server, json, os, signal, sys, time

ip, name = os.environ["POD_IP"], os.environ["POD_NAME"]
marker_dir = os.environ.get("MARKER_DIR", "")

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print(f"{name}: GET {self.path}", flush=True)  # probes are counted from the log
        body = json.dumps({k: os.environ.get(k) for k in (
            "POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "POD_UID", "GREETING",
            "FROM_CM", "FROM_SECRET", "EXPANDED")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

def on_term(*_):
    print(f"{name}: SIGTERM, draining", flush=True)
    time.sleep(1.0)  # in-flight work finishing
    if marker_dir and os.path.isdir(marker_dir):
        with open(os.path.join(marker_dir, name), "w") as f:
            f.write("graceful\n")
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
print(f"{name}: serving on {ip}:8080", flush=True)
http.server.ThreadingHTTPServer((ip, 8080), Handler).serve_forever()
"""


def field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def server_container(marker_dir: str = "") -> Obj:
    return {
        "name": "server",
        "image": PY_IMAGE,
        "command": ["python3", "-c", SERVER],
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [
            field_env("POD_IP", "status.podIP"),
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("NODE_NAME", "spec.nodeName"),
            field_env("POD_UID", "metadata.uid"),
            {"name": "GREETING", "value": "hello"},
            {"name": "EXPANDED", "value": "$(GREETING)-$(POD_NAME)"},
            {"name": "MARKER_DIR", "value": marker_dir},
        ],
        "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1},
        # In image mode a pod sees only its volumes: the marker dir is shared by hostPath.
        "volumeMounts": [{"name": "host", "mountPath": marker_dir}] if marker_dir else [],
    }


def host_dir(path: str) -> list[Obj]:
    """A hostPath volume named "host" (mounted at the same path) when ``path`` is set."""
    return [{"name": "host", "hostPath": {"path": path, "type": "Directory"}}] if path else []


def ready_pods(kube: Cluster, ns: str, selector: str) -> list[Obj]:
    return [
        p
        for p in pods(kube.kube, ns, selector)
        if condition_status(p, "Ready") == "True" and not p["metadata"].get("deletionTimestamp")
    ]


def exactly(items: list[Obj], n: int) -> list[Obj] | None:
    return items if len(items) == n else None


def test_http_server_pod_answers_on_pod_ip_and_becomes_ready(
    kube: Cluster, podrunner: PodRunner, namespace: str
) -> None:
    cms = resource_path("v1", "configmaps", namespace)
    kube.kube.create(cms, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                           "data": {"key": "from-configmap"}})  # fmt: skip
    kube.kube.create(
        resource_path("v1", "secrets", namespace),
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"},
         "stringData": {"key": "from-secret"}},
    )  # fmt: skip
    container = server_container()
    container["env"] += [
        {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "key"}}},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "key"}}},
    ]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web"},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    got = wait_until(
        lambda: (p := kube.kube.get(f"{path}/web"))
        and condition_status(p, "Ready") == "True"
        and p,
        60,
        "web pod Ready",
        on_timeout=lambda: podrunner.log_tail(namespace, "web"),
    )
    ip = got["status"]["podIP"]
    if podrunner.local:
        assert ip.startswith("127.") and ip != "127.0.0.1", ip
        assert got["spec"]["nodeName"] in podrunner.nodes
    status, body = podrunner.http_get(got, 8080)
    assert status == 200
    env = json.loads(body)
    assert env == {
        "POD_IP": ip,
        "POD_NAME": "web",
        "POD_NAMESPACE": namespace,
        "NODE_NAME": got["spec"]["nodeName"],
        "POD_UID": got["metadata"]["uid"],
        "GREETING": "hello",
        "FROM_CM": "from-configmap",
        "FROM_SECRET": "from-secret",
        "EXPANDED": "hello-web",
    }
    cstatus = got["status"]["containerStatuses"][0]
    assert cstatus["ready"] and "running" in cstatus["state"]
    assert got["status"]["phase"] == "Running"
    if podrunner.local:
        log_path = podrunner.log_path(namespace, "web", "server")
        assert log_path is not None
        assert "serving on" in log_path.read_text()


def _probes(podrunner: PodRunner, namespace: str, pod: str) -> int:
    """GETs the server container logged (only the readiness probe calls it in these tests)."""
    return podrunner.log_tail(namespace, pod, "server", lines=100_000).count(": GET /")


def test_readiness_gate_holds_ready_until_condition_true(
    kube: Cluster, podrunner: PodRunner, namespace: str
) -> None:
    gate = "omnistage.io/routable"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated"},
        "spec": {
            "readinessGates": [{"conditionType": gate}],
            "containers": [server_container()],
            "terminationGracePeriodSeconds": 5,
        },
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    wait_until(
        lambda: condition_status(kube.kube.get(f"{path}/gated"), "ContainersReady") == "True",
        60,
        "containers ready",
        on_timeout=lambda: podrunner.log_tail(namespace, "gated"),
    )
    probed = _probes(podrunner, namespace, "gated")
    wait_until(lambda: _probes(podrunner, namespace, "gated") >= probed + 2, 60,
               "two more readiness probes")  # the gate alone must keep the pod unready
    got = kube.kube.get(f"{path}/gated")
    assert condition_status(got, "Ready") == "False"
    ready = condition(got, "Ready")
    assert ready is not None
    assert ready.get("reason") == "ReadinessGatesNotReady"

    def gated_ready() -> str | None:
        return condition_status(kube.kube.get(f"{path}/gated"), "Ready")

    def set_gate(value: str) -> None:
        cond = {"type": gate, "status": value, "reason": "Test", "lastTransitionTime": None}
        kube.kube.patch(
            f"{path}/gated/status", {"status": {"conditions": [cond]}}, kind="strategic"
        )

    set_gate("True")
    wait_until(lambda: gated_ready() == "True", 30, "Ready")
    # The runner keeps posting status after each probe; it must not clobber the gate condition.
    probed = _probes(podrunner, namespace, "gated")
    wait_until(lambda: _probes(podrunner, namespace, "gated") >= probed + 2, 60,
               "two more readiness probes")
    got = kube.kube.get(f"{path}/gated")
    assert condition_status(got, gate) == "True"
    assert condition_status(got, "Ready") == "True"
    set_gate("False")
    wait_until(lambda: gated_ready() == "False", 30, "unready")


def test_container_restarts_after_crash(
    kube: Cluster, podrunner: PodRunner, namespace: str
) -> None:
    script = "import os,sys; print('run', flush=True); sys.exit(3)"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crashy"},
        "spec": {
            "containers": [{"name": "c", "image": PY_IMAGE, "command": ["python3", "-c", script]}]
        },
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    got = wait_until(
        lambda: (
            (p := kube.kube.get(f"{path}/crashy"))
            and (p["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0) >= 2
            and p
        ),
        90,
        "two restarts",
    )
    last = got["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 3


def test_failing_liveness_probe_restarts_container(
    kube: Cluster, podrunner: PodRunner, namespace: str
) -> None:
    container = server_container()
    container["livenessProbe"] = {
        "tcpSocket": {"port": 8081},  # nothing listens there
        "periodSeconds": 1,
        "failureThreshold": 2,
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "unhealthy"},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 3},
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    got = wait_until(
        lambda: (
            (p := kube.kube.get(f"{path}/unhealthy"))
            and (p["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0) >= 1
            and p
        ),
        60,
        "a liveness restart",
        on_timeout=lambda: podrunner.log_tail(namespace, "unhealthy"),
    )
    # Killed gracefully: our server exits 0 on SIGTERM.
    assert got["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 0


@pytest.mark.timeout(240)
def test_kubectl_drain_evicts_gracefully_within_pdb(
    kube: Cluster, podrunner: PodRunner, namespace: str, tmp_path: Path
) -> None:
    """Both replicas start on node A; drain A: one eviction at a time (PDB), SIGTERM, no loss."""
    assert len(podrunner.nodes) >= 2, "need two nodes to move pods"
    node_a, node_b = podrunner.nodes[:2]
    marker_dir = str(tmp_path) if podrunner.local else ""
    kube.kubectl("cordon", node_b)
    try:
        deploy = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "drainme"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "drainme"}},
                "template": {
                    "metadata": {"labels": {"app": "drainme"}},
                    "spec": {
                        "containers": [server_container(marker_dir)],
                        "volumes": host_dir(marker_dir),
                        "terminationGracePeriodSeconds": 15,
                    },
                },
            },
        }
        kube.kube.create(resource_path("apps/v1", "deployments", namespace), deploy)
        pdb = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "drainme"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "drainme"}}},
        }
        pdb_path = resource_path("policy/v1", "poddisruptionbudgets", namespace)
        kube.kube.create(pdb_path, pdb)
        originals = wait_until(
            lambda: exactly(ready_pods(kube, namespace, "app=drainme"), 2),
            60,
            "2 ready replicas",
            on_timeout=podrunner.runner_log,
        )
        assert {p["spec"]["nodeName"] for p in originals} == {node_a}
        wait_until(
            lambda: (
                kube.kube.get(f"{pdb_path}/drainme").get("status", {}).get("disruptionsAllowed")
                == 1
            ),
            30,
            "PDB to allow one disruption",
        )
    finally:
        kube.kubectl("uncordon", node_b)

    # Watch availability while draining: the PDB must keep at least one replica Ready throughout.
    min_ready = [2]
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            min_ready[0] = min(min_ready[0], len(ready_pods(kube, namespace, "app=drainme")))
            time.sleep(0.1)

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    try:
        drain = kube.kubectl(
            "drain", node_a, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s",
            timeout=200,
        )  # fmt: skip
    finally:
        stop.set()
        watcher.join()
        kube.kubectl("uncordon", node_a, check=False)
    out = drain.stdout + drain.stderr
    names = sorted(p["metadata"]["name"] for p in originals)
    for name in names:
        assert f"pod/{name} evicted" in out, out
    # The second eviction had to wait for the replacement: the PDB really refused it.
    assert "disruption budget" in out, out
    assert min_ready[0] >= 1, f"availability dropped to {min_ready[0]} during the drain"
    now = wait_until(
        lambda: exactly(ready_pods(kube, namespace, "app=drainme"), 2),
        60,
        "2 ready replacements",
    )
    assert {p["spec"]["nodeName"] for p in now} == {node_b}
    assert not {p["metadata"]["name"] for p in now} & set(names)
    if podrunner.local:
        # Graceful: each original got SIGTERM, drained, wrote its marker and exited 0 — no SIGKILL.
        assert sorted(f.name for f in tmp_path.iterdir()) == names
    if podrunner.state_dir is not None:
        ends = {e["pod"]: e for e in podrunner.events() if e["namespace"] == namespace}
        for name in names:
            assert ends[name]["sentSignal"] == "SIGTERM", ends[name]
            assert ends[name]["exitCode"] == 0, ends[name]


def test_init_container_then_completion_then_deletion(
    kube: Cluster, podrunner: PodRunner, namespace: str
) -> None:
    """Init containers run first; a restartPolicy=Never pod ends Succeeded; deleting it works."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "job"},
        "spec": {
            "restartPolicy": "Never",
            "initContainers": [
                {"name": "init", "image": PY_IMAGE, "command": ["python3", "-c", "print('init')"]}
            ],
            "containers": [
                {
                    "name": "main",
                    "image": PY_IMAGE,
                    "command": ["python3", "-c"],
                    "args": ["import sys; print('done'); sys.exit(0)"],
                }
            ],
        },
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    got = wait_until(
        lambda: (p := kube.kube.get(f"{path}/job"))["status"].get("phase") == "Succeeded" and p,
        60,
        "job pod Succeeded",
        on_timeout=lambda: podrunner.log_tail(namespace, "job"),
    )
    init = got["status"]["initContainerStatuses"][0]["state"]["terminated"]
    main = got["status"]["containerStatuses"][0]["state"]["terminated"]
    assert init["exitCode"] == 0 and main["exitCode"] == 0
    assert init["finishedAt"] <= main["startedAt"]
    assert condition_status(got, "Ready") == "False"
    assert "done" in podrunner.log_tail(namespace, "job", "main")
    kube.kube.delete(f"{path}/job")
    wait_until(lambda: not pods(kube.kube, namespace), 30, "completed pod removed")


def test_deleted_pod_leaves_no_processes(
    kube: Cluster, podrunner: PodRunner, namespace: str, tmp_path: Path
) -> None:
    """A child that ignores SIGTERM still dies with its pod (the process group is killed)."""
    if not podrunner.local:
        pytest.skip("checks host processes of the local pod runner")
    pidfile = tmp_path / "child.pid"
    # The child reports its pid only once it ignores SIGTERM, so the deletion cannot race it.
    stubborn = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(os.environ['PIDFILE'], 'w').write(str(os.getpid())); time.sleep(300)"
    )
    script = f'python3 -c "{stubborn}" & trap "exit 0" TERM; wait'
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "family"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": PY_IMAGE,
                    "command": ["sh", "-c", script],
                    "env": [{"name": "PIDFILE", "value": str(pidfile)}],
                    "volumeMounts": [{"name": "host", "mountPath": str(tmp_path)}],
                }
            ],
            "volumes": host_dir(str(tmp_path)),
            # A minute: waiting it out would be far beyond the bound below, however loaded.
            "terminationGracePeriodSeconds": 60,
        },
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 30, "child pid")
    child = int(pidfile.read_text())
    assert Path(f"/proc/{child}").exists()
    started = time.monotonic()
    kube.kube.delete(f"{path}/family")
    wait_until(lambda: not pods(kube.kube, namespace), 60, "pod removed")
    # The shell exits on SIGTERM at once, so the grace period is not waited out (a far guard:
    # half of it)...
    assert time.monotonic() - started < 30
    # ...and the child that ignored SIGTERM was killed with the group.
    wait_until(lambda: not alive(child), 30, f"child {child} gone")
