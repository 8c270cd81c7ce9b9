"""Hold-and-wake through the real engine, real worker processes and real ZMQ.

A stage with autoscaling at zero replicas: requests that need it are held (bounded, FIFO) and
the stage is woken; they go on once a replica is routable. The waker here only records its
calls; the test plays the placement and publishes a replica it started beforehand.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.http_api import serve_http
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import Outcome, PipelineRequest
from omnistage.procs import WorkerProcess
from omnistage.spec import parse_pipeline
from tests.harness.waiting import until

pytestmark = pytest.mark.timeout(240)

COLD = {"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "holdQueue": 2}}


def pipeline() -> Any:
    """a -> b and a -> c; b and c autoscaled from zero. finals ["b"] never needs c."""
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "hw"},
        "spec": {"orchestrator": {"api": ["generic"]}, "stages": [
            {"name": "a", "kind": "echo"},
            {"name": "b", "kind": "echo", "inputs": ["a"], "finalOutput": True, **COLD},
            {"name": "c", "kind": "echo", "inputs": ["a"], "finalOutput": True, **COLD},
        ]},
    })


class RecordingWaker:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def wake(self, stage: str) -> None:
        self.calls.append(stage)


class Setup:
    def __init__(self, orch: Orchestrator, membership: StaticMembership, waker: RecordingWaker,
                 b: WorkerProcess, release: Path) -> None:
        self.orch, self.membership, self.waker, self.b, self.release = (
            orch, membership, waker, b, release)

    def held(self, stage: str = "b") -> int:
        return self.orch.load().stages[stage].held

    def publish_b(self) -> None:
        """The placement's part: a replica of b is up."""
        self.membership.publish(ReplicaInfo("b", self.b.name, self.b.zmq))


