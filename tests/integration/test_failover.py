"""Failover through the real engine, with real worker processes over real ZMQ and kill -9.

A task whose replica is killed runs again on another replica of its stage (from what the
orchestrator kept); a final AR stream resumes from the tokens the client already has; a
streamed edge restarts from the chunks kept. The bounds: maxRetries (0 keeps today's
replica_lost, which proves these tests can fail), the suspect rule, aborts. The same paths with
fake replicas: tests/unit/test_failover.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnistage.orchestrator.requests import Delta, Outcome, PipelineRequest
from tests.integration.test_orchestrator import _until, collect, echo, held, pipeline
from tests.integration.test_orchestrator import launch as launch  # the fixture
from tests.integration.test_shm import config, worker_state
from tests.integration.test_shm import shm_dir as shm_dir  # the fixture
from tests.integration.test_speech_streaming import PROMPT, sink_env, speech
from tests.integration.test_speech_streaming import sink_kind as sink_kind  # the fixture
from tests.integration.test_stage_streaming import TEXT, two_stage

pytestmark = pytest.mark.timeout(300)


def retries(pipe: Any, n: int) -> Any:
    pipe.spec.orchestrator.failover.max_retries = n
    return pipe


def proc_of(procs: dict[str, list[Any]], stage: str, name: str) -> Any:
    return next(w for w in procs[stage] if w.name == name)


@pytest.mark.parametrize("max_retries", [2, 0])
async def test_kill_9_under_concurrency_fails_nothing_unless_retries_are_off(
        launch, tmp_path: Path, max_retries: int) -> None:
    """12 requests held on 3 replicas of a middle stage; one replica is killed while it holds
    some. With failover none fails (each went on from a's output kept); with maxRetries 0
    exactly the victim's fail with replica_lost: the test can fail."""
    pipe = retries(pipeline(f"conc{max_retries}", [
        echo("a"), echo("b", ("a",)), echo("c", ("b",), final=True)]), max_retries)
    release = tmp_path / "release"
    orch, procs, _ = await launch(pipe, {"a": [{}], "b": [held(release)] * 3, "c": [{}]},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handles = [orch.submit(PipelineRequest(prompt=f"p{i}")) for i in range(12)]
    await _until(lambda: sum(r.inflight for r in orch.pools["b"].replicas.values()) == 12,
                 "12 requests held at b")
    victim = orch.pools["b"].replicas[f"conc{max_retries}-b-0"]
    bound = {t.child.request.id for t in victim.bound}
    assert bound
    proc_of(procs, "b", victim.name).proc.send_signal(signal.SIGKILL)
    await _until(lambda: not victim.bound and victim.incarnation is None, "the loss seen")
    release.touch()
    outcomes = await asyncio.wait_for(asyncio.gather(*(h.outcome() for h in handles)), 120)
    failed = {o.request_id: o.error.code for o in outcomes if o.status != "ok"}
    if max_retries:
        assert failed == {}
        for h, o in zip(handles, outcomes, strict=True):
            assert o.children[0].outputs["c"].fields["text"] == h._request.req.prompt
        assert orch.failovers["retries"] == {"b": len(bound)}
    else:
        assert failed == dict.fromkeys(bound, "replica_lost")
    assert sum(orch.outcomes.values()) == 12  # one terminal outcome each
    assert orch.requests == {} and orch.tasks == {}


def chat(name: str) -> Any:
    return pipeline(name, [{"name": "llm", "kind": "ar", "model": "tiny-llama",
                            "finalOutput": True, "engine": {"maxTokens": 160}}])


async def stream(orch: Any, req: PipelineRequest, on_first: Any = None
                 ) -> tuple[list[Delta], Outcome]:
    deltas: list[Delta] = []
    handle = orch.submit(req)
    async for ev in handle.events():
        if isinstance(ev, Delta):
            deltas.append(ev)
            if len(deltas) == 3 and on_first is not None:
                on_first(handle)
        elif isinstance(ev, Outcome):
            return deltas, ev
    raise AssertionError("no outcome")


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded"])
async def test_a_chat_stream_resumes_on_another_replica_byte_for_byte(
        launch, sampling: dict[str, Any]) -> None:
    """The replica streaming a chat answer is killed after three deltas: the stream goes on
    from another replica; the client's text and tokens equal a fault-free run's, none
    repeated or missing."""
    pipe = chat("resume")
    orch, procs, _ = await launch(pipe, {"llm": [{}, {}]},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    params = {"llm": {"ignore_eos": True, **sampling}}

    def req() -> PipelineRequest:
        return PipelineRequest(prompt="tell me a story", stream=True, params=params)

    clean_deltas, clean = await stream(orch, req())
    assert clean.status == "ok"
    killed: list[str] = []

    def kill(handle: Any) -> None:
        task = handle._request.children[0].running[("llm", False)]
        killed.append(task.replica.name)
        proc_of(procs, "llm", task.replica.name).proc.send_signal(signal.SIGKILL)

    deltas, out = await stream(orch, req(), on_first=kill)
    assert out.status == "ok", out
    assert orch.failovers["resumes"] == {"llm": 1}, "the kill came after the stream ended"
    assert out.children[0].outputs["llm"].replica != killed[0]
    assert "".join(d.text for d in deltas) == "".join(d.text for d in clean_deltas)
    assert [t for d in deltas for t in d.token_ids] == \
        [t for d in clean_deltas for t in d.token_ids]
    fields, clean_fields = out.children[0].outputs["llm"].fields, \
        clean.children[0].outputs["llm"].fields
    assert fields["text"] == clean_fields["text"]
    assert fields["token_ids"] == clean_fields["token_ids"]
    assert fields["completion_tokens"] == 160


async def test_a_request_that_kills_every_replica_fails_once_as_a_suspect(
        launch, tmp_path: Path, caplog) -> None:
    """Each replica the request reaches dies under it (the test plays the poison): after the
    second loss it fails with replica_lost and is logged as a suspect; the third replica never
    sees it, though retries were left."""
    caplog.set_level(logging.WARNING, logger="omnistage.orchestrator")
    release = tmp_path / "release"
    pipe = retries(pipeline("poison", [echo("a", final=True)]), 5)
    orch, procs, _ = await launch(pipe, {"a": [held(release)] * 3},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handle = orch.submit(PipelineRequest(prompt="poison", request_id="poison-1"))
    child = handle._request.children[0]
    reached = []
    for _ in range(2):
        await _until(lambda: ("a", False) in child.running
                     and child.running[("a", False)].replica is not None
                     and child.running[("a", False)].replica.name not in reached,
                     "the request on a new replica")
        name = child.running[("a", False)].replica.name
        reached.append(name)
        proc_of(procs, "a", name).proc.send_signal(signal.SIGKILL)
    events = [ev async for ev in handle.events()]
    assert len(events) == 1 and isinstance(events[0], Outcome)
    assert events[0].error.code == "replica_lost"
    assert "request poison-1 is a suspect: it lost 2 replicas of stage a" in caplog.text
    third = next(r for r in orch.pools["a"].replicas.values() if r.name not in reached)
    assert third.served == 0
    release.touch()


async def test_an_aborted_request_is_not_retried(launch, tmp_path: Path) -> None:
    release = tmp_path / "release"
    pipe = pipeline("aborted", [echo("a", final=True)])
    orch, procs, _ = await launch(pipe, {"a": [held(release)] * 2},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handle = orch.submit(PipelineRequest(prompt="x"))
    task = handle._request.children[0].running[("a", False)]
    await _until(lambda: task.replica is not None, "sent")
    lost = task.replica
    # The abort and the kill cross: no loop turn between them, so the loss may well come
    # before the worker's Aborted reply.
    handle.abort()
    proc_of(procs, "a", lost.name).proc.send_signal(signal.SIGKILL)
    out = await asyncio.wait_for(handle.outcome(), 60)
    assert out.status == "abort"
    assert orch.failovers["retries"] == {}
    assert all(r.served == 0 for r in orch.pools["a"].replicas.values() if r is not lost)
    release.touch()


@pytest.mark.parametrize("victim", ["a", "b"])
async def test_a_streamed_edge_restarts_when_either_end_is_killed(launch, victim: str) -> None:
    """a streams chunks to b. b killed: another b is fed every chunk kept; a killed: a runs
    again elsewhere and b restarts on its new chunks. The output is whole either way."""
    pipe = two_stage(f"edge{victim}", echoChunkChars=1, echoChunkDelayMs=60)
    orch, procs, _ = await launch(pipe, {"a": [{}, {}], "b": [{}, {}]},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handle = orch.submit(PipelineRequest(prompt=TEXT))
    child = handle._request.children[0]
    await _until(lambda: len(child.streams["a"].chunks) >= 3
                 and ("b", False) in child.running, "b fed three chunks")
    task = child.running[(victim, False)]
    proc_of(procs, victim, task.replica.name).proc.send_signal(signal.SIGKILL)
    out = await asyncio.wait_for(handle.outcome(), 120)
    assert out.status == "ok", out
    assert out.children[0].outputs["b"].fields["text"] == TEXT
    assert orch.failovers["retries"] == {victim: 1}
    assert orch.requests == {} and orch.tasks == {}


async def test_speech_vocoder_killed_mid_stream_restarts_from_the_chunks_kept(
        sink_kind, launch, tmp_path: Path) -> None:
    """talker -> vocoder -> sink, chunk by chunk. The vocoder decoding one of two streams is
    killed: another vocoder is fed every talker chunk kept, the sink it fed restarts on the new
    vocoder's chunks, and both requests end with the same audio (the talker is seeded)."""
    hold = tmp_path / "release"
    sinks = [{"env": sink_env(hold)}] * 2
    orch, procs, _ = await launch(speech("fospeech"), {
        "talker": [{}, {}], "vocoder": [{}, {}], "sink": sinks},
        heartbeat_interval=0.5, heartbeat_timeout=60)
    handles = [orch.submit(PipelineRequest(prompt=PROMPT)) for _ in range(2)]
    victim = orch.pools["vocoder"].replicas["fospeech-vocoder-0"]
    other = orch.pools["vocoder"].replicas["fospeech-vocoder-1"]
    await _until(lambda: victim.bound and other.bound, "both vocoder replicas fed")
    proc_of(procs, "vocoder", victim.name).proc.send_signal(signal.SIGKILL)
    await _until(lambda: orch.failovers["retries"] == {"vocoder": 1}, "the vocoder failed over")
    hold.touch()
    outs = await asyncio.wait_for(asyncio.gather(*(h.outcome() for h in handles)), 120)
    assert [o.status for o in outs] == ["ok", "ok"], outs
    audio = [o.children[0].outputs["sink"].tensors["audio"].numpy() for o in outs]
    # Equal up to float rounding: the two streams were not decoded in the same batches.
    assert audio[0].shape[0] > 0 and audio[0].shape == audio[1].shape
    np.testing.assert_allclose(audio[0], audio[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("victim", ["a", "b"])
async def test_failover_on_shared_memory_gives_every_block_back(
        launch, shm_dir, victim: str) -> None:
    """Every chunk tensor lies in shared memory (min_bytes 0). Whichever end of the streamed
    edge is killed, the request ends ok and, once it did, no live worker has a block lent and
    the orchestrator's own segment is empty: keeping upstream outputs for a retry leaks
    nothing."""
    cfg = config(shm_dir, session=f"fo{victim}", min_bytes=0)
    env = {"env": cfg.env()}
    pipe = two_stage(f"shm{victim}", echoChunkChars=1, echoChunkDelayMs=60)
    orch, procs, _ = await launch(pipe, {"a": [env, env], "b": [env, env]}, shm=cfg,
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handle = orch.submit(PipelineRequest(prompt=TEXT))
    child = handle._request.children[0]
    await _until(lambda: len(child.streams["a"].chunks) >= 3
                 and ("b", False) in child.running, "b fed three chunks")
    killed = child.running[(victim, False)].replica.name
    proc_of(procs, victim, killed).proc.send_signal(signal.SIGKILL)
    out = await asyncio.wait_for(handle.outcome(), 120)
    assert out.status == "ok", out
    assert out.children[0].outputs["b"].fields["text"] == TEXT
    assert orch.failovers["retries"] == {victim: 1}
    live = [w for ws in procs.values() for w in ws if w.name != killed]
    for w in live:
        await _until(lambda w=w: worker_state(w)["shm"]["lent"] == 0, f"{w.name}: blocks back")
        await _until(lambda w=w: worker_state(w)["in_flight"] == 0, f"{w.name}: idle")
    assert orch.shm is not None and orch.shm.segment.live == 0


async def test_a_diffusion_sample_restarts_and_equals_the_fault_free_image(launch) -> None:
    """The replica denoising a seeded sample is killed: the sample starts over on the other
    replica from the encoder's hidden states kept (the encoder does not run again), and the
    image equals a fault-free run's."""
    pipe = pipeline("fot2i", [
        {"name": "enc", "kind": "ar", "model": "tiny-llama", "engine": {"maxTokens": 2}},
        {"name": "img", "kind": "diffusion", "model": "tiny-unet", "inputs": ["enc"],
         "finalOutput": True},
    ])
    orch, procs, _ = await launch(pipe, {"enc": [{}], "img": [{}, {}]},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    # Enough steps that the kill surely lands while it denoises.
    params = {"img": {"height": 32, "width": 32, "num_inference_steps": 25, "seed": 11}}
    _, clean = await collect(orch, PipelineRequest(prompt="a cat", params=params))
    assert clean.status == "ok", clean
    enc_served = orch.pools["enc"].replicas["fot2i-enc-0"].served
    handle = orch.submit(PipelineRequest(prompt="a cat", params=params))
    child = handle._request.children[0]
    await _until(lambda: ("img", False) in child.running
                 and child.running[("img", False)].replica is not None, "img sent")
    killed = child.running[("img", False)].replica.name
    proc_of(procs, "img", killed).proc.send_signal(signal.SIGKILL)
    out = await asyncio.wait_for(handle.outcome(), 120)
    assert out.status == "ok", out
    assert out.children[0].outputs["img"].replica != killed
    assert orch.failovers["retries"] == {"img": 1}
    assert orch.pools["enc"].replicas["fot2i-enc-0"].served == enc_served + 1
    assert np.array_equal(out.children[0].outputs["img"].tensors["image"].numpy(),
                          clean.children[0].outputs["img"].tensors["image"].numpy())


@pytest.mark.parametrize("window", [2, None], ids=["window", "no-window"])
async def test_with_a_dispatch_window_a_failed_over_request_goes_first(
        launch, tmp_path: Path, window: int | None) -> None:
    """Two serial echo replicas, 8 requests held by the workers, a dispatch window of 2 (one
    running, one queued on each replica, four waiting in the orchestrator). kill -9 of the
    replica holding the oldest request: nothing fails, and each failed-over request finishes
    before every request admitted after the ones then on replicas (its retry went to the front
    of the orchestrator's queue). Without a window (the default) every task is on a replica
    at once and the retries queue behind the survivor's: some later request finishes first,
    which proves the test can fail."""
    stage = {**echo("a", final=True), "dispatch": {"perReplica": window}}
    pipe = pipeline(f"win{window or 0}", [stage])
    release = tmp_path / "release"
    orch, procs, _ = await launch(pipe, {"a": [held(release)] * 2},
                                  heartbeat_interval=0.5, heartbeat_timeout=60)
    handles = [orch.submit(PipelineRequest(prompt=f"p{i}", request_id=f"r{i}"))
               for i in range(8)]
    replicas = orch.pools["a"].replicas
    await _until(lambda: sum(r.inflight for r in replicas.values()) == (4 if window else 8),
                 "the requests placed")
    assert orch.load().stages["a"].held == (4 if window else 0)
    victim = next(r for r in replicas.values() if any(
        t.child.request.id == "r0" for t in r.bound))
    bound = {t.child.request.id for t in victim.bound}
    later = {f"r{i}" for i in range(4, 8)} - bound  # admitted after those on replicas
    order: list[str] = []

    async def ended(h: Any) -> Outcome:
        out = await h.outcome()
        order.append(h.id)
        return out

    waits = [asyncio.ensure_future(ended(h)) for h in handles]
    proc_of(procs, "a", victim.name).proc.send_signal(signal.SIGKILL)
    await _until(lambda: not victim.bound and victim.incarnation is None, "the loss seen")
    release.touch()
    outcomes = await asyncio.wait_for(asyncio.gather(*waits), 120)
    assert [o.status for o in outcomes] == ["ok"] * 8, outcomes
    assert [o.children[0].outputs["a"].fields["text"] for o in outcomes] == \
        [f"p{i}" for i in range(8)]
    assert orch.failovers["retries"] == {"a": len(bound)}
    last_retried = max(order.index(rid) for rid in bound)
    first_later = min(order.index(rid) for rid in later)
    if window:
        assert last_retried < first_later, order
    else:
        assert first_later < last_retried, order
    assert orch.requests == {} and orch.tasks == {}
