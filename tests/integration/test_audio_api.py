"""The audio and media routes through a real `omnistage serve`, with the official openai client.

The pipeline `speak` is listen -> tone, two test-only kinds (tests/harness/speech_kinds.py)
that the server and its workers know through OMNISTAGE_STAGE_KINDS: `listen` answers chat and
says what input media it received, `tone` turns the text into a sine at 22050 Hz whose length
follows the text and whose pitch follows the voice. `mute` has the listen stage only, so it
has no speech stage.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import soundfile
import yaml
from PIL import Image

from omnistage import media
from tests.harness import speech_kinds
from tests.integration.test_serve import Serve

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(600)

VOICES = speech_kinds.VOICES


def _start(tmp: Path, name: str, speech: bool) -> Serve:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(speech_kinds.manifest(name, speech)))
    return Serve(path, tmp / f"logs-{name}", tmp)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Both pipelines, started together; each server and worker is killed at teardown."""
    tmp = tmp_path_factory.mktemp("audio-api")
    with speech_kinds.kinds_env():
        started = [_start(tmp, "speak", True), _start(tmp, "mute", False)]
    try:
        yield {"speak": started[0].url(300), "mute": started[1].url(300)}
    finally:
        for s in started:
            s.stop()


def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def error_of(url: str, body: Any) -> dict[str, Any]:
    status, _, raw = post(url, body)
    assert status == 400, (status, raw[:300])
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error", err
    return dict(err)


def pitch(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[int(np.argmax(spectrum))])


def tone_samples(text: str) -> int:
    return round(len(text) * speech_kinds.SECONDS_PER_CHAR * speech_kinds.TONE_RATE)


def wav_b64(seconds: float, rate: int) -> str:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), rate,
                    format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def png_url(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


HELLO = [{"role": "user", "content": "hello there"}]


# --------------------------------------------------------------------------- chat with audio


def test_chat_answers_with_a_wav_and_its_transcript(servers: dict[str, str]) -> None:
    reply = client(servers["speak"]).chat.completions.create(
        model="speak", messages=HELLO, modalities=["text", "audio"],
        audio={"voice": "bass", "format": "wav"})
    message = reply.choices[0].message
    assert message.content is None and message.audio is not None
    assert message.audio.transcript == "hello there"
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert rate == speech_kinds.TONE_RATE  # the stage's own rate
    # tone speaks the transcript: its length follows the text, its pitch the voice.
    assert samples.size == tone_samples("hello there") > 0
    assert abs(pitch(samples, rate) - speech_kinds.PITCH["bass"]) < 5
    assert message.audio.id and message.audio.expires_at > reply.created


def test_each_sample_gets_its_own_audio(servers: dict[str, str]) -> None:
    reply = client(servers["speak"]).chat.completions.create(
        model="speak", messages=HELLO, modalities=["text", "audio"], n=2,
        audio={"voice": "alto", "format": "mp3"})
    assert [c.index for c in reply.choices] == [0, 1]
    ids = {c.message.audio.id for c in reply.choices}
    assert len(ids) == 2
    for choice in reply.choices:
        with av.open(io.BytesIO(base64.b64decode(choice.message.audio.data))) as container:
            assert container.streams.audio[0].codec_context.name.startswith("mp3")


def test_an_omitted_voice_is_the_stage_default(servers: dict[str, str]) -> None:
    status, _, raw = post(f"{servers['speak']}/v1/chat/completions", {
        "messages": HELLO, "modalities": ["text", "audio"], "audio": {"format": "flac"}})
    assert status == 200, raw
    audio = json.loads(raw)["choices"][0]["message"]["audio"]
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio["data"])))
    assert abs(pitch(samples, rate) - speech_kinds.PITCH[VOICES[0]]) < 5  # the first voice


