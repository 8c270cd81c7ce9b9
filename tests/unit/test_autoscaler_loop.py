"""The operator's autoscaler loop (omni_operator.autoscaler) against a stand-in API that counts
calls: no write while the desired size holds, one scale write and one event per change, the
wake at once, no scale-down without a signal, an HPA refused. The same paths run against a real
API server in tests/cluster/test_autoscaler.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from omni_operator import builders
from omni_operator.autoscaler import (
    FIELD_MANAGER,
    Autoscaler,
    LoadUnavailable,
    StageFigures,
    hpa_targets,
    stage_figures,
)
from omni_operator.controller import Controller
from omni_operator.models import API_VERSION
from omni_operator.status import pool_status
from omnistage import kube
from omnistage.autoscaling import ANNOTATION_WAKE_REQUESTED, LOAD_PATH
from omnistage.kubeapi import ApiError
from omnistage.spec import parse_pipeline
from tests.harness.fakeload import FakeLoadServer, load_document, stage_load

Obj = dict[str, Any]
T0 = 1_800_000_000.0  # the fake clock's start (wall time, as the loop's clock is)


class CountingApi:
    """Records every call; answers the HPA list with `hpas`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.hpas: list[Obj] = []

    def writes(self, kind: str = "") -> list[tuple[str, str, Any]]:
        return [c for c in self.calls if c[0] != "GET" and kind in c[1]]

    def events(self) -> list[Obj]:
        return [c[2] for c in self.calls if c[0] == "POST" and c[1].endswith("/events")]

    async def patch(self, url: str, body: Any, kind: str = "merge", **params: Any) -> Obj:
        self.calls.append(("PATCH", url, {"body": body, **params}))
        return {"metadata": {"resourceVersion": "999"}}

    async def create(self, url: str, body: Obj, **_: Any) -> Obj:
        self.calls.append(("POST", url, body))
        return body

    async def list(self, url: str, **_: Any) -> list[Obj]:
        self.calls.append(("GET", url, None))
        return list(self.hpas)

    async def request(self, method: str, url: str, *_: Any, **kwargs: Any) -> Any:
        self.calls.append((method, url, kwargs.get("headers")))
        raise ApiError(503, {"message": "no endpoints available"}, method, url)

    async def get(self, url: str, **_: Any) -> None:
        return None

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def pool(replicas: int, *, rv: str = "1", annotations: dict[str, str] | None = None,
         **scaling: Any) -> Obj:
    return {
        "apiVersion": API_VERSION, "kind": "StagePool",
        "metadata": {"name": "p-a", "namespace": "ns", "uid": "u-a", "generation": 1,
                     "resourceVersion": rv, "annotations": annotations or {}},
        "spec": {"pipeline": "p", "replicas": replicas, "image": "x/y:1",
                 "stage": {"name": "a", "kind": "echo", "finalOutput": True,
                           "autoscaling": {"maxReplicas": 8, "periodSeconds": 15,
                                           "coolDownSeconds": 60, **scaling}}},
    }


def load(**figures: Any) -> Obj:
    return load_document({"a": stage_load(**figures)}, now=T0)


class Rig:
    """A controller (not started: no workers) with the autoscaler driven by hand."""

    def __init__(self, doc: Obj | None = None) -> None:
        self.api = CountingApi()
        self.clock = Clock()
        self.doc = doc if doc is not None else load(arrivals_per_s=2.0, service_s=1.0)
        self.reads: list[tuple[str, str]] = []
        self.controller = Controller(self.api)  # type: ignore[arg-type]
        self.scaler = Autoscaler(self.controller, clock=self.clock, read_load=self._read)
        self.controller.autoscaler = self.scaler

    async def _read(self, ns: str, pipeline: str) -> Obj:
        self.reads.append((ns, pipeline))
        if isinstance(self.doc, Exception):
            raise self.doc
        return self.doc

    def see(self, obj: Obj) -> None:
        self.controller.view.observe("StagePool", "MODIFIED", obj)

    async def step(self, at: float) -> None:
        self.clock.now = T0 + at
        await self.scaler.step()
        for _ in range(5):  # events are recorded in background tasks
            await asyncio.sleep(0)

    def scale_writes(self) -> list[tuple[str, str, Any]]:
        return self.api.writes("/scale")

    def due(self) -> float:
        """When the pool p-a is decided next, in seconds from T0."""
        return self.scaler._tracked[("ns", "p-a")].due - T0


def test_a_steady_pool_costs_one_read_per_period_and_no_write() -> None:
    async def main() -> None:
        rig = Rig()
        rig.see(pool(2))
        await rig.step(0)
        first = rig.due()  # on the pipeline's phase: half a period to one and a half away
        assert 7.5 <= first <= 22.5
        for at in (5, first - 1, first, first + 14, first + 15, first + 29.9, first + 30):
            await rig.step(at)
        assert rig.reads == [("ns", "p")] * 4  # at 0, then once per period
        assert rig.scale_writes() == [] and rig.api.events() == []
        report = rig.scaler.report(pool(2))
        assert report is not None and report.decision == "keep 2"
        assert report.inputs and report.inputs["arrivalsPerSecond"] == 2.0

    asyncio.run(main())


