"""Speech streamed between stages, in real worker processes behind the real orchestrator.

talker -> vocoder -> sink: the talker hands its codec frames on every `chunkFrames`, the vocoder
decodes each window as its frames arrive and hands its audio on, and `sink` (a test-only kind
registered here, which takes audio chunks) collects them. The sink can be held (it waits for a
file before it takes anything), so back-pressure keeps all three stages mid-speech for as long
as a test needs: no sleeps, no races with the tiny models' millisecond steps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import omnistage.kinds as stage_kinds
from omnistage.admission import ExecutionContext
from omnistage.executors.base import Emit, Executor, Outcome, StageIO
from omnistage.kinds import Payload, StageKind
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import Outcome as Done
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.protocol import WireTensor
from tests.integration.test_orchestrator import _until, pipeline
from tests.integration.test_orchestrator import launch as launch  # the fixture
from tests.integration.test_shm import config, segments, worker_state
from tests.integration.test_shm import shm_dir as shm_dir  # the fixture
from tests.integration.test_stage_kinds import _pythonpath

pytestmark = pytest.mark.timeout(300)

HOLD_ENV = "OMNISTAGE_TEST_SINK_HOLD"
PROMPT = "hello there"
SEED = 3  # with PROMPT, the tiny talker speaks 20+ frames before its end code


class SinkExecutor(Executor):
    """Takes audio, whole or fed in chunks, and returns it joined. With HOLD_ENV set to a path
    it takes nothing until that file exists (abortable)."""

    kind = "sink"

    def load(self) -> None:
        hold = os.environ.get(HOLD_ENV)
        self.hold = Path(hold) if hold else None

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> Any:
        return dict(tensors)

    def cost(self, job: Any) -> int:
        return 1

    def execute(self, job: Any, ctx: ExecutionContext, emit: Emit) -> Outcome:
        io = StageIO.of(emit)
        while self.hold is not None and not self.hold.exists():
            if ctx.token.cancelled:
                return Outcome({"finish_reason": "abort"}, aborted=True)
            ctx.check()
            time.sleep(0.01)
        if io.fed:
            pieces = [np.array(c.tensors["audio"].numpy()) for c in io.inputs()]
        else:
            pieces = [np.array(job["audio"].numpy())]
        return Outcome({"finish_reason": "stop"}, {"audio": np.concatenate(pieces)})


SINK = StageKind(name="sink", executor=f"{__name__}:SinkExecutor", summary="test only",
                 needs_model=False, consumes=frozenset({Payload.AUDIO}),
                 emits=frozenset({Payload.AUDIO}), chunked_input=True)


@pytest.fixture
def sink_kind() -> Iterator[StageKind]:
    with stage_kinds.registered(SINK) as kind:
        yield kind


def sink_env(hold: Path | None = None) -> dict[str, str]:
    env = {stage_kinds.ENV_VAR: f"{__name__}:SINK", "PYTHONPATH": _pythonpath()}
    if hold is not None:
        env[HOLD_ENV] = str(hold)
    return env


def speech(name: str, *, streaming: bool = True, chunk: int = 2, frames: int = 32) -> Any:
    """talker -> vocoder -> sink, every edge with a window of 1 chunk."""
    flow = {"enabled": streaming, "window": 1}
    return pipeline(name, [
        {"name": "talker", "kind": "talker", "model": "tiny-omni-talker", "streaming": flow,
         "engine": {"voices": ["default"], "maxFrames": frames, "chunkFrames": chunk,
                    "seed": SEED}},
        {"name": "vocoder", "kind": "vocoder", "model": "tiny-omni-vocoder", "inputs": ["talker"],
         "streaming": flow, "engine": {"chunkFrames": chunk}},
        {"name": "sink", "kind": "sink", "inputs": ["vocoder"], "finalOutput": True,
         "streaming": flow},
    ])


def chunks(w: Any) -> dict[str, int]:
    return worker_state(w)["chunks"]  # type: ignore[no-any-return]


def record(orch: Orchestrator) -> list[tuple[str, str]]:
    """The order in which the orchestrator took its workers' chunks and terminal replies."""
    events: list[tuple[str, str]] = []
    on_chunk, on_terminal = orch._on_chunk, orch._on_terminal

    def chunk(task: Any, msg: Any) -> None:
        events.append((task.stage, "chunk"))
        on_chunk(task, msg)

    def terminal(task: Any, msg: Any) -> None:
        events.append((task.stage, "end"))
        on_terminal(task, msg)

    orch._on_chunk, orch._on_terminal = chunk, terminal  # type: ignore[method-assign]
    return events


@pytest.fixture
async def serve_twice(start_worker) -> AsyncIterator[Any]:
    """One worker per stage, and an orchestrator over them for each pipeline given: streaming
    on and off (streaming is the orchestrator's routing; the workers are the same)."""
    orchs: list[Orchestrator] = []

    async def go(*pipes: Any) -> tuple[Any, ...]:
        procs, infos = {}, []
        for stage in pipes[0].spec.stages:
            env = sink_env() if stage.kind == "sink" else None
            name = f"{pipes[0].metadata.name}-{stage.name}-0"
            w = start_worker(stage, name=name, env=env)
            procs[stage.name] = w
            infos.append(ReplicaInfo(stage.name, name, w.zmq))
        mine = [Orchestrator(pipe, StaticMembership(infos)) for pipe in pipes]
        for orch in mine:
            await orch.start()
            orchs.append(orch)
        return (*mine, procs)

    yield go
    for orch in orchs:
        await orch.stop(drain_timeout=1)


