"""Cross-request batching with the real tiny models: outputs equal the one-at-a-time path.

First the executors in this process (a batch driven step by step, so joins and aborts land on
known steps), then real worker processes over ZMQ with concurrent requests, compared with a
worker that runs one request at a time (engine.maxBatchSize 1).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

from omnistage import protocol as p
from omnistage.admission import ExecutionContext
from omnistage.executors import BadRequest
from omnistage.spec import EngineOptions
from tests.harness.metrics import sample

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Hello", "The quick brown fox jumps over", "a", "Once upon a time, in a land far "
           "away, there lived", "xyz 123", "zz top", "Batching keeps the GPU busy", "q"]


# ---------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def ar() -> Any:
    import torch

    from omnistage.executors.ar import ARExecutor

    ex = ARExecutor("tiny-llama", EngineOptions(max_batch_tokens=1000), torch.device("cpu"))
    ex.load()
    assert ex.batchable
    return ex


@pytest.fixture(scope="module")
def diffusion() -> Any:
    import torch

    from omnistage.executors.diffusion import DiffusionExecutor

    ex = DiffusionExecutor("tiny-unet", EngineOptions(), torch.device("cpu"))
    ex.load()
    return ex


def _alone(ex: Any, params: dict[str, Any], tensors: dict[str, Any] | None = None) -> Any:
    return ex.execute(ex.prepare(params, tensors or {}), ExecutionContext(), lambda _d: None)


def _ar_params(i: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPTS[i], "max_tokens": 12 + 3 * i, "ignore_eos": True, **extra}


def test_ar_batch_with_joins_and_an_abort_equals_one_at_a_time(ar) -> None:
    """Mixed prompt lengths and lengths of output; two sequences join mid-flight; one is
    aborted mid-flight and returns its prefix; every token id equals the one-at-a-time run."""
    import torch

    alone = [_alone(ar, _ar_params(i)).fields["token_ids"] for i in range(len(PROMPTS))]
    # The one-at-a-time path itself agrees with transformers' own greedy generate().
    for i in (0, 3):
        ids = torch.tensor([ar.tokenizer(PROMPTS[i]).input_ids])
        ref = ar.model.generate(ids, max_new_tokens=len(alone[i]), min_new_tokens=len(alone[i]),
                                do_sample=False, pad_token_id=ar.tokenizer.pad_token_id)
        assert ref[0, ids.shape[1]:].tolist() == alone[i]

    batch, done, streamed = ar.new_batch(), {}, []
    for i in range(5):
        emit = streamed.append if i == 2 else (lambda _d: None)
        batch.add(i, ar.prepare(_ar_params(i, stream=i == 2), {}), emit)
    for step in range(200):
        if step == 4:  # joins mid-flight, into a cache of other lengths
            batch.add(5, ar.prepare(_ar_params(5), {}), lambda _d: None)
        if step == 9:
            batch.add(6, ar.prepare(_ar_params(6), {}), lambda _d: None)
            batch.add(7, ar.prepare(_ar_params(7), {}), lambda _d: None)
        if step == 6:
            aborted = batch.abort(2)  # leaves now; the others go on
        done.update({k: v.fields["token_ids"] for k, v in batch.step().items()})
        if len(done) == len(PROMPTS) - 1:
            break
    assert aborted.aborted and aborted.fields["finish_reason"] == "abort"
    prefix = aborted.fields["token_ids"]
    assert 0 < len(prefix) < len(alone[2]) and prefix == alone[2][:len(prefix)]
    assert prefix == [t for d in streamed for t in d["token_ids"]]  # exactly what was streamed
    for i in set(range(len(PROMPTS))) - {2}:
        assert done[i] == alone[i], f"sequence {i} differs from its one-at-a-time run"


def test_ar_seeded_sampling_and_hidden_states_match_one_at_a_time(ar) -> None:
    params = [_ar_params(i, temperature=0.9, seed=40 + i, return_hidden_states=True)
              for i in range(4)]
    alone = [_alone(ar, ps) for ps in params]
    batch, done = ar.new_batch(), {}
    for i, ps in enumerate(params):
        batch.add(i, ar.prepare(ps, {}), lambda _d: None)
    while len(done) < len(params):
        done.update(batch.step())
    for i in range(len(params)):
        assert done[i].fields["token_ids"] == alone[i].fields["token_ids"]
        h, h1 = done[i].tensors["hidden_states"], alone[i].tensors["hidden_states"]
        n = len(ar.tokenizer(PROMPTS[i]).input_ids) + len(alone[i].fields["token_ids"])
        assert h.shape == h1.shape == (n, ar.hidden_size)
        assert np.allclose(h.numpy(), h1.numpy(), atol=1e-4)  # equal up to float rounding
    # Different seeds really sample differently (the comparison above can fail).
    assert done[0].fields["token_ids"] != done[1].fields["token_ids"]


def test_ar_refuses_a_request_above_max_batch_tokens(ar) -> None:
    with pytest.raises(BadRequest, match=r"params.max_tokens: prompt \(1 tokens\) \+ max_tokens "
                                         r"\(1005\) exceeds the stage's engine.maxBatchTokens "
                                         r"of 1000"):
        ar.prepare({"prompt": "x", "max_tokens": 1005}, {})
    assert ar.cost(ar.prepare({"prompt": "x", "max_tokens": 999}, {})) == 1000


def _images(outcomes: list[Any]) -> np.ndarray:
    return np.stack([o.tensors["image"].numpy() for o in outcomes])


def _assert_same_images(batched: np.ndarray, alone: np.ndarray) -> None:
    """Equal up to float rounding. Bitwise equality is not what the CPU kernels give: oneDNN
    convolutions and a one-row GEMM round differently from the same ops over a batch, so a
    value that lands on .5 can round to the neighbouring 8-bit level (0 such values at the
    default 32x32x4 on the development machine; 145 of 98,304 at 64x64x10)."""
    assert batched.shape == alone.shape
    diff = np.abs(batched.astype(np.int16) - alone)
    assert diff.max() <= 1, f"pixel values differ by up to {diff.max()}"
    assert (diff > 0).mean() < 0.005


def test_diffusion_batch_with_joins_and_an_abort_equals_one_at_a_time(diffusion) -> None:
    """Samples of other step counts and conditioning lengths share the UNet passes, one joins
    mid-flight, one is aborted: every image is its one-at-a-time image."""
    rng = np.random.default_rng(3)
    base = {"height": 32, "width": 48, "guidance_scale": 3.0}
    params = [{**base, "seed": 7 + i, "num_inference_steps": 3 + i % 3} for i in range(5)]
    tensors = [{"encoder_hidden_states": p.WireTensor.from_any(
        rng.standard_normal((4 + i, 64)).astype(np.float32))} for i in range(5)]
    alone = _images([_alone(diffusion, ps, t) for ps, t in zip(params, tensors, strict=True)])
    jobs = [diffusion.prepare(ps, t) for ps, t in zip(params, tensors, strict=True)]
    assert len({diffusion.batch_key(j) for j in jobs}) == 1
    batch, done = diffusion.new_batch(), {}
    for i in range(4):
        batch.add(i, jobs[i], None)
    batch.step()
    assert batch.abort(1).aborted  # an aborted sample leaves whole, no partial image
    batch.add(4, jobs[4], None)  # joins at step 2 of the others
    while len(done) < 4:
        done.update(batch.step())
    assert sorted(done) == [0, 2, 3, 4]
    assert all(done[i].fields["steps"] == params[i]["num_inference_steps"] for i in done)
    _assert_same_images(_images([done[i] for i in (0, 2, 3, 4)]), alone[[0, 2, 3, 4]])
    assert np.abs(alone[0].astype(np.int16) - alone[2]).mean() > 10  # the inputs matter


def test_diffusion_batch_key_separates_incompatible_requests(diffusion) -> None:
    neg = {"negative_encoder_hidden_states": p.WireTensor.from_any(np.ones((5, 64), np.float32))}
    key, job = diffusion.batch_key, diffusion.prepare
    same = [key(job(ps, {})) for ps in ({"seed": 1}, {"seed": 2}, {"num_inference_steps": 9})]
    assert same[0] == same[1] == same[2]  # seed and step count do not matter
    others = [key(job(ps, {})) for ps in ({"height": 64}, {"width": 64}, {"guidance_scale": 2.0})]
    others.append(key(job({}, neg)))  # a negative prompt turns guidance on
    assert all(k != same[0] for k in others) and len(set(others)) == len(others)


# ---------------------------------------------------------------------------- worker process


def _scrape(w: Any) -> str:
    with urllib.request.urlopen(w.http + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def _metric(w: Any, name: str) -> float:
    value = sample(_scrape(w), name)
    assert value is not None, name
    return value


async def _exec_seconds(w: Any) -> float:
    return await asyncio.to_thread(_metric, w, "omnistage_worker_execution_seconds_sum")


async def _collect(q: asyncio.Queue[Any]) -> tuple[list[Any], Any]:
    deltas = []
    while True:
        msg = await asyncio.wait_for(q.get(), 120)
        if msg.type != "delta":
            return deltas, msg
        deltas.append(msg)


async def test_worker_batches_concurrent_ar_requests_with_identical_tokens(start_worker,
                                                                          channels) -> None:
    batched = start_worker("ar", model="tiny-llama", engine={"maxBatchSize": 8})
    serial = start_worker("ar", model="tiny-llama", engine={"maxBatchSize": 1})
    ch, ref_ch = channels(batched), channels(serial)
    params = [_ar_params(i, max_tokens=40) for i in range(len(PROMPTS))]
    long = {"prompt": "abort me", "max_tokens": 400, "ignore_eos": True, "stream": True}
    reference = [(await ref_ch.request(f"r{i}", ps))[1].header.token_ids
                 for i, ps in enumerate(params)]
    _, long_ref = await ref_ch.request("long", {**long, "max_tokens": 60, "stream": False})

    before, t0 = await _exec_seconds(batched), time.monotonic()
    first = [ch.submit(f"r{i}", ps) for i, ps in enumerate(params[:6])]
    victim = ch.submit("long", long)
    seen = []
    while len(seen) < 8:  # the batch is under way...
        msg = await asyncio.wait_for(victim.get(), 60)
        assert isinstance(msg.header, p.Delta), msg.header
        seen += msg.header.token_ids
    late = [ch.submit(f"r{i}", params[i]) for i in (6, 7)]  # ...when these join it
    ch.abort("long")
    deltas, aborted = await _collect(victim)
    results = [await _collect(q) for q in first + late]
    wall = time.monotonic() - t0

    assert isinstance(aborted.header, p.Aborted), aborted.header
    prefix = aborted.header.token_ids
    assert prefix == seen + [t for d in deltas for t in d.header.token_ids]
    assert 8 <= len(prefix) < 400 and prefix == long_ref.header.token_ids[:len(prefix)]
    for i, (_, final) in enumerate(results):
        assert isinstance(final.header, p.Final), final.header
        assert final.header.token_ids == reference[i], f"request {i} differs from serial"
    # Serial execution can never spend more executor time than wall time; sharing steps does.
    assert await _exec_seconds(batched) - before > 2 * wall


async def test_worker_batch_deadline_overload_and_token_budget(start_worker, channels) -> None:
    w = start_worker("ar", model="tiny-llama", engine={"maxBatchSize": 4, "maxBatchTokens": 1020},
                     admission={"maxRequests": 3})
    ch = channels(w)
    # A request above maxBatchTokens is refused at once, naming the knob.
    _, big = await ch.request("big", {"prompt": "x", "max_tokens": 1021})
    assert isinstance(big.header, p.Error) and big.header.code == "bad_request"
    assert "engine.maxBatchTokens of 1020" in big.header.message
    # The slow request's deadline must pass mid-answer on any machine: the time 300 tokens
    # take here, a third of its 900's (a fixed 1 s was once enough for all 900 in CI), and
    # never so short that the checks below outrun it.
    started = time.monotonic()
    _, gauge = await ch.request("gauge", {"prompt": "g", "max_tokens": 300, "ignore_eos": True})
    assert isinstance(gauge.header, p.Final)
    deadline = max(0.4, time.monotonic() - started)
    slow = ch.submit("slow", {"prompt": "s", "max_tokens": 900, "ignore_eos": True,
                              "stream": True}, timeout_s=deadline)
    assert isinstance((await asyncio.wait_for(slow.get(), 60)).header, p.Delta)  # running
    quick = ch.submit("quick", {"prompt": "q", "max_tokens": 30, "ignore_eos": True})
    third = ch.submit("third", {"prompt": "t", "max_tokens": 30, "ignore_eos": True})
    # The admission budget still counts requests one by one: a fourth is refused.
    _, fourth = await ch.request("fourth", {"prompt": "f", "max_tokens": 2})
    assert isinstance(fourth.header, p.Overloaded), fourth.header
    _, done = await _collect(quick)
    assert isinstance(done.header, p.Final) and done.header.completion_tokens == 30
    assert isinstance((await _collect(third))[1].header, p.Final)
    _, late = await _collect(slow)  # its deadline ends it alone, between two steps
    assert isinstance(late.header, p.Deadline), late.header
    assert "generated tokens" in late.header.message
    _, after = await ch.request("after", {"prompt": "a", "max_tokens": 3, "ignore_eos": True})
    assert isinstance(after.header, p.Final)  # the budget came back


async def test_worker_batches_compatible_diffusion_requests(start_worker, channels) -> None:
    batched = start_worker("diffusion", model="tiny-unet", engine={"maxBatchSize": 8})
    serial = start_worker("diffusion", model="tiny-unet", engine={"maxBatchSize": 1})
    ch, ref_ch = channels(batched), channels(serial)
    params = [{"height": 32, "width": 32, "num_inference_steps": 6, "seed": i} for i in range(6)]
    params.insert(3, {"height": 48, "width": 32, "num_inference_steps": 6, "seed": 99})
    reference = [(await ref_ch.request(f"r{i}", ps))[1] for i, ps in enumerate(params)]
    before, t0 = await _exec_seconds(batched), time.monotonic()
    results = await asyncio.gather(*(ch.request(f"r{i}", ps) for i, ps in enumerate(params)))
    wall = time.monotonic() - t0
    for (_, final), ref, ps in zip(results, reference, params, strict=True):
        assert isinstance(final.header, p.Final), final.header
        image = final.tensors["image"].numpy()
        assert image.shape == (ps["height"], ps["width"], 3)
        _assert_same_images(image[None], ref.tensors["image"].numpy()[None])
    assert await _exec_seconds(batched) - before > 1.5 * wall  # they shared steps


async def test_worker_batches_concurrent_thinker_requests_with_mixed_media(start_worker,
                                                                          channels) -> None:
    """Text only, an image, audio and both, eight at once on a thinker worker with maxBatchSize
    8: the same greedy tokens as a worker that runs them one at a time, and shared steps
    (executor time beyond the wall time)."""
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)
    clip = rng.uniform(-0.5, 0.5, 8000).astype(np.float32)
    media = [{}, {"input_image.0": image}, {"input_audio.0": clip},
             {"input_image.0": image, "input_audio.0": clip}]
    requests = [({"prompt": PROMPTS[i], "max_tokens": 30, "ignore_eos": True}, media[i % 4])
                for i in range(8)]
    batched = start_worker("thinker", model="tiny-omni-thinker", engine={"maxBatchSize": 8})
    serial = start_worker("thinker", model="tiny-omni-thinker", engine={"maxBatchSize": 1})
    ch, ref_ch = channels(batched), channels(serial)
    reference = [(await ref_ch.request(f"r{i}", ps, ts))[1].header.token_ids
                 for i, (ps, ts) in enumerate(requests)]
    before, t0 = await _exec_seconds(batched), time.monotonic()
    results = await asyncio.gather(*(ch.request(f"r{i}", ps, ts)
                                     for i, (ps, ts) in enumerate(requests)))
    wall = time.monotonic() - t0
    for i, (_, final) in enumerate(results):
        assert isinstance(final.header, p.Final), final.header
        assert final.header.token_ids == reference[i], f"request {i} differs from serial"
    assert await _exec_seconds(batched) - before > 2 * wall


async def test_a_worker_reuses_a_shared_prefix_and_counts_it(start_worker, channels) -> None:
    """Over ZMQ, batched: requests sharing a system prompt get the cache-off worker's tokens,
    and /metrics says how many prompt tokens came from the cache."""
    system = "You are a terse assistant who answers every question in one short line. "
    cached = start_worker("ar", model="tiny-llama", engine={"maxBatchSize": 8})
    plain = start_worker("ar", model="tiny-llama", engine={"maxBatchSize": 8,
                                                           "prefixCacheMib": 0})
    ch, ref_ch = channels(cached), channels(plain)
    questions = ["why?", "what is the time", "name three colours", "count to four"]
    params = [{"prompt": system + q, "max_tokens": 10, "ignore_eos": True} for q in questions]
    refs = [(await ref_ch.request(f"r{i}", ps))[1] for i, ps in enumerate(params)]
    first = (await ch.request("first", params[0]))[1]  # keeps the system prompt's blocks
    got = await asyncio.gather(*(ch.request(f"g{i}", ps) for i, ps in enumerate(params)))
    for i, (ref, (_, msg)) in enumerate(zip(refs, got, strict=True)):
        assert isinstance(msg.header, p.Final), msg.header
        assert msg.header.token_ids == ref.header.token_ids, i
    assert first.header.token_ids == refs[0].header.token_ids
    shared = len(system) // 16 * 16
    prefix = "omnistage_worker_prefix_cache_"
    saved = await asyncio.to_thread(_metric, cached, prefix + "saved_tokens_total")
    hits = await asyncio.to_thread(_metric, cached, prefix + "hits_total")
    # Each reused the system prompt's blocks at least (g0, first's twin, its whole prompt's).
    assert hits == len(questions) and saved >= shared * len(questions)
    text = await asyncio.to_thread(_scrape, plain)
    assert "omnistage_worker_ready" in text and prefix not in text  # off: no such families
