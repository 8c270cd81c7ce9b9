"""The operator's autoscaler loop (omni_operator.autoscaler) against a stand-in API that counts
calls: no write while the desired size holds, one scale write and one event per change, the
wake at once, no scale-down without a signal, an HPA refused. The same paths run against a real
API server in tests/cluster/test_autoscaler.py."""

from __future__ import annotations

import asyncio
import json
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
from omnistage.autoscaling import ANNOTATION_WAKE_REQUESTED, LOAD_PATH
from omnistage.kubeapi import ApiError
from omnistage.spec import parse_pipeline

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

    async def request(self, method: str, url: str, *_: Any, **__: Any) -> Any:
        self.calls.append((method, url, None))
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
    entry = {"replicas": 1, "inflight": 0, "held": 0, "arrivals_per_s": 0.0, "service_s": 0.0,
             "queue_wait_p95_s": 0.0, "ttfo_p95_s": 0.0, "last_request_unix": None,
             "wake_pending": False, **figures}
    return {"window_s": 60.0, "now": T0, "stages": {"a": entry}}


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
        self.controller.observe("StagePool", "MODIFIED", obj)

    async def step(self, at: float) -> None:
        self.clock.now = T0 + at
        await self.scaler.step()
        for _ in range(5):  # events are recorded in background tasks
            await asyncio.sleep(0)

    def scale_writes(self) -> list[tuple[str, str, Any]]:
        return self.api.writes("/scale")


def test_a_steady_pool_costs_one_read_per_period_and_no_write() -> None:
    async def main() -> None:
        rig = Rig()
        rig.see(pool(2))
        for at in (0, 5, 14, 15, 29, 30, 45):
            await rig.step(at)
        assert rig.reads == [("ns", "p")] * 4  # at 0, 15, 30, 45: once per period
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
        await rig.step(15)
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
        await rig.step(15)  # idle 15 s >= 10 s: down to 0
        assert rig.scale_writes()[-1][2]["body"] == {"spec": {"replicas": 0}}
        old = {ANNOTATION_WAKE_REQUESTED: "2027-01-15T08:00:05Z"}  # T0 + 5, before the down
        rig.see(pool(0, rv="2", minReplicas=0, idleSeconds=10, annotations=old))
        await rig.step(16)
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


def test_the_load_is_read_through_the_service_proxy_else_from_a_ready_orchestrator_pod() -> None:
    """The proxy first (its path names the orchestrator Service's http port); when it refuses
    (loopback endpoints with the local pod runner), a Ready orchestrator pod straight; neither:
    no signal, with the reason."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps(load(inflight=2)).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            assert self.path == LOAD_PATH
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        async def main() -> None:
            api = CountingApi()
            controller = Controller(api)  # type: ignore[arg-type]
            scaler = controller.autoscaler
            with pytest.raises(LoadUnavailable, match="GET /v1/load of p-orchestrator"):
                await scaler._read_load("ns", "p")
            assert api.calls == [("GET", "/api/v1/namespaces/ns/services/p-orchestrator:http/"
                                         "proxy/v1/load", None)]
            controller.children[("Service", "ns", "p-orchestrator")] = {
                "spec": {"ports": [{"name": "http", "port": server.server_address[1]}]}}
            orchestrator = {"metadata": {"name": "p-orchestrator-x", "namespace": "ns"},
                            "status": {"podIP": "127.0.0.1",
                                       "conditions": [{"type": "Ready", "status": "True"}]}}
            not_ready = {"metadata": {"name": "p-orchestrator-y", "namespace": "ns"},
                         "status": {"podIP": "127.0.0.2", "conditions": []}}
            controller.pods[("ns", "p-orchestrator")] = {"y": not_ready, "x": orchestrator}
            assert await scaler._read_load("ns", "p") == load(inflight=2)

        asyncio.run(main())
    finally:
        server.shutdown()


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
        c._event = lambda *a: None  # type: ignore[method-assign,assignment]
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
        await c._ensure_child(owner, child(2))  # the manifest now says replicas: 2
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
        await rig.step(15)
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
