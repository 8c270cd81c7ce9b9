"""Streaming between stages, against real worker processes over real ZMQ (echo stages).

An echo stage with `chunk_chars` sends its text in pieces; a downstream echo starts on the
first piece (fed) and echoes each as it comes. What proves the streaming is read from the
workers (their /state `chunks` figures) and from the order of events, never from sleeps.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import msgspec
import numpy as np
import pytest

import omnistage.kinds as stage_kinds
from omnistage import protocol as p
from omnistage.orchestrator.requests import Delta, Outcome, PipelineRequest
from tests.integration.test_orchestrator import _until, collect, pipeline
from tests.integration.test_orchestrator import launch as launch  # the fixture
from tests.integration.test_shm import config, segments, worker_state
from tests.integration.test_shm import shm_dir as shm_dir  # the fixture
from tests.integration.test_stage_kinds import ENTRY, _pythonpath
from tests.integration.test_stage_kinds import reverse as reverse  # the fixture

pytestmark = pytest.mark.timeout(300)

TEXT = "streaming between stages!"  # 25 characters


def echo(name: str, inputs: tuple[str, ...] = (), *, final: bool = False,
         streaming: bool = True, window: int = 8, **engine: Any) -> dict[str, Any]:
    return {"name": name, "kind": "echo", "inputs": list(inputs), "finalOutput": final,
            "engine": engine, "streaming": {"enabled": streaming, "window": window}}


def chunks(w: Any) -> dict[str, int]:
    """A worker's streaming figures, from its side port's /state."""
    return worker_state(w)["chunks"]  # type: ignore[no-any-return]


def two_stage(name: str, *, streaming: bool = True, **a_engine: Any) -> Any:
    return pipeline(name, [echo("a", streaming=streaming, **a_engine),
                           echo("b", ("a",), final=True)])


async def test_downstream_starts_on_the_first_chunk_and_the_output_is_unchanged(launch) -> None:
    """b's first delta reaches the client while a is still emitting (a's worker has sent
    fewer chunks than it will), and the text equals what the same pipeline gives without
    streaming, where b starts only after a's end."""
    engine = {"echoChunkChars": 2, "echoChunkDelayMs": 40}  # 13 pieces, 40 ms apart
    orch, procs, _ = await launch(two_stage("on", **engine), {"a": [{}], "b": [{}]})
    handle = orch.submit(PipelineRequest(prompt=TEXT, stream=True))
    child = handle._request.children[0]
    seen: dict[str, Any] = {}
    deltas: list[Delta] = []
    outcome = None
    async for ev in handle.events():
        if isinstance(ev, Delta):
            if not deltas:
                seen = {"a_running": ("a", False) in child.running,
                        "a_sent": chunks(procs["a"][0])["sent"],
                        "b_fed": chunks(procs["b"][0])["fed"]}
            deltas.append(ev)
        else:
            outcome = ev
    assert outcome is not None and outcome.status == "ok", outcome
    assert seen["a_running"], seen  # b spoke before a's end reached the orchestrator
    assert 1 <= seen["a_sent"] < 13, seen  # ... and before a's worker had sent every piece
    assert seen["b_fed"] >= 1, seen
    assert [d.stage for d in deltas] == ["b"] * 13  # one delta per piece, as they came
    streamed = outcome.children[0].outputs["b"].fields["text"]
    assert "".join(d.text for d in deltas) == streamed == TEXT
    assert chunks(procs["a"][0])["sent"] == 13 and chunks(procs["b"][0])["fed"] == 13

    # The same pipeline with streaming turned off on a: b starts after a's end, same text.
    orch2, procs2, _ = await launch(two_stage("off", streaming=False, **engine),
                                    {"a": [{}], "b": [{}]})
    handle = orch2.submit(PipelineRequest(prompt=TEXT, stream=True))
    child = handle._request.children[0]
    first: bool | None = None
    async for ev in handle.events():
        if isinstance(ev, Delta) and first is None:
            first = ("a", False) in child.running
        elif isinstance(ev, Outcome):
            outcome = ev
    assert first is False  # a had ended before b's first delta
    assert outcome.status == "ok" and outcome.children[0].outputs["b"].fields["text"] == streamed
    assert chunks(procs2["a"][0])["sent"] == 0 and chunks(procs2["b"][0])["fed"] == 0