def test_a_change_is_one_scale_write_and_one_event() -> None:
    async def main() -> None:
        rig = Rig(load(inflight=3, arrivals_per_s=3.0, service_s=1.0))
        rig.see(pool(1))
        await rig.step(0)
        [(verb, url, call)] = rig.scale_writes()
        assert (verb, url) == ("PATCH", "/apis/omnistage.io/v1alpha1/namespaces/ns/stagepools/"
                                        "p-a/scale")
        assert call == {"body": {"spec": {"replicas": 3}}, "fieldManager": FIELD_MANAGER}
        [event] = rig.api.events()
        assert (event["type"], event["reason"]) == ("Normal", "Autoscaled")
        assert event["message"].startswith("scale up 1 -> 3: Little's law")
        # The view has not shown the write yet: the next period does not write it again.
        await rig.step(15)
        assert len(rig.scale_writes()) == 1 and len(rig.api.events()) == 1
        rig.see(pool(3, rv="2"))  # the watch delivers it
        await rig.step(30)
        assert len(rig.scale_writes()) == 1 and len(rig.api.events()) == 1
        report = rig.scaler.report(pool(3))
        assert report is not None
        assert (report.decision, report.desired_replicas, report.last_direction) == (
            "scale up 1 -> 3", 3, "Up")
        assert report.last_change_time == "2027-01-15T08:00:00Z"

    asyncio.run(main())


def test_the_status_explains_the_decision_and_says_when_the_signal_is_missing() -> None:
    async def main() -> None:
        rig = Rig(ApiError(503, {"message": "no endpoints"}, "GET", LOAD_PATH))
        rig.see(pool(4))
        await rig.step(0)
        assert rig.scale_writes() == []  # no signal: never a scale-down
        report = rig.scaler.report(pool(4))
        assert report is not None and report.signal == "Unavailable"
        status = pool_status(pool(4), [], "h", "2027-01-01T00:00:00Z", report).wire()
        cond = next(c for c in status["conditions"] if c["type"] == "Autoscaling")
        assert (cond["status"], cond["reason"]) == ("False", "SignalUnavailable")
        assert status["autoscaler"]["decision"] == "no signal: keep 4"
        # Below minReplicas it still comes up, without a signal.
        rig.see(pool(1, rv="2", minReplicas=2))
        await rig.step(rig.due())
        [(_, _, call)] = rig.scale_writes()
        assert call["body"] == {"spec": {"replicas": 2}}

    asyncio.run(main())


def test_a_wake_scales_a_pool_at_zero_at_once() -> None:
    async def main() -> None:
        rig = Rig(load(held=2))
        rig.see(pool(0, minReplicas=0))
        await rig.step(0)  # the first period: held at zero wakes it too
        assert len(rig.scale_writes()) == 1
        rig.see(pool(0, rv="2", minReplicas=0))  # say someone scaled it back to 0
        rig.doc = load()  # nothing held by the time we read
        await rig.step(1)  # not due (period 15 s): no read, no write
        assert len(rig.reads) == 1 and len(rig.scale_writes()) == 1
        woken = pool(0, rv="3", minReplicas=0,
                     annotations={ANNOTATION_WAKE_REQUESTED: "2027-01-15T08:00:02Z"})
        rig.see(woken)
        await rig.step(2)  # at once, not on the next period
        assert len(rig.reads) == 2
        [_, (_, _, call)] = rig.scale_writes()
        assert call["body"] == {"spec": {"replicas": 1}}
        assert [e["reason"] for e in rig.api.events()] == ["Woken", "Woken"]
        rig.see({**woken, "metadata": {**woken["metadata"], "resourceVersion": "4"}})
        await rig.step(3)  # the same annotation again: nothing more
        assert len(rig.scale_writes()) == 2

    asyncio.run(main())


def test_a_wake_older_than_the_scale_down_is_ignored() -> None:
    async def main() -> None:
        rig = Rig(load())
        rig.see(pool(1, minReplicas=0, idleSeconds=10))
        await rig.step(0)
        down = rig.due()
        assert down >= 10
        await rig.step(down)  # idle >= 10 s: down to 0
        assert rig.scale_writes()[-1][2]["body"] == {"spec": {"replicas": 0}}
        old = {ANNOTATION_WAKE_REQUESTED: "2027-01-15T08:00:05Z"}  # T0 + 5, before the down
        rig.see(pool(0, rv="2", minReplicas=0, idleSeconds=10, annotations=old))
        await rig.step(down + 1)
        assert len(rig.scale_writes()) == 1

    asyncio.run(main())


def test_a_pool_an_hpa_scales_is_refused_once() -> None:
    async def main() -> None:
        rig = Rig(load(inflight=5, arrivals_per_s=5.0, service_s=1.0))
        rig.api.hpas = [{"metadata": {"name": "keda-hpa-a"},
                         "spec": {"scaleTargetRef": {"apiVersion": API_VERSION,
                                                     "kind": "StagePool", "name": "p-a"}}}]
        rig.see(pool(1))
        await rig.step(0)
        await rig.step(15)
        assert rig.scale_writes() == []
        [event] = rig.api.events()
        assert (event["type"], event["reason"]) == ("Warning", "ExternalAutoscaler")
        assert "keda-hpa-a" in event["message"]
        report = rig.scaler.report(pool(1))
        status = pool_status(pool(1), [], "h", "2027-01-01T00:00:00Z", report).wire()
        cond = next(c for c in status["conditions"] if c["type"] == "Autoscaling")
        assert (cond["status"], cond["reason"]) == ("False", "ExternalAutoscaler")

    asyncio.run(main())


def test_the_cool_down_survives_a_restart_through_the_status() -> None:
    async def main() -> None:
        rig = Rig(load(inflight=3, arrivals_per_s=3.0, service_s=1.0))
        rig.see(pool(1))
        await rig.step(0)
        report = rig.scaler.report(pool(1))
        assert report is not None
        stored = pool(3, rv="2")
        stored["status"] = {"autoscaler": report.wire()}
        restarted = Rig(load(arrivals_per_s=0.5, service_s=1.0))  # asks 1: a change of direction
        restarted.see(stored)
        await restarted.step(30)  # within the 60 s cool-down of the change at 0
        assert restarted.scale_writes() == []
        await restarted.step(60)
        assert restarted.scale_writes()[0][2]["body"] == {"spec": {"replicas": 1}}

    asyncio.run(main())


