"""The worker's admission queue in the load signal, through the real engine: a replica that
runs one request at a time reports how long each waited in its queue (protocol
`queue_wait_s`), the orchestrator adds it to its own wait, and a `queueWaitSeconds` target
grows the pool. Before the field, that wait counted as service time and the target saw ~0."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from omnistage import protocol as p
from omnistage.autoscaling import AutoscalerState, decide
from omnistage.kube import LOAD_PATH
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.http_api import serve_http
from omnistage.orchestrator.load import StageLoad
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.spec import Autoscaling, parse_pipeline

pytestmark = pytest.mark.timeout(240)

DELAY_S = 0.8  # the echo's service time: each request queued behind k others waits k x this
TARGET_S = DELAY_S / 2


def one_stage() -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "queuep"},
        "spec": {"orchestrator": {"api": ["generic"]}, "stages": [
            {"name": "q", "kind": "echo", "finalOutput": True,
             "engine": {"echoDelayMs": int(DELAY_S * 1000)},
             "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                             "target": {"queueWaitSeconds": TARGET_S}}},
        ]},
    })


async def test_worker_queue_wait_reaches_the_signal_and_the_target(start_worker) -> None:
    pipe = one_stage()
    w = start_worker(pipe.spec.stage("q"), name="queuep-q-0")
    orch = Orchestrator(pipe, StaticMembership([ReplicaInfo("q", w.name, w.zmq)]))
    await orch.start()
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    admin, admin_url = await serve_http(orch, "127.0.0.1", 0, listener="admin")
    try:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> None:
                async with s.post(f"{url}/v1/pipelines/queuep/requests",
                                  json={"prompt": f"p{i}"}) as resp:
                    assert resp.status == 200, await resp.text()

            # Three at once on one serial replica: the orchestrator dispatches all three at
            # once (nothing waits for a replica there); the worker runs them one by one, so
            # the last waits about 2 x DELAY_S in its queue.
            await asyncio.gather(*(one(i) for i in range(3)))
            async with s.get(admin_url + LOAD_PATH) as resp:
                assert resp.status == 200, await resp.text()
                q = (await resp.json())["stages"]["q"]
    finally:
        await runner.cleanup()
        await admin.cleanup()
        await orch.stop(drain_timeout=1)
    # p95 of three samples is the largest: at least one full run behind another (2 x DELAY_S
    # less the spread of the three arrivals, which is far under DELAY_S).
    assert q["queue_wait_p95_s"] >= DELAY_S, q
    assert q["ttfo_p95_s"] >= q["queue_wait_p95_s"] - 0.05, q  # the queue precedes the output
    # exec_s, what Little's law sizes on, leaves the worker's queue out: service times of about
    # 1, 2 and 3 x DELAY_S (mean 2) but each ran about DELAY_S.
    assert DELAY_S * 0.9 <= q["exec_s"] <= q["service_s"] - DELAY_S / 2, q
    spec = pipe.spec.stage("q").autoscaling
    assert isinstance(spec, Autoscaling)
    load = StageLoad(**q)
    d = decide(spec, load, 1, AutoscalerState(), 0.0)
    # p95 over the target by a factor >= 2: the pool grows in proportion.
    assert d.desired >= 2 and d.direction == 1, d


async def test_the_worker_reports_its_queue_on_the_first_delta_and_the_final(
        start_worker, channels) -> None:
    """On the wire: a streamed echo's first delta and its final carry queue_wait_s; the first
    request of three (one runs at a time) waited for nothing, the third for two runs."""
    w = start_worker("echo", engine={"echoDelayMs": int(DELAY_S * 1000)})
    ch = channels(w)
    replies = await asyncio.gather(*(ch.request(f"r{i}", {"prompt": f"p{i}", "stream": True})
                                     for i in range(3)))
    waits = []
    for deltas, final in replies:
        assert isinstance(final.header, p.Final), final.header
        first, *rest = deltas
        assert first.header.seq == 1 and first.header.queue_wait_s is not None
        assert all(d.header.queue_wait_s is None for d in rest)  # the first output only
        assert final.header.queue_wait_s == first.header.queue_wait_s
        waits.append(final.header.queue_wait_s)
    waits.sort()
    assert waits[0] < DELAY_S / 2, waits  # it ran at once
    assert waits[2] >= DELAY_S, waits  # two runs of DELAY_S ahead of it, less the arrivals' spread
