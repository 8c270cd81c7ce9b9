"""Kubernetes membership without a cluster: the pod -> replica mapping, the cache diffing, and the
watcher task's list/watch/410/stop behaviour against a scripted loopback API server, plus the CLI
glue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from omnistage import kube
from omnistage.kubeapi import ApiError, KubeApi, KubeConfig
from omnistage.orchestrator.k8s_membership import (
    KubernetesMembership,
    Tracked,
    apply_pod,
    relist_changes,
    replica_from_pod,
)
from omnistage.orchestrator.main import (
    UsageError,
    make_membership,
    parse_replica,
    read_pipeline,
    serve_orchestrator,
)
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership

PORT = 5555


def pod(
    name: str = "p-a-0",
    stage: str | None = "a",
    ip: str | None = "127.0.0.2",
    ready: bool | None = True,
    *,
    uid: str | None = None,
    phase: str = "Running",
    deleting: bool = False,
    draining: str | None = None,
    rv: str = "1",
) -> dict[str, Any]:
    labels = {kube.LABEL_PIPELINE: "p", kube.LABEL_COMPONENT: "stage"}
    if stage is not None:
        labels[kube.LABEL_STAGE] = stage
    meta: dict[str, Any] = {"name": name, "uid": uid or f"uid-{name}", "labels": labels,
                            "resourceVersion": rv}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if draining is not None:
        meta["annotations"] = {kube.ANNOTATION_DRAINING: draining}
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    if ready is not None:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "True"},
            {"type": kube.READINESS_GATE, "status": "True" if ready else "False"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]
    return {"metadata": meta, "status": status}


def ep(ip: str = "127.0.0.2") -> str:
    return f"tcp://{ip}:{PORT}"


# ---- replica_from_pod ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "deleted", "state"),
    [
        ({}, False, "ready"),
        ({"ready": False}, False, "joining"),
        ({"ready": None}, False, "joining"),  # no conditions yet
        ({"ip": None}, False, None),  # not reachable yet: not a replica
        ({"ip": None, "ready": False}, False, None),
        ({"deleting": True}, False, "draining"),  # terminating: finish bound work only
        ({"deleting": True, "ready": False}, False, "draining"),
        ({"draining": "true"}, False, "draining"),
        # One spelling, the operator's: its readiness gate and retirement read the mark alike.
        ({"draining": "True"}, False, "ready"),
        ({"draining": "false"}, False, "ready"),
        ({"draining": "true", "ready": False}, False, "draining"),
        ({}, True, "gone"),
        ({"ip": None}, True, "gone"),
        ({"phase": "Succeeded"}, False, "gone"),
        ({"phase": "Failed", "ready": False}, False, "gone"),
        ({"phase": "Pending", "ready": False}, False, "joining"),
        ({"stage": None}, False, None),  # not one of ours
    ],
)
def test_replica_from_pod_truth_table(
    kwargs: dict[str, Any], deleted: bool, state: str | None
) -> None:
    info = replica_from_pod(pod(**kwargs), PORT, deleted=deleted)
    if state is None:
        assert info is None
        return
    assert info is not None
    assert (info.stage, info.name, info.state) == ("a", "p-a-0", state)
    expected_ep = ep() if kwargs.get("ip", "x") else ""
    assert info.endpoint == expected_ep
    assert info.routable == (state == "ready")


def test_replica_from_pod_port_and_ipv6() -> None:
    assert replica_from_pod(pod(ip="127.9.8.7"), 7000).endpoint == "tcp://127.9.8.7:7000"  # type: ignore[union-attr]
    assert replica_from_pod(pod(ip="fd00::5"), 7000).endpoint == "tcp://[fd00::5]:7000"  # type: ignore[union-attr]


def test_replica_from_pod_tolerates_sparse_objects() -> None:
    assert replica_from_pod({}, PORT) is None
    assert replica_from_pod({"metadata": {"name": "x"}}, PORT) is None
    bare = {"metadata": {"name": "x", "labels": {kube.LABEL_STAGE: "s"}},
            "status": {"podIP": "127.0.0.9"}}
    assert replica_from_pod(bare, PORT) == ReplicaInfo("s", "x", ep("127.0.0.9"), "joining")


def test_replica_from_pod_carries_its_curve_generation(caplog: pytest.LogCaptureFixture) -> None:
    """The pod's omnistage.io/curve-generation annotation (the operator's, rotation) names
    the key generation its worker holds; absent: None (the orchestrator's own generation); not
    an integer >= 0: None, warned once per pod and value however often the pod is seen."""

    def annotated(value: str | None, name: str = "p-a-0") -> dict[str, Any]:
        obj = pod(name)
        if value is not None:
            obj["metadata"]["annotations"] = {kube.ANNOTATION_CURVE_GENERATION: value}
        return obj

    assert kube.ANNOTATION_CURVE_GENERATION == "omnistage.io/curve-generation"
    assert replica_from_pod(annotated(None), PORT).curve_generation is None  # type: ignore[union-attr]
    assert replica_from_pod(annotated("0"), PORT).curve_generation == 0  # type: ignore[union-attr]
    assert replica_from_pod(annotated("3"), PORT).curve_generation == 3  # type: ignore[union-attr]
    gone = replica_from_pod(annotated("2"), PORT, deleted=True)
    assert gone is not None and gone.state == "gone" and gone.curve_generation == 2
    caplog.set_level(logging.WARNING, logger="omnistage.orchestrator.k8s_membership")
    for _ in range(3):
        for bad in ("one", "-1", "1.5"):
            assert replica_from_pod(annotated(bad, "p-a-9"), PORT).curve_generation is None  # type: ignore[union-attr]
    said = [r.getMessage() for r in caplog.records if "curve-generation" in r.getMessage()]
    assert len(said) == 3, said
    assert all(m.startswith("pod p-a-9: annotation omnistage.io/curve-generation=") for m in said)
    # A change of generation on the same pod is a change to report.
    known: dict[str, Tracked] = {}
    assert apply_pod(known, annotated("0"), PORT)[0].curve_generation == 0
    assert [i.curve_generation for i in apply_pod(known, annotated("1"), PORT)] == [1]


# ---- the cache: apply_pod and relist_changes -------------------------------------------------


def test_apply_pod_reports_only_changes() -> None:
    known: dict[str, Tracked] = {}
    assert apply_pod(known, pod(ip=None, ready=False), PORT) == []  # no IP yet
    assert apply_pod(known, pod(ready=False), PORT) == [ReplicaInfo("a", "p-a-0", ep(), "joining")]
    assert apply_pod(known, pod(ready=False, rv="2"), PORT) == []  # nothing routing-relevant
    assert apply_pod(known, pod(), PORT) == [ReplicaInfo("a", "p-a-0", ep(), "ready")]
    assert apply_pod(known, pod(draining="true"), PORT) == [
        ReplicaInfo("a", "p-a-0", ep(), "draining")]
    assert apply_pod(known, pod(draining="true"), PORT, deleted=True) == [
        ReplicaInfo("a", "p-a-0", ep(), "gone")]
    assert known == {}
    assert apply_pod(known, pod(), PORT, deleted=True) == []  # already gone: no repeat


def test_apply_pod_replacement_with_same_name() -> None:
    known: dict[str, Tracked] = {}
    apply_pod(known, pod(uid="one"), PORT)
    # The replacement reuses the name; even with the same IP the old instance is reported gone.
    assert apply_pod(known, pod(uid="two", ready=False), PORT) == [
        ReplicaInfo("a", "p-a-0", ep(), "gone"),
        ReplicaInfo("a", "p-a-0", ep(), "joining"),
    ]
    # A late DELETED for the old instance does not remove the new one.
    assert apply_pod(known, pod(uid="one"), PORT, deleted=True) == []
    assert known["p-a-0"].uid == "two"
    # Same uid, new IP (what a sandbox restart looks like): the new endpoint is reported.
    assert apply_pod(known, pod(uid="two", ip="127.0.0.7"), PORT) == [
        ReplicaInfo("a", "p-a-0", ep("127.0.0.7"), "ready")]


def test_apply_pod_finished_pod_is_gone_and_forgotten() -> None:
    known: dict[str, Tracked] = {}
    apply_pod(known, pod(), PORT)
    assert apply_pod(known, pod(phase="Failed"), PORT) == [ReplicaInfo("a", "p-a-0", ep(), "gone")]
    assert known == {}


def test_relist_diffs_against_known() -> None:
    known: dict[str, Tracked] = {}
    first = relist_changes(known, [pod("x-0"), pod("x-1", ready=False), pod("x-2", ip=None)], PORT)
    assert [(i.name, i.state) for i in first] == [("x-0", "ready"), ("x-1", "joining")]
    # While the watch was down: x-0 vanished, x-1 became ready, x-3 appeared, x-4 was replaced.
    apply_pod(known, pod("x-4", uid="old"), PORT)
    second = relist_changes(
        known, [pod("x-1"), pod("x-2", ip=None), pod("x-3"), pod("x-4", uid="new")], PORT)
    assert [(i.name, i.state) for i in second] == [
        ("x-1", "ready"), ("x-3", "ready"), ("x-4", "gone"), ("x-4", "ready"), ("x-0", "gone")]
    assert sorted(known) == ["x-1", "x-3", "x-4"]
    # An identical relist reports nothing.
    assert relist_changes(known, [pod("x-1"), pod("x-3"), pod("x-4", uid="new")], PORT) == []
    # A pod that lost its IP (replaced before the new one got one) counts as gone.
    assert [(i.name, i.state) for i in relist_changes(
        known, [pod("x-1", uid="again", ip=None), pod("x-3"), pod("x-4", uid="new")], PORT)] == [
        ("x-1", "gone")]
    assert sorted(relist_changes(known, [], PORT), key=lambda i: i.name) == [
        ReplicaInfo("a", "x-3", ep(), "gone"), ReplicaInfo("a", "x-4", ep(), "gone")]
    assert known == {}


# ---- the watcher task against a fake API server -----------------------------------------------


class FakeApiServer:
    """A loopback HTTP server answering the Pod list and watch calls from a script, so the
    real client code (HTTP, streaming, 410, backoff) runs. An exhausted watch script keeps the
    stream open until the client goes away."""

    def __init__(self, lists: list[list[dict[str, Any]]],
                 watches: list[list[dict[str, Any]] | int]) -> None:
        self.lists = lists
        self.watches = watches
        self.calls: list[dict[str, str]] = []
        self.open_watches = 0
        self.closed_watches = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(dict(request.query))
        if request.query.get("watch") != "true":
            if not self.lists:
                return web.json_response({"kind": "Status", "code": 500}, status=500)
            items = self.lists.pop(0)
            rv = str(len(self.calls))
            return web.json_response({"metadata": {"resourceVersion": rv}, "items": items})
        step = self.watches.pop(0) if self.watches else None
        if isinstance(step, int):
            return web.json_response({"kind": "Status", "code": step, "message": "scripted"},
                                     status=step)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if step is None:
            self.open_watches += 1
            try:  # blank keep-alive lines (the client skips them) until the client goes away
                for _ in range(3000):
                    await resp.write(b"\n")
                    await asyncio.sleep(0.01)
            except (ConnectionError, RuntimeError):
                pass
            self.closed_watches += 1
            return resp
        for line in step:
            text = (json.dumps(line) + "\n").encode()
            mid = len(text) // 2  # chunk boundaries fall mid-line
            await resp.write(text[:mid])
            await asyncio.sleep(0.005)
            await resp.write(text[mid:])
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def fake_server(lists: list[list[dict[str, Any]]],
                      watches: list[list[dict[str, Any]] | int]) -> AsyncIterator[
                          tuple[FakeApiServer, KubeApi]]:
    server = FakeApiServer(lists, watches)
    api = KubeApi(KubeConfig(server=await server.start()))
    try:
        yield server, api
    finally:
        await api.close()
        await server.stop()


def ev(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_watcher_lists_watches_relists_and_stops() -> None:
    expired = ev("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})
    async with fake_server(
        lists=[[pod("x-0", ready=False), pod("x-1")], [pod("x-0", draining="true"), pod("x-2")]],
        watches=[
            [ev("MODIFIED", pod("x-0")), ev("BOOKMARK", {"metadata": {"resourceVersion": "9"}})],
            [ev("ADDED", pod("x-1", rv="10"))],  # no change: not reported again
            500,  # a reconnect with backoff, same resourceVersion
            [expired],  # 410 inside the stream: relist, diffed against the cache
        ],
    ) as (server, api):
        seen: list[ReplicaInfo] = []
        m = KubernetesMembership("ns", "p", api=api, backoff=(0.01, 0.05))
        await m.start(seen.append)
        # start() reports what the first list found before returning.
        assert [(i.name, i.state) for i in seen] == [("x-0", "joining"), ("x-1", "ready")]
        await until(lambda: server.open_watches == 1)
        assert [(i.name, i.state) for i in seen[2:]] == [
            ("x-0", "ready"), ("x-0", "draining"), ("x-2", "ready"), ("x-1", "gone")]
        assert m.relists == 2
        assert sorted(i.name for i in m.replicas) == ["x-0", "x-2"]
        assert all(c["labelSelector"] == kube.stage_selector("p") for c in server.calls)
        watches = [c for c in server.calls if c.get("watch")]
        assert [c["resourceVersion"] for c in watches[:4]] == ["1", "9", "10", "10"]
        assert watches[0]["allowWatchBookmarks"] == "true"
        assert watches[-1]["resourceVersion"] == "6"  # from the relist after the 410
        # The fake watch never ends by itself: a stop that waited for it would hang here.
        await asyncio.wait_for(m.stop(), 30)
        await until(lambda: server.closed_watches == 1)
        assert api.writes == 0


async def test_resync_relists_and_reports_nothing_new() -> None:
    async with fake_server(lists=[[pod("x-0")], [pod("x-0")], [pod("x-0"), pod("x-1")]],
                           watches=[]) as (server, api):
        seen: list[ReplicaInfo] = []
        m = KubernetesMembership("ns", "p", api=api, backoff=(0.01, 0.05))
        await m.start(seen.append)
        await until(lambda: server.open_watches == 1)
        m.resync()
        await until(lambda: server.open_watches == 2 and m.relists == 2)
        assert [(i.name, i.state) for i in seen] == [("x-0", "ready")]
        m.resync()
        await until(lambda: len(seen) == 2)
        assert seen[1] == ReplicaInfo("a", "x-1", ep(), "ready")
        await m.stop()


async def test_initial_list_retries_then_fails() -> None:
    async with fake_server(lists=[], watches=[]) as (server, api):
        # 1 s of retries: three lists take milliseconds, even on a loaded machine.
        m = KubernetesMembership("ns", "p", api=api, backoff=(0.01, 0.02), start_timeout=1.0)
        with pytest.raises(ApiError) as failed:
            await m.start(lambda info: None)
        assert failed.value.status == 500
        assert len(server.calls) >= 3
        await m.stop()


async def test_no_reports_after_stop() -> None:
    async with fake_server(lists=[[pod("x-0")]], watches=[]) as (server, api):
        seen: list[ReplicaInfo] = []
        m = KubernetesMembership("ns", "p", api=api)
        await m.start(seen.append)
        await until(lambda: server.open_watches == 1)
        await m.stop()
        m._emit([ReplicaInfo("a", "late", ep(), "ready")])  # a straggling batch
        assert [i.name for i in seen] == ["x-0"]


async def test_watch_start_410_relists_at_once() -> None:
    async with fake_server(lists=[[pod("x-0")], [pod("x-1")]], watches=[410]) as (_, api):
        seen: list[ReplicaInfo] = []
        m = KubernetesMembership("ns", "p", api=api, backoff=(60.0, 60.0))  # no backoff on 410
        await m.start(seen.append)
        await until(lambda: len(seen) == 3, 30)  # hang guard: far below the 60 s backoff
        assert [(i.name, i.state) for i in seen] == [("x-0", "ready"), ("x-1", "ready"),
                                                     ("x-0", "gone")]
        await m.stop()


# ---- CLI glue --------------------------------------------------------------------------------

MANIFEST = {
    "apiVersion": "omnistage.io/v1alpha1",
    "kind": "OmniPipeline",
    "metadata": {"name": "echo"},
    "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]},
}


def test_parse_replica() -> None:
    assert parse_replica("a=echo-a-0@tcp://127.0.0.1:5555") == ReplicaInfo(
        "a", "echo-a-0", "tcp://127.0.0.1:5555", "ready")
    for bad in ["a=b", "echo-a-0@tcp://x:1", "a=@tcp://x:1", "a=b@http://x:1"]:
        with pytest.raises(UsageError):
            parse_replica(bad)


def test_read_pipeline_from_env() -> None:
    pipeline = read_pipeline(None, {kube.PIPELINE_ENV: json.dumps(MANIFEST)})
    assert pipeline.metadata.name == "echo"
    with pytest.raises(UsageError, match="no pipeline"):
        read_pipeline(None, {})
    with pytest.raises(UsageError, match="not valid JSON"):
        read_pipeline(None, {kube.PIPELINE_ENV: "{"})


def test_make_membership() -> None:
    pipeline = read_pipeline(None, {kube.PIPELINE_ENV: json.dumps(MANIFEST)})
    static = make_membership("static", pipeline, replicas=["a=r0@tcp://127.0.0.1:1"])
    assert isinstance(static, StaticMembership)
    assert [r.name for r in static.replicas] == ["r0"]
    k8s = make_membership("kubernetes", pipeline, namespace="ns", zmq_port=6000)
    assert isinstance(k8s, KubernetesMembership)
    assert (k8s.namespace, k8s.selector, k8s.zmq_port) == (
        "ns", kube.stage_selector("echo"), 6000)
    with pytest.raises(UsageError):
        make_membership("kubernetes", pipeline, replicas=["a=r0@tcp://127.0.0.1:1"])


async def test_serve_orchestrator_starts_and_drains_on_stop() -> None:
    pipeline = read_pipeline(None, {kube.PIPELINE_ENV: json.dumps(MANIFEST)})
    before = signal.getsignal(signal.SIGINT)
    stop = asyncio.Event()
    urls: list[str] = []
    task = asyncio.create_task(serve_orchestrator(
        pipeline, StaticMembership(), "127.0.0.1", 0, stop=stop, on_ready=urls.append,
        shutdown_delay=0))
    await until(lambda: bool(urls) or task.done(), 10)
    assert urls and urls[0].startswith("http://127.0.0.1:")
    stop.set()
    assert await asyncio.wait_for(task, 10) == 0
    assert signal.getsignal(signal.SIGINT) is before  # an embedding program keeps its handler


def test_cli_usage_errors(monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from omnistage.cli import main

    monkeypatch.delenv(kube.PIPELINE_ENV, raising=False)
    assert main(["orchestrator", "--membership", "static"]) == 2
    assert "no pipeline" in capsys.readouterr().err
    monkeypatch.setenv(kube.PIPELINE_ENV, json.dumps(MANIFEST))
    assert main(["orchestrator", "--replica", "a=r@tcp://127.0.0.1:1"]) == 2
    assert "only for --membership static" in capsys.readouterr().err
    assert main(["orchestrator", "--membership", "static", "--replica", "bad"]) == 2
    bad = dict(MANIFEST, spec={"stages": []})
    monkeypatch.setenv(kube.PIPELINE_ENV, json.dumps(bad))
    assert main(["orchestrator", "--membership", "static"]) == 2
    assert "invalid pipeline" in capsys.readouterr().err


def test_the_orchestrator_command_refuses_a_bad_key_generation(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """$OMNISTAGE_CURVE_GENERATION names the pair of the mounted Secret the orchestrator holds:
    one that is not an integer, or whose files are not there, is refused at start (exit 2)."""
    from omnistage import curve_keys
    from omnistage.cli import main

    monkeypatch.setenv(kube.PIPELINE_ENV, json.dumps(MANIFEST))
    monkeypatch.setenv(curve_keys.CURVE_KEYS_ENV, str(curve_keys.write(curve_keys.generate(),
                                                                       tmp_path / "curve")))
    monkeypatch.setenv(curve_keys.CURVE_GENERATION_ENV, "next")
    assert main(["orchestrator", "--membership", "static"]) == 2
    assert "$OMNISTAGE_CURVE_GENERATION: a key generation is an integer >= 0, not 'next'" in \
        capsys.readouterr().err
    monkeypatch.setenv(curve_keys.CURVE_GENERATION_ENV, "1")
    assert main(["orchestrator", "--membership", "static"]) == 2
    assert "public-1: no such file" in capsys.readouterr().err