def test_a_pool_without_autoscaling_is_left_alone() -> None:
    async def main() -> None:
        rig = Rig()
        fixed = pool(2)
        del fixed["spec"]["stage"]["autoscaling"]
        rig.see(fixed)
        await rig.step(0)
        assert rig.reads == [] and rig.api.calls == []

    asyncio.run(main())


def test_decoding_the_load_and_the_hpa_targets() -> None:
    figures = stage_figures(load(inflight=2, last_request_unix=5), "a")
    assert figures is not None and (figures.inflight, figures.last_request_unix) == (2, 5.0)
    assert stage_figures(load(), "b") is None and stage_figures("oops", "a") is None
    assert hpa_targets([{"metadata": {"name": "h"}, "spec": {"scaleTargetRef": {
        "kind": "Deployment", "name": "p-a"}}}]) == {}


@pytest.mark.parametrize(("scaled", "names"), [((), None), (("a",), ["p-a"]),
                                                (("a", "b"), ["p-a", "p-b"])])
def test_the_orchestrator_may_patch_only_its_autoscaled_pools(scaled: tuple[str, ...],
                                                               names: list[str] | None) -> None:
    stages = [{"name": n, "kind": "echo", "inputs": [] if n == "a" else ["a"],
               "finalOutput": n == "c",
               **({"autoscaling": {"maxReplicas": 2}} if n in scaled else {})}
              for n in ("a", "b", "c")]
    doc = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": {"stages": stages}}
    [role] = [c for c in builders.pipeline_children(doc, parse_pipeline(doc))
              if c["kind"] == "Role"]
    pools = [r for r in role["rules"] if r["resources"] == ["stagepools"]]
    if names is None:
        assert pools == []
    else:
        assert pools == [{"apiGroups": ["omnistage.io"], "resources": ["stagepools"],
                          "verbs": ["patch"], "resourceNames": names}]