def test_streamed_chat_interleaves_transcript_and_pcm16_audio(servers: dict[str, str]) -> None:
    stream = client(servers["speak"]).chat.completions.create(
        model="speak", messages=HELLO, modalities=["text", "audio"], stream=True,
        audio={"voice": {"id": "alto"}, "format": "pcm16"})
    transcript, pcm, ends, order = "", b"", [], []
    for chunk in stream:
        for choice in chunk.choices:
            audio = choice.delta.audio
            if audio is not None:
                if audio.transcript:
                    transcript += audio.transcript
                    order.append("text")
                if audio.data:
                    pcm += base64.b64decode(audio.data)
                    order.append("audio")
                if audio.expires_at:
                    order.append("end")
            if choice.finish_reason:
                ends.append(choice.finish_reason)
    assert transcript == "hello there" and ends == ["stop"]
    assert order[0] == "text" and order[-1] == "end" and "audio" in order
    samples, rate = soundfile.read(io.BytesIO(pcm), format="RAW", subtype="PCM_16",
                                   samplerate=media.PCM_SAMPLE_RATE, channels=1)
    seconds = tone_samples("hello there") / speech_kinds.TONE_RATE
    assert abs(samples.size / rate - seconds) < 0.01
    assert abs(pitch(samples, rate) - speech_kinds.PITCH["alto"]) < 5


# --------------------------------------------------------------------------- /v1/audio/speech


@pytest.mark.parametrize("fmt", media.AUDIO_OUTPUT_FORMATS)
def test_speech_in_each_format(servers: dict[str, str], fmt: str) -> None:
    text = "a sentence to say"
    with client(servers["speak"]).audio.speech.with_streaming_response.create(
            model="speak", input=text, voice="bass", response_format=fmt) as raw:
        data = raw.read()
        assert raw.headers["content-type"] == media.MEDIA_TYPES[fmt]
    if fmt == "pcm":
        samples = np.frombuffer(data, "<i2").astype(np.float32) / 32767
        rate = media.PCM_SAMPLE_RATE
    elif fmt in ("wav", "flac"):
        samples, rate = soundfile.read(io.BytesIO(data))
        assert rate == speech_kinds.TONE_RATE and samples.size == tone_samples(text)
    else:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            samples = np.concatenate([f.to_ndarray().reshape(-1)
                                      for f in container.decode(stream)])
    seconds = tone_samples(text) / speech_kinds.TONE_RATE
    assert abs(samples.size / rate - seconds) < 0.1, (fmt, samples.size, rate)
    assert abs(pitch(samples, rate) - speech_kinds.PITCH["bass"]) < 5


def test_speech_speed_and_sse(servers: dict[str, str]) -> None:
    url = f"{servers['speak']}/v1/audio/speech"
    text = "a longer sentence to be spoken twice as fast"
    status, _, raw = post(url, {"input": text, "response_format": "wav", "speed": 2.0})
    assert status == 200
    samples, rate = soundfile.read(io.BytesIO(raw))
    assert abs(samples.size - tone_samples(text) / 2) < 0.05 * tone_samples(text)
    status, headers, raw = post(url, {"input": text, "response_format": "wav",
                                      "stream_format": "sse"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1]) and events[:-1]
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    samples, rate = soundfile.read(io.BytesIO(data))
    assert rate == speech_kinds.TONE_RATE and samples.size == tone_samples(text)


def test_models_list_the_voices(servers: dict[str, str]) -> None:
    models = client(servers["speak"]).models.list().data
    assert [m.model_extra.get("voices") for m in models] == [VOICES]
    assert "voices" not in client(servers["mute"]).models.list().data[0].model_extra


# --------------------------------------------------------------------------- input media


def test_image_and_audio_parts_reach_the_entry_stage(servers: dict[str, str]) -> None:
    reply = client(servers["mute"]).chat.completions.create(model="mute", messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": png_url(32, 24)}},
            # 0.5 s at 44.1 kHz: resampled to the input rate, 16 kHz.
            {"type": "input_audio", "input_audio": {"data": wav_b64(0.5, 44100),
                                                    "format": "wav"}}]}])
    assert reply.choices[0].message.content == (
        f"what is this image 0 32x24 audio 0 {media.INPUT_AUDIO_SAMPLE_RATE // 2} samples")


