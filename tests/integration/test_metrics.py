"""Metrics of a real orchestrator over real worker processes, served by the side port."""

from __future__ import annotations

import aiohttp
import pytest

from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.sideport import start_side_port
from omnistage.spec import parse_pipeline
from tests.harness.metrics import sample

pytestmark = pytest.mark.timeout(240)


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_orchestrator_and_worker_metrics_follow_requests_and_membership(
    start_worker,
) -> None:
    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "m"},
        "spec": {"stages": [{"name": "echo", "kind": "echo", "finalOutput": True}]},
    })
    workers = [start_worker("echo", name=f"echo-{i}") for i in range(2)]
    infos = [ReplicaInfo("echo", w.name, w.zmq) for w in workers]
    membership = StaticMembership(infos)
    orch = Orchestrator(pipe, membership)
    await orch.start()
    runner, url = await start_side_port("127.0.0.1", 0, readiness=orch.readiness,
                                        registry=orch.registry, state=orch.status)
    try:
        text = await _scrape(url)
        assert sample(text, "omnistage_orchestrator_replicas", stage="echo", state="ready") == 2
        assert sample(text, "omnistage_orchestrator_requests_total", status="ok") is None

        outcome = await orch.submit(PipelineRequest(prompt="hi")).outcome()
        assert outcome.status == "ok", outcome
        text = await _scrape(url)
        assert sample(text, "omnistage_orchestrator_requests_total", pipeline="m",
                      status="ok") == 1
        assert sample(text, "omnistage_orchestrator_request_seconds_count") == 1
        assert sample(text, "omnistage_orchestrator_inflight_requests") == 0
        served = outcome.children[0].outputs["echo"].replica
        worker = next(w for w in workers if w.name == served)
        replies = sample(await _scrape(worker.http), "omnistage_worker_replies_total",
                         replica=served, type="final")
        assert replies == 1

        membership.publish(ReplicaInfo("echo", workers[0].name, workers[0].zmq, "draining"))
        text = await _scrape(url)
        assert sample(text, "omnistage_orchestrator_replicas", stage="echo", state="ready") == 1
        assert sample(text, "omnistage_orchestrator_replicas", stage="echo",
                      state="draining") == 1
        async with aiohttp.ClientSession() as s, s.get(url + "/state") as resp:
            assert {r["name"]: r["state"] for r in (await resp.json())["echo"]} == {
                workers[0].name: "draining", workers[1].name: "ready"}
    finally:
        await runner.cleanup()
        await orch.stop(drain_timeout=1)