def test_a_pool_at_zero_that_wakes_on_demand_is_ready() -> None:
    """minReplicas 0: at zero the stage still serves (held, then woken), so the pool (and so
    the pipeline) stays Ready; a fixed pool at zero cannot serve."""
    idle = pool_status(pool(0, minReplicas=0), [], "h", "2027-01-01T00:00:00Z").wire()
    ready = next(c for c in idle["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "IdleAtZero")
    for fixed in (pool(0, minReplicas=1), {**pool(0), "spec": {**pool(0)["spec"], "stage": {
            "name": "a", "kind": "echo"}}}):
        st = pool_status(fixed, [], "h", "2027-01-01T00:00:00Z").wire()
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero")


PIPELINE_UID = "u-p"


def _know_pipeline(controller: Controller, admin_port: int | None = None) -> dict[str, str]:
    """Pipeline p in the view (its uid is part of its admin key) and, with `admin_port`, its
    admin Service (where the autoscaler takes the port from); the header every read of its
    orchestrators must carry."""
    controller.view.pipelines[("ns", "p")] = {
        "apiVersion": API_VERSION, "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns", "uid": PIPELINE_UID}, "spec": {}}
    if admin_port is not None:
        controller.children[("Service", "ns", "p-orchestrator-admin")] = {
            "spec": {"ports": [{"name": "admin", "port": admin_port}]}}
    key = controller.pipeline_reconciler.admin.key("ns", "p", PIPELINE_UID)
    return {kube.ADMIN_KEY_HEADER: key}


def _serve(doc: Any, served: list[str] | None = None) -> FakeLoadServer:
    """A loopback orchestrator stand-in answering every GET with `doc` (keep-alive, as the
    LoadClient expects); the paths asked are appended to `served`."""
    def document(path: str) -> Any:
        if served is not None:
            served.append(path)
        return doc

    return FakeLoadServer(document=document)


def test_the_load_is_read_from_a_ready_orchestrator_pod_else_through_the_service_proxy() -> None:
    """Straight from a Ready orchestrator pod first (no load on the API server); when no pod
    answers, through the API server's service proxy (its path names the admin Service's
    admin port, and the call carries the pipeline's admin key), which is then tried first for
    that pipeline; neither: no signal, with the reason. A pipeline the view does not have:
    no key, no read."""
    served: list[str] = []
    server = _serve(load(inflight=2), served)
    proxy_path = "/api/v1/namespaces/ns/services/p-orchestrator-admin:admin/proxy/v1/load"
    try:
        async def main() -> None:
            api = CountingApi()
            controller = Controller(api)  # type: ignore[arg-type]
            scaler = controller.autoscaler
            with pytest.raises(LoadUnavailable, match=r"no pipeline ns/p in the view, so no "
                               r"admin key"):
                await scaler._read_load("ns", "p")
            assert api.calls == []
            headers = _know_pipeline(controller)
            with pytest.raises(LoadUnavailable, match=r"GET /v1/load of p-orchestrator: "
                               r"straight: .*no ready orchestrator pod.*; proxy: ApiError"):
                await scaler._read_load("ns", "p")
            assert api.calls == [("GET", proxy_path, headers)]
            _know_pipeline(controller, server.port)
            orchestrator = {"metadata": {"name": "p-orchestrator-x", "namespace": "ns"},
                            "status": {"podIP": "127.0.0.1",
                                       "conditions": [{"type": "Ready", "status": "True"}]}}
            not_ready = {"metadata": {"name": "p-orchestrator-y", "namespace": "ns"},
                         "status": {"podIP": "127.0.0.2", "conditions": []}}
            controller.pods[("ns", "p-orchestrator")] = {"y": not_ready, "x": orchestrator}
            api.calls.clear()
            for _ in range(2):  # straight, then on the kept-alive connection
                reads = await scaler._read_load("ns", "p")
                assert reads.docs == {"p-orchestrator-x": load(inflight=2)} and reads.complete
            assert served == [LOAD_PATH, LOAD_PATH] and api.calls == []  # not the proxy
            await scaler.close()

        asyncio.run(main())
    finally:
        server.close()


def test_a_pipeline_read_through_the_proxy_tries_the_proxy_first_next_time() -> None:
    """Its one ready orchestrator pod cannot be reached straight (an operator outside the pods'
    network): the service proxy answers, and is asked first from then on."""
    import socket

    async def main() -> None:
        api = CountingApi()
        answers = [json.dumps(load(inflight=1))]

        async def request(method: str, url: str, *_: Any, **kwargs: Any) -> Any:
            api.calls.append((method, url, kwargs.get("headers")))
            return answers[0]

        api.request = request  # type: ignore[method-assign]
        controller = Controller(api)  # type: ignore[arg-type]
        scaler = controller.autoscaler
        straight: list[str] = []
        real = scaler._client.get_json

        async def counted(url: str, headers: Any = None) -> Any:
            straight.append(url)
            return await real(url, headers)

        scaler._client.get_json = counted  # type: ignore[method-assign]
        with socket.socket() as refused:  # bound, never listening: the straight read fails
            refused.bind(("127.0.0.2", 0))
            headers = _know_pipeline(controller, refused.getsockname()[1])
            controller.pods[("ns", "p-orchestrator")] = {"x": {
                "metadata": {"name": "p-orchestrator-x", "namespace": "ns"},
                "status": {"podIP": "127.0.0.2",
                           "conditions": [{"type": "Ready", "status": "True"}]}}}
            reads = await scaler._read_load("ns", "p")
            assert reads.docs == {"p-orchestrator-x": load(inflight=1)} and reads.complete
            assert len(straight) == 1 and len(api.calls) == 1  # straight first, then the proxy
            reads = await scaler._read_load("ns", "p")
            assert reads.docs == {"p-orchestrator-x": load(inflight=1)}
            assert len(straight) == 1 and len(api.calls) == 2  # the proxy first now
            assert [h for _, _, h in api.calls] == [headers, headers]
            assert straight == [f"http://127.0.0.2:{refused.getsockname()[1]}{LOAD_PATH}"]
        await scaler.close()

    asyncio.run(main())


def test_re_applying_a_manifest_leaves_the_autoscalers_count_alone() -> None:
    """With autoscaling, a changed `replicas` in the pipeline only seeds new pools: once the
    autoscaler wrote the count, the operator's apply leaves it out (without autoscaling the
    same change forces it back: tests/unit/test_controller_apply.py)."""
    from omni_operator.controller import applied_intent

    async def main() -> None:
        class ApplyApi(CountingApi):
            async def apply(self, url: str, obj: Obj, **kw: Any) -> Any:
                from omnistage.kubeapi import Applied
                self.calls.append(("APPLY", url, obj))
                return Applied(obj, created=False)

        api = ApplyApi()
        c = Controller(api)  # type: ignore[arg-type]
        c.writes.event = lambda *a: None  # type: ignore[method-assign,assignment]
        owner = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
                 "metadata": {"name": "p", "namespace": "ns", "uid": "u0"}}

        def child(seed: int) -> Obj:
            doc = pool(seed)
            doc["metadata"] = {"name": "p-a", "namespace": "ns", "annotations": {
                builders.ANNOTATION_SEED_REPLICAS: str(seed)}}
            return doc

        live = applied_intent(child(1))
        live["spec"]["replicas"] = 4  # the autoscaler's
        live["metadata"].update(uid="u", resourceVersion="7", managedFields=[
            {"manager": "omnistage-operator", "operation": "Apply", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:spec": {"f:stage": {}}}},
            {"manager": FIELD_MANAGER, "operation": "Update", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:spec": {"f:replicas": {}}}, "subresource": "scale"}])
        c.pools[("ns", "p-a")] = live
        # the manifest now says replicas: 2
        await c.pipeline_reconciler.ensure_child(owner, child(2))
        [(_, _, intent)] = [call for call in api.calls if call[0] == "APPLY"]
        assert "replicas" not in intent["spec"]

    asyncio.run(main())


def test_no_growth_while_a_replica_cannot_be_placed() -> None:
    """A replica the scheduler cannot place (no node has room) bounds the pool at its size:
    more replicas would only wait too."""
    async def main() -> None:
        rig = Rig(load(inflight=4, arrivals_per_s=4.0, service_s=1.0))
        rig.see(pool(2))
        unschedulable = {"metadata": {"name": "p-a-1", "namespace": "ns"},
                         "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                                                    "reason": "Unschedulable",
                                                    "message": "0/3 nodes: Insufficient gpu"}]}}
        rig.controller.pods[("ns", "p-a")] = {"p-a-1": unschedulable}
        await rig.step(0)
        assert rig.scale_writes() == []
        report = rig.scaler.report(pool(2))
        assert report is not None and report.rule == "bounds"
        rig.controller.pods[("ns", "p-a")] = {}  # placed after all
        await rig.step(rig.due())
        assert rig.scale_writes()[0][2]["body"] == {"spec": {"replicas": 4}}

    asyncio.run(main())


def test_the_operator_reads_every_figure_the_orchestrator_writes() -> None:
    """The operator decodes /v1/load without msgspec (its image lacks the runtime extra): its
    StageFigures must keep the orchestrator's StageLoad fields, and decode what it encodes.

    Kills: a figure added to StageLoad (or renamed) that the autoscaler silently reads as 0."""
    import dataclasses

    import msgspec

    from omnistage.orchestrator.load import PipelineLoad, StageLoad

    assert [f.name for f in dataclasses.fields(StageFigures)] == list(StageLoad.__struct_fields__)
    sent = StageLoad(replicas=2, inflight=3, held=1, arrivals_per_s=1.5, service_s=0.25,
                     exec_s=0.2, queue_wait_p95_s=0.5, ttfo_p95_s=0.75, last_request_unix=7.0,
                     wake_pending=True)
    doc = json.loads(msgspec.json.encode(PipelineLoad(window_s=60.0, now=T0,
                                                      stages={"a": sent})))
    assert stage_figures(doc, "a") == StageFigures(**msgspec.structs.asdict(sent))


def test_no_autoscaler_reads_no_load_and_leaves_the_size_alone() -> None:
    """`omnistage operator --no-autoscaler` (chart value operator.autoscaler=false): the loop
    never starts, so an autoscaled pool is neither read for nor scaled; the flag parses, and the
    chart passes it only when the value is false."""
    import argparse

    from omni_operator import command

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    assert parser.parse_args(["operator"]).autoscaler is True
    assert parser.parse_args(["operator", "--no-autoscaler"]).autoscaler is False

    async def main(enabled: bool) -> int:
        api = CountingApi()
        controller = Controller(api, autoscaler=enabled)  # type: ignore[arg-type]
        reads: list[str] = []

        async def read(ns: str, pipeline: str) -> Obj:
            reads.append(pipeline)
            return load(arrivals_per_s=6.0, service_s=1.0)

        controller.autoscaler = Autoscaler(controller, read_load=read, tick=0.01)
        controller.view.observe("StagePool", "ADDED", pool(1))
        controller.start()
        try:
            for _ in range(200):  # the loop's first step comes at its first tick
                await asyncio.sleep(0.01)
                if reads:
                    break
        finally:
            await controller.stop()
        assert enabled or not api.writes("/scale")
        return len(reads)

    assert asyncio.run(main(True)) >= 1  # the same rig does read when the loop runs
    assert asyncio.run(main(False)) == 0

    from tests.harness.helm import helm_binary, render

    if helm_binary() is None:
        return

    def args(*values: str) -> list[str]:
        deploy = next(o for o in render(*values) if o["kind"] == "Deployment")
        return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])

    assert "--no-autoscaler" not in args()
    assert "--no-autoscaler" in args("--set=operator.autoscaler=false")