async def test_three_stages_stream_through_a_fed_stage_that_also_emits_chunks(launch) -> None:
    pipe = pipeline("chain", [echo("a", echoChunkChars=3, echoChunkDelayMs=30),
                              echo("b", ("a",), echoChunkChars=1),
                              echo("c", ("b",), final=True)])
    orch, procs, _ = await launch(pipe, {"a": [{}], "b": [{}], "c": [{}]})
    _, out = await collect(orch, PipelineRequest(prompt=TEXT))
    assert out.status == "ok", out
    assert out.children[0].outputs["c"].fields["text"] == TEXT
    assert chunks(procs["b"][0])["fed"] == 9  # ceil(25 / 3) pieces of a
    assert chunks(procs["b"][0])["sent"] == 25 == chunks(procs["c"][0])["fed"]


async def test_abort_mid_stream_stops_every_stage_and_frees_every_block(launch, shm_dir) -> None:
    """Every chunk tensor goes through shared memory (min_bytes 0); an abort while both
    stages run ends both (in-flight 0), and every block goes back."""
    cfg = config(shm_dir, session="stream", min_bytes=0)
    env = {"env": cfg.env()}
    pipe = two_stage("abort", echoChunkChars=1, echoChunkDelayMs=100)  # 25 pieces, 2.5 s
    orch, procs, _ = await launch(pipe, {"a": [env], "b": [env]}, shm=cfg)
    a, b = procs["a"][0], procs["b"][0]
    handle = orch.submit(PipelineRequest(prompt=TEXT))
    await _until(lambda: chunks(b)["fed"] >= 3, "b fed three chunks")
    # Chunk tensors went through a's segment (each block back at its credit, not the end).
    assert worker_state(a)["shm"]["placed"] >= 3
    assert worker_state(a)["in_flight"] == 1 and worker_state(b)["in_flight"] == 1
    handle.abort()
    out = await asyncio.wait_for(handle.outcome(), 30)
    assert out.status == "abort", out
    assert chunks(a)["sent"] < 25  # a stopped mid-stream
    await _until(lambda: worker_state(a)["in_flight"] == 0 == worker_state(b)["in_flight"],
                 "both stages stopped")
    await _until(lambda: worker_state(a)["shm"]["lent"] == 0, "a got every block back")
    await _until(lambda: worker_state(b)["shm"]["lent"] == 0, "b lent nothing that stayed")
    assert orch.shm is not None and orch.shm.segment.live == 0
    assert len(segments(shm_dir)) == 3  # two workers and the orchestrator, nothing else
    # The pipeline still streams after the abort.
    _, ok = await collect(orch, PipelineRequest(prompt="ok", params={"a": {"chunk_delay_ms": 0}}))
    assert ok.status == "ok" and ok.children[0].outputs["b"].fields["text"] == "ok"


