"""Pods really run: HTTP on the pod IP, readiness probes and gates, env, a PDB-aware drain, and
Secret volumes that follow their Secret.

Here the pods run under the local pod runner (tests/harness/podrunner.py); on kind the same tests
run on real kubelets with a Python image. The volume layout tests at the end drive the runner's
PodVolumes (tests/harness/podvolumes.py) directly, against a fake API.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import re
import stat
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from omnistage.kube import condition, condition_status
from omnistage.kubeapi import ApiError, Obj, resource_path
from omnistage.orchestrator import auth
from tests.harness import podvolumes
from tests.harness.cluster import PY_IMAGE, Cluster, PodRunner, pods
from tests.harness.kubeclient import wait_until
from tests.harness.local import alive
from tests.harness.podrunner import field_value

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


# ---- Secret and ConfigMap volumes follow their objects (a kubelet's atomic writer) -------------
TIMESTAMPED = re.compile(r"\.\.\d{4}_\d\d_\d\d_\d\d_\d\d_\d\d\.\d+")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class FakeApi:
    """The GETs PodVolumes makes, answered from objects by API path, and counted."""

    def __init__(self) -> None:
        self.objects: dict[str, Obj] = {}
        self.gets: Counter[str] = Counter()

    def get(self, path: str, **_: Any) -> Obj:
        self.gets[path] += 1
        if path not in self.objects:
            raise ApiError(404, {"reason": "NotFound", "message": f"{path} not found"}, "GET", path)
        return copy.deepcopy(self.objects[path])


def layout(volume: Path) -> tuple[str, list[str]]:
    """The timestamped folder ``..data`` names, and the visible names (each checked to be the
    writer's ``name -> ..data/name`` symlink); only one timestamped folder may exist."""
    folders = [e.name for e in volume.iterdir() if TIMESTAMPED.fullmatch(e.name)]
    target = os.readlink(volume / podvolumes.DATA_LINK)
    assert folders == [target], (folders, target)
    assert (volume / target).is_dir() and not (volume / target).is_symlink()
    assert not (volume / podvolumes.DATA_TMP).exists()
    visible = sorted(e.name for e in volume.iterdir() if not e.name.startswith(".."))
    for name in visible:
        assert os.readlink(volume / name) == f"{podvolumes.DATA_LINK}/{name}", name
    return target, visible


def assert_file(path: Path, text: str, mode: int, group: int) -> None:
    assert path.read_text() == text
    st = path.stat()  # through the symlinks: the file in force
    assert stat.S_IMODE(st.st_mode) == mode, oct(st.st_mode)
    if os.geteuid() == 0:
        assert st.st_gid == group


def test_secret_volumes_use_the_atomic_writer_layout_and_follow_their_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Laid out as a kubelet lays them out (..data -> a timestamped folder, key -> ..data/key),
    refreshed only after SYNC_S with one GET per object, a change swapped in with its modes and
    fsGroup kept, the old folder removed; a deleted Secret keeps the content in force, a deleted
    optional ConfigMap empties its volume. The orchestrator's key reader follows the swap."""
    key_a, key_b = "sk-volume-a-0123456789abcdef", "sk-volume-b-0123456789abcdef"
    key_c = "sk-volume-c-0123456789abcdef"
    api = FakeApi()
    secret = resource_path("v1", "secrets", "ns", "keys")
    config = resource_path("v1", "configmaps", "ns", "cfg")
    api.objects[secret] = {"data": {"a": b64(key_a + "\n"), "b": b64(key_c + "\n")}}
    api.objects[config] = {"data": {"x": "1"}}
    pod: Obj = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"v": "1"}},
        "spec": {"securityContext": {"fsGroup": 2345}, "containers": [], "volumes": [
            {"name": "keys", "secret": {"secretName": "keys", "defaultMode": 0o440}},
            {"name": "cfg", "configMap": {"name": "cfg", "optional": True, "items": [
                {"key": "x", "path": "sub/x.txt", "mode": 0o600}]}},
            {"name": "both", "projected": {"sources": [
                {"secret": {"name": "keys", "items": [{"key": "a", "path": "a"}]}},
                {"configMap": {"name": "cfg"}},
                {"downwardAPI": {"items": [
                    {"path": "v", "fieldRef": {"fieldPath": "metadata.labels['v']"}}]}},
            ]}},
        ]},
    }
    now = [100.0]
    vols = podvolumes.PodVolumes(api, pod, tmp_path / "volumes",  # type: ignore[arg-type]
                                 lambda _pod, path: field_value(pod, path),
                                 clock=lambda: now[0])
    keys, cfg, both = (vols.path(n) for n in ("keys", "cfg", "both"))
    first, visible = layout(keys)
    assert visible == ["a", "b"]
    assert_file(keys / "a", key_a + "\n", 0o440, 2345)
    assert_file(keys / "b", key_c + "\n", 0o440, 2345)
    assert layout(cfg)[1] == ["sub"]
    assert_file(cfg / "sub" / "x.txt", "1", 0o600, 2345)
    assert layout(both)[1] == ["a", "v", "x"]
    assert (both / "v").read_text() == "1"
    reader = auth.ApiKeys.from_file(keys, clock=lambda: now[0])  # the orchestrator's reader
    assert reader.allows(f"Bearer {key_a}") and reader.count == 2  # a file per Secret key
    assert api.gets == {secret: 2, config: 2}  # made: one GET per volume naming the object

    assert vols.sync() == [] and api.gets == {secret: 2, config: 2}  # not before SYNC_S
    now[0] += max(podvolumes.SYNC_S, auth.RELOAD_S)
    assert vols.sync() == []  # nothing changed: nothing written
    assert api.gets == {secret: 3, config: 3}  # one GET per object per pass, not per volume
    assert layout(keys)[0] == first

    # The Secret is rotated: key B only.
    api.objects[secret] = {"data": {"a": b64(key_b + "\n")}}
    now[0] += max(podvolumes.SYNC_S, auth.RELOAD_S)
    assert vols.sync() == ["keys", "both"]
    second, visible = layout(keys)
    assert second != first and not (keys / first).exists()
    assert visible == ["a"]  # the name gone from the Secret is gone from the volume
    assert_file(keys / "a", key_b + "\n", 0o440, 2345)
    assert (both / "a").read_text() == key_b + "\n"
    assert reader.allows(f"Bearer {key_b}") and reader.count == 1
    assert not reader.allows(f"Bearer {key_a}") and not reader.allows(f"Bearer {key_c}")

    # A changed label reaches the downward part; only that volume is rewritten.
    pod["metadata"]["labels"]["v"] = "2"
    now[0] += podvolumes.SYNC_S
    assert vols.sync() == ["both"] and (both / "v").read_text() == "2"

    # The Secret is deleted: its volumes keep their content (logged once); the optional
    # ConfigMap is deleted: its own volume is emptied.
    del api.objects[secret], api.objects[config]
    with caplog.at_level(logging.WARNING, logger="podrunner.volumes"):
        for _ in range(2):
            now[0] += podvolumes.SYNC_S
            changed = vols.sync()
            assert "keys" not in changed and "both" not in changed
    warned = [r.getMessage() for r in caplog.records if "not refreshed" in r.getMessage()]
    assert len(warned) == 2 and all("secret 'keys' not found" in m for m in warned), warned
    assert layout(keys) == (second, ["a"])
    assert_file(keys / "a", key_b + "\n", 0o440, 2345)
    assert layout(cfg)[1] == []
    assert reader.allows(f"Bearer {key_b}")

    # Back again: the volumes follow it.
    api.objects[secret] = {"data": {"a": b64(key_a + "\n")}}
    api.objects[config] = {"data": {"x": "3"}}
    now[0] += max(podvolumes.SYNC_S, auth.RELOAD_S)
    assert vols.sync() == ["keys", "cfg", "both"]
    assert_file(keys / "a", key_a + "\n", 0o440, 2345)
    assert_file(cfg / "sub" / "x.txt", "3", 0o600, 2345)
    assert reader.allows(f"Bearer {key_a}") and not reader.allows(f"Bearer {key_b}")


