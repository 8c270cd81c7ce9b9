"""The prefix cache (omnistage.executors.prefix_cache) on its own, and in the ar and thinker
engines over the tiny models: a hit gives what a miss gives (tokens, hidden states, streamed
chunks), alone, batched with joins, aborts and a failover resume, and under memory pressure.

"A miss" is the same executor with its cache taken away (`ex.prefix = None`): the code path
the other tests hold to one-at-a-time and to the model's own positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from omnistage.admission import ExecutionContext
from omnistage.executors.ar import ARExecutor, ThinkerExecutor
from omnistage.executors.prefix_cache import BLOCK_TOKENS, PrefixCache
from omnistage.spec import EngineOptions
from tests.unit.test_speech_batching import drain
from tests.unit.test_speech_streaming import Sink, wire

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(180)

# A shared "system prompt" of 3 whole blocks and a bit (the tiny tokenizers are byte-level:
# a character a token), then each request's own question.
SYSTEM = "You are a helpful assistant. Answer briefly, and kindly. "
assert len(SYSTEM) > 3 * BLOCK_TOKENS
QUESTIONS = ["what is two and two?", "name a colour", "why is the sky blue, and the sea?",
             "count to five", "hello"]


# ---- the cache on its own ----------------------------------------------------------------

def _kv(n: int, fill: float, layers: int = 2) -> list[tuple[Any, Any]]:
    """A pass's KV for n tokens: token i of every layer holds fill + i (so slices are seen)."""
    t = (torch.arange(n, dtype=torch.float32) + fill).view(1, 1, n, 1).expand(1, 2, n, 4)
    return [(t.clone(), -t.clone()) for _ in range(layers)]


def _block_bytes(layers: int = 2) -> int:
    return layers * 2 * (2 * BLOCK_TOKENS * 4 * 4)  # k and v: [1, 2, 16, 4] float32


def test_a_block_is_found_only_after_the_same_whole_prefix() -> None:
    cache = PrefixCache(10**6)
    a = list(range(100, 164))  # 4 blocks
    cache.insert(a, len(a), _kv(64, 0.0))
    hit = cache.lookup([*a, 1, 2, 3], 67, want_rows=False)
    assert hit is not None and hit.tokens == 64
    assert torch.equal(hit.kv[1][0][0, 0, :, 0], torch.arange(64, dtype=torch.float32))
    # Same second block after another first block: nothing (the KV would differ).
    b = [7] * 16 + a[16:]
    assert cache.lookup(b, len(b), want_rows=False) is None
    # A prefix that diverges inside block 3 reuses blocks 1 and 2 only.
    c = a[:40] + [9] * 24
    hit = cache.lookup(c, len(c), want_rows=False)
    assert hit is not None and hit.tokens == 32
    assert cache.stats.lookups == 3 and cache.stats.hits == 2
    assert cache.stats.saved_tokens == 64 + 32
    assert cache.stats.prompt_tokens == 67 + 64 + 64


def test_the_limit_is_never_passed_and_only_whole_blocks_count() -> None:
    cache = PrefixCache(10**6)
    ids = list(range(48))
    cache.insert(ids, 40, _kv(48, 0.0))  # blocks 1, 2 (40 is not a whole third)
    assert cache.stats.blocks == 2
    assert cache.lookup(ids, 31, want_rows=False).tokens == 16  # 31: one whole block
    assert cache.lookup(ids, 15, want_rows=False) is None
    assert cache.lookup(ids, 48, want_rows=False).tokens == 32


def test_rows_are_reused_only_where_kept_and_filled_in_later() -> None:
    cache = PrefixCache(10**6)
    ids = list(range(32))
    cache.insert(ids, 32, _kv(32, 0.0))  # no rows
    assert cache.lookup(ids, 32, want_rows=True) is None
    assert cache.lookup(ids, 32, want_rows=False).tokens == 32
    rows = (torch.arange(32.0).view(32, 1), -torch.arange(32.0).view(32, 1))
    before = cache.stats.bytes
    cache.insert(ids, 32, _kv(32, 0.0), rows)
    assert cache.stats.bytes == before + 2 * 32 * 4
    hit = cache.lookup(ids, 32, want_rows=True)
    assert hit.tokens == 32 and torch.equal(hit.rows[1], rows[1])


def test_the_budget_evicts_the_least_recent_and_last_blocks_first() -> None:
    cache = PrefixCache(3 * _block_bytes())
    a = list(range(64))
    cache.insert(a, 64, _kv(64, 0.0))  # 4 blocks for a budget of 3
    st = cache.stats
    assert st.blocks == 3 and st.evicted_blocks == 1 and st.bytes <= st.capacity_bytes
    assert cache.lookup(a, 64, want_rows=False).tokens == 48  # the first three stayed
    b = [5] * 32
    cache.insert(b, 32, _kv(32, 100.0))  # two more: a's last two blocks go
    assert st.blocks == 3 and st.evicted_blocks == 3
    assert cache.lookup(a, 64, want_rows=False).tokens == 16
    assert torch.equal(cache.lookup(b, 32, want_rows=False).kv[0][0][0, 0, :, 0],
                       torch.arange(32, dtype=torch.float32) + 100)
    cache.clear()
    assert st.blocks == 0 and st.bytes == 0 and cache.lookup(a, 64, want_rows=False) is None
    with pytest.raises(ValueError):
        PrefixCache(-1)


