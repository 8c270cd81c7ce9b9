"""The load signal through the real engine: GET /v1/load and the omnistage_stage_* gauges,
over real worker processes and real ZMQ."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.http_api import serve_http
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.spec import parse_pipeline
from tests.harness.metrics import sample
from tests.harness.waiting import until

pytestmark = pytest.mark.timeout(240)

DELAY_S = 0.3  # stage b's echoDelayMs: its service time and time to first output


def two_stage() -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "loadp"},
        "spec": {"orchestrator": {"api": ["generic"]}, "stages": [
            {"name": "a", "kind": "echo"},
            {"name": "b", "kind": "echo", "inputs": ["a"], "finalOutput": True,
             "engine": {"echoDelayMs": int(DELAY_S * 1000)}},
        ]},
    })


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json() if resp.content_type == "application/json" else await resp.text()


async def test_load_and_metrics_follow_real_requests(start_worker, tmp_path: Path) -> None:
    pipe = two_stage()
    release = tmp_path / "release"
    wa = start_worker(pipe.spec.stage("a"), name="loadp-a-0")
    wb = start_worker(pipe.spec.stage("b"), name="loadp-b-0", env={HOLD_FILE_ENV: str(release)})
    orch = Orchestrator(pipe, StaticMembership([ReplicaInfo("a", wa.name, wa.zmq),
                                                ReplicaInfo("b", wb.name, wb.zmq)]))
    await orch.start()
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    admin, admin_url = await serve_http(orch, "127.0.0.1", 0, listener="admin")
    requests_url = f"{url}/v1/pipelines/loadp/requests"
    try:
        async with aiohttp.ClientSession() as s:
            doc = await _get(s, admin_url + "/openapi.json")
            assert "/v1/load" in doc["paths"]
            idle = await _get(s, admin_url + "/v1/load")
            assert idle["window_s"] == 60.0
            assert idle["stages"]["b"] == {
                "replicas": 1, "inflight": 0, "held": 0, "arrivals_per_s": 0.0,
                "service_s": 0.0, "exec_s": 0.0, "queue_wait_p95_s": 0.0, "ttfo_p95_s": 0.0,
                "last_request_unix": None, "wake_pending": False}

            # One request held in stage b: the load shows it in flight there, not in a.
            before = time.time()
            first = asyncio.ensure_future(s.post(requests_url, json={"prompt": "x"}))
            await until(lambda: any(r.inflight for r in orch.pools["b"].replicas.values()),
                        "the request to reach stage b")
            busy = await _get(s, admin_url + "/v1/load")
            assert busy["stages"]["b"]["inflight"] == 1
            assert busy["stages"]["a"]["inflight"] == 0
            assert busy["stages"]["a"]["service_s"] > 0  # a finished it
            assert before <= busy["stages"]["b"]["last_request_unix"] <= time.time()
            text = await _get(s, admin_url + "/metrics")
            assert sample(text, "omnistage_stage_inflight", pipeline="loadp", stage="b") == 1
            release.touch()
            async with await first as resp:
                assert resp.status == 200, await resp.text()
            for i in range(3):
                async with s.post(requests_url, json={"prompt": f"p{i}"}) as resp:
                    assert resp.status == 200, await resp.text()

            load = await _get(s, admin_url + "/v1/load")
            text = await _get(s, admin_url + "/metrics")
        b = load["stages"]["b"]
        assert b["inflight"] == 0 and b["held"] == 0 and b["replicas"] == 1
        # 4 tasks needed b, within the tracker's first minute: 4 per its age (at least 1 s).
        age = time.monotonic() - orch.load_tracker.started
        assert 4 / max(age, 1.0) <= b["arrivals_per_s"] <= 4.0
        # Each of b's tasks takes its delay at least (the first also waited for the release).
        assert b["service_s"] >= DELAY_S
        assert DELAY_S <= b["ttfo_p95_s"] <= b["service_s"] * 4
        assert DELAY_S <= b["exec_s"] <= b["service_s"]  # fed at the final reply
        assert b["queue_wait_p95_s"] < DELAY_S  # nothing waited for a replica
        for name, field in (("omnistage_stage_service_seconds", "service_s"),
                            ("omnistage_stage_exec_seconds", "exec_s"),
                            ("omnistage_stage_ttfo_p95_seconds", "ttfo_p95_s"),
                            ("omnistage_stage_queue_wait_p95_seconds", "queue_wait_p95_s"),
                            ("omnistage_stage_held", "held"),
                            ("omnistage_stage_inflight", "inflight")):
            assert sample(text, name, pipeline="loadp", stage="b") == pytest.approx(b[field]), name
        assert 0 < sample(text, "omnistage_stage_arrivals_per_second", stage="b") <= 4.0
        assert json.loads(json.dumps(load))  # plain JSON, as the operator decodes it
    finally:
        await runner.cleanup()
        await admin.cleanup()
        await orch.stop(drain_timeout=1)