@pytest.fixture
async def setup(start_worker, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    orchs: list[Orchestrator] = []

    async def go(hold_a: bool = False) -> Setup:
        """a is routable (held on a file when hold_a); b is started but not published."""
        pipe = pipeline()
        release = tmp_path / "release-a"
        env = {HOLD_FILE_ENV: str(release)} if hold_a else None
        a = start_worker(pipe.spec.stage("a"), name="hw-a-0", env=env)
        b = start_worker(pipe.spec.stage("b"), name="hw-b-0")
        membership = StaticMembership([ReplicaInfo("a", a.name, a.zmq)])
        waker = RecordingWaker()
        orch = Orchestrator(pipe, membership, waker=waker)
        await orch.start()
        orchs.append(orch)
        return Setup(orch, membership, waker, b, release)

    yield go
    for orch in orchs:
        await orch.stop(drain_timeout=1)


async def only_outcome(handle: Any) -> Outcome:
    """The handle's events: exactly one terminal outcome, last."""
    events = [ev async for ev in handle.events()]
    outcomes = [ev for ev in events if isinstance(ev, Outcome)]
    assert len(outcomes) == 1 and events[-1] is outcomes[0], events
    return outcomes[0]


async def test_held_requests_are_served_in_order_once_a_replica_appears(setup) -> None:
    s = await setup()
    ok, reason = s.orch.readiness()
    assert ok and "at zero replicas" in reason, reason  # a stage at zero is not a failure
    first = s.orch.submit(PipelineRequest(prompt="one", finals=["b"], timeout_s=120))
    second = s.orch.submit(PipelineRequest(prompt="two", finals=["b"], timeout_s=120))
    await until(lambda: s.held() == 2, "both requests held at b")
    load = s.orch.load().stages["b"]
    assert (load.replicas, load.inflight, load.wake_pending) == (0, 0, True)
    assert s.waker.calls == ["b"]  # once per second per stage, not once per request
    s.publish_b()
    out1, out2 = await only_outcome(first), await only_outcome(second)
    assert out1.status == "ok" and out2.status == "ok", (out1, out2)
    assert out1.children[0].outputs["b"].fields["text"] == "one"
    assert out2.children[0].outputs["b"].fields["text"] == "two"
    load = s.orch.load().stages["b"]
    assert (load.held, load.wake_pending, load.replicas) == (0, False, 1)
    assert load.queue_wait_p95_s > 0  # the time held counts as queue wait
    assert "c" not in s.waker.calls


async def test_full_hold_queue_is_503_with_retry_after_over_http(setup) -> None:
    s = await setup()
    runner, url = await serve_http(s.orch, "127.0.0.1", 0)
    route = f"{url}/v1/pipelines/hw/requests"
    body = {"prompt": "x", "finals": ["b"], "timeout_s": 120}
    try:
        async with aiohttp.ClientSession() as session:
            held = [asyncio.ensure_future(session.post(route, json=body)) for _ in range(2)]
            await until(lambda: s.held() == 2, "the hold queue (2) to fill")
            async with session.post(route, json=body) as resp:
                assert resp.status == 503, await resp.text()
                assert int(resp.headers["Retry-After"]) >= 1
                error = (await resp.json())["error"]
                assert error["code"] == "no_replica" and "hold queue is full" in error["message"]
            s.publish_b()
            for pending in held:  # the held ones were not hurt by the refusal
                async with await pending as resp:
                    assert resp.status == 200, await resp.text()
    finally:
        await runner.cleanup()


async def test_deadline_while_held_is_the_deadline_error_once(setup) -> None:
    s = await setup()
    handle = s.orch.submit(PipelineRequest(prompt="x", finals=["b"], timeout_s=0.5))
    await until(lambda: s.held() == 1, "the request held")
    out = await only_outcome(handle)
    assert out.status == "request_error" and out.error is not None, out
    assert out.error.code == "deadline"
    assert s.held() == 0
    s.publish_b()  # nothing is left to dispatch: the replica gets no work
    await until(lambda: s.orch.load().stages["b"].replicas == 1, "b routable")
    assert all(r.served == 0 for r in s.orch.pools["b"].replicas.values())


async def test_abort_while_held_ends_it_and_frees_its_place(setup) -> None:
    s = await setup()
    handle = s.orch.submit(PipelineRequest(prompt="x", finals=["b"], timeout_s=120))
    await until(lambda: s.held() == 1, "the request held")
    handle.abort()
    out = await only_outcome(handle)
    assert out.status == "abort", out
    assert s.held() == 0 and not s.orch.requests
    s.publish_b()
    await until(lambda: s.orch.load().stages["b"].replicas == 1, "b routable")
    assert all(r.served == 0 for r in s.orch.pools["b"].replicas.values())


async def test_warm_up_wakes_the_downstream_stage_at_admission_not_unused_ones(setup) -> None:
    s = await setup(hold_a=True)
    handle = s.orch.submit(PipelineRequest(prompt="x", finals=["b"], timeout_s=120))
    # Woken while the request is still in stage a (held there on a file), not when it
    # reaches b; c, which this request does not use, is not woken.
    await until(lambda: s.waker.calls, "a wake")
    assert s.waker.calls == ["b"]
    assert s.orch.load().stages["a"].inflight == 1 and s.held() == 0
    assert s.orch.load().stages["b"].wake_pending
    assert not s.orch.load().stages["c"].wake_pending
    s.publish_b()  # b comes up while a still works: no hold at all
    await until(lambda: s.orch.load().stages["b"].replicas == 1, "b routable")
    s.release.touch()
    out = await only_outcome(handle)
    assert out.status == "ok", out
    assert "c" not in s.waker.calls
    assert s.orch.load().stages["b"].queue_wait_p95_s < 1.0  # it never waited for b


async def test_a_stage_without_autoscaling_still_fails_at_once(start_worker) -> None:
    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "fixed"},
        "spec": {"stages": [{"name": "a", "kind": "echo"},
                            {"name": "b", "kind": "echo", "inputs": ["a"],
                             "finalOutput": True}]},
    })
    a = start_worker(pipe.spec.stage("a"), name="fixed-a-0")
    waker = RecordingWaker()
    orch = Orchestrator(pipe, StaticMembership([ReplicaInfo("a", a.name, a.zmq)]), waker=waker)
    await orch.start()
    try:
        out = await orch.submit(PipelineRequest(prompt="x")).outcome()
        assert out.error is not None and out.error.code == "no_replica", out
        assert waker.calls == [] and not orch.readiness()[0]
    finally:
        await orch.stop(drain_timeout=1)


async def test_a_deadline_shorter_than_the_measured_start_up_is_refused_at_once(setup) -> None:
    s = await setup()
    # The first wake measures b's start-up (wake -> routable).
    first = s.orch.submit(PipelineRequest(prompt="x", finals=["b"], timeout_s=120))
    await until(lambda: s.held() == 1, "the request held")
    s.publish_b()
    assert (await only_outcome(first)).status == "ok"
    assert s.orch.startup_s["b"] > 0
    # Back at zero, as if b had last taken 30 s to start: a request with 2 s left is refused
    # at admission (503 with Retry-After), not held until its deadline.
    s.membership.publish(ReplicaInfo("b", s.b.name, s.b.zmq, "gone"))
    await until(lambda: s.orch.load().stages["b"].replicas == 0, "b at zero")
    s.orch.startup_s["b"] = 30.0
    out = await only_outcome(s.orch.submit(
        PipelineRequest(prompt="x", finals=["b"], timeout_s=2)))
    assert out.error is not None and out.error.code == "no_replica", out
    assert "takes about 30.0s to start" in out.error.message
    assert out.error.retry_after is not None and out.error.retry_after >= 29
    assert s.held() == 0
    # One with time enough is held as before.
    s.orch.submit(PipelineRequest(prompt="x", finals=["b"], timeout_s=60))
    await until(lambda: s.held() == 1, "the request held")