# ---- in the ar engine --------------------------------------------------------------------

@pytest.fixture(scope="module")
def ar() -> ARExecutor:
    ex = ARExecutor("tiny-llama", EngineOptions(return_hidden_states=True), CPU)
    ex.load()
    assert ex.prefix is not None and ex.batchable
    return ex


@contextmanager
def no_cache(ex: ARExecutor) -> Iterator[None]:
    prefix, ex.prefix = ex.prefix, None
    try:
        yield
    finally:
        ex.prefix = prefix


def _fresh_cache(ex: ARExecutor, capacity: int = 64 * 2**20) -> PrefixCache:
    ex.prefix = PrefixCache(capacity)
    return ex.prefix


def _params(q: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": SYSTEM + q, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "stream": True, **extra}


def _run(ex: ARExecutor, params: dict[str, Any], sink: Sink | None = None) -> Any:
    sink = sink or Sink()
    return ex.execute(ex.prepare(params, {}), ExecutionContext(), sink.io)


def _same(got: Any, ref: Any, what: Any) -> None:
    assert got.fields == ref.fields, what
    assert np.allclose(got.tensors["hidden_states"].numpy(),
                       ref.tensors["hidden_states"].numpy(), atol=1e-4), what


def test_a_hit_gives_what_a_miss_gives(ar) -> None:
    with no_cache(ar):
        refs = [_run(ar, _params(q)) for q in QUESTIONS]
    cache = _fresh_cache(ar)
    forwards: list[int] = []
    hook = ar.model.register_forward_hook(
        lambda _m, _a, kw, _out: forwards.append(int(kw["input_ids"].shape[1])),
        with_kwargs=True)
    try:
        got = [_run(ar, _params(q)) for q in QUESTIONS]
    finally:
        hook.remove()
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        _same(g, r, i)
    st = cache.stats
    shared = len(SYSTEM) // BLOCK_TOKENS * BLOCK_TOKENS
    assert st.lookups == len(QUESTIONS) and st.hits == len(QUESTIONS) - 1
    assert st.saved_tokens == shared * (len(QUESTIONS) - 1)
    # Every prompt pass after the first computed only what follows the shared blocks.
    prompt_passes = [n for n in forwards if n > 1]
    assert prompt_passes[0] == len(SYSTEM + QUESTIONS[0])
    assert prompt_passes[1:] == [len(SYSTEM + q) - shared for q in QUESTIONS[1:]]


def test_a_repeated_prompt_computes_at_least_its_last_token(ar) -> None:
    prompt = "x" * (2 * BLOCK_TOKENS)  # whole blocks only
    with no_cache(ar):
        ref = _run(ar, _params("", prompt=prompt))
    cache = _fresh_cache(ar)
    first, again = _run(ar, _params("", prompt=prompt)), _run(ar, _params("", prompt=prompt))
    _same(first, ref, "first")
    _same(again, ref, "again")
    assert cache.stats.saved_tokens == BLOCK_TOKENS  # the last block is computed again


def test_batched_with_joins_an_abort_and_a_resume(ar) -> None:
    with no_cache(ar):
        refs = [_run(ar, _params(q)) for q in QUESTIONS]
    _fresh_cache(ar)
    _run(ar, _params("warm the system prompt"))
    resumed = refs[4].fields["token_ids"][:5]
    batch, sinks, done = ar.new_batch(), [Sink() for _ in QUESTIONS], {}
    for i in range(3):
        batch.add(i, ar.prepare(_params(QUESTIONS[i]), {}), sinks[i].io)
    for _ in range(3):
        done.update(batch.step())
    aborted = batch.abort(1)
    batch.add(3, ar.prepare(_params(QUESTIONS[3]), {}), sinks[3].io)
    batch.add(4, ar.prepare(_params(QUESTIONS[4], resume_token_ids=resumed,
                                    resume_text=ar._text(resumed)), {}), sinks[4].io)
    drain(batch, 4, done)
    # Three steps: a prompt pass and a decode step in the first, then one each.
    assert aborted.aborted and aborted.fields["token_ids"] == refs[1].fields["token_ids"][:4]
    for i in (0, 2, 3, 4):
        _same(done[i], refs[i], i)
    # Every request after the warm-up hit, the aborted one too.
    assert ar.prefix.stats.hits == len(QUESTIONS)


def test_under_memory_pressure_it_evicts_and_stays_right(ar) -> None:
    prompts = [f"{n}: " + SYSTEM[:40] + q for n in range(4) for q in QUESTIONS[:2]]
    with no_cache(ar):
        refs = [_run(ar, _params("", prompt=p)) for p in prompts]
    blocks = len(ar.model.model.layers) * 2 * ar.model.config.num_key_value_heads \
        * BLOCK_TOKENS * ar.model.config.head_dim * 4
    rows = BLOCK_TOKENS * ar.hidden_size * 4
    cache = _fresh_cache(ar, 3 * (blocks + rows))  # three blocks with their rows
    got = [_run(ar, _params("", prompt=p)) for p in prompts * 2]
    for i, g in enumerate(got):
        _same(g, refs[i % len(prompts)], i)
    st = cache.stats
    assert st.evicted_blocks > 0 and st.blocks <= 3 and 0 < st.bytes <= st.capacity_bytes
    assert st.hits > 0  # each prompt's twin, right after it, still found its blocks


def test_sleep_gives_the_blocks_back(ar) -> None:
    cache = _fresh_cache(ar)
    _run(ar, _params("a"))
    assert cache.stats.blocks > 0
    ar.sleep()
    ar.wake_up()
    assert cache.stats.blocks == 0 and cache.stats.bytes == 0


def test_off_and_for_kinds_whose_cache_is_not_plain() -> None:
    ex = ARExecutor("tiny-llama", EngineOptions(prefix_cache_mib=0), CPU)
    ex.load()
    assert ex.prefix is None and ex.prefix_stats() is None
    ex.batchable = False
    ex.engine = EngineOptions()
    assert ex._new_prefix_cache() is None  # a model whose KV is not plain tensors


# ---- in the thinker ----------------------------------------------------------------------

RNG = np.random.default_rng(5)
IMAGE = RNG.integers(0, 256, (112, 112, 3), dtype=np.uint8)
CLIP = RNG.uniform(-0.5, 0.5, 8000).astype(np.float32)


@pytest.fixture(scope="module")
def thinker() -> ThinkerExecutor:
    ex = ThinkerExecutor("tiny-omni-thinker", EngineOptions(return_hidden_states=True), CPU)
    ex.load()
    assert ex.prefix is not None
    return ex


def _think(ex: ThinkerExecutor, q: str, media: dict[str, Any]) -> tuple[Any, Sink]:
    sink = Sink()
    job = ex.prepare(_params(q), {k: wire(v) for k, v in media.items()})
    return ex.execute(job, ExecutionContext(), sink.io), sink


def _same_thought(got: tuple[Any, Sink], ref: tuple[Any, Sink], what: Any) -> None:
    (g, gs), (r, rs) = got, ref
    assert g.fields == r.fields, what
    for name in ("hidden_states", "token_embeds"):
        assert np.allclose(g.tensors[name].numpy(), r.tensors[name].numpy(), atol=1e-4), \
            (what, name)
    assert torch.equal(g.tensors["token_ids"], r.tensors["token_ids"]), what
    assert [c["token_ids"].tolist() for c in gs.chunks] == \
        [c["token_ids"].tolist() for c in rs.chunks], what


def test_thinker_text_and_media_after_a_shared_prefix(thinker, monkeypatch) -> None:
    # Media go at the start of the last user turn in a chat-templated prompt; the tiny
    # tokenizer has no template, so put them after the system prompt as such a prompt would.
    monkeypatch.setattr(thinker, "_media_position", lambda ids: len(SYSTEM))
    cases = [("hello", {}), ("what is this", {"input_image.0": IMAGE}),
             ("listen", {"input_audio.0": CLIP}),
             ("both", {"input_image.0": IMAGE, "input_audio.0": CLIP}),
             ("and this text only", {})]
    with no_cache(thinker):
        refs = [_think(thinker, q, m) for q, m in cases]
    cache = _fresh_cache(thinker)
    got = [_think(thinker, q, m) for q, m in cases]
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        _same_thought(g, r, i)
    shared = len(SYSTEM) // BLOCK_TOKENS * BLOCK_TOKENS
    assert cache.stats.hits == len(cases) - 1
    assert cache.stats.saved_tokens == shared * (len(cases) - 1)
    # Nothing after the first media is kept: the blocks are the longest text-only prompt's.
    assert cache.stats.blocks == len(SYSTEM + cases[-1][0]) // BLOCK_TOKENS


def test_thinker_batch_of_hits_equals_one_at_a_time(thinker, monkeypatch) -> None:
    monkeypatch.setattr(thinker, "_media_position", lambda ids: len(SYSTEM))
    cases = [("hello", {}), ("what is this", {"input_image.0": IMAGE}),
             ("listen to it", {"input_audio.0": CLIP})]
    with no_cache(thinker):
        refs = [_think(thinker, q, m) for q, m in cases]
    _fresh_cache(thinker)
    _think(thinker, "prime", {})
    batch, sinks, done = thinker.new_batch(), [Sink() for _ in cases], {}
    for i, (q, m) in enumerate(cases):
        batch.add(i, thinker.prepare(_params(q), {k: wire(v) for k, v in m.items()}),
                  sinks[i].io)
        done.update(batch.step())  # each joins a running batch
    drain(batch, len(cases), done)
    for i, ref in enumerate(refs):
        _same_thought((done[i], sinks[i]), ref, i)
    assert thinker.prefix.stats.hits == len(cases)