async def outcome_of(orch: Orchestrator, req: PipelineRequest) -> Done:
    return await asyncio.wait_for(orch.submit(req).outcome(), 120)


async def test_the_vocoder_speaks_before_the_talker_ends_and_the_audio_is_unchanged(
    sink_kind, serve_twice,
) -> None:
    on, off, procs = await serve_twice(speech("on"), speech("off", streaming=False))
    finals = ["talker", "vocoder", "sink"]
    events = record(on)
    out = await outcome_of(on, PipelineRequest(prompt=PROMPT, finals=finals))
    assert out.status == "ok", out
    got = out.children[0].outputs
    frames = got["talker"].tensors["codec_codes"].numpy().shape[0]
    n = -(-frames // 2)  # chunks of 2 frames
    assert n >= 4, frames  # enough chunks that the order below means something
    first_audio = events.index(("vocoder", "chunk"))
    assert first_audio < events.index(("talker", "end")), events
    assert events.count(("talker", "chunk")) == n == events.count(("vocoder", "chunk")), events
    # The workers' own figures: every talker chunk fed to the vocoder, every audio chunk to
    # the sink.
    assert chunks(procs["talker"])["sent"] == n == chunks(procs["vocoder"])["fed"]
    assert chunks(procs["vocoder"])["sent"] == n == chunks(procs["sink"])["fed"]
    audio = got["vocoder"].tensors["audio"].numpy()
    assert audio.dtype == np.float32 and audio.size > 0
    assert got["vocoder"].fields["sample_rate"] == 16000
    assert got["sink"].tensors["audio"].numpy().tobytes() == audio.tobytes()  # chunks == whole

    # Streaming off: the vocoder starts after the talker's end, with the whole codes; the
    # same audio, byte for byte (its decode windows do not depend on how the codes came).
    events_off = record(off)
    whole = await outcome_of(off, PipelineRequest(prompt=PROMPT, finals=finals))
    assert whole.status == "ok", whole
    assert ("vocoder", "chunk") not in events_off
    assert events_off.index(("talker", "end")) < events_off.index(("vocoder", "end"))
    w = whole.children[0].outputs
    assert np.array_equal(w["talker"].tensors["codec_codes"].numpy(),
                          got["talker"].tensors["codec_codes"].numpy())
    assert w["vocoder"].tensors["audio"].numpy().tobytes() == audio.tobytes()
    assert w["sink"].tensors["audio"].numpy().tobytes() == audio.tobytes()
    assert chunks(procs["talker"])["sent"] == n  # nothing streamed this time


def omni(name: str, *, streaming: bool = True) -> Any:
    """thinker -> talker -> vocoder, the thinker's window 1 chunk (one token's rows)."""
    flow = {"enabled": streaming, "window": 1}
    return pipeline(name, [
        {"name": "thinker", "kind": "thinker", "model": "tiny-omni-thinker", "streaming": flow,
         "engine": {"maxTokens": 8}},
        {"name": "talker", "kind": "talker", "model": "tiny-omni-talker", "inputs": ["thinker"],
         "streaming": flow, "engine": {"voices": ["default"], "maxFrames": 23,
                                       "chunkFrames": 2, "seed": 0}},
        {"name": "vocoder", "kind": "vocoder", "model": "tiny-omni-vocoder", "inputs": ["talker"],
         "finalOutput": True, "streaming": flow, "engine": {"chunkFrames": 2}},
    ])


async def test_the_talker_speaks_before_the_thinker_ends_and_the_answer_is_unchanged(
    serve_twice,
) -> None:
    """thinker -> talker streams too: the talker starts on the thinker's prompt and first
    answer token and speaks while the thinker still writes; codes, audio and text are the
    same as with every edge handing over whole outputs."""
    on, off, procs = await serve_twice(omni("omni-on"), omni("omni-off", streaming=False))
    req = {"prompt": "say something", "finals": ["thinker", "talker", "vocoder"],
           "params": {"thinker": {"ignore_eos": True}}}
    events = record(on)
    out = await outcome_of(on, PipelineRequest(**req))
    assert out.status == "ok", out
    got = out.children[0].outputs
    answer = got["thinker"].fields["completion_tokens"]
    assert answer == 8 and got["talker"].tensors["codec_codes"].shape[0] == 23
    assert events.index(("talker", "chunk")) < events.index(("thinker", "end")), events
    assert events.count(("thinker", "chunk")) == 1 + answer  # the prompt, then one a token
    assert chunks(procs["talker"])["fed"] == 1 + answer
    events_off = record(off)
    whole = await outcome_of(off, PipelineRequest(**req))
    assert whole.status == "ok", whole
    assert not [e for e in events_off if e[1] == "chunk"]
    w = whole.children[0].outputs
    assert w["thinker"].fields["text"] == got["thinker"].fields["text"]
    assert np.array_equal(w["talker"].tensors["codec_codes"].numpy(),
                          got["talker"].tensors["codec_codes"].numpy())
    assert w["vocoder"].tensors["audio"].numpy().tobytes() == \
        got["vocoder"].tensors["audio"].numpy().tobytes()


async def test_abort_mid_speech_stops_every_stage_and_frees_every_block(
    sink_kind, launch, shm_dir, tmp_path,
) -> None:
    """Every chunk tensor goes through shared memory (min_bytes 0). The held sink stops taking,
    so with windows of 1 the vocoder and the talker wait mid-speech; an abort ends all three
    and every block goes back."""
    cfg = config(shm_dir, session="speech", min_bytes=0)
    hold = tmp_path / "release"
    env = {"env": cfg.env()}
    orch, procs, _ = await launch(speech("abort"), {
        "talker": [env], "vocoder": [env], "sink": [{"env": {**cfg.env(), **sink_env(hold)}}]},
        shm=cfg)
    talker, vocoder, sink = procs["talker"][0], procs["vocoder"][0], procs["sink"][0]
    handle = orch.submit(PipelineRequest(prompt=PROMPT))
    await _until(lambda: chunks(vocoder)["sent"] >= 1 and chunks(talker)["sent"] >= 2,
                 "the vocoder spoke and the talker went on")
    await _until(lambda: all(worker_state(w)["in_flight"] == 1 for w in (talker, vocoder, sink)),
                 "all three stages mid-speech")
    # A chunk's block goes back at its credit: what nobody took (the sink holds, so the
    # vocoder stops taking) lies in the segments, codec chunks in the talker's, audio in the
    # vocoder's.
    await _until(lambda: worker_state(talker)["shm"]["lent"] >= 1, "a codec chunk untaken")
    await _until(lambda: worker_state(vocoder)["shm"]["lent"] >= 1, "an audio chunk untaken")
    handle.abort()
    out = await asyncio.wait_for(handle.outcome(), 30)
    assert out.status == "abort", out
    for w in (talker, vocoder, sink):
        await _until(lambda w=w: worker_state(w)["in_flight"] == 0, "the stage stopped")
        await _until(lambda w=w: worker_state(w)["shm"]["lent"] == 0, "every block back")
    assert chunks(talker)["sent"] < 16  # it stopped mid-speech, not at its end
    assert orch.shm is not None and orch.shm.segment.live == 0
    assert len(segments(shm_dir)) == 4  # three workers and the orchestrator, nothing else
    # The pipeline speaks on once the sink takes again.
    hold.touch()
    ok = await outcome_of(orch, PipelineRequest(prompt=PROMPT))
    assert ok.status == "ok" and ok.children[0].outputs["sink"].tensors["audio"].shape[0] > 0


async def test_kill_9_vocoder_mid_stream_fails_only_its_requests_once(
    sink_kind, launch, tmp_path,
) -> None:
    hold = tmp_path / "release"
    sinks = [{"env": sink_env(hold)}] * 2
    pipe = speech("kill")
    pipe.spec.orchestrator.failover.max_retries = 0  # the no-retry path; failover: test_failover.py
    orch, procs, _ = await launch(pipe, {
        "talker": [{}, {}], "vocoder": [{}, {}], "sink": sinks},
        heartbeat_interval=0.5, heartbeat_timeout=3.0)
    handles = [orch.submit(PipelineRequest(prompt=PROMPT)) for _ in range(2)]
    victim = orch.pools["vocoder"].replicas["kill-vocoder-0"]
    other = orch.pools["vocoder"].replicas["kill-vocoder-1"]
    # The held sinks keep both streams open: each vocoder replica decodes one.
    await _until(lambda: victim.bound and other.bound, "both vocoder replicas fed")
    bound = {t.child.request.id for t in victim.bound}
    assert len(bound) == 1
    procs["vocoder"][0].proc.send_signal(signal.SIGKILL)
    lost = next(h for h in handles if h.id in bound)
    events = [ev async for ev in lost.events()]
    terminal = [e for e in events if isinstance(e, Done)]
    assert len(terminal) == 1, events  # exactly one terminal outcome
    assert terminal[0].status == "fatal" and terminal[0].error.code == "replica_lost"
    assert terminal[0].error.stage == "vocoder"
    hold.touch()  # the surviving stream finishes
    kept = next(h for h in handles if h.id not in bound)
    events = [ev async for ev in kept.events()]
    terminal = [e for e in events if isinstance(e, Done)]
    assert len(terminal) == 1 and terminal[0].status == "ok", events
    assert terminal[0].children[0].outputs["sink"].tensors["audio"].shape[0] > 0
    assert orch.outcomes.get("fatal") == 1 and sum(orch.outcomes.values()) == 2
    for w in (*procs["talker"], *procs["sink"], procs["vocoder"][1]):
        await _until(lambda w=w: worker_state(w)["in_flight"] == 0, "stage idle")
