"""The speech kinds (thinker -> talker -> vocoder, and talker -> vocoder) in real worker
processes behind the real orchestrator, running the examples as shipped."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnistage.models import TINY_SAMPLE_RATE
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.render import speech_usage
from omnistage.orchestrator.requests import Outcome, PipelineRequest
from omnistage.spec import load_pipeline

pytestmark = pytest.mark.timeout(300)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def serve(start_worker) -> AsyncIterator[Callable[[str], Any]]:
    """An Orchestrator over one real worker per stage of an example file."""
    orchs: list[Orchestrator] = []

    async def go(example: str) -> Orchestrator:
        pipe = load_pipeline(EXAMPLES / example)
        infos = []
        for stage in pipe.spec.stages:
            name = f"{pipe.metadata.name}-{stage.name}-0"
            infos.append(ReplicaInfo(stage.name, name, start_worker(stage, name=name).zmq))
        orch = Orchestrator(pipe, StaticMembership(infos))
        await orch.start()
        orchs.append(orch)
        return orch

    yield go
    for orch in orchs:
        await orch.stop(drain_timeout=1)


async def run(orch: Orchestrator, req: PipelineRequest) -> Outcome:
    async for ev in orch.submit(req).events():
        if isinstance(ev, Outcome):
            return ev
    raise AssertionError("no outcome")


def audio_of(out: Outcome, stage: str = "vocoder") -> np.ndarray:
    assert out.status == "ok", out
    result = out.children[0].outputs[stage]
    assert result.fields["sample_rate"] == TINY_SAMPLE_RATE
    audio = result.tensors["audio"].numpy()
    assert audio.dtype == np.float32 and audio.ndim == 1 and audio.size > 0
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0
    return audio


async def test_tts_example_speaks_the_prompt(serve) -> None:
    orch = await serve("tts.yaml")
    seed = {"*": {"seed": 1}}  # unseeded, each request draws its own (the talker samples)
    first = await run(orch, PipelineRequest(prompt="hello there", params=seed))
    one = audio_of(first)
    # Usage (speech.audio.done's): no thinker here, so the talker counts the text it read.
    talker = first.children[0].usage["talker"]  # a stage that ran, not a final one
    assert "talker" not in first.children[0].outputs
    usage = speech_usage(first)
    assert usage["input_tokens"] == talker["prompt_tokens"] > 0
    assert usage["output_tokens"] == talker["completion_tokens"] > 0
    again = audio_of(await run(orch, PipelineRequest(prompt="hello there", params=seed)))
    assert np.array_equal(one, again)  # seeded: the same request, the same audio
    other = audio_of(await run(orch, PipelineRequest(prompt="something else entirely",
                                                     params=seed)))
    assert not np.array_equal(one[:other.size], other[:one.size])  # the text conditions it
    bad = await run(orch, PipelineRequest(prompt="hi", params={"talker": {"voice": "nobody"}}))
    assert bad.status == "request_error" and "params.voice" in bad.error.message, bad


async def test_omni_speech_example_answers_in_audio_and_reads_media(serve) -> None:
    orch = await serve("omni-speech.yaml")
    audio_of(await run(orch, PipelineRequest(prompt="say something")))

    # Media reach the thinker and its encoders run: two images of one size make the same
    # number of placeholder tokens, so hidden states that differ can only come from the vision
    # tower having read the pixels; likewise the audio tower for two clips of one length.
    rng = np.random.default_rng(0)

    async def thinker(**media: np.ndarray) -> tuple[int, np.ndarray]:
        req = PipelineRequest(prompt="what is this?", tensors=media, finals=["thinker"],
                              params={"thinker": {"return_hidden_states": True}})
        out = await run(orch, req)
        assert out.status == "ok", out
        result = out.children[0].outputs["thinker"]
        return result.fields["prompt_tokens"], result.tensors["hidden_states"].numpy()

    plain, _ = await thinker()
    img_a, img_b = (rng.integers(0, 256, (40, 50, 3), dtype=np.uint8) for _ in range(2))
    with_a, a_h = await thinker(**{"input_image.0": img_a})
    with_b, b_h = await thinker(**{"input_image.0": img_b})
    assert with_a == with_b > plain
    assert not np.allclose(a_h[:with_a], b_h[:with_b])
    clip_a, clip_b = (rng.uniform(-0.5, 0.5, 16000).astype(np.float32) for _ in range(2))
    aud_a, aa_h = await thinker(**{"input_audio.0": clip_a})
    aud_b, ab_h = await thinker(**{"input_audio.0": clip_b})
    assert aud_a == aud_b > plain
    assert not np.allclose(aa_h[:aud_a], ab_h[:aud_b])
    both, _ = await thinker(**{"input_image.0": img_a, "input_audio.0": clip_a})
    assert both == with_a + aud_a - plain

    # A corrupt media tensor is the request's error, naming the tensor; the stage lives on.
    bad = await run(orch, PipelineRequest(prompt="x", tensors={
        "input_image.0": np.zeros((4, 4), dtype=np.uint8)}))
    assert bad.status == "request_error" and "tensors.input_image.0" in bad.error.message, bad
    audio_of(await run(orch, PipelineRequest(prompt="still here")))