async def test_kill_9_downstream_mid_stream_fails_only_its_requests_once(launch) -> None:
    pipe = two_stage("kill", echoChunkChars=1, echoChunkDelayMs=100)  # 2.5 s per request
    pipe.spec.orchestrator.failover.max_retries = 0  # the no-retry path; failover: test_failover.py
    orch, procs, _ = await launch(pipe, {"a": [{}, {}], "b": [{}, {}]},
                                  heartbeat_interval=0.5, heartbeat_timeout=3.0)
    handles = [orch.submit(PipelineRequest(prompt=TEXT)) for _ in range(4)]
    victim = orch.pools["b"].replicas["kill-b-0"]
    other = orch.pools["b"].replicas["kill-b-1"]
    # Two requests stream at once (a runs one request per replica); each b replica takes one.
    await _until(lambda: victim.bound and other.bound, "both b replicas fed")
    bound = {t.child.request.id for t in victim.bound}
    procs["b"][0].proc.send_signal(signal.SIGKILL)
    for h in handles:
        events = [ev async for ev in h.events()]
        terminal = [e for e in events if isinstance(e, Outcome)]
        assert len(terminal) == 1, events  # exactly one terminal outcome each
        if h.id in bound:
            assert terminal[0].status == "fatal" and terminal[0].error.code == "replica_lost"
            assert terminal[0].error.stage == "b"
        else:
            assert terminal[0].status == "ok", terminal[0]
            assert terminal[0].children[0].outputs["b"].fields["text"] == TEXT
    assert sum(orch.outcomes.values()) == 4
    assert orch.outcomes.get("fatal") == len(bound) >= 1
    for w in procs["a"]:  # the upstream of a lost request was stopped too
        await _until(lambda w=w: worker_state(w)["in_flight"] == 0, "a idle")


async def test_deadline_mid_stream_is_one_terminal_outcome(launch) -> None:
    pipe = two_stage("late", echoChunkChars=1, echoChunkDelayMs=100)  # 2.5 s of work
    orch, procs, _ = await launch(pipe, {"a": [{}], "b": [{}]})
    handle = orch.submit(PipelineRequest(prompt=TEXT, timeout_s=1.0))
    events = [ev async for ev in handle.events()]
    terminal = [e for e in events if isinstance(e, Outcome)]
    assert len(terminal) == 1 and terminal[0].error is not None
    assert terminal[0].error.code == "deadline", terminal[0]
    assert chunks(procs["b"][0])["fed"] >= 1  # it was mid-stream
    for w in (procs["a"][0], procs["b"][0]):
        await _until(lambda w=w: worker_state(w)["in_flight"] == 0, "stage stopped")
    assert chunks(procs["a"][0])["sent"] < 25  # ended by the deadline, not by the work
    assert not orch.requests


async def test_a_slow_downstream_holds_the_upstream_within_its_window(launch) -> None:
    """a could send its 25 pieces at once; b takes one per 60 ms. a's worker never has more
    than the window (3) out, and had to wait for credit."""
    pipe = pipeline("slow", [echo("a", window=3, echoChunkChars=1),
                             echo("b", ("a",), final=True, echoChunkDelayMs=60)])
    orch, procs, _ = await launch(pipe, {"a": [{}], "b": [{}]})
    a = procs["a"][0]
    handle = orch.submit(PipelineRequest(prompt=TEXT))
    await _until(lambda: chunks(procs["b"][0])["fed"] >= 5, "b fed five chunks")
    mid = chunks(a)
    assert mid["sent"] < 25 and mid["outstanding"] <= 3, mid  # held back mid-way
    out = await handle.outcome()
    assert out.status == "ok" and out.children[0].outputs["b"].fields["text"] == TEXT
    done = chunks(a)
    assert done["sent"] == 25 and done["outstanding_peak"] == 3, done
    assert done["window_waits"] >= 10, done  # back-pressure held it, again and again


# ---- the worker's side of the wire, without an orchestrator ---------------------------------