def test_a_fleets_reads_are_spread_over_the_period_and_bounded_in_flight() -> None:
    """500 pipelines decided in one step (created at once, or an operator restart) read their
    loads on their own phases afterwards, not in one burst a period; reads in flight at once
    are bounded; a tick before anything is due does not even scan the pools."""
    from omni_operator.autoscaler import MAX_READS_IN_FLIGHT, due_after

    period = 15.0
    dues = [due_after(T0, period, "ns", f"p{i}") - T0 for i in range(500)]
    assert all(period / 2 <= d <= 1.5 * period for d in dues)
    buckets = [sum(1 for d in dues if b <= d % period < b + 1) for b in range(int(period))]
    assert max(buckets) <= 3 * 500 / period, buckets  # roughly even, no burst
    again = [due_after(T0 + d, period, "ns", f"p{i}") - T0 - d for i, d in enumerate(dues)]
    assert all(abs(g - period) < 1e-6 for g in again)  # then exactly a period apart

    async def main() -> None:
        rig = Rig()
        in_flight = peak = 0

        async def read(ns: str, pipeline: str) -> Obj:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.001)
            in_flight -= 1
            rig.reads.append((ns, pipeline))
            return load(arrivals_per_s=2.0, service_s=1.0)

        rig.scaler.read_load = read
        for i in range(100):
            p = pool(2)
            p["metadata"].update(name=f"p{i}-a", uid=f"u{i}")
            p["spec"]["pipeline"] = f"p{i}"
            rig.see(p)
        await rig.step(0)
        assert len(rig.reads) == 100 and 1 < peak <= MAX_READS_IN_FLIGHT

        class Counting(dict):  # type: ignore[type-arg]
            scans = 0

            def items(self) -> Any:
                Counting.scans += 1
                return super().items()

        rig.controller.view.pools = Counting(rig.controller.view.pools)
        await rig.step(1)  # nothing due: no scan, no read
        assert Counting.scans == 0 and len(rig.reads) == 100
        await rig.step(1.5 * 15)  # every pipeline due by now: off the heap, still no scan
        assert Counting.scans == 0 and len(rig.reads) == 200
        late = pool(2)
        late["metadata"].update(name="late-a", uid="u-late")
        late["spec"]["pipeline"] = "late"
        rig.see(late)  # a pool not tracked yet: one scan finds it at the next tick
        await rig.step(1.5 * 15 + 1)
        assert Counting.scans == 1 and rig.reads[200:] == [("ns", "late")]
        rig.controller.view.observe("StagePool", "DELETED", late)
        await rig.step(3 * 15 + 1)  # its heap entry comes up and is dropped
        assert ("ns", "late-a") not in rig.scaler._tracked and ("ns", "late") not in rig.reads[201:]

    asyncio.run(main())


def test_one_lost_read_writes_nothing_two_say_unavailable() -> None:
    async def main() -> None:
        rig = Rig()
        rig.see(pool(2))
        await rig.step(0)
        report = rig.scaler.report(pool(2))
        assert report is not None and report.signal == "Available"
        queued = len(rig.controller.queue._queued)
        rig.doc = TimeoutError()
        await rig.step(rig.due())  # one lost read: the size and the status stay
        assert rig.scaler.report(pool(2)) is report and len(rig.controller.queue._queued) == queued
        await rig.step(rig.due())  # the second in a row: now the status says so
        report = rig.scaler.report(pool(2))
        assert report is not None and report.signal == "Unavailable"
        assert report.signal_message and report.signal_message.startswith("TimeoutError")
        assert rig.scale_writes() == []

    asyncio.run(main())


