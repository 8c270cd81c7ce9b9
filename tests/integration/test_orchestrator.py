"""The orchestration contract against real worker processes over real ZMQ."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnistage import protocol as p
from omnistage.client import ControlError
from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import Delta, Outcome, PipelineRequest
from omnistage.procs import WorkerProcess
from omnistage.spec import parse_pipeline
from tests.harness.fake_worker import FakeWorker
from tests.harness.local import free_port
from tests.harness.metrics import sample

pytestmark = pytest.mark.timeout(300)


def pipeline(name: str, stages: list[dict[str, Any]]) -> Any:
    return parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {"stages": stages},
    })


def echo(name: str, inputs: tuple[str, ...] = (), final: bool = False) -> dict[str, Any]:
    return {"name": name, "kind": "echo", "inputs": list(inputs), "finalOutput": final}


Launch = Callable[..., Any]


def held(release: Path) -> dict[str, Any]:
    """start_worker options for an echo replica whose requests wait until `release` exists
    (abortable, under their deadline): work that ends on the test's signal, not a clock."""
    return {"env": {HOLD_FILE_ENV: str(release)}}


@pytest.fixture
async def launch(start_worker) -> AsyncIterator[Launch]:
    """Start workers for a pipeline and an Orchestrator over them (static membership)."""
    orchs: list[Orchestrator] = []

    async def go(pipe: Any, workers: dict[str, list[dict[str, Any]]], **kw: Any):
        """workers: per stage, one dict of start_worker options (e.g. a fixed port) a replica."""
        procs: dict[str, list[WorkerProcess]] = {}
        infos = []
        for stage, replicas in workers.items():
            for i, options in enumerate(replicas):
                name = f"{pipe.metadata.name}-{stage}-{i}"
                w = start_worker(pipe.spec.stage(stage), name=name, **options)
                procs.setdefault(stage, []).append(w)
                infos.append(ReplicaInfo(stage, name, w.zmq))
        membership = StaticMembership(infos)
        orch = Orchestrator(pipe, membership, **kw)
        await orch.start()
        orchs.append(orch)
        return orch, procs, membership

    yield go
    for orch in orchs:
        await orch.stop(drain_timeout=1)


async def collect(orch: Orchestrator, req: PipelineRequest) -> tuple[list[Delta], Outcome]:
    deltas: list[Delta] = []
    async for ev in orch.submit(req).events():
        if isinstance(ev, Delta):
            deltas.append(ev)
        else:
            return deltas, ev
    raise AssertionError("no outcome")


# ---- routing ---------------------------------------------------------------------------------


async def test_two_stage_routing_follows_the_dag(launch) -> None:
    pipe = pipeline("two", [echo("a"), echo("b", ("a",), final=True)])
    orch, _, _ = await launch(pipe, {"a": [{}], "b": [{}]})
    _, out = await collect(orch, PipelineRequest(prompt="hello"))
    assert out.status == "ok", out
    [child] = out.children
    assert set(child.outputs) == {"b"}  # only final stages are outputs
    assert child.outputs["b"].fields["text"] == "hello"  # a's text became b's prompt
    assert child.outputs["b"].replica == "two-b-0"


async def test_join_waits_for_all_inputs(launch) -> None:
    pipe = pipeline("join", [echo("a"), echo("slow"), echo("j", ("a", "slow"), final=True)])
    orch, _, _ = await launch(pipe, {"a": [{}], "slow": [{}], "j": [{}]})
    req = PipelineRequest(prompt="x", params={"slow": {"delay_ms": 400}})
    _, out = await collect(orch, req)
    assert out.status == "ok"
    assert out.children[0].outputs["j"].fields["text"] == "x"


async def test_ar_to_diffusion_with_negative_prompt_companion(launch) -> None:
    pipe = pipeline("t2i", [
        {"name": "enc", "kind": "ar", "model": "tiny-llama", "engine": {"maxTokens": 2}},
        {"name": "img", "kind": "diffusion", "model": "tiny-unet", "inputs": ["enc"],
         "finalOutput": True},
    ])
    orch, _, _ = await launch(pipe, {"enc": [{}], "img": [{}]})
    params = {"img": {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.0}}
    _, plain = await collect(orch, PipelineRequest(prompt="a cat", params=params))
    assert plain.status == "ok", plain
    image = plain.children[0].outputs["img"].tensors["image"].numpy()
    assert image.shape == (32, 32, 3)
    served_before = orch.pools["enc"].replicas["t2i-enc-0"].served
    _, cfg = await collect(orch, PipelineRequest(prompt="a cat", negative_prompt="blurry",
                                                 params=params))
    assert cfg.status == "ok", cfg
    # The companion ran on the AR stage too, and its output changed the guided image.
    assert orch.pools["enc"].replicas["t2i-enc-0"].served - served_before == 2
    assert not np.array_equal(cfg.children[0].outputs["img"].tensors["image"].numpy(), image)


