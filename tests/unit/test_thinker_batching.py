"""The thinker's continuous batching, in-process over the tiny Qwen3-Omni thinker: requests with
different media (text only, an image, audio, both) share decode steps, a request joins a running
batch, and each gets exactly what it gets alone.

"Alone" is `execute` (a batch of one). What makes the batch correct is each sequence's own
multimodal RoPE offset: the model keeps only the last prompt pass's, so a batch that let the
model place the decode positions would put every row at the last joiner's offset (the
image and audio requests' answers would change; `test_the_offsets_are_needed` shows they do).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omnistage.executors.ar import ThinkerExecutor
from omnistage.spec import EngineOptions
from tests.unit.test_speech_batching import alone, drain
from tests.unit.test_speech_streaming import Sink, wire

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(180)

RNG = np.random.default_rng(3)
IMAGE = RNG.integers(0, 256, (112, 112, 3), dtype=np.uint8)  # 4 x 4 merged patches
CLIP = RNG.uniform(-0.5, 0.5, 8000).astype(np.float32)
#: (params, media): prompts of different lengths and media, so rows are padded and offsets differ.
REQUESTS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"prompt": "hello", "max_tokens": 14}, {}),
    ({"prompt": "what is in this picture, and why", "max_tokens": 11},
     {"input_image.0": IMAGE}),
    ({"prompt": "listen", "max_tokens": 17}, {"input_audio.0": CLIP}),
    ({"prompt": "both", "max_tokens": 9}, {"input_image.0": IMAGE, "input_audio.0": CLIP}),
    ({"prompt": "a longer text-only question to answer", "max_tokens": 12}, {}),
]


@pytest.fixture(scope="module")
def thinker() -> ThinkerExecutor:
    ex = ThinkerExecutor("tiny-omni-thinker", EngineOptions(return_hidden_states=True), CPU)
    ex.load()
    assert ex.batchable
    return ex


def params(i: int, **extra: Any) -> dict[str, Any]:
    return {**REQUESTS[i][0], "ignore_eos": True, "temperature": 0.0, **extra}


def job(ex: ThinkerExecutor, i: int, **extra: Any) -> Any:
    return ex.prepare(params(i, **extra), {k: wire(v) for k, v in REQUESTS[i][1].items()})


def references(ex: ThinkerExecutor) -> tuple[list[Any], list[Sink]]:
    sinks = [Sink() for _ in REQUESTS]
    return [alone(ex, params(i), REQUESTS[i][1], sinks[i]) for i in range(len(REQUESTS))], sinks


def assert_same(got: Any, ref: Any, sink: Sink, ref_sink: Sink, i: int) -> None:
    assert got.fields == ref.fields, i  # text, token ids, finish reason, token counts
    for name in ("hidden_states", "token_embeds"):
        assert np.allclose(got.tensors[name].numpy(), ref.tensors[name].numpy(),
                           atol=1e-4), (i, name)
    for name in ("token_ids", "prompt_length"):
        assert torch.equal(got.tensors[name], ref.tensors[name]), (i, name)
    # The talker's stream: the same chunks (the prompt's rows, then one row a token).
    assert [c["token_ids"].tolist() for c in sink.chunks] == \
        [c["token_ids"].tolist() for c in ref_sink.chunks], i
    for c, r in zip(sink.chunks, ref_sink.chunks, strict=True):
        assert np.allclose(c["hidden_states"].numpy(), r["hidden_states"].numpy(), atol=1e-4)


def test_mixed_media_batch_with_a_join_equals_one_at_a_time(thinker) -> None:
    refs, ref_sinks = references(thinker)
    forwards = []
    hook = thinker.model.register_forward_hook(lambda _m, _a, _kw, out: forwards.append(1),
                                               with_kwargs=True)
    try:
        batch, sinks, done = thinker.new_batch(), [Sink() for _ in REQUESTS], {}
        for i in range(3):
            batch.add(i, job(thinker, i), sinks[i].io)
        for _ in range(4):
            done.update(batch.step())
        assert not done and len(batch.rows) == 3
        for i in (3, 4):  # join a batch already four tokens in
            batch.add(i, job(thinker, i), sinks[i].io)
        drain(batch, len(REQUESTS), done)
    finally:
        hook.remove()
    for i, ref in enumerate(refs):
        assert_same(done[i], ref, sinks[i], ref_sinks[i], i)
    # Alone, a request makes a prompt pass and one pass a token; here the decode passes were
    # shared: 5 prompt passes and at most the longest answer's decode steps (+ the joiners' lag).
    alone_passes = sum(1 + r.fields["completion_tokens"] for r in refs)
    assert len(forwards) <= 5 + 17 + 4 < alone_passes


def own_positions(ex: ThinkerExecutor, i: int) -> tuple[list[int], Any]:
    """Request i's greedy tokens and hidden states with the model placing every position
    itself (its rope_deltas from the prompt pass, no explicit positions): the unbatched
    reference the executor's explicit positions must reproduce."""
    j = job(ex, i)
    with torch.inference_mode():
        ids = torch.tensor([j.prompt_ids])
        out = ex.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                       output_hidden_states=True, **j.prefill_inputs)
        hidden, tokens = [out.hidden_states[ex.hidden_layer][0]], []
        for _ in range(j.max_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = ex.model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True,
                           output_hidden_states=True,
                           **{ex._cache_arg: getattr(out, ex._cache_arg)})
            hidden.append(out.hidden_states[ex.hidden_layer][0])
    return tokens, torch.cat(hidden)