# --------------------------------------------------------------------------- bad input


def _chat(audio: Any = None, content: Any = "hi", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], **extra}
    if audio is not None:
        body["modalities"] = ["text", "audio"]
        body["audio"] = audio
    return body


def test_bad_audio_requests_name_the_field(servers: dict[str, str]) -> None:
    chat = f"{servers['speak']}/v1/chat/completions"
    speech = f"{servers['speak']}/v1/audio/speech"
    err = error_of(chat, _chat({"voice": "tenor", "format": "wav"}))
    assert err["param"] == "audio.voice" and err["code"] == "invalid_value"
    assert "'alto' or 'bass'" in err["message"], err
    err = error_of(chat, _chat({"voice": {"id": "tenor"}, "format": "wav"}))
    assert err["param"] == "audio.voice.id", err
    assert error_of(chat, _chat({"voice": "alto", "format": "aac"}))["param"] == "audio.format"
    assert error_of(chat, _chat({"voice": "alto", "format": "wav"}, stream=True))["param"] == \
        "audio.format"  # streamed audio is pcm16
    assert error_of(chat, _chat(modalities=["text", "audio"]))["param"] == "audio"
    assert error_of(chat, _chat(modalities=["audio", "video"]))["param"] == "modalities"
    assert error_of(speech, {"input": "x", "voice": "tenor"})["param"] == "voice"
    assert error_of(speech, {"input": "x", "response_format": "aac"})["param"] == \
        "response_format"
    assert error_of(speech, {"input": "x", "speed": 9})["param"] == "speed"
    assert error_of(speech, {"input": ""})["param"] == "input"
    # A pipeline without a speech stage: chat refuses audio, the speech route is not there.
    err = error_of(f"{servers['mute']}/v1/chat/completions",
                   _chat({"voice": "alto", "format": "wav"}))
    assert err["param"] == "audio" and err["code"] == "unsupported_parameter"
    assert "no speech stage" in err["message"]
    status, _, raw = post(f"{servers['mute']}/v1/audio/speech", {"input": "x"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "api_not_enabled"


def test_bad_media_parts_name_the_part(servers: dict[str, str]) -> None:
    chat = f"{servers['mute']}/v1/chat/completions"
    at = "messages[0].content[1]"

    def part(p: dict[str, Any]) -> dict[str, Any]:
        return _chat(content=[{"type": "text", "text": "look"}, p])

    cases = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
         f"{at}.image_url.url", "invalid_value"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
         f"{at}.image_url.url", "invalid_media"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}},
         f"{at}.image_url.url", "invalid_media"),
        ({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + "A" * (media.MAX_IMAGE_BYTES * 4 // 3 + 8)}},
         f"{at}.image_url.url", "media_too_large"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF junk").decode(),
                                                 "format": "wav"}},
         f"{at}.input_audio.data", "invalid_media"),
        ({"type": "input_audio", "input_audio": {"data": wav_b64(0.1, 44100), "format": "ogg"}},
         f"{at}.input_audio.format", "invalid_value"),
        ({"type": "input_audio", "input_audio": {"data": wav_b64(0.1, 4000), "format": "wav"}},
         f"{at}.input_audio.data", "invalid_media"),  # a rate below what is taken
        ({"type": "video_url", "video_url": {"url": "x"}}, at, "unsupported_parameter"),
    ]
    for p, param, code in cases:
        err = error_of(chat, part(p))
        assert (err["param"], err["code"]) == (param, code), (p["type"], err)
    # The speak pipeline's entry stage takes them too; the mute one's as well. Both live.
    status, _, _ = post(chat, _chat())
    assert status == 200