async def test_companion_failure_fails_the_parent(launch) -> None:
    pipe = pipeline("t2i", [
        {"name": "enc", "kind": "ar", "model": "tiny-llama", "engine": {"maxTokens": 2}},
        {"name": "img", "kind": "diffusion", "model": "tiny-unet", "inputs": ["enc"],
         "finalOutput": True},
    ])
    orch, _, _ = await launch(pipe, {"enc": [{}], "img": [{}]})
    # An over-long negative prompt is refused by the AR worker: only the companion fails.
    _, out = await collect(orch, PipelineRequest(prompt="ok", negative_prompt="n" * 5000))
    assert out.status == "request_error"
    assert out.error is not None and out.error.code == "bad_request"
    assert out.error.stage == "enc"


# ---- replica selection and affinity ------------------------------------------------------


async def test_requests_spread_across_replicas_and_sessions_pin(launch) -> None:
    pipe = pipeline("spread", [echo("a", final=True)])
    orch, _, _ = await launch(pipe, {"a": [{}, {}]})
    reqs = [PipelineRequest(prompt=str(i), params={"a": {"delay_ms": 50}}) for i in range(20)]
    outs = await asyncio.gather(*(collect(orch, r) for r in reqs))
    used = Counter(o.children[0].outputs["a"].replica for _, o in outs)
    assert set(used) == {"spread-a-0", "spread-a-1"}, used
    assert min(used.values()) >= 5  # least in-flight keeps them balanced
    pinned = [await collect(orch, PipelineRequest(prompt="s", session="user-1")) for _ in range(6)]
    assert len({o.children[0].outputs["a"].replica for _, o in pinned}) == 1


async def test_abort_goes_to_the_bound_replica_and_returns_prefix(launch) -> None:
    pipe = pipeline("chat", [{"name": "llm", "kind": "ar", "model": "tiny-llama",
                              "finalOutput": True}])
    orch, _, _ = await launch(pipe, {"llm": [{}, {}]})
    handle = orch.submit(PipelineRequest(
        prompt="hi", stream=True,
        params={"llm": {"max_tokens": 1000, "ignore_eos": True}}))
    streamed: list[int] = []
    async for ev in handle.events():
        if isinstance(ev, Delta):
            streamed.extend(ev.token_ids)
            if len(streamed) == 5:
                handle.abort()
        else:
            out = ev
            break
    assert out.status == "abort"
    output = out.children[0].outputs["llm"]
    assert output.fields["finish_reason"] == "abort"
    assert output.fields["token_ids"] == streamed  # the acked prefix is what streamed
    assert 5 <= len(streamed) < 1000
    assert orch.counters["late_messages"] == 0


