"""Held requests and replica departures through the real engine, real worker processes and
real ZMQ (issue 37: one bound for every held request, a wake that spreads, retirements that
are not faults). The fast twins against fake replicas: tests/unit/test_holds.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.local_runtime import LocalStageRuntime
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.holds import HoldCause
from omnistage.orchestrator.http_api import serve_http
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.spec import parse_pipeline
from tests.harness.local import alive
from tests.harness.metrics import sample
from tests.harness.waiting import until

pytestmark = pytest.mark.timeout(240)


def one_stage(name: str, **stage: Any) -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": name},
        "spec": {"orchestrator": {"api": ["generic"]}, "stages": [
            {"name": "b", "kind": "echo", "finalOutput": True, "resources": {"gpus": 0},
             **stage}]},
    })


@pytest.fixture
async def orchestrators() -> AsyncIterator[list[Orchestrator]]:
    started: list[Orchestrator] = []
    yield started
    for orch in started:
        await orch.stop(drain_timeout=1)


async def test_requests_waiting_for_the_window_are_bounded_and_refused_by_cause(
        start_worker, orchestrators, tmp_path: Path) -> None:
    """holdQueue 2, dispatch window 1, one replica whose work waits on a file: one request
    runs, two wait in the orchestrator, the fourth is a 503 `no_replica` whose message names
    the dispatch window; GET /v1/load and /metrics say 2 held for `window`. Before the fix
    only a wake checked the bound: the fourth waited too, and nothing said why they waited."""
    pipe = one_stage("hq", replicas=1, dispatch={"perReplica": 1}, autoscaling={
        "minReplicas": 1, "maxReplicas": 2, "holdQueue": 2})
    release = tmp_path / "release"
    b = start_worker(pipe.spec.stage("b"), name="hq-b-0", env={HOLD_FILE_ENV: str(release)})
    orch = Orchestrator(pipe, StaticMembership([ReplicaInfo("b", b.name, b.zmq)]))
    await orch.start()
    orchestrators.append(orch)
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    admin, admin_url = await serve_http(orch, "127.0.0.1", 0, listener="admin")
    route = f"{url}/v1/pipelines/hq/requests"
    body = {"prompt": "x", "timeout_s": 120}
    try:
        async with aiohttp.ClientSession() as session:
            first = asyncio.ensure_future(session.post(route, json=body))
            await until(lambda: orch.load().stages["b"].inflight == 1, "one on the replica")
            held = [asyncio.ensure_future(session.post(route, json=body)) for _ in range(2)]
            await until(lambda: orch.load().stages["b"].held == 2, "two waiting for room")
            # (Its own deadline is short: a fourth held without a bound ends there, a 504.)
            async with session.post(route, json={**body, "timeout_s": 10}) as resp:
                assert resp.status == 503, await resp.text()
                assert int(resp.headers["Retry-After"]) >= 1
                error = (await resp.json())["error"]
            assert error["code"] == "no_replica", error
            assert "dispatch window" in error["message"], error
            assert "hold queue is full" in error["message"], error
            async with session.get(f"{admin_url}/v1/load") as resp:
                load = await resp.json()
            assert load["stages"]["b"]["held"] == 2  # the autoscaler's figure, as before
            assert load["held_by_cause"]["b"] == {"wake": 0, "revision": 0, "window": 2}
            async with session.get(f"{admin_url}/metrics") as resp:
                text = await resp.text()
            assert sample(text, "omnistage_stage_held_requests", pipeline="hq", stage="b",
                          cause="window") == 2
            assert sample(text, "omnistage_orchestrator_hold_refusals_total", pipeline="hq",
                          stage="b", cause="window") == 1
            release.touch()
            for pending in [first, *held]:  # the held ones were not hurt by the refusal
                async with await pending as resp:
                    assert resp.status == 200, await resp.text()
    finally:
        await runner.cleanup()
        await admin.cleanup()


async def test_a_wake_spreads_held_requests_over_replicas_as_they_arrive(
        start_worker, orchestrators, tmp_path: Path) -> None:
    """Six requests held while b is at zero. The first replica takes two (echo runs one at a
    time, plus one queued); the other four wait in the orchestrator and go to the next two
    replicas as each becomes routable. Before the fix all six went to the first replica and
    ran one after another while the other two sat idle."""
    pipe = one_stage("sp", replicas=0, autoscaling={
        "minReplicas": 0, "maxReplicas": 3, "holdQueue": 8})
    release = tmp_path / "release"
    workers = [start_worker(pipe.spec.stage("b"), name=f"sp-b-{i}",
                            env={HOLD_FILE_ENV: str(release)}) for i in range(3)]
    membership = StaticMembership()
    orch = Orchestrator(pipe, membership)
    await orch.start()
    orchestrators.append(orch)
    handles = [orch.submit(PipelineRequest(prompt=f"p{i}", timeout_s=120)) for i in range(6)]
    pool = orch.pools["b"]

    def held(cause: HoldCause) -> int:
        return sum(orch.holds.cause(t) is cause for t in orch.holds.queue("b"))

    assert held(HoldCause.WAKE) == 6

    def publish(i: int) -> None:
        membership.publish(ReplicaInfo("b", workers[i].name, workers[i].zmq))

    publish(0)
    await until(lambda: pool.has_routable() and not held(HoldCause.WAKE)
                and "b" not in orch.router.pending, "the first replica's share sent")
    assert pool.replicas["sp-b-0"].inflight == 2
    assert orch.load().held_by_cause["b"] == {"wake": 0, "revision": 0, "window": 4}
    publish(1)
    publish(2)
    await until(lambda: len(pool.routable()) == 3 and orch.holds.held("b") == 0,
                "the held requests spread over the three replicas")
    assert [pool.replicas[w.name].inflight for w in workers] == [2, 2, 2]
    release.touch()
    outcomes = [await asyncio.wait_for(h.outcome(), 60) for h in handles]
    assert [o.status for o in outcomes] == ["ok"] * 6, outcomes
    served = [o.children[0].outputs["b"].replica for o in outcomes]
    assert sorted(served.count(w.name) for w in workers) == [2, 2, 2], served


async def test_scale_down_counts_a_retirement_not_a_loss_or_a_restart(
        tmp_path: Path, orchestrators) -> None:
    """`omnistage serve`'s runtime scales b from 2 to 1 with no fault: the orchestrator counts
    one retired replica, no lost one and no restart. Before the fix the drain-then-exit read as
    one restart (the connection closed) and one loss (it left the membership). A kill -9 of
    the replica that stays is still a fault."""
    name = f"r{uuid.uuid4().hex[:8]}"
    pipe = one_stage(name, replicas=2, drainTimeoutSeconds=30,
                     autoscaling={"minReplicas": 1, "maxReplicas": 2})
    rt = LocalStageRuntime(pipe, base_dir=tmp_path, log_dir=tmp_path / "logs", ipc=False,
                           watch_interval=0.05)
    rt.start()
    try:
        orch = Orchestrator(pipe, rt.membership)
        await orch.start()
        orchestrators.append(orch)
        pool: Callable[[], Any] = lambda: orch.pools["b"]  # noqa: E731
        await until(lambda: len(pool().routable()) == 2, "two routable replicas")
        out = await asyncio.wait_for(orch.submit(PipelineRequest(prompt="x")).outcome(), 60)
        assert out.status == "ok", out
        pids = rt.pids
        rt.scale("b", 1)
        await until(lambda: len(rt.replicas) == 1 and len(pool().replicas) == 1,
                    "the highest ordinal retired and gone from routing")
        [(retired, pid)] = [(n, pid) for n, pid in pids.items() if n not in rt.replicas]
        await until(lambda: not alive(pid), f"{retired}'s process to exit")
        counters = orch.counters
        assert (counters.get("replicas_retired"), counters["replicas_lost"],
                counters["replica_restarts"]) == (1, 0, 0), counters
        assert rt.retired == {"b": 1}  # the runtime's count; it restarted nothing
        assert all(rep.restarts == 0 for rep in rt.replicas.values())
        [(stays, victim)] = rt.pids.items()
        os.kill(victim, signal.SIGKILL)
        await until(lambda: counters["replicas_lost"] + counters["replica_restarts"] >= 1,
                    f"the kill of {stays} seen as a fault")
        assert counters["replicas_retired"] == 1
    finally:
        await asyncio.to_thread(rt.shutdown, 10)