async def test_the_worker_speaks_chunk_feed_and_credit(start_worker, channels) -> None:
    """A producer holds at its window until credited; a fed consumer credits each chunk it
    takes; stray or malformed streaming messages are refused and the worker keeps serving."""
    w = start_worker("echo")
    ch = channels(w)
    await ch.handshake(10)

    async def next_reply() -> p.Message[Any]:
        return await asyncio.wait_for(ch.unsolicited.get(), 10)

    ch.send(p.Submit(id="up", params={"prompt": "abcdef", "chunk_chars": 2}, chunk_window=1))
    first = await next_reply()
    assert isinstance(first.header, p.Chunk) and (first.header.seq, first.header.text) == (1, "ab")
    assert bytes(first.tensors["chunk"].numpy()) == b"ab"
    await _until(lambda: chunks(w)["window_waits"] == 1, "the producer waits for credit")
    assert ch.unsolicited.empty() and chunks(w)["outstanding"] == 1
    texts = ["ab"]
    for seq in (1, 2):
        ch.send(p.Credit(id="up", seq=seq))
        msg = await next_reply()
        assert isinstance(msg.header, p.Chunk) and msg.header.seq == seq + 1
        texts.append(msg.header.text)
    final = await next_reply()
    assert isinstance(final.header, p.Final) and final.header.text == "".join(texts) == "abcdef"

    ch.send(p.Submit(id="down", fed=True))
    ch.send(p.Feed(id="down", seq=1, text="xy"), {"chunk": np.frombuffer(b"xy", np.uint8)})
    credit = await next_reply()
    assert isinstance(credit.header, p.Credit) and (credit.header.id, credit.header.seq) == (
        "down", 1)
    ch.send(p.Feed(id="down", seq=1, text="again"))  # a repeat: dropped
    ch.send(p.Feed(id="down", seq=2, last=True))
    final = await next_reply()
    assert isinstance(final.header, p.Final) and final.header.text == "xy"
    # The whole input at once (one turn, so one batch): by the time the executor takes the
    # chunk the input has ended, nothing upstream waits for room, and no credit is sent.
    ch.send(p.Submit(id="whole", fed=True))
    ch.send(p.Feed(id="whole", seq=1, text="pq"))
    ch.send(p.Feed(id="whole", seq=2, last=True))
    final = await next_reply()
    assert isinstance(final.header, p.Final) and final.header.text == "pq", final.header

    ch.send(p.Feed(id="gone", seq=1, text="x"))  # no such request: counted, no reply
    ch.send(p.Credit(id="gone", seq=1))
    await _until(lambda: chunks(w)["late_feeds"] == 3, "stray messages counted")
    ch.send_raw([msgspec.msgpack.encode({"t": "feed", "id": "bad", "seq": 0})])
    bad = await next_reply()
    assert isinstance(bad.header, p.Error) and bad.header.code == "malformed"
    assert bad.header.id == "bad" and "`$.seq`" in bad.header.message
    ch.send(p.Submit(id="plain", params={"delay_ms": 30_000}))
    ch.send(p.Feed(id="plain", seq=1, text="x"))  # not submitted fed: the misuse cancels it
    aborted = await next_reply()
    assert isinstance(aborted.header, p.Aborted) and aborted.header.id == "plain"
    assert (await ch.ping(5)).state.ready and ch.unsolicited.empty()
    assert worker_state(w)["in_flight"] == 0


async def test_only_edges_whose_kinds_stream_do(reverse, launch, start_worker, channels) -> None:
    """A kind whose row says neither (the test-only `reverse`) hands over whole outputs to a
    streaming kind, and its worker refuses chunk_window and fed naming the field."""
    env = {"env": {stage_kinds.ENV_VAR: ENTRY, "PYTHONPATH": _pythonpath()}}
    pipe = pipeline("rev", [{"name": "rev", "kind": "reverse"}, echo("out", ("rev",), final=True)])
    orch, procs, _ = await launch(pipe, {"rev": [env], "out": [{}]})
    _, out = await collect(orch, PipelineRequest(prompt="abc"))
    assert out.status == "ok" and out.children[0].outputs["out"].fields["text"] == "cba"
    assert chunks(procs["out"][0])["fed"] == 0  # out got the whole text in its submit
    ch = channels(procs["rev"][0])
    await ch.handshake(10)
    for submit, error in ((p.Submit(id="w", chunk_window=2),
                           "chunk_window: stage kind 'reverse' does not emit chunks"),
                          (p.Submit(id="f", fed=True),
                           "fed: stage kind 'reverse' does not consume chunks")):
        ch.send(submit)
        reply = await asyncio.wait_for(ch.unsolicited.get(), 10)
        assert isinstance(reply.header, p.Error) and reply.header.code == "bad_request"
        assert reply.header.message == error