async def _until(pred: Callable[[], Any], what: str, timeout: float = 60) -> None:
    """Wait for observable state (not for a wall-clock window); the timeout only bounds a hang."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _running(handle: Any, child: int = 0) -> set[str]:
    return {stage for stage, _ in handle._request.children[child].running}


async def test_several_final_stages_only_last_abort_is_terminal(launch) -> None:
    """Two final stages run; an abort reaches both. The first `aborted` reply must not end the
    request: the outcome comes with the last one, and carries both stages' abort outputs.

    Kills: `_settle` ignoring `child.running` (the first final-stage abort made terminal), and an
    `Aborted` reply failing the child at once: either way f2's output is missing and its reply
    arrives after the terminal outcome (counted as a late message)."""
    pipe = pipeline("multi", [echo("src"), echo("f1", ("src",), final=True),
                              echo("f2", ("src",), final=True)])
    orch, _, _ = await launch(pipe, {"src": [{}], "f1": [{}], "f2": [{}]})
    # Long delays: the abort, not the clock, ends both stages.
    req = PipelineRequest(prompt="x", params={"f1": {"delay_ms": 60000},
                                              "f2": {"delay_ms": 60000}})
    handle = orch.submit(req)
    await _until(lambda: _running(handle) == {"f1", "f2"}, "f1 and f2 both running")
    handle.abort()
    events = [ev async for ev in handle.events()]
    assert len(events) == 1 and isinstance(events[0], Outcome)
    out = events[0]
    assert out.status == "abort"
    outputs = out.children[0].outputs
    assert set(outputs) == {"f1", "f2"}, outputs  # both abort replies arrived before the end
    assert all(o.fields["finish_reason"] == "abort" for o in outputs.values())
    assert not orch.requests and not orch.tasks
    assert orch.counters["late_messages"] == 0


async def test_abort_after_one_final_stage_finished_keeps_its_output(launch) -> None:
    """f1 finished, f2 still runs: the abort ends the request as `abort` only once f2 answers,
    with f1's completed output kept beside f2's abort output.

    Kills: an abort that drops the outputs already gathered, and `abort_requested` ignored
    when the outputs happen to be complete after the aborted stage answers."""
    pipe = pipeline("multi2", [echo("src"), echo("f1", ("src",), final=True),
                               echo("f2", ("src",), final=True)])
    orch, _, _ = await launch(pipe, {"src": [{}], "f1": [{}], "f2": [{}]})
    handle = orch.submit(PipelineRequest(prompt="x", params={"f2": {"delay_ms": 60000}}))
    child = handle._request.children[0]
    await _until(lambda: "f1" in child.outputs and _running(handle) == {"f2"},
                 "f1 done while f2 runs")
    handle.abort()
    out = await handle.outcome()
    assert out.status == "abort"
    outputs = out.children[0].outputs
    assert outputs["f1"].fields == {"text": "x", "finish_reason": "stop"}
    assert outputs["f2"].fields["finish_reason"] == "abort"
    assert orch.counters["late_messages"] == 0


async def test_parallel_sampling_child_abort_drops_parent_when_none_remain(
        launch, tmp_path: Path) -> None:
    pipe = pipeline("par", [echo("a", final=True)])
    release = tmp_path / "release"
    orch, _, _ = await launch(pipe, {"a": [held(release), held(release)]})
    # The aborts and the release, not the clock, end these samples; waits are on the engine's
    # own state.
    handle = orch.submit(PipelineRequest(prompt="p", n=3))
    children = handle._request.children
    await _until(lambda: all(c.running for c in children), "all three samples running")
    handle.abort(child=1)
    await _until(lambda: children[1].outcome is not None, "sample 1 aborted")
    assert handle.id in orch.requests  # two children still running: the parent lives
    handle.abort(child=0)
    handle.abort(child=2)
    out = await handle.outcome()
    assert out.status == "abort"
    assert [c.status for c in out.children] == ["abort"] * 3
    # Sample 1 must finish by itself: both are held until sample 0's abort has ended it.
    mixed = orch.submit(PipelineRequest(prompt="q", n=2))
    await _until(lambda: bool(mixed._request.children[0].running), "sample 0 running")
    mixed.abort(child=0)
    await _until(lambda: mixed._request.children[0].outcome is not None, "sample 0 aborted")
    release.touch()
    out = await mixed.outcome()
    assert out.status == "ok" and [c.status for c in out.children] == ["abort", "ok"]


# ---- failure isolation -------------------------------------------------------------------


async def test_kill_9_one_replica_fails_only_its_bound_requests(launch, tmp_path: Path) -> None:
    pipe = pipeline("iso", [echo("a", final=True)])
    pipe.spec.orchestrator.failover.max_retries = 0  # the no-retry path; failover: test_failover.py
    release = tmp_path / "release"
    # The socket monitor notices the kill; heartbeats a minute apart cannot drop the live
    # replica however loaded the machine is.
    orch, procs, _ = await launch(pipe, {"a": [held(release), held(release)]},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    # Every request is held until the release: none can finish between the snapshot of
    # `bound` and the kill.
    handles = [orch.submit(PipelineRequest(prompt=str(i))) for i in range(6)]
    victim = orch.pools["a"].replicas["iso-a-0"]
    await _until(lambda: len(orch.tasks) == 6, "all 6 requests sent")
    bound = {t.child.request.id for t in victim.bound}
    assert bound and len(bound) < 6
    procs["a"][0].proc.send_signal(signal.SIGKILL)
    outcomes = {h.id: [ev async for ev in h.events()] for h in handles if h.id in bound}
    # The victim's requests failed while the others were still held on the live replica.
    assert all(c.outcome is None for h in handles if h.id not in bound
               for c in h._request.children)
    release.touch()
    outcomes.update({h.id: [ev async for ev in h.events()] for h in handles if h.id not in bound})
    for rid, events in outcomes.items():
        terminal = [e for e in events if isinstance(e, Outcome)]
        assert len(terminal) == 1  # exactly one terminal outcome each
        if rid in bound:
            assert terminal[0].status == "fatal"
            assert terminal[0].error.code == "replica_lost"
        else:
            assert terminal[0].status == "ok", terminal[0]
    # Not routed to until a new process at its address answers a hello (the heartbeat, a
    # minute away here, would drop it from the pool later).
    assert victim.incarnation is None
    _, after = await collect(orch, PipelineRequest(prompt="after"))
    assert after.status == "ok" and after.children[0].outputs["a"].replica == "iso-a-1"


async def test_dead_downstream_stage(launch) -> None:
    pipe = pipeline("down", [echo("a"), echo("b", ("a",), final=True)])
    # The socket monitor notices the kill; a minute's heartbeat timeout keeps a loaded machine
    # from dropping the live stage a.
    orch, procs, _ = await launch(pipe, {"a": [{}], "b": [{}]},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handle = orch.submit(PipelineRequest(prompt="x", params={"b": {"delay_ms": 30000}}))
    await _until(lambda: ("b", False) in handle._request.children[0].running, "b running")
    procs["b"][0].proc.send_signal(signal.SIGKILL)
    out = await handle.outcome()
    assert out.status == "fatal" and out.error.code == "replica_lost"
    assert out.error.stage == "b"
    # With no live replica left, new requests fail at once with 503 (not at their 300 s
    # deadline: the bound is a hang guard, far from both).
    _, now = await asyncio.wait_for(collect(orch, PipelineRequest(prompt="y")), 30)
    assert now.error is not None and now.error.code == "no_replica"
    assert now.error.http_status == 503
    assert orch.readiness() == (False, "stage 'b' has no ready replica")


async def test_unencodable_value_is_a_request_error_and_loop_keeps_running(launch) -> None:
    pipe = pipeline("enc", [echo("a", final=True)])
    orch, _, _ = await launch(pipe, {"a": [{}]})
    for bad in (PipelineRequest(prompt="\ud800"),
                PipelineRequest(prompt="x", params={"a": {"seed": 2**70}})):
        _, out = await collect(orch, bad)
        assert out.status == "request_error" and out.error.http_status == 400, out
    _, ok = await collect(orch, PipelineRequest(prompt="fine"))
    assert ok.status == "ok"


async def test_terminal_state_is_monotonic(launch, tmp_path: Path) -> None:
    pipe = pipeline("mono", [echo("src"), echo("f1", ("src",), final=True),
                             echo("f2", ("src",), final=True)])
    never = held(tmp_path / "never-created")  # f1 and f2 hold work until aborted or late
    orch, _, _ = await launch(pipe, {"src": [{}], "f1": [never], "f2": [never]})
    # f1 fails at once (a bad parameter); f2 is still running when the request becomes
    # terminal.
    handle = orch.submit(PipelineRequest(prompt="x", stream=True, params={
        "f1": {"delay_ms": -1}}))
    events = [ev async for ev in handle.events()]
    assert len(events) == 1 and events[0].status == "request_error"
    assert events[0].error.code == "bad_request" and events[0].error.stage == "f1"
    handle.abort()  # an abort after the terminal outcome is dropped and counted
    assert orch.counters["late_aborts"] == 1
    # f2's own reply (to the abort we sent it) is dropped and counted
    await _until(lambda: orch.counters["late_messages"] >= 1, "f2's late reply counted")
    assert handle._request.queue.empty()
    # A deadline is a request-scoped terminal outcome (504), also exactly once.
    late = orch.submit(PipelineRequest(prompt="y", timeout_s=0.3))
    events = [ev async for ev in late.events()]
    assert len(events) == 1 and events[0].status == "request_error"
    assert events[0].error.code == "deadline" and events[0].error.http_status == 504


async def test_draining_replica_takes_no_new_work(launch) -> None:
    pipe = pipeline("drain", [echo("a", final=True)])
    orch, _, membership = await launch(pipe, {"a": [{}, {}]})
    info = next(r for r in membership.replicas if r.name == "drain-a-0")
    membership.publish(ReplicaInfo(info.stage, info.name, info.endpoint, "draining"))
    outs = [await collect(orch, PipelineRequest(prompt=str(i))) for i in range(6)]
    assert {o.children[0].outputs["a"].replica for _, o in outs} == {"drain-a-1"}


# ---- control RPCs ---------------------------------------------------------------------------


async def test_control_fan_out_and_error_propagation(launch) -> None:
    pipe = pipeline("ctl", [echo("a"), echo("b", ("a",), final=True)])
    orch, _, _ = await launch(pipe, {"a": [{}, {}], "b": [{}]})
    with pytest.raises(ValueError, match="unknown stage"):
        await orch.control("pause", ["a", "nope"])
    states = await orch.control("pause", ["a"])  # nothing was paused by the rejected call
    assert set(states) == {"ctl-a-0", "ctl-a-1"} and all(s["paused"] for s in states.values())
    handle = orch.submit(PipelineRequest(prompt="held"))

    async def queued_on_a() -> int:  # pause is idempotent, and answers each replica's state
        return sum(st["queued"] for st in (await orch.control("pause", ["a"])).values())

    end = asyncio.get_running_loop().time() + 60  # hang guard
    while await queued_on_a() != 1:  # admitted by a paused replica, not dispatched
        assert asyncio.get_running_loop().time() < end, "never queued on a paused replica"
    assert handle.id in orch.requests
    await orch.control("sleep", ["b"])
    with pytest.raises(ControlError, match="asleep"):
        await orch.control("resume", ["b"])
    woke = await orch.control("wake_up", ["b"])
    assert all(s["paused"] for s in woke.values())  # wake_up does not resume admission
    await orch.control("resume")
    assert (await handle.outcome()).status == "ok"


async def test_stalled_replica_is_dropped_then_readmitted(launch) -> None:
    pipe = pipeline("stall", [echo("a", final=True)])
    # The drop takes the heartbeat timeout; 10 s (not the 3 s default) is a far guard against
    # a loaded machine silencing the live stall-a-1 for that long too.
    orch, procs, _ = await launch(pipe, {"a": [{}, {}]}, heartbeat_interval=0.5,
                                  heartbeat_timeout=10.0)
    victim = procs["a"][0]
    victim.proc.send_signal(signal.SIGSTOP)  # alive but silent: heartbeats stop
    try:
        await _until(lambda: "stall-a-0" not in orch.pools["a"].replicas, "stall-a-0 dropped")
        assert "stall-a-0" in orch.suspects
        outs = [await collect(orch, PipelineRequest(prompt=str(i))) for i in range(4)]
        assert {o.children[0].outputs["a"].replica for _, o in outs} == {"stall-a-1"}
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    # It answers again: back in routing without a membership change.
    await _until(lambda: "stall-a-0" in orch.pools["a"].replicas, "stall-a-0 readmitted")
    assert not orch.suspects
    _, out = await collect(orch, PipelineRequest(prompt="back", session="s"))
    assert out.status == "ok"


# ---- handshake and protocol versions --------------------------------------------------------


def _state(w: WorkerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(w.http + "/state", timeout=5) as resp:
        return json.loads(resp.read())


async def test_replicas_are_routed_only_after_a_handshake_of_our_version(launch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="omnistage.orchestrator")
    pipe = pipeline("ver", [echo("a", final=True)])
    orch, procs, membership = await launch(pipe, {"a": [{}]})
    # start() waited for the handshake: the replica is routable, bound to the process that
    # answered, and the first request finds it.
    real = orch.pools["a"].replicas["ver-a-0"]
    assert real.incarnation == (await asyncio.to_thread(_state, procs["a"][0]))["incarnation"]
    newer, older = FakeWorker(p.PROTOCOL_VERSION + 1), FakeWorker(None)
    try:
        for name, fake in (("newer", newer), ("older", older)):
            membership.publish(ReplicaInfo("a", name, fake.endpoint))
        await _until(lambda: all(orch.pools["a"].replicas[n].refused for n in ("newer", "older")),
                     "both handshakes refused")
        status = {r["name"]: r for r in orch.status()["a"]}
        assert f"speaks protocol version {p.PROTOCOL_VERSION + 1}" in status["newer"]["refused"]
        assert "refused the handshake" in status["older"]["refused"]
        assert status["newer"]["incarnation"] is None and status["older"]["incarnation"] is None
        outs = [await collect(orch, PipelineRequest(prompt=str(i))) for i in range(6)]
        assert {o.children[0].outputs["a"].replica for _, o in outs} == {"ver-a-0"}
        for fake in (newer, older):
            assert "submit" not in {m["t"] for m in fake.received}
        assert "not routing to replica newer: replica newer at" in caplog.text
        assert "not routing to replica older" in caplog.text
    finally:
        await newer.close()
        await older.close()


async def test_a_restart_at_the_same_address_fails_the_old_work_at_once(
        launch, start_worker, caplog) -> None:
    """kill -9, and a new process at the same address before any heartbeat could tell: the work
    bound to the old process fails within a second, and none of it reaches the new one."""
    caplog.set_level(logging.INFO, logger="omnistage.orchestrator")
    pipe = pipeline("inc", [echo("a", final=True)])
    port = free_port()
    # Heartbeats too rare to notice anything during the test: the socket monitor must.
    orch, procs, _ = await launch(pipe, {"a": [{"port": port}]}, heartbeat_interval=30,
                                  heartbeat_timeout=60)
    replica = orch.pools["a"].replicas["inc-a-0"]
    first = replica.incarnation
    assert first == (await asyncio.to_thread(_state, procs["a"][0]))["incarnation"]
    handles = [orch.submit(PipelineRequest(prompt=str(i), params={"a": {"delay_ms": 20000}}))
               for i in range(4)]
    await _until(lambda: replica.inflight == 4, "4 requests in flight")
    # ... and on the worker: sent is not arrived (ZMQ keeps what never left for the next peer)
    for _ in range(600):
        if (await asyncio.to_thread(_state, procs["a"][0]))["in_flight"] == 4:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the worker never had the 4 requests in flight")
    procs["a"][0].kill()  # blocks the loop until the process is reaped
    killed = time.monotonic()
    # The loop has not yet seen the closed connection: this one still goes to the old process,
    # so ZMQ queues it for whoever listens at the address next.
    queued = orch.submit(PipelineRequest(prompt="queued", params={"a": {"delay_ms": 20000}}))
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(h.outcome() for h in [*handles, queued])), 25)
    elapsed = time.monotonic() - killed
    assert [o.error.code for o in outcomes if o.error] == ["replica_lost"] * 5, outcomes
    # The socket monitor, not a heartbeat (every 30 s) nor the 20 s of work, ended them: a
    # bound far from the machine's load and below both.
    assert elapsed < 15.0, elapsed
    assert orch.readiness() == (False, "stage 'a' has no ready replica")  # until it answers
    again = await asyncio.to_thread(start_worker, pipe.spec.stage("a"), port=port,
                                    name="inc-a-0")
    second = (await asyncio.to_thread(_state, again))["incarnation"]
    # routable again once the new process answered the hello
    await _until(lambda: replica.incarnation == second, "the new process's hello")
    assert second != first
    _, out = await collect(orch, PipelineRequest(prompt="after"))
    assert out.status == "ok" and out.children[0].outputs["a"].replica == "inc-a-0"
    state = await asyncio.to_thread(_state, again)
    metrics = await asyncio.to_thread(
        lambda: urllib.request.urlopen(again.http + "/metrics", timeout=5).read().decode())
    labels = {"stage": "a", "replica": "inc-a-0"}
    assert sample(metrics, "omnistage_worker_stale_messages_total", **labels) == 1  # "queued"
    assert sample(metrics, "omnistage_worker_admitted_total", **labels) == 1  # only "after"
    assert state["in_flight"] == 0
    assert orch.counters["replica_restarts"] == 1
    assert f"replica inc-a-0: connection closed: incarnation {first} is gone; failing 5 " \
           "bound tasks" in caplog.text


async def test_a_new_incarnation_seen_in_a_pong_or_a_refusal_fails_the_old_work() -> None:
    """When no closed connection was seen, a pong naming another incarnation, or a worker
    refusing a submit as stale, has the same effect: the old work fails with replica_lost,
    nothing more is sent for it, and the replica is routed to after a new handshake."""
    stale: list[str] = []

    def on_submit(msg: dict[str, Any]) -> list[Any] | None:
        if msg["params"].get("prompt") == "refuse":
            stale.append(msg["incarnation"])
            return p.encode(p.Error(code="stale_incarnation", id=msg["id"], replica="fake",
                                    message="the replica restarted"))
        return None  # stays in flight

    fake = FakeWorker(on_submit=on_submit)
    pipe = pipeline("pong", [echo("a", final=True)])
    orch = Orchestrator(pipe, StaticMembership([ReplicaInfo("a", "fake", fake.endpoint)]),
                        heartbeat_interval=0.1, heartbeat_timeout=60)
    await orch.start()
    try:
        replica = orch.pools["a"].replicas["fake"]
        first = fake.incarnation
        assert replica.incarnation == first
        held = orch.submit(PipelineRequest(prompt="held"))
        fake.incarnation = "second"  # the next pong says so; the connection never closed
        out = await asyncio.wait_for(held.outcome(), 5)
        assert out.error is not None and out.error.code == "replica_lost"
        assert f"restarted: incarnation {first} -> second" in out.error.message
        # a hello went out, and its reply made the replica routable
        await _until(lambda: replica.incarnation == "second", "the second hello's reply")
        # The submit named the process it was for; nothing more was sent for the lost work
        # (no abort: the old process is gone).
        [submit] = [m for m in fake.received if m["t"] in ("submit", "abort")]
        assert (submit["t"], submit["incarnation"]) == ("submit", first)
        assert [m["t"] for m in fake.received].count("hello") == 2
        # A refusal as stale: that request fails, and the replica handshakes again.
        fake.incarnation = "third"
        out = await asyncio.wait_for(orch.submit(PipelineRequest(prompt="refuse")).outcome(), 5)
        assert out.error is not None and out.error.code == "replica_lost"
        assert stale == ["second"]
        await _until(lambda: replica.incarnation == "third", "the third hello's reply")
        assert orch.counters["replica_restarts"] == 2
    finally:
        await orch.stop(drain_timeout=1)
        await fake.close()


# ---- contract gaps: per-child failures, the stage's default deadline -----------------------


async def test_generic_route_reports_failures_per_child(launch, tmp_path: Path) -> None:
    """One failed sample does not fail the request on the generic route (docs/http-api.md);
    only a request whose every sample failed answers with an HTTP error."""
    import aiohttp

    from omnistage.orchestrator.http_api import serve_http

    stage = {**echo("a", final=True), "admission": {"maxRequests": 1}}
    pipe = pipeline("per", [stage])
    release = tmp_path / "release"
    orch, _, _ = await launch(pipe, {"a": [held(release)]})
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    route = f"{url}/v1/pipelines/per/requests"
    try:
        async with aiohttp.ClientSession() as http:
            # Two samples on a replica that admits one request: the second is refused while
            # the first is held, which is released once the refusal is in.
            post = asyncio.ensure_future(http.post(route, json={"prompt": "x", "n": 2}))
            await _until(lambda: any(c.outcome is not None for r in orch.requests.values()
                                     for c in r.children), "one sample refused")
            release.touch()
            async with await post as resp:
                assert resp.status == 200, await resp.text()
                got = await resp.json()
            assert got["status"] == "ok"
            assert [c["status"] for c in got["children"]] == ["ok", "request_error"]
            assert got["children"][0]["outputs"]["a"]["fields"]["text"] == "x"
            assert got["children"][1]["error"]["code"] == "overloaded"
            assert got["children"][1]["error"]["stage"] == "a"
            # A request whose only sample fails is a request-level error, with its status.
            # The first admitted is held until the other's refusal is in, however slow the
            # machine.
            release.unlink()
            one = {"prompt": "y"}
            statuses = []
            for coro in asyncio.as_completed([http.post(route, json=one) for _ in range(2)]):
                async with await coro as resp:
                    statuses.append(resp.status)
                    if resp.status == 429:
                        assert resp.headers["Retry-After"] == "1"
                        assert (await resp.json())["error"]["code"] == "overloaded"
                release.touch()
            assert statuses == [429, 200]
    finally:
        await runner.cleanup()


async def test_stage_default_deadline_applies_through_the_orchestrator(launch) -> None:
    stage = {**echo("a", final=True), "admission": {"defaultDeadlineSeconds": 0.5}}
    pipe = pipeline("dl", [stage])
    orch, _, _ = await launch(pipe, {"a": [{}]})
    t0 = time.monotonic()
    _, out = await collect(orch, PipelineRequest(prompt="x", params={"a": {"delay_ms": 60000}}))
    elapsed = time.monotonic() - t0
    assert out.status == "request_error" and out.error is not None
    # A deadline, so neither the 60 s of work (that would be ok) nor the orchestrator's 300 s
    # bound (the test would time out first); and not before the stage's 0.5 s. Only a lower
    # bound: a loaded machine makes things later, never earlier.
    assert (out.error.code, out.error.stage) == ("deadline", "a")
    assert elapsed >= 0.45, elapsed
    # A request that carries its own deadline is held to that one instead.
    _, own = await collect(orch, PipelineRequest(prompt="y", timeout_s=20,
                                                 params={"a": {"delay_ms": 1000}}))
    assert own.status == "ok", own


# ---- worker refusals through the real engine ------------------------------------------------


def _metrics(w: WorkerProcess) -> str:
    with urllib.request.urlopen(w.http + "/metrics", timeout=5) as resp:
        return resp.read().decode()


async def test_overloaded_worker_is_429_with_retry_after_through_the_real_engine(launch) -> None:
    """A real worker whose admission budget is full refuses; the real engine and HTTP layer turn
    that into 429 with Retry-After, and the held request is unaffected.

    Kills: the engine mapping `overloaded` to another kind (500/503 or a retry), and a refusal
    that fails the held request too. (Dropping `retry_after` is not observable here: the worker
    always says 1 s, which is also the HTTP layer's default.)"""
    import aiohttp

    from omnistage.orchestrator.http_api import serve_http

    stage = {**echo("a", final=True), "admission": {"maxRequests": 1}}
    pipe = pipeline("ovl", [stage])
    orch, procs, _ = await launch(pipe, {"a": [{}]})
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    route = f"{url}/v1/pipelines/ovl/requests"
    replica = orch.pools["a"].replicas["ovl-a-0"]
    try:
        async with aiohttp.ClientSession() as http:
            held = orch.submit(PipelineRequest(prompt="held", params={"a": {"delay_ms": 60000}}))
            # Admitted, not merely sent: the worker counts it once its budget holds it.
            await _until(lambda: replica.inflight == 1, "the held request in flight")
            await _until(lambda: (sample(_metrics(procs["a"][0]),
                                         "omnistage_worker_admitted_total",
                                         stage="a", replica="ovl-a-0") or 0) >= 1,
                         "the worker admitted the held request")
            async with http.post(route, json={"prompt": "y"}) as resp:
                assert resp.status == 429, await resp.text()
                assert resp.headers["Retry-After"] == "1"
                body = await resp.json()
            assert body["error"]["code"] == "overloaded"
            assert "admission budget full" in body["error"]["message"]
            assert sample(_metrics(procs["a"][0]), "omnistage_worker_rejected_total",
                          stage="a", replica="ovl-a-0", reason="budget") == 1
            assert held.id in orch.requests  # the refusal touched only the new request
            held.abort()
            assert (await held.outcome()).status == "abort"
            async with http.post(route, json={"prompt": "z"}) as resp:  # room again
                assert resp.status == 200, await resp.text()
    finally:
        await runner.cleanup()


async def test_a_draining_reply_is_retried_on_another_replica(launch) -> None:
    """A real worker that is draining (SIGTERM, one request still held) but still listed by
    membership refuses new work with `draining`; the engine retries it on the other replica.

    Kills: the `Draining` case failing the child instead of retrying (the request would end as
    an error), and a retry that excludes nothing (it would go back to the draining replica)."""
    pipe = pipeline("dr", [echo("a", final=True)])
    orch, procs, _ = await launch(pipe, {"a": [{}, {}]})
    held = orch.submit(PipelineRequest(prompt="held", session="s",
                                       params={"a": {"delay_ms": 60000}}))
    child = held._request.children[0]
    await _until(lambda: ("a", False) in child.running, "the held request sent")
    victim = child.running[("a", False)].replica
    assert victim is not None
    other = next(n for n in orch.pools["a"].replicas if n != victim.name)
    proc = next(w for w in procs["a"] if w.name == victim.name)
    # Sent is not enough: the worker must hold it, or the drain would bounce it elsewhere.
    await _until(lambda: _state_or_none(proc).get("in_flight") == 1, "the victim holding it")
    proc.proc.send_signal(signal.SIGTERM)
    await _until(lambda: _state_or_none(proc).get("draining") is True, "the victim draining")
    # Membership still lists it as ready and the session pins to it: the engine sends there.
    assert victim.routable
    _, out = await collect(orch, PipelineRequest(prompt="new", session="s"))
    assert out.status == "ok", out
    assert out.children[0].outputs["a"].replica == other
    assert sample(_metrics(proc), "omnistage_worker_rejected_total", stage="a",
                  replica=victim.name, reason="draining") == 1
    held.abort()
    assert (await held.outcome()).status == "abort"


async def test_a_request_cut_by_a_drain_timeout_says_so_over_http(launch) -> None:
    """A real worker retiring with a request that outlasts its drainTimeoutSeconds cuts it;
    the engine and the HTTP API answer 503 `drain_timeout` (docs/http-api.md), not 200
    `status: abort` with empty text, which is what a client's own abort gets.

    Kills: the worker answering the cut as `aborted`, and the engine mapping its
    `error/drain_timeout` to another code (stage_failed, 502)."""
    import aiohttp

    from omnistage.orchestrator.http_api import serve_http

    pipe = pipeline("cut", [{**echo("a", final=True), "drainTimeoutSeconds": 1}])
    orch, procs, _ = await launch(pipe, {"a": [{}]})
    proc = procs["a"][0]
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    route = f"{url}/v1/pipelines/cut/requests"
    try:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "x", "params": {"a": {"delay_ms": 60000}}, "timeout_s": 120}
            post = asyncio.ensure_future(http.post(route, json=body))
            await _until(lambda: _state_or_none(proc).get("in_flight") == 1,
                         "the request held by the worker")
            proc.proc.send_signal(signal.SIGTERM)
            async with await asyncio.wait_for(post, 60) as resp:  # far less than its 60 s
                got = await resp.json()
                assert resp.status == 503, got
            assert got["error"]["code"] == "drain_timeout", got
            assert got["error"]["type"] == "service_unavailable_error"
            assert "cut the request while draining" in got["error"]["message"], got
            assert "(stage a)" in got["error"]["message"], got
    finally:
        await runner.cleanup()


