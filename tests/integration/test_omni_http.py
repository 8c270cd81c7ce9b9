"""The omni speech example (thinker -> talker -> vocoder, examples/omni-speech.yaml) through a
real `omnistage serve` and its HTTP API: where features meet (issue 37's defects 4-7).

- Seeds: an unseeded sampled request draws its own seed, so two of them answer differently;
  an explicit seed stays reproducible.
- Mixed media: text, an image and an audio clip in (in either order, or across messages),
  streamed text and audio out.
- Usage: speech.audio.done counts the tokens of the stages that ran (the thinker's prompt).
- Errors: a part the thinker refuses is named as the client sent it, never as the tensor.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_audio_api import client, png_url, post, wav_b64
from tests.integration.test_serve import Serve

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(600)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "omni-speech.yaml"
MODEL = "omni-speech"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("omni-http")
    served = Serve(EXAMPLE, tmp / "logs", tmp)
    try:
        yield served.url(300)
    finally:
        served.stop()


def _chat(url: str, **body: Any) -> dict[str, Any]:
    status, _, raw = post(f"{url}/v1/chat/completions", {"model": MODEL, **body})
    assert status == 200, raw[:500]
    return dict(json.loads(raw))


def _text(url: str, **extra: Any) -> str:
    reply = _chat(url, messages=[{"role": "user", "content": "tell me a story"}],
                  temperature=1.0, max_tokens=12, ignore_eos=True, **extra)
    return str(reply["choices"][0]["message"]["content"])


# --------------------------------------------------------------------------- seeds (defect 4)


def test_unseeded_sampled_requests_differ_and_a_seed_repeats(url: str) -> None:
    unseeded = {_text(url) for _ in range(3)}
    assert len(unseeded) == 3, unseeded  # each drew its own seed (they were all seed 0)
    assert _text(url, seed=5) == _text(url, seed=5)  # explicit: reproducible
    speech = {post(f"{url}/v1/audio/speech", {"input": "hello there", "response_format": "pcm"})[2]
              for _ in range(2)}
    assert len(speech) == 2  # the talker samples its first codes: a seed each


# --------------------------------------------------------------------------- media (defect 5)

IMAGE = {"type": "image_url", "image_url": {"url": png_url(40, 30)}}
AUDIO = {"type": "input_audio", "input_audio": {"data": wav_b64(0.5, 16000), "format": "wav"}}
TEXT = {"type": "text", "text": "what do you see and hear?"}


def _streamed(url: str, messages: list[dict[str, Any]]) -> tuple[str, bytes, int]:
    """(transcript, pcm16 audio, prompt tokens) of a streamed chat answered in audio."""
    stream = client(url).chat.completions.create(
        model=MODEL, messages=messages, stream=True, modalities=["text", "audio"],
        audio={"voice": "default", "format": "pcm16"}, stream_options={"include_usage": True})
    transcript, pcm, prompt, finished = "", b"", 0, False
    for chunk in stream:
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            audio = choice.delta.audio
            if audio is not None:
                transcript += audio.transcript or ""
                pcm += base64.b64decode(audio.data or "")
            finished = finished or choice.finish_reason is not None
    assert finished
    return transcript, pcm, prompt


def test_image_audio_and_text_in_streamed_text_and_audio_out(url: str) -> None:
    _, plain_pcm, plain = _streamed(url, [{"role": "user", "content": [TEXT]}])
    assert plain > 0 and plain_pcm
    shapes = {
        "image first": [{"role": "user", "content": [TEXT, IMAGE, AUDIO]}],
        "audio first": [{"role": "user", "content": [AUDIO, TEXT, IMAGE]}],
        "across messages": [{"role": "user", "content": [IMAGE]},
                            {"role": "user", "content": [TEXT, AUDIO]}],
    }
    prompts = {}
    for shape, messages in shapes.items():
        transcript, pcm, prompts[shape] = _streamed(url, messages)
        assert pcm and len(pcm) % 2 == 0, shape
        assert transcript, shape
        # Each medium's placeholder tokens (and its two bounds) reached the thinker.
        assert prompts[shape] > plain + 4, (shape, prompts, plain)
    assert prompts["image first"] == prompts["audio first"]  # one turn: the order is no matter


# --------------------------------------------------------------------------- usage (defect 6)


def test_speech_sse_reports_the_stages_token_counts(url: str) -> None:
    text = "say hello to everyone in the room"
    status, _, raw = post(f"{url}/v1/audio/speech",
                          {"input": text, "stream_format": "sse", "response_format": "pcm"})
    assert status == 200, raw[:300]
    events = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
              if line.startswith(b"data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    # The same prompt through the generic route: the thinker's own counts.
    status, _, raw = post(f"{url}/v1/pipelines/{MODEL}/requests",
                          {"prompt": text, "finals": ["thinker"]})
    assert status == 200, raw[:300]
    thinker = json.loads(raw)["children"][0]["outputs"]["thinker"]["fields"]
    assert usage["input_tokens"] == thinker["prompt_tokens"] > 0
    # The thinker's answer (greedy: the same one) plus the talker's codec frames.
    assert usage["output_tokens"] > thinker["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


# --------------------------------------------------------------------------- errors (defect 7)


def _refused(url: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    status, _, raw = post(f"{url}/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert status == 400, raw[:300]
    return dict(json.loads(raw)["error"])


def test_a_part_the_thinker_refuses_is_named_as_the_client_sent_it(url: str) -> None:
    short = {"type": "input_audio", "input_audio": {"data": wav_b64(100 / 16000, 16000),
                                                    "format": "wav"}}
    err = _refused(url, [short, TEXT])
    assert err["param"] == "messages[0].content[0].input_audio", err
    assert err["message"].startswith("messages[0].content[0].input_audio: the audio is too "
                                     "short"), err
    assert "tensors." not in err["message"] and "stage" not in err["message"], err
    # The second image part, after an audio clip: its own field, whatever the numbering.
    wide = {"type": "image_url", "image_url": {"url": png_url(300, 1)}}
    err = _refused(url, [TEXT, AUDIO, IMAGE, wide])
    assert err["param"] == "messages[0].content[3].image_url", err
    assert err["message"].startswith("messages[0].content[3].image_url: "), err
    assert "aspect ratio" in err["message"] and "tensors." not in err["message"], err