def test_one_at_a_time_is_the_models_own_positions(thinker) -> None:
    """The executor's explicit decode positions are the ones the model computes for itself,
    for every kind of media (kills: the offset left out of _decode_positions)."""
    for i in range(len(REQUESTS)):
        ref = alone(thinker, params(i), REQUESTS[i][1])
        tokens, hidden = own_positions(thinker, i)
        assert ref.fields["token_ids"] == tokens, i
        assert np.allclose(ref.tensors["hidden_states"].numpy(), hidden.float().numpy(),
                           atol=1e-5), i


def test_the_offsets_are_needed(thinker) -> None:
    """An image's RoPE offset is not zero: its 16 tokens take 4 x 4 positions (audio's are
    sequential, so its offset is zero), so the batch would be wrong without each row's own."""
    batch = thinker.new_batch()
    for i in range(4):
        batch.add(i, job(thinker, i), Sink().io)
    batch.step()
    deltas = [batch.seqs[i].rope_delta for i in range(4)]
    assert deltas[0] == deltas[2] == 0 and deltas[1] == deltas[3] < 0


def test_abort_seeded_sampling_and_a_resumed_stream_in_one_batch(thinker) -> None:
    """One request aborted mid-batch returns its prefix; seeded sampling draws each request's
    own tokens; a failover resume (its first tokens given back) finishes as the whole answer."""
    sampled = [alone(thinker, params(i, temperature=0.9, seed=50 + i), REQUESTS[i][1])
               for i in range(4)]
    whole = sampled[2].fields["token_ids"]
    batch, done = thinker.new_batch(), {}
    for i in (0, 1, 3):
        batch.add(i, job(thinker, i, temperature=0.9, seed=50 + i), Sink().io)
    batch.add(2, job(thinker, 2, temperature=0.9, seed=52, resume_token_ids=whole[:5],
                     resume_text=thinker._text(whole[:5])), Sink().io)
    for _ in range(3):
        done.update(batch.step())
    aborted = batch.abort(0)
    drain(batch, 3, done)
    prefix = aborted.fields["token_ids"]
    assert aborted.aborted and 0 < len(prefix) < 14
    assert prefix == sampled[0].fields["token_ids"][:len(prefix)]
    for i in (1, 3):
        assert done[i].fields["token_ids"] == sampled[i].fields["token_ids"], i
    assert done[2].fields["token_ids"] == whole and done[2].fields["text"] == \
        sampled[2].fields["text"]
    assert sampled[1].fields["token_ids"] != sampled[3].fields["token_ids"]  # seeds differ