def _state_or_none(w: WorkerProcess) -> dict[str, Any]:
    try:
        return _state(w)
    except OSError:
        return {}


async def test_a_not_ready_reply_is_retried_on_another_replica(launch) -> None:
    """A replica still loading its model answers `not_ready`; the engine tries the next one.

    A real worker cannot be held in its loading phase, so the loading replica is a FakeWorker;
    the engine and the serving replica are real. Kills: `not_ready` handled as a stage failure,
    and a retry that does not exclude the replica that refused."""
    pipe = pipeline("nr", [echo("a", final=True)])
    orch, _, membership = await launch(pipe, {"a": [{}]})

    def not_ready(msg: dict[str, Any]) -> list[Any]:
        return p.encode(p.Error(code="not_ready", id=msg["id"], replica="loading",
                                message="model is still loading"))

    loading = FakeWorker(on_submit=not_ready)
    try:
        membership.publish(ReplicaInfo("a", "loading", loading.endpoint))
        await _until(lambda: "loading" in orch.pools["a"].replicas
                     and orch.pools["a"].replicas["loading"].routable, "the fake routable")
        # Pin a session to the loading replica so the first try must go there.
        orch.pools["a"].sessions["s"] = "loading"
        _, out = await collect(orch, PipelineRequest(prompt="x", session="s"))
        assert out.status == "ok", out
        assert out.children[0].outputs["a"].replica == "nr-a-0"
        assert [m["t"] for m in loading.received].count("submit") == 1
    finally:
        await loading.close()
