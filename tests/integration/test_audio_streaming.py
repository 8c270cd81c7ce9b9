"""Streamed audio: the speech stage's chunks reach the client as the stage makes them.

A real `omnistage serve` runs `listen -> tone` (tests/harness/speech_kinds.py). When the
request streams, tone emits its sine in chunks with a window of one, so each chunk waits for
the credit the HTTP layer sends once it wrote the previous one; a prompt `gated <name> ...`
holds tone's last chunk back until the test creates the file <gate>/<name>. Audio that arrives
while the stage waits there cannot have been sent from the final reply. The real vocoder
(examples/tts.yaml) streams its windows to a streaming request the same way.
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import soundfile
import yaml

from omnistage import media
from omnistage.models import TINY_SAMPLE_RATE
from omnistage.orchestrator.requests import AudioChunk, Outcome, PipelineRequest
from tests.harness import speech_kinds
from tests.integration.test_audio_api import pitch, post, tone_samples
from tests.integration.test_serve import Serve
from tests.integration.test_speech_stages import audio_of, run
from tests.integration.test_speech_stages import serve as serve  # the fixture

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(600)

GUARD_S = 60.0  # far bound on what takes milliseconds


class Server:
    def __init__(self, serve: Serve, url: str, gate: Path) -> None:
        self.serve, self.url, self.gate = serve, url, gate

    def tone_state(self) -> dict[str, Any]:
        [name] = [f.name.removesuffix(".ports.json")
                  for f in self.serve.log_dir.glob("*.ports.json") if "-speak-" in f.name]
        return self.serve.worker_state(name)

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=GUARD_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("audio-stream")
    gate = tmp / "gate"
    gate.mkdir()
    manifest = speech_kinds.manifest("stream", True)
    manifest["spec"]["stages"][1]["streaming"] = {"window": 1}
    path = tmp / "stream.yaml"
    path.write_text(yaml.safe_dump(manifest))
    with speech_kinds.kinds_env():
        s = Serve(path, tmp / "logs", tmp, env={speech_kinds.TONE_GATE_ENV: str(gate)})
    try:
        yield Server(s, s.url(300), gate)
    finally:
        s.stop()


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _chat(text: str, stream: bool) -> dict[str, Any]:
    return {"model": "stream", "messages": [{"role": "user", "content": text}],
            "modalities": ["text", "audio"], "audio": {"voice": "alto", "format": "pcm16"},
            "stream": stream}


def _whole_pcm(server: Server, text: str) -> bytes:
    """The same audio, not streamed (the gate of `text` must be open)."""
    reply = server.client().chat.completions.create(**_chat(text, False))
    pcm = base64.b64decode(reply.choices[0].message.audio.data)
    status, _, raw = post(f"{server.url}/v1/audio/speech",
                          {"input": text, "voice": "alto", "response_format": "pcm"})
    assert status == 200 and raw == pcm  # both routes render the whole audio alike
    return pcm


def test_chat_audio_streams_before_the_stage_ends(server: Server) -> None:
    text = "gated one hello there streamed"
    stream = server.client().chat.completions.create(**_chat(text, True))
    pieces: list[bytes] = []
    order: list[str] = []
    for chunk in stream:
        for choice in chunk.choices:
            audio = choice.delta.audio
            if audio is not None and audio.data:
                pieces.append(base64.b64decode(audio.data))
                order.append("data")
                if len(pieces) == 1:
                    # The stage holds its last chunk until the gate opens: this audio came
                    # from its earlier chunks, not from its final reply.
                    assert server.tone_state()["in_flight"] == 1
                    (server.gate / "one").touch()
            elif audio is not None and audio.expires_at:
                order.append("end")
            if choice.finish_reason:
                order.append(choice.finish_reason)
    assert order[-2:] == ["end", "stop"] and order.count("end") == 1
    # Held to its window of one: each next chunk waited for the credit of the one written.
    chunks = server.tone_state()["chunks"]
    assert chunks["outstanding_peak"] == 1 and chunks["window_waits"] > 0, chunks
    # Each of tone's chunks went out as it came (resampled 22050 -> 24000 Hz, one encoder).
    assert len(pieces) >= speech_kinds.TONE_CHUNKS - 1
    assert b"".join(pieces) == _whole_pcm(server, text)


def test_speech_sse_pcm_streams_before_the_stage_ends(server: Server) -> None:
    text = "gated two a sentence to say"
    req = urllib.request.Request(
        f"{server.url}/v1/audio/speech", data=json.dumps(
            {"input": text, "voice": "alto", "response_format": "pcm",
             "stream_format": "sse"}).encode(), headers={"Content-Type": "application/json"})
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=GUARD_S) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                assert events[0]["type"] == "speech.audio.delta"
                assert server.tone_state()["in_flight"] == 1
                (server.gate / "two").touch()
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert data == _whole_pcm(server, text)


@pytest.mark.parametrize("fmt", media.STREAMED_FORMATS)
def test_the_speech_file_streams_before_the_stage_ends(server: Server, fmt: str) -> None:
    """stream_format audio (the default): the file's first bytes reach the openai client while
    the stage still holds its last chunk, and the joined bytes are one file of the audio."""
    text = f"gated file-{fmt} a sentence to say, streamed as a file"
    data = b""
    with server.client().audio.speech.with_streaming_response.create(
            model="stream", input=text, voice="alto", response_format=fmt) as raw:
        assert raw.headers["content-type"] == media.MEDIA_TYPES[fmt]
        for piece in raw.iter_bytes():
            if piece and not data:
                # The stage waits at its gate: these bytes came from its earlier chunks.
                assert server.tone_state()["in_flight"] == 1
                (server.gate / f"file-{fmt}").touch()
            data += piece
    assert (server.gate / f"file-{fmt}").exists()  # bytes came before the stage ended
    samples_want = tone_samples(text)
    if fmt == "pcm":
        assert data == _whole_pcm(server, text)
        return
    if fmt == "wav":  # a header of unknown length, then the samples: read to the end
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert rate == speech_kinds.TONE_RATE and samples.size == samples_want
        whole = media.encode_audio(np.array(samples), rate, "wav")
        assert soundfile.read(io.BytesIO(whole))[0].size == samples_want
    else:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            samples = np.concatenate([f.to_ndarray().reshape(-1)
                                      for f in container.decode(stream)])
        assert abs(samples.size / rate - samples_want / speech_kinds.TONE_RATE) < 0.1
    assert abs(pitch(samples, rate) - speech_kinds.PITCH["alto"]) < 5


def test_flac_is_sent_whole_with_its_length(server: Server) -> None:
    """flac is not streamed (its header holds the length): the stage runs unstreamed, so its
    gate (only a streaming request waits there) is never waited on, and soundfile reads the
    file whole."""
    text = "gated flac-never-opened a sentence to say"
    with server.client().audio.speech.with_streaming_response.create(
            model="stream", input=text, voice="alto", response_format="flac") as raw:
        assert raw.headers["content-type"] == media.MEDIA_TYPES["flac"]
        data = raw.read()
    samples, rate = soundfile.read(io.BytesIO(data))
    assert rate == speech_kinds.TONE_RATE and samples.size == tone_samples(text)
    assert not (server.gate / "flac-never-opened").exists()


def test_a_client_gone_mid_stream_stops_the_stage(server: Server) -> None:
    stream = server.client().chat.completions.create(**_chat("gated never opens", True))
    for chunk in stream:
        if any(c.delta.audio is not None and c.delta.audio.data for c in chunk.choices):
            break  # audio is flowing and the stage waits at its gate
    assert server.tone_state()["in_flight"] == 1
    stream.close()
    _until(lambda: server.tone_state()["in_flight"] == 0, "the speech stage was not stopped")
    # The server goes on serving.
    status, _, _ = post(f"{server.url}/v1/audio/speech", {"input": "after", "voice": "bass"})
    assert status == 200


async def test_the_vocoder_streams_its_windows_to_a_streaming_request(serve) -> None:
    orch = await serve("tts.yaml")
    seed = {"*": {"seed": 1}}  # the same audio twice: unseeded, each request draws its own
    whole = audio_of(await run(orch, PipelineRequest(prompt="hello there", params=seed)))
    chunks: list[np.ndarray] = []
    outcome = None
    streamed = PipelineRequest(prompt="hello there", stream=True, params=seed)
    async for event in orch.submit(streamed).events():
        if isinstance(event, AudioChunk):
            assert outcome is None and event.stage == "vocoder"
            assert event.sample_rate == TINY_SAMPLE_RATE and event.seq == len(chunks) + 1
            chunks.append(np.array(event.audio.numpy()))
            event.credit()
        elif isinstance(event, Outcome):
            outcome = event
    assert outcome is not None and len(chunks) > 1
    # The windows joined are the audio, which the final reply still holds whole.
    assert np.concatenate(chunks).tobytes() == whole.tobytes() == audio_of(outcome).tobytes()