# A pod-side server that answers with the content of the file $KEY_FILE names.
READER = r"""
import http.server, os

path = os.environ["KEY_FILE"]

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(path, "rb") as f:
            body = f.read()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), Handler).serve_forever()
"""


def test_a_secret_volume_follows_its_secret_in_a_running_pod(
    kube: Cluster, podrunner: PodRunner, namespace: str
) -> None:
    """The process reads the new content once the Secret changes, with no restart, from a
    group-only file its fsGroup may read; a deleted Secret leaves the content in force."""
    secrets = resource_path("v1", "secrets", namespace)
    kube.kube.create(secrets, {"apiVersion": "v1", "kind": "Secret",
                               "metadata": {"name": "rotating"}, "data": {"key": b64("one")}})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reader"},
        "spec": {
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000},
            "containers": [{
                "name": "reader",
                "image": PY_IMAGE,
                "command": ["python3", "-c", READER],
                "env": [field_env("POD_IP", "status.podIP"),
                        {"name": "KEY_FILE", "value": "/etc/rotating/key"}],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1},
                "volumeMounts": [{"name": "rotating", "mountPath": "/etc/rotating",
                                  "readOnly": True}],
            }],
            "volumes": [{"name": "rotating",
                         "secret": {"secretName": "rotating", "defaultMode": 0o440}}],
            "terminationGracePeriodSeconds": 2,
        },
    }
    path = resource_path("v1", "pods", namespace)
    kube.kube.create(path, pod)
    got = wait_until(
        lambda: (p := kube.kube.get(f"{path}/reader")) and condition_status(p, "Ready") == "True"
        and p,
        60, "reader pod Ready", on_timeout=lambda: podrunner.log_tail(namespace, "reader"),
    )
    assert podrunner.http_get(got, 8080) == (200, "one")
    # A kubelet's sync period is a minute or so; the local runner's about a second.
    guard = 30 if podrunner.local else 180
    kube.kube.patch(f"{secrets}/rotating", {"data": {"key": b64("two")}})
    wait_until(lambda: podrunner.http_get(got, 8080) == (200, "two"), guard,
               "the pod to read the rotated Secret",
               on_timeout=lambda: podrunner.log_tail(namespace, "reader"))
    local = podrunner.local and podrunner.state_dir is not None
    if local:
        assert podrunner.state_dir is not None
        volume = podrunner.state_dir / "pods" / got["metadata"]["uid"] / "volumes" / "rotating"
        assert layout(volume)[1] == ["key"]
        assert_file(volume / "key", "two", 0o440, 2000)
    kube.kube.delete(f"{secrets}/rotating")
    if local:
        assert podrunner.state_dir is not None
        log_file = podrunner.state_dir / "podrunner.log"
        wait_until(lambda: f"pod {namespace}/reader: volume rotating not refreshed"
                   in log_file.read_text(errors="replace"), guard,
                   "the runner to find the Secret gone", on_timeout=podrunner.runner_log)
    assert podrunner.http_get(got, 8080) == (200, "two")
    now = kube.kube.get(f"{path}/reader")
    assert now["metadata"]["uid"] == got["metadata"]["uid"]
    assert condition_status(now, "Ready") == "True"
    assert now["status"]["containerStatuses"][0]["restartCount"] == 0