def test_every_running_orchestrator_pod_is_read_and_the_proxy_only_for_the_one_running() -> None:
    """What a question about all of a pipeline's requests reads (the pin wait of a retiring
    replica, omni_operator.drain): each Running orchestrator pod's own /v1/load, straight; one
    not Running is not asked. Where the straight read fails, the service proxy only while one
    orchestrator pod runs (it answers for a pod of its choosing: with two, it could answer
    for the wrong one). Kills: reading one pod of two, reading a pod not running, and a
    service proxy read standing for one of two pods."""
    import socket

    serve = _serve
    first = serve({"revisions": {"b": {"r": {"pinned": 1}}}})
    port = first.port
    proxied = "/api/v1/namespaces/ns/services/p-orchestrator-admin:admin/proxy/v1/load"

    def orchestrator(name: str, ip: str, phase: str = "Running") -> Obj:
        return {"metadata": {"name": name, "namespace": "ns"},
                "status": {"phase": phase, "podIP": ip}}

    async def main() -> None:
        api = CountingApi()
        answers: dict[str, Any] = {}

        async def request(method: str, url: str, *_: Any, **kwargs: Any) -> Any:
            api.calls.append((method, url, kwargs.get("headers")))
            if url not in answers:
                raise ApiError(503, {"message": "no endpoints available"}, method, url)
            return answers[url]

        api.request = request  # type: ignore[method-assign]
        controller = Controller(api)  # type: ignore[arg-type]
        scaler = controller.autoscaler
        assert await scaler.orchestrator_loads("ns", "p") == []  # none runs: nothing in flight
        _know_pipeline(controller, port)
        with socket.socket() as refused:  # 127.0.0.2 at that port: bound, never listening
            refused.bind(("127.0.0.2", port))
            pods = controller.pods[("ns", "p-orchestrator")] = {
                "x": orchestrator("p-orchestrator-x", "127.0.0.1"),
                "y": orchestrator("p-orchestrator-y", "127.0.0.2"),
                "z": orchestrator("p-orchestrator-z", "127.0.0.3", "Pending")}
            answers[proxied] = json.dumps({"revisions": {}})
            with pytest.raises(LoadUnavailable, match=r"GET /v1/load of p-orchestrator-y: "
                               r"straight: LoadReadError.*; proxy: not tried"):
                await scaler.orchestrator_loads("ns", "p")
            assert api.calls == []  # two run: the service proxy could answer for either
            del pods["x"]  # y alone runs: its read through the service proxy stands for it
            assert await scaler.orchestrator_loads("ns", "p") == [{"revisions": {}}]
            assert [url for _, url, _ in api.calls] == [proxied]
        pods["y"] = orchestrator("p-orchestrator-y", "127.0.0.1")  # reachable straight again
        pods["x"] = orchestrator("p-orchestrator-x", "127.0.0.1")
        api.calls.clear()
        del answers[proxied]
        assert await scaler.orchestrator_loads("ns", "p") == [
            {"revisions": {"b": {"r": {"pinned": 1}}}}] * 2
        assert api.calls == []
        await scaler.close()

    try:
        asyncio.run(main())
    finally:
        first.close()


# ---- every orchestrator (issue 37, defect 1) ------------------------------------------------


def test_combining_loads_adds_the_counts_and_weights_the_times_by_arrivals() -> None:
    """Little's law adds up over orchestrators (arrivals x service of the whole is the sum of
    each one's); a latency p95 errs high; the idle time is the shortest any one reports, on
    its own clock; a stage is in use if any one sends to it. Kills: taking one document, a
    plain mean of the service times, a sum of the p95s or of the replicas."""
    from omni_operator.autoscaler import combine_loads

    x = load_document({"a": stage_load(replicas=3, inflight=2, held=1, arrivals_per_s=3.0,
                                       service_s=1.0, exec_s=0.8, queue_wait_p95_s=0.2,
                                       ttfo_p95_s=0.5, last_request_unix=T0 - 30)},
                      now=T0)
    y = load_document({"a": stage_load(replicas=3, inflight=1, arrivals_per_s=1.0,
                                       service_s=2.0, exec_s=1.6, queue_wait_p95_s=0.9,
                                       ttfo_p95_s=0.1, last_request_unix=T0 - 12,
                                       wake_pending=True),
                       "b": stage_load(inflight=1, arrivals_per_s=0.5)},
                      now=T0 - 10)  # y's clock is 10 s behind: its last request was 2 s ago
    both = combine_loads([x, y])
    a = stage_figures(both, "a")
    assert a is not None
    assert (a.replicas, a.inflight, a.held, a.arrivals_per_s) == (3, 3, 1, 4.0)
    assert a.service_s == pytest.approx((3 * 1.0 + 1 * 2.0) / 4)  # 1.25, not the mean 1.5
    assert a.exec_s == pytest.approx((3 * 0.8 + 1 * 1.6) / 4)
    assert (a.queue_wait_p95_s, a.ttfo_p95_s, a.wake_pending) == (0.9, 0.5, True)
    assert both["now"] == T0 and a.last_request_unix == pytest.approx(T0 - 2)
    b = stage_figures(both, "b")  # reported by y alone: in use
    assert b is not None and (b.inflight, b.arrivals_per_s) == (1, 0.5)
    assert combine_loads([x]) is x  # one orchestrator: its document as it is
    idle = combine_loads([load(), load()])
    assert stage_figures(idle, "a") == StageFigures(replicas=1)


@contextlib.contextmanager
def _load_servers() -> Iterator[tuple[FakeLoadServer, FakeLoadServer]]:
    """Two orchestrators' GET /v1/load: x at 127.0.0.1 and y at 127.0.0.2, on one port."""
    x = FakeLoadServer("127.0.0.1")
    try:
        y = FakeLoadServer("127.0.0.2", x.port)
        try:
            yield x, y
        finally:
            y.close()
    finally:
        x.close()


