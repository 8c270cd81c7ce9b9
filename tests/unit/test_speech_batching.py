"""Batching in the speech kinds, in-process over the tiny built-ins: several requests' frames
(talker) and decode windows (vocoder) go through one forward pass, and each request gets what
it gets alone; an abort or a bad input ends its own request only.

"Alone" is `execute` (a batch of one: the one-at-a-time path, which test_speech_streaming.py
holds to the model's own chunked_decode and to the thinker-fed talker). The talker's codes are
identical batched (its padded rows are masked, and the first code's sampling is each request's
own seeded generator). The vocoder's samples are close, not identical: the same windows
decoded in a batch of several run Code2Wav's convolutions as one batched call, whose CPU
kernels sum in another order than a batch of one (differences around 1e-10; the windows and
every decoded frame are the same).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from omnistage.admission import ExecutionContext
from omnistage.batching import BatchScheduler
from omnistage.executors.base import BadRequest, InputChunk, Outcome, StageIO
from omnistage.executors.talker import TalkerExecutor
from omnistage.executors.vocoder import LEFT_CONTEXT, VocoderExecutor
from omnistage.models import TINY_QUANTIZERS
from omnistage.spec import EngineOptions
from tests.unit.test_speech_streaming import Sink, codes_of, wire

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(180)

#: (prompt, seed): prompts of different lengths, so the merged KV cache has padded rows.
SPOKEN = [("hello there", 1), ("a much longer sentence to speak out loud here", 2),
          ("hi", 22), ("hello there", 4)]
VOCODER_ATOL = 1e-6


@pytest.fixture(scope="module")
def talker() -> TalkerExecutor:
    ex = TalkerExecutor("tiny-omni-talker", EngineOptions(max_frames=30, chunk_frames=5), CPU)
    ex.load()
    return ex


@pytest.fixture(scope="module")
def vocoder() -> VocoderExecutor:
    ex = VocoderExecutor("tiny-omni-vocoder", EngineOptions(chunk_frames=6), CPU)
    ex.load()
    return ex


def drain(batch: Any, want: int, done: dict[int, Any] | None = None,
          steps: int = 10_000) -> dict[int, Any]:
    """Step a batch until `want` requests have an outcome (a far guard on the step count)."""
    done = {} if done is None else done
    for _ in range(steps):
        if len(done) >= want:
            return done
        done.update(batch.step())
    raise AssertionError(f"{len(done)} of {want} requests finished in {steps} steps")


def alone(ex: Any, params: dict[str, Any], tensors: dict[str, Any] | None = None,
          sink: Sink | None = None) -> Outcome:
    job = ex.prepare(params, {k: wire(v) for k, v in (tensors or {}).items()})
    return ex.execute(job, ExecutionContext(), sink.io if sink else (lambda _d: None))


def talker_job(ex: TalkerExecutor, prompt: str, seed: int) -> Any:
    return ex.prepare({"prompt": prompt, "seed": seed}, {})


def test_batched_talker_codes_are_each_requests_own(talker) -> None:
    """Four requests, one joining three frames late: the same codes, chunks and fields as
    each alone, from far fewer talker passes than frames."""
    refs, ref_sinks = [], []
    for prompt, seed in SPOKEN:
        ref_sinks.append(Sink())
        refs.append(alone(talker, {"prompt": prompt, "seed": seed}, sink=ref_sinks[-1]))
    batch = talker.new_batch()
    sinks = [Sink() for _ in SPOKEN]
    for i, (prompt, seed) in enumerate(SPOKEN[:3]):
        batch.add(i, talker_job(talker, prompt, seed), sinks[i].io)
    done: dict[int, Any] = {}
    for _ in range(3):
        done.update(batch.step())
    assert not done and len(batch.rows) == 3  # three requests share one merged cache
    batch.add(3, talker_job(talker, *SPOKEN[3]), sinks[3].io)
    drain(batch, 4, done)
    frames = 0
    for i, ref in enumerate(refs):
        got = done[i]
        assert isinstance(got, Outcome) and got.fields == ref.fields, (i, got)
        assert torch.equal(got.tensors["codec_codes"], ref.tensors["codec_codes"]), i
        assert [c["codec_codes"].tobytes() for c in sinks[i].chunks] == \
            [c["codec_codes"].tobytes() for c in ref_sinks[i].chunks], i
        frames += ref.fields["completion_tokens"]
    assert {r.fields["finish_reason"] for r in refs} == {"stop", "length"}  # both endings
    assert frames >= 100
    # A request alone makes one talker pass a frame; together they shared them.
    assert batch.forwards <= 35, (batch.forwards, frames)


def test_batched_vocoder_audio_matches_each_request_alone(vocoder) -> None:
    """Whole and fed requests of different lengths: equal-length windows of different
    requests share a decode pass; each request's audio and chunks are its own."""
    inputs: list[Any] = [codes_of(40, seed=1), [codes_of(n, seed=2 + n) for n in (1, 7, 30, 23)],
                         codes_of(13, seed=3), codes_of(61, seed=4)]
    refs, ref_sinks = [], []
    for item in inputs:
        sink = Sink(item if isinstance(item, list) else None)
        ref_sinks.append(sink)
        refs.append(alone(vocoder, {}, None if isinstance(item, list) else
                          {"codec_codes": item}, sink))
    batch = vocoder.new_batch()
    sinks = []
    for i, item in enumerate(inputs):
        fed = isinstance(item, list)
        sinks.append(Sink(item if fed else None))
        batch.add(i, alone_job(vocoder, None if fed else item), sinks[-1].io)
    done = drain(batch, len(inputs))
    windows = 0
    for i, ref in enumerate(refs):
        got, want = done[i].tensors["audio"].numpy(), ref.tensors["audio"].numpy()
        assert done[i].fields == ref.fields and got.shape == want.shape and got.size > 0, i
        np.testing.assert_allclose(got, want, rtol=0, atol=VOCODER_ATOL)
        assert [c["audio"].shape for c in sinks[i].chunks] == \
            [c["audio"].shape for c in ref_sinks[i].chunks], i
        windows += len(ref_sinks[i].chunks)
    assert windows == 7 + 11 + 3 + 11
    assert batch.forwards < windows * 2 / 3, (batch.forwards, windows)


