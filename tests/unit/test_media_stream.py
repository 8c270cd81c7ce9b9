"""media.AudioFileStream: an audio file made chunk by chunk (stream_format audio of
/v1/audio/speech). Bytes come out while the audio still arrives, and the joined bytes are one
file that decodes to the audio (soundfile for wav and flac, PyAV for mp3 and opus)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile

from omnistage import media

RATE = 22050
CHUNK = RATE // 10  # 0.1 s


def tone(seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def stream(fmt: str, audio: np.ndarray) -> tuple[list[bytes], bytes]:
    enc = media.AudioFileStream(fmt, RATE)
    parts = [enc.feed(audio[i:i + CHUNK]) for i in range(0, audio.size, CHUNK)]
    return parts, enc.close()


def decoded(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    if fmt in ("wav", "flac"):
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        return samples, rate
    with av.open(io.BytesIO(data)) as container:
        s = container.streams.audio[0]
        rate = s.codec_context.sample_rate
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(s)]), rate


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[int(np.argmax(spectrum))])


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus"])
def test_a_streamed_file_comes_out_as_its_audio_comes_in(fmt: str) -> None:
    audio = tone(2.0)
    parts, tail = stream(fmt, audio)
    # Bytes after the first half second of audio, long before the end.
    assert sum(len(p) for p in parts[:5]) > 0, [len(p) for p in parts]
    assert sum(1 for p in parts if p) >= len(parts) // 2, [len(p) for p in parts]
    samples, rate = decoded(fmt, b"".join(parts) + tail)
    assert abs(samples.size / rate - 2.0) < 0.1, (samples.size, rate)
    assert abs(peak_hz(samples, rate) - 440.0) < 2


def test_a_streamed_wav_is_the_whole_wavs_samples() -> None:
    """wav: a header of unknown length (what FFmpeg writes to a pipe), then 16-bit PCM at the
    stage's rate: the same samples, bit for bit, as the wav encoded whole."""
    audio = tone(1.0)
    parts, tail = stream("wav", audio)
    data = b"".join(parts) + tail
    assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff"  # RIFF and data sizes unknown
    whole = media.encode_audio(audio, RATE, "wav")
    got, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    want, _ = soundfile.read(io.BytesIO(whole), dtype="int16")
    assert rate == RATE and np.array_equal(got, want)


def test_streamed_pcm_is_the_whole_pcm() -> None:
    audio = tone(1.3)
    parts, tail = stream("pcm", audio)
    assert b"".join(parts) + tail == media.encode_audio(audio, RATE, "pcm")


def test_a_streamed_flac_decodes_though_its_length_is_unknown() -> None:
    """flac streams from here too, but its header then has no length (0: unknown), which
    FFmpeg reads and libsndfile does not: why the API sends flac whole (STREAMED_FORMATS)."""
    assert "flac" not in media.STREAMED_FORMATS
    audio = tone(1.0)
    parts, tail = stream("flac", audio)
    samples, rate = decoded("mp3", b"".join(parts) + tail)  # through PyAV
    assert rate == RATE and abs(samples.size - audio.size) < 4608


@pytest.mark.parametrize("fmt", media.AUDIO_OUTPUT_FORMATS)
def test_no_audio_at_all_is_still_a_file(fmt: str) -> None:
    data = media.AudioFileStream(fmt, RATE).close()
    if fmt == "pcm":
        assert data == b""
    elif fmt == "wav":
        assert soundfile.read(io.BytesIO(data))[0].size == 0
    else:
        samples, _ = decoded("mp3" if fmt == "flac" else fmt, data)  # silence, one frame
        assert float(np.abs(samples).max()) < 1e-3


def test_bad_formats_rates_and_chunks_are_named() -> None:
    with pytest.raises(media.MediaError, match="format 'aac' is not one of"):
        media.AudioFileStream("aac", RATE)
    with pytest.raises(media.MediaError, match="sample rate 100"):
        media.AudioFileStream("mp3", 100)
    enc = media.AudioFileStream("mp3", RATE)
    with pytest.raises(media.MediaError, match="mono"):
        enc.feed(np.zeros((2, 10), np.float32))