def _two_orchestrators(port: int) -> tuple[CountingApi, Clock, Controller, Autoscaler]:
    """A controller whose pipeline p has ready orchestrator pods x (127.0.0.1) and y
    (127.0.0.2) on the same port, x first, and its real autoscaler (reader included)."""
    api = CountingApi()
    clock = Clock()
    controller = Controller(api)  # type: ignore[arg-type]
    scaler = Autoscaler(controller, clock=clock)
    controller.autoscaler = scaler
    _know_pipeline(controller, port)
    controller.pods[("ns", "p-orchestrator")] = {
        name: {"metadata": {"name": f"p-orchestrator-{name}", "namespace": "ns"},
               "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}
        for name, ip in (("x", "127.0.0.1"), ("y", "127.0.0.2"))}
    return api, clock, controller, scaler


def test_every_ready_orchestrator_is_read_and_its_load_counted() -> None:
    """Two orchestrators each carry half the load: the pool is sized on the sum (4, not 2),
    and a stage only y sends to is not scaled to zero however long x has been idle for it.
    Kills: reading the first ready orchestrator pod only (issue 37: pools sized on half the
    load, a stage scaled to zero while another orchestrator still sent to it)."""
    with _load_servers() as (x, y):
        x.clock = y.clock = lambda: T0
        half = stage_load(inflight=2, arrivals_per_s=2.0, service_s=1.0, exec_s=1.0)
        x.stages = {"a": half, "b": stage_load()}  # x never sends to b
        y.stages = {"a": half, "b": stage_load(inflight=1, arrivals_per_s=0.5, service_s=1.0,
                                               last_request_unix=T0)}

        async def main() -> None:
            api, clock, controller, scaler = _two_orchestrators(x.port)
            b = pool(1, minReplicas=0, idleSeconds=10, coolDownSeconds=0)
            b["metadata"].update(name="p-b", uid="u-b")
            b["spec"]["stage"]["name"] = "b"
            controller.view.observe("StagePool", "MODIFIED", pool(1))
            controller.view.observe("StagePool", "MODIFIED", b)
            for at in (0, 15, 30, 45, 60):  # past idleSeconds, a period at a time
                clock.now = T0 + at
                await scaler.step()
            sizes = {url.split("/")[-2]: call["body"]["spec"]["replicas"]
                     for _, url, call in api.writes("/scale")}
            assert sizes == {"p-a": 4}  # b stays at 1: y sends to it
            assert x.reads >= 2 and y.reads >= 2
            report = scaler.report(pool(1))
            assert report is not None and report.inputs is not None
            assert report.inputs["orchestratorsRead"] == 2
            assert report.inputs["orchestratorsUnread"] == 0
            assert report.reason is not None and report.reason.endswith(
                "read 2 orchestrators (p-orchestrator-x, p-orchestrator-y)")
            [event] = [e for e in api.events() if e["reason"] == "Autoscaled"]
            assert "read 2 orchestrators" in event["message"]
            await scaler.close()

        asyncio.run(main())


def test_a_partial_read_grows_but_never_shrinks_and_names_what_it_missed() -> None:
    """y cannot be read (HTTP 500): what x reports is a floor of the load, so the pool may
    grow on it but not shrink, nor go to zero; the decision says which orchestrator it read
    and which not, and why. Kills: deciding on the orchestrators that answered as if they
    were all, and a decision silent about the one it missed."""
    with _load_servers() as (x, y):
        y.broken = True
        x.stages = {"a": stage_load()}  # idle for x: asks for zero

        async def main() -> None:
            api, clock, controller, scaler = _two_orchestrators(x.port)
            controller.view.observe("StagePool", "MODIFIED",
                                     pool(4, minReplicas=0, idleSeconds=10, coolDownSeconds=0))
            for at in (0, 15, 30, 45):
                clock.now = T0 + at
                await scaler.step()
            assert api.writes("/scale") == []
            report = scaler.report(pool(4))
            assert report is not None and report.inputs is not None
            assert (report.desired_replicas, report.rule, report.signal) == (4, "partial",
                                                                             "Available")
            assert report.inputs["orchestratorsUnread"] == 1
            assert report.reason is not None
            assert "a partial read never scales down" in report.reason
            assert ("read 1 orchestrator (p-orchestrator-x); not read: 1 (p-orchestrator-y "
                    "(straight: LoadReadError: HTTP 500") in report.reason
            x.stages = {"a": stage_load(inflight=6, arrivals_per_s=6.0, service_s=1.0)}
            clock.now = T0 + 60
            await scaler.step()
            [(_, _, call)] = api.writes("/scale")
            assert call["body"] == {"spec": {"replicas": 6}}  # growth on a floor is safe
            await scaler.close()

        asyncio.run(main())


def test_a_credentials_failure_while_scaling_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """An exec plugin that fails at run time reaches the autoscaler as a ConfigError from its
    scale write: logged as one line with the plugin's message, no traceback (issue 37, 13)."""
    from omnistage.kubeapi import ConfigError

    async def main() -> None:
        rig = Rig(load(inflight=3, arrivals_per_s=3.0, service_s=1.0))

        async def failing(url: str, body: Any, kind: str = "merge", **params: Any) -> Obj:
            raise ConfigError("kubeconfig user 'u': exec credential plugin `get-token` "
                              "failed: exit 1: token service down")

        rig.api.patch = failing  # type: ignore[method-assign]
        rig.see(pool(1))
        with caplog.at_level("WARNING", logger="omnistage.operator"):
            await rig.step(0)

    asyncio.run(main())
    [record] = [r for r in caplog.records if "autoscaling ns/p-a failed" in r.getMessage()]
    assert "token service down" in record.getMessage()
    assert record.exc_info is None and "\n" not in record.getMessage()


# ---- the admin listener and its key (issue 43) ---------------------------------------------


class KeyedLoad:
    """An orchestrator's admin listener on loopback, as the runtime serves it: GET /v1/load
    with the pipeline's admin key in kube.ADMIN_KEY_HEADER answers the load, without it (or
    with another key) 401. Records the headers of every GET (aiohttp: the real server library
    of the orchestrator)."""

    def __init__(self, key: str, doc: Obj) -> None:
        self.key, self.doc = key, doc
        self.seen: list[dict[str, str]] = []
        self.port = 0
        self._runner: Any = None

    async def start(self, host: str = "127.0.0.1") -> KeyedLoad:
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            self.seen.append(dict(request.headers))
            if request.headers.get(kube.ADMIN_KEY_HEADER) != self.key:
                return web.json_response({"error": "invalid admin key"}, status=401)
            return web.json_response(self.doc)

        app = web.Application()
        app.router.add_get(LOAD_PATH, handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def close(self) -> None:
        await self._runner.cleanup()


def _ready_orchestrator(controller: Controller, ip: str = "127.0.0.1") -> None:
    controller.pods[("ns", "p-orchestrator")] = {"x": {
        "metadata": {"name": "p-orchestrator-x", "namespace": "ns"},
        "status": {"podIP": ip, "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]}}}


def test_every_load_read_carries_the_pipeline_s_admin_key_at_the_admin_port(
        caplog: pytest.LogCaptureFixture) -> None:
    """The autoscaler's reads and the drain's (orchestrator_loads) go to the admin port the
    admin Service names, with the key derived for the pipeline's uid: the orchestrator admits
    them. A key for another uid (the pipeline made again) is refused (401), and the refusal
    in the logs and the status never shows a key. Kills: reading the API port, reading
    without the header, a key not derived from the pipeline's identity, a key in a message."""
    async def main() -> None:
        api = CountingApi()
        controller = Controller(api)  # type: ignore[arg-type]
        scaler = controller.autoscaler
        headers = _know_pipeline(controller)
        key = headers[kube.ADMIN_KEY_HEADER]
        assert key == controller.pipeline_reconciler.admin_key("ns", "p")
        server = await KeyedLoad(key, load(inflight=2)).start()
        try:
            _know_pipeline(controller, server.port)
            _ready_orchestrator(controller)
            reads = await scaler._read_load("ns", "p")
            assert reads.docs == {"p-orchestrator-x": load(inflight=2)} and reads.complete
            assert await scaler.orchestrator_loads("ns", "p") == [load(inflight=2)]
            assert [h.get(kube.ADMIN_KEY_HEADER) for h in server.seen] == [key, key]
            assert api.calls == []  # straight, not through the proxy
            # The pipeline made again (a new uid): the old key is not the new pods' key.
            server.key = controller.pipeline_reconciler.admin.key("ns", "p", "u-new")
            with caplog.at_level("DEBUG"):
                with pytest.raises(LoadUnavailable, match="HTTP 401") as caught:
                    await scaler._read_load("ns", "p")
                _, why = await scaler._load("ns", "p")
            assert why is not None and "HTTP 401" in why
            for text in (str(caught.value), why, caplog.text):
                assert key not in text and server.key not in text
        finally:
            await server.close()
            await scaler.close()

    asyncio.run(main())


def test_the_admin_port_comes_from_the_admin_service_else_the_pipeline() -> None:
    controller = Controller(CountingApi())  # type: ignore[arg-type]
    scaler = controller.autoscaler
    assert scaler._admin_port("ns", "p") == 8001  # nothing known: the spec's default
    _know_pipeline(controller)
    controller.view.pipelines[("ns", "p")]["spec"] = {"orchestrator": {"port": 9000}}
    assert scaler._admin_port("ns", "p") == 9001  # adminPort's default: port + 1
    controller.view.pipelines[("ns", "p")]["spec"] = {"orchestrator": {"adminPort": 9100}}
    assert scaler._admin_port("ns", "p") == 9100
    controller.children[("Service", "ns", "p-orchestrator-admin")] = {
        "spec": {"ports": [{"name": "admin", "port": 9200}]}}
    assert scaler._admin_port("ns", "p") == 9200
    # The public Service's port is never taken for it.
    controller.children[("Service", "ns", "p-orchestrator")] = {
        "spec": {"ports": [{"name": "http", "port": 8000}]}}
    del controller.children[("Service", "ns", "p-orchestrator-admin")]
    assert scaler._admin_port("ns", "p") == 9100


def test_the_test_hook_sends_the_key_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """OMNISTAGE_AUTOSCALER_LOAD_URL (cluster tests, benches): the same header, when the
    view has the pipeline; without it the hook still reads (a fake needs no key)."""
    from omni_operator.autoscaler import LOAD_URL_ENV
    from omni_operator.loadclient import LoadReadError

    async def main() -> None:
        controller = Controller(CountingApi())  # type: ignore[arg-type]
        scaler = controller.autoscaler
        key = _know_pipeline(controller)[kube.ADMIN_KEY_HEADER]
        server = await KeyedLoad(key, load(inflight=1)).start()
        try:
            monkeypatch.setenv(LOAD_URL_ENV, f"http://127.0.0.1:{server.port}{LOAD_PATH}"
                               "?ns={namespace}&p={pipeline}")
            reads = await scaler._read_load("ns", "p")
            assert reads.docs == {"p-orchestrator": load(inflight=1)}
            assert await scaler.orchestrator_loads("ns", "p") == [load(inflight=1)]
            assert [h.get(kube.ADMIN_KEY_HEADER) for h in server.seen] == [key, key]
            with pytest.raises(LoadReadError, match="HTTP 401"):  # q: unknown, no header
                await scaler._read_load("ns", "q")
            assert kube.ADMIN_KEY_HEADER not in server.seen[-1]
        finally:
            await server.close()
            await scaler.close()

    asyncio.run(main())