def alone_job(ex: VocoderExecutor, codes: Any) -> Any:
    return ex.prepare({}, {} if codes is None else {"codec_codes": wire(codes)})


def test_batched_vocoder_windows_of_one_length_share_one_pass(vocoder) -> None:
    """Eight requests of the same length decode each window step in one pass."""
    batch = vocoder.new_batch()
    for i in range(8):
        batch.add(i, alone_job(vocoder, codes_of(6 * 5, seed=i)), lambda _d: None)
    done = drain(batch, 8)
    assert batch.forwards == 5  # five windows each, all eight in every pass
    ref = alone(vocoder, {}, {"codec_codes": codes_of(30, seed=5)}).tensors["audio"].numpy()
    np.testing.assert_allclose(done[5].tensors["audio"].numpy(), ref, rtol=0, atol=VOCODER_ATOL)
    assert LEFT_CONTEXT > 6  # every later window re-decodes context: all the same length


def test_an_abort_in_a_talker_batch_ends_that_request_alone(talker) -> None:
    refs = [alone(talker, {"prompt": p, "seed": s}) for p, s in SPOKEN[:3]]
    batch = talker.new_batch()
    for i, (prompt, seed) in enumerate(SPOKEN[:3]):
        batch.add(i, talker_job(talker, prompt, seed), lambda _d: None)
    done: dict[int, Any] = {}
    for _ in range(6):
        done.update(batch.step())
    stopped = batch.abort(1)
    assert stopped.aborted and stopped.fields["finish_reason"] == "abort"
    codes = stopped.tensors["codec_codes"]
    assert 0 < codes.shape[0] < refs[1].tensors["codec_codes"].shape[0]
    assert torch.equal(codes, refs[1].tensors["codec_codes"][:codes.shape[0]])  # its prefix
    late = batch.expire(2)
    assert "deadline passed after" in str(late)
    drain(batch, 1, done)
    assert set(done) == {0}
    assert torch.equal(done[0].tensors["codec_codes"], refs[0].tensors["codec_codes"])


def test_a_bad_input_in_a_batch_fails_its_request_alone(talker, vocoder) -> None:
    """Vocoder: a fed request whose second chunk is out of range, and a request with no
    codes; talker: a request with no input. Each fails with its own error; the rest speak."""
    bad = np.full((2, TINY_QUANTIZERS), 64, dtype=np.int64)
    ok = codes_of(20, seed=9)
    ref = alone(vocoder, {}, {"codec_codes": ok}).tensors["audio"].numpy()
    batch = vocoder.new_batch()
    batch.add(0, alone_job(vocoder, ok), lambda _d: None)
    batch.add(1, alone_job(vocoder, None), Sink([codes_of(3), bad]).io)
    batch.add(2, alone_job(vocoder, None), lambda _d: None)  # not fed: nothing to decode
    batch.add(3, alone_job(vocoder, ok), lambda _d: None)
    done = drain(batch, 4)
    assert isinstance(done[1], BadRequest) and "feed 2: tensors.codec_codes: codes must be in" \
        in str(done[1])
    assert isinstance(done[2], BadRequest) and "tensors.codec_codes is required" in str(done[2])
    for i in (0, 3):
        np.testing.assert_allclose(done[i].tensors["audio"].numpy(), ref, rtol=0,
                                   atol=VOCODER_ATOL)

    want = alone(talker, {"prompt": "hello there", "seed": 1})
    batch = talker.new_batch()
    batch.add(0, talker.prepare({}, {}), lambda _d: None)
    batch.add(1, talker_job(talker, "hello there", 1), lambda _d: None)
    done = drain(batch, 2)
    assert isinstance(done[0], BadRequest) and "params.prompt is required" in str(done[0])
    assert torch.equal(done[1].tensors["codec_codes"], want.tensors["codec_codes"])


