"""KubernetesMembership against the real kube-apiserver: the states the orchestrator routes by.

The Pods never run: they are bound to a node that does not exist (so neither the scheduler, the
pod runner nor kwok touches them) and the test writes their status through the pods/status
subresource, as a kubelet would. Loopback pod IPs are accepted here (EndpointSlices reject them,
which is why membership watches Pods).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from omnistage import kube as names
from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.kubeapi import ApiError, KubeApi, KubeConfig, resource_path
from omnistage.orchestrator.k8s_membership import KubernetesMembership
from omnistage.orchestrator.membership import ReplicaInfo
from omnistage.procs import spawn_worker
from omnistage.spec import Stage
from tests.harness.cluster import Cluster
from tests.harness.kubeclient import Kube, wait_until
from tests.harness.local import free_port
from tests.harness.waiting import HANG_GUARD

PIPELINE = "mp"
NOWHERE = "omnistage-test-nowhere"  # no such node: nothing runs or finalizes these pods
PORT = 5555


def _pod(name: str, stage: str, pipeline: str = PIPELINE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                names.LABEL_PIPELINE: pipeline,
                names.LABEL_COMPONENT: "stage",
                names.LABEL_STAGE: stage,
            },
        },
        "spec": {
            "nodeName": NOWHERE,
            "readinessGates": [{"conditionType": names.READINESS_GATE}],
            "containers": [{"name": "worker", "image": "omnistage/worker:test"}],
            "terminationGracePeriodSeconds": 30,
        },
    }


def _set_status(k: Kube, ns: str, name: str, ip: str, ready: bool) -> None:
    """What the kubelet (podIP, Ready) and the operator (readiness gate) would write."""
    flag = "True" if ready else "False"
    k.patch(
        resource_path("v1", "pods", ns, name, "status"),
        {
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [
                    {"type": names.READINESS_GATE, "status": flag},
                    {"type": "Ready", "status": flag},
                ],
            }
        },
    )


def _force_delete(k: Kube, ns: str, name: str) -> None:
    with contextlib.suppress(ApiError):
        k.delete(resource_path("v1", "pods", ns, name), {"gracePeriodSeconds": 0})


class Recorder:
    """Collects membership reports (on the loop thread) and waits for expected ones."""

    def __init__(self) -> None:
        self.seen: list[ReplicaInfo] = []

    def __call__(self, info: ReplicaInfo) -> None:
        self.seen.append(info)

    def of(self, name: str) -> list[str]:
        return [i.state for i in self.seen if i.name == name]

    async def wait(self, cond: Callable[[], bool], what: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; seen: {self.seen}")
            await asyncio.sleep(0.02)


@pytest.fixture
async def api(kube: Cluster, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeApi]:
    """The client the orchestrator would build from $KUBECONFIG (the test cluster's)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    client = KubeApi(KubeConfig.load())
    yield client
    await client.close()


async def test_membership_follows_pod_lifecycle(
    kube: Cluster, namespace: str, api: KubeApi
) -> None:
    k, ns = kube.kube, namespace
    pods_path = resource_path("v1", "pods", ns)
    created = ["mp-a-0", "mp-a-1", "mp-b-0", "other-a-0"]
    rec = Recorder()
    m = KubernetesMembership(ns, PIPELINE, zmq_port=PORT, api=api, backoff=(0.1, 1.0))
    try:
        # Known before start: start() must report it before returning.
        k.create(pods_path, _pod("mp-b-0", "b"))
        _set_status(k, ns, "mp-b-0", "127.0.20.1", ready=True)
        k.create(pods_path, _pod("other-a-0", "a", pipeline="other"))  # another pipeline
        _set_status(k, ns, "other-a-0", "127.0.20.9", ready=True)
        await m.start(rec)
        assert rec.seen == [ReplicaInfo("b", "mp-b-0", "tcp://127.0.20.1:5555", "ready")]

        # joining -> ready -> draining (operator's annotation) -> gone (delete).
        k.create(pods_path, _pod("mp-a-0", "a"))  # no IP yet: not a replica
        _set_status(k, ns, "mp-a-0", "127.0.20.2", ready=False)
        await rec.wait(lambda: rec.of("mp-a-0") == ["joining"], "mp-a-0 joining")
        _set_status(k, ns, "mp-a-0", "127.0.20.2", ready=True)
        await rec.wait(lambda: rec.of("mp-a-0") == ["joining", "ready"], "mp-a-0 ready")
        k.patch(
            resource_path("v1", "pods", ns, "mp-a-0"),
            {"metadata": {"annotations": {names.ANNOTATION_DRAINING: "true"}}},
        )
        await rec.wait(lambda: rec.of("mp-a-0")[-1:] == ["draining"], "mp-a-0 draining")
        _force_delete(k, ns, "mp-a-0")
        await rec.wait(lambda: rec.of("mp-a-0")[-1:] == ["gone"], "mp-a-0 gone")
        assert rec.of("mp-a-0") == ["joining", "ready", "draining", "gone"]
        gone = [i for i in rec.seen if i.name == "mp-a-0"][-1]
        assert gone.endpoint == "tcp://127.0.20.2:5555"

        # A terminating pod (graceful delete: deletionTimestamp, no kubelet to finish it) drains.
        k.create(pods_path, _pod("mp-a-1", "a"))
        _set_status(k, ns, "mp-a-1", "127.0.20.3", ready=True)
        await rec.wait(lambda: rec.of("mp-a-1") == ["ready"], "mp-a-1 ready")
        k.delete(resource_path("v1", "pods", ns, "mp-a-1"), {"gracePeriodSeconds": 30})
        await rec.wait(lambda: rec.of("mp-a-1") == ["ready", "draining"], "mp-a-1 draining")

        # A forced watch restart relists: the same set, and nothing new is reported.
        before = sorted(m.replicas, key=lambda i: i.name)
        assert [(i.name, i.state) for i in before] == [("mp-a-1", "draining"), ("mp-b-0", "ready")]
        count, relists = len(rec.seen), m.relists
        m.resync()
        await rec.wait(lambda: m.relists == relists + 1, "relist after the forced restart")
        await asyncio.sleep(0.3)
        assert sorted(m.replicas, key=lambda i: i.name) == before
        assert len(rec.seen) == count
        # A relist does not count as a write, nor does anything else membership does.
        assert api.writes == 0
        # An independent watcher's initial list agrees.
        fresh = Recorder()
        other = KubernetesMembership(ns, PIPELINE, zmq_port=PORT, api=api)
        await other.start(fresh)
        await other.stop()
        assert sorted(fresh.seen, key=lambda i: i.name) == before

        # The watch still runs after the restart: finishing the terminating pod reports gone.
        _force_delete(k, ns, "mp-a-1")
        await rec.wait(lambda: rec.of("mp-a-1")[-1:] == ["gone"], "mp-a-1 gone")
        assert not rec.of("other-a-0")
    finally:
        # No assertion here: it would hide the failure that brought us here.
        t0 = time.monotonic()
        await m.stop()
        stop_seconds = time.monotonic() - t0
        for name in created:  # bound to a missing node: only a forced delete removes them
            _force_delete(k, ns, name)
    # The open watch runs for minutes: a stop that waited for it instead of ending it would
    # take that long. A bound far from both, so a loaded machine does not matter.
    assert stop_seconds < 30, f"stop() took {stop_seconds:.1f}s: it must end the watch"



class CuttableProxy:
    """A loopback TCP proxy to the API server that can drop every connection and refuse new
    ones: what a restarted API server or a broken network looks like to a client. TLS passes
    through untouched."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.down = False
        self.accepted = 0
        self.sent = 0  # bytes passed on to the API server
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        if self.down:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                    if dst is up_writer:
                        self.sent += len(data)
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        self.down = True
        for w in list(self._writers):
            w.close()

    def restore(self) -> None:
        self.down = False

    async def close(self) -> None:
        """Stop accepting, drop every connection and let the handlers finish."""
        if self._server is not None:
            self._server.close()
        self.cut()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()


async def test_membership_loses_no_update_while_the_api_server_is_unreachable(
    kube: Cluster, namespace: str, api: KubeApi
) -> None:
    """Every connection drops and new ones are refused (as while the API server restarts);
    meanwhile a replica appears, one is deleted and one drains. Once the server is reachable
    again the watch resumes from its last resourceVersion and reports all three."""
    k, ns = kube.kube, namespace
    pods_path = resource_path("v1", "pods", ns)
    target = urlparse(api.config.server)
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 443)
    port = await proxy.start()
    via_proxy = KubeApi(dataclasses.replace(api.config, server=f"https://127.0.0.1:{port}"))
    rec = Recorder()
    m = KubernetesMembership(ns, PIPELINE, zmq_port=PORT, api=via_proxy, backoff=(0.1, 0.5))
    created = ["mp-a-0", "mp-a-1", "mp-a-2"]
    try:
        for name, ip in (("mp-a-0", "127.0.30.1"), ("mp-a-2", "127.0.30.3")):
            k.create(pods_path, _pod(name, "a"))
            _set_status(k, ns, name, ip, ready=True)
        await m.start(rec)  # returns after the list, before the watch task has run
        listed = proxy.sent
        assert sorted((i.name, i.state) for i in rec.seen) == [
            ("mp-a-0", "ready"), ("mp-a-2", "ready")]
        await rec.wait(lambda: proxy.sent > listed, "the watch request on its way")
        proxy.cut()
        k.create(pods_path, _pod("mp-a-1", "a"))
        _set_status(k, ns, "mp-a-1", "127.0.30.2", ready=True)
        _force_delete(k, ns, "mp-a-0")
        k.patch(resource_path("v1", "pods", ns, "mp-a-2"),
                {"metadata": {"annotations": {names.ANNOTATION_DRAINING: "true"}}})
        accepted = proxy.accepted
        await rec.wait(lambda: proxy.accepted > accepted,
                       "the client retrying while the server is unreachable")
        assert len(rec.seen) == 2, "nothing can be learned while the server is unreachable"
        proxy.restore()
        await rec.wait(
            lambda: rec.of("mp-a-1") == ["ready"] and rec.of("mp-a-0")[-1:] == ["gone"]
            and rec.of("mp-a-2") == ["ready", "draining"],
            "the changes made while unreachable", timeout=15)
        assert m.relists == 1, "the watch resumed from its resourceVersion, without a relist"
    finally:
        await m.stop()
        await via_proxy.close()
        await proxy.close()
        for name in created:
            _force_delete(k, ns, name)


def _http(url: str, body: dict[str, Any] | None = None,
          timeout: float = 10) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            is_json = "json" in resp.headers.get("Content-Type", "")
            return resp.status, json.loads(raw) if is_json else raw.decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def test_orchestrator_process_routes_by_pod_membership(
    kube: Cluster, namespace: str, tmp_path: Path
) -> None:
    """`omnistage orchestrator --membership kubernetes` end to end: a real echo worker becomes
    routable when its Pod is Ready, stops being routable when the Pod is marked draining, and
    SIGTERM (twice) drains and exits 0."""
    k, ns = kube.kube, namespace
    zmq_port, api_port = free_port(), free_port()
    # The echo worker holds each request while the release file is missing (see the drain).
    release = tmp_path / "release"
    release.touch()
    worker = spawn_worker("mp-a-0", Stage(name="a", kind="echo"), port=zmq_port,
                          log_dir=tmp_path, env={HOLD_FILE_ENV: str(release)})
    manifest = {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": PIPELINE},
        "spec": {
            "orchestrator": {"api": ["generic"]},
            "stages": [{"name": "a", "kind": "echo", "finalOutput": True}],
        },
    }
    env = {key: v for key, v in os.environ.items() if key != "KUBERNETES_SERVICE_HOST"}
    env.update(KUBECONFIG=str(kube.kubeconfig), **{names.PIPELINE_ENV: json.dumps(manifest)})
    log_path = tmp_path / "orchestrator.log"
    url = f"http://127.0.0.1:{api_port}"
    proc: subprocess.Popen[bytes] | None = None

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""

    def start(port: int) -> subprocess.Popen[bytes]:
        with open(log_path, "wb") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "omnistage.cli", "orchestrator", "--namespace", ns,
                 "--host", "127.0.0.1", "--port", str(port), "--admin-port",
                 str(free_port()), "--zmq-port", str(zmq_port)],
                stdout=log, stderr=subprocess.STDOUT, env=env)

    try:
        worker.wait_ready(60)
        # free_port() is a guess: a test session running beside this one (hack/test.sh runs
        # e2e and cluster side by side) can take the port first. Only that is retried.
        for attempt in range(3):
            proc = start(api_port)
            wait_until(
                lambda p=proc, u=url: p.poll() is not None or _http(u + "/readyz")[0] == 503,
                20,
                "orchestrator up, not ready",
                on_timeout=log_tail,
            )
            if proc.poll() is None or "Address already in use" not in log_tail() or attempt == 2:
                break
            api_port = free_port()
            url = f"http://127.0.0.1:{api_port}"
        assert proc.poll() is None, log_tail()
        k.create(resource_path("v1", "pods", ns), _pod("mp-a-0", "a"))
        _set_status(k, ns, "mp-a-0", "127.0.0.1", ready=True)
        wait_until(
            lambda: _http(url + "/readyz")[0] == 200,
            10,
            "ready once the Pod is Ready",
            on_timeout=log_tail,
        )
        status, body = _http(f"{url}/v1/pipelines/{PIPELINE}/requests", {"prompt": "hello"})
        assert status == 200 and body["status"] == "ok", body
        k.patch(
            resource_path("v1", "pods", ns, "mp-a-0"),
            {"metadata": {"annotations": {names.ANNOTATION_DRAINING: "true"}}},
        )
        wait_until(
            lambda: _http(url + "/readyz")[0] == 503,
            10,
            "not ready once draining",
            on_timeout=log_tail,
        )
        k.patch(
            resource_path("v1", "pods", ns, "mp-a-0"),
            {"metadata": {"annotations": {names.ANNOTATION_DRAINING: "false"}}},
        )
        wait_until(lambda: _http(url + "/readyz")[0] == 200, 10, "ready again after the mark",
                   on_timeout=log_tail)
        # SIGTERM with a request in flight (held in stage a until the release): it is
        # drained, a second SIGTERM changes nothing.
        release.unlink()
        reply: list[tuple[int, Any]] = []
        slow = {"prompt": "drain me"}
        t = threading.Thread(target=lambda: reply.append(
            _http(f"{url}/v1/pipelines/{PIPELINE}/requests", slow, timeout=HANG_GUARD)))
        t.start()
        wait_until(lambda: _http(worker.http + "/state")[1]["in_flight"] == 1, HANG_GUARD,
                   "the request inside stage a", on_timeout=log_tail)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM received" in log_tail(), HANG_GUARD, "SIGTERM noticed",
                   on_timeout=log_tail)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM ignored" in log_tail(), HANG_GUARD, "the second SIGTERM",
                   on_timeout=log_tail)
        assert not reply and proc.poll() is None  # still draining the held request
        release.touch()
        t.join(HANG_GUARD)
        assert reply and reply[0][0] == 200 and reply[0][1]["status"] == "ok", reply
        assert proc.wait(HANG_GUARD) == 0, log_tail()
        assert "already shutting down; SIGTERM ignored" in log_tail()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if worker.proc.poll() is None:
            worker.kill()
        _force_delete(k, ns, "mp-a-0")