async def test_the_scheduler_runs_talker_requests_in_one_batch(talker) -> None:
    """Through a real BatchScheduler (its engine thread, checkpoints and per-request
    outcomes): four requests join one batch; one is cancelled by its own chunk callback
    after its first chunk, one has no input; the other two speak as alone."""
    refs = [alone(talker, {"prompt": p, "seed": s}) for p, s in SPOKEN]
    batches: list[Any] = []
    new_batch = talker.new_batch

    def recording() -> Any:
        batches.append(new_batch())
        return batches[-1]

    talker.new_batch = recording  # type: ignore[method-assign]
    sched = BatchScheduler(max_size=8)
    try:
        ctxs = [ExecutionContext() for _ in SPOKEN]
        cancel = Sink()
        first = cancel.take

        def take_then_cancel(seq: int, text: str | None, tensors: dict[str, Any]) -> None:
            first(seq, text, tensors)
            ctxs[2].token.cancel()  # on the engine thread, mid-step: aborted at the next one

        cancel.io._send_chunk = take_then_cancel
        jobs = [talker_job(talker, *SPOKEN[0]), talker_job(talker, *SPOKEN[1]),
                talker_job(talker, *SPOKEN[2]), talker.prepare({}, {})]
        emits = [lambda _d: None, lambda _d: None, cancel.io, lambda _d: None]
        sched.pause()  # all four join the same batch on resume
        tasks = [asyncio.ensure_future(sched.run_with_context(ctx, talker, job, emit))
                 for ctx, job, emit in zip(ctxs, jobs, emits, strict=True)]
        await asyncio.sleep(0)
        assert sched.queued == 4
        sched.resume()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        talker.new_batch = new_batch  # type: ignore[method-assign]
        sched.close()
    for i in (0, 1):
        assert torch.equal(results[i].tensors["codec_codes"], refs[i].tensors["codec_codes"])
    aborted = results[2]
    assert isinstance(aborted, Outcome) and aborted.aborted
    assert aborted.tensors["codec_codes"].shape[0] == 5  # its first chunk's frames
    assert isinstance(results[3], BadRequest)
    assert len(batches) == 1  # one batch served them all
    assert batches[0].forwards < sum(r.fields["completion_tokens"] for r in refs[:2])


def test_a_thinker_fed_talker_in_a_batch_speaks_as_from_the_whole_output(talker) -> None:
    """A talker fed the thinker's chunks shares a batch with a text-to-speech request: it
    starts once the prompt rows are in and makes the codes it makes from the whole output."""
    from omnistage.executors.ar import ThinkerExecutor

    thinker = ThinkerExecutor("tiny-omni-thinker", EngineOptions(max_tokens=8), CPU)
    thinker.load()
    sink = Sink()
    out = thinker.execute(thinker.prepare({"prompt": "say something", "ignore_eos": True,
                                           "return_hidden_states": True}, {}),
                          ExecutionContext(), sink.io)
    whole = {("encoder_hidden_states" if k == "hidden_states" else k): v
             for k, v in out.tensors.items()}
    ask = {"seed": 0, "max_frames": 23}
    ref = alone(talker, ask, whole)
    tts = alone(talker, {"prompt": "hello there", "seed": 1})
    batch = talker.new_batch()
    io = StageIO(fed=True)  # the thinker's chunks arrive while the batch runs
    chunks = [InputChunk(i, tensors={k: wire(v.numpy()) for k, v in c.items()})
              for i, c in enumerate(sink.chunks, start=1)]
    batch.add(0, talker_job(talker, "hello there", 1), lambda _d: None)
    batch.add(1, talker.prepare(ask, {}), io)
    done: dict[int, Any] = {}
    for _ in range(4):  # nothing fed yet: the fed request sits these steps out
        done.update(batch.step())
    assert batch.voices[1].phase == "start" and len(batch.voices[0].frames) == 4
    io.feed(chunks[0], False)  # the prompt's rows
    io.feed(chunks[1], False)  # the first answer position: it can start
    for _ in range(3):
        done.update(batch.step())
    # Its first frame is made; the next input needs answer position 1, not made yet.
    assert len(batch.voices[1].frames) == 1
    assert batch.voices[1].phase == "text"
    for chunk in chunks[2:]:
        io.feed(chunk, False)
    io.feed(InputChunk(len(chunks) + 1), True)
    drain(batch, 2, done)
    assert torch.equal(done[1].tensors["codec_codes"], ref.tensors["codec_codes"])
    assert done[1].fields == ref.fields
    assert torch.equal(done[0].tensors["codec_codes"], tts.tensors["codec_codes"])
