"""omnistage.media: round trips through each format, read back by soundfile / PyAV / Pillow,
and the refusals of corrupt and oversized input."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import soundfile
from PIL import Image

from omnistage import media

RATE = 22050


def sine(seconds: float = 0.5, rate: int = RATE, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def pitch(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[int(np.argmax(spectrum))])


def read_av(data: bytes) -> tuple[np.ndarray, int, str]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return np.concatenate(frames), stream.codec_context.sample_rate, stream.codec_context.name


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --------------------------------------------------------------------------- audio out


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_keep_rate_length_and_samples(fmt: str) -> None:
    wave = sine()
    data = media.encode_audio(wave, RATE, fmt)
    back, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert soundfile.info(io.BytesIO(data)).format == fmt.upper()
    assert rate == RATE and back.shape == wave.shape
    assert np.abs(back - wave).max() < 1e-3  # 16-bit quantisation only


@pytest.mark.parametrize(("fmt", "codec", "rates"), [
    ("mp3", "mp3", (22050,)), ("opus", "opus", (48000,))])
def test_lossy_formats_read_back_with_pyav(fmt: str, codec: str, rates: tuple[int, ...]) -> None:
    data = media.encode_audio(sine(), RATE, fmt)
    back, rate, name = read_av(data)
    assert name.startswith(codec) and rate in rates
    assert abs(back.size / rate - 0.5) < 0.08  # encoder padding at most
    assert abs(pitch(back, rate) - 440) < 5


def test_pcm_is_raw_int16_at_the_openai_rate() -> None:
    data = media.encode_audio(sine(), RATE, "pcm")
    back = np.frombuffer(data, "<i2")
    assert back.size == media.PCM_SAMPLE_RATE // 2
    assert abs(pitch(back.astype(np.float32), media.PCM_SAMPLE_RATE) - 440) < 5
    at_rate = sine(rate=media.PCM_SAMPLE_RATE)  # already at the pcm rate: no resampling
    assert media.pcm16(at_rate, media.PCM_SAMPLE_RATE) == \
        np.rint(at_rate * 32767).astype("<i2").tobytes()


@pytest.mark.parametrize("rate", [24000, 22050, 44100, 16000])
@pytest.mark.parametrize("sizes", [[9000], [1000] * 9, [1, 2, 4000, 4997], [0, 3000, 0, 6000]])
def test_pcm_stream_joins_to_the_whole_pcm(rate: int, sizes: list[int]) -> None:
    """A streamed speech stage's chunks, each encoded as it comes, give the bytes of the whole."""
    x = (0.5 * np.sin(np.arange(9000) * 0.05)).astype(np.float32)
    stream = media.PcmStream(rate)
    parts, at = [], 0
    for n in sizes:
        parts.append(stream.feed(x[at:at + n]))
        at += n
    parts.append(stream.close())
    assert b"".join(parts) == media.pcm16(x, rate)
    assert len(b"".join(parts[:-1])) > 0  # most of it came before the end
    with pytest.raises(media.MediaError, match="sample rate"):
        media.PcmStream(4000)


def test_output_audio_is_checked() -> None:
    with pytest.raises(media.MediaError, match="mono"):
        media.encode_audio(np.zeros((2, 100), np.float32), RATE, "wav")
    with pytest.raises(media.MediaError, match="floating point"):
        media.encode_audio(np.zeros(100, np.int16), RATE, "wav")
    with pytest.raises(media.MediaError, match="sample rate 100 "):
        media.encode_audio(sine(), 100, "wav")
    with pytest.raises(media.MediaError, match="'aac' is not one of"):
        media.encode_audio(sine(), RATE, "aac")
    loud = media.encode_audio(np.array([5.0, np.nan, -np.inf], np.float32), RATE, "wav")
    assert soundfile.read(io.BytesIO(loud))[0].tolist() == pytest.approx([1.0, 0.0, -1.0],
                                                                        abs=1e-4)


def test_speed_changes_tempo_not_pitch() -> None:
    wave = sine(1.0)
    for speed in (0.5, 2.0, 4.0):
        out = media.change_speed(wave, RATE, speed)
        assert abs(out.size - wave.size / speed) < 0.03 * wave.size / speed, speed
        assert abs(pitch(out, RATE) - 440) < 10
    assert media.change_speed(wave, RATE, 1.0) is not None
    with pytest.raises(media.MediaError, match="speed"):
        media.change_speed(wave, RATE, 8.0)


# --------------------------------------------------------------------------- audio in


@pytest.mark.parametrize("rate", [8000, 16000, 44100, 48000])
def test_wav_input_is_resampled_to_the_input_rate(rate: int) -> None:
    buf = io.BytesIO()
    stereo = np.stack([sine(0.5, rate, 300), sine(0.5, rate, 300)], axis=1)
    soundfile.write(buf, stereo, rate, format="WAV", subtype="PCM_16")
    got = media.decode_audio(b64(buf.getvalue()), "wav")
    assert got.dtype == np.float32 and got.ndim == 1
    assert abs(got.size - media.INPUT_AUDIO_SAMPLE_RATE // 2) <= 2
    assert abs(pitch(got, media.INPUT_AUDIO_SAMPLE_RATE) - 300) < 5


def test_mp3_input_round_trips() -> None:
    data = media.encode_audio(sine(), RATE, "mp3")
    got = media.decode_audio(b64(data), "mp3")
    assert abs(got.size / media.INPUT_AUDIO_SAMPLE_RATE - 0.5) < 0.08
    assert abs(pitch(got, media.INPUT_AUDIO_SAMPLE_RATE) - 440) < 5


def test_corrupt_and_oversized_audio_are_refused() -> None:
    wav = media.encode_audio(sine(), RATE, "wav")
    with pytest.raises(media.MediaError, match="not valid base64"):
        media.decode_audio("@@@@", "wav")
    with pytest.raises(media.MediaError, match="not readable wav"):
        media.decode_audio(b64(b"RIFF" + bytes(40)), "wav")
    with pytest.raises(media.MediaError, match=r"not readable mp3|no audio"):
        media.decode_audio(b64(wav[:44] + bytes(3000)), "mp3")
    with pytest.raises(media.MediaError, match="is empty"):
        media.decode_audio("", "wav")
    with pytest.raises(media.MediaTooLarge, match=f"larger than {media.MAX_AUDIO_BYTES}"):
        media.decode_audio("A" * (media.MAX_AUDIO_BYTES * 4 // 3 + 16), "wav")
    with pytest.raises(media.MediaError, match="format 'ogg'"):
        media.decode_audio(b64(wav), "ogg")
    buf = io.BytesIO()
    soundfile.write(buf, sine(0.1, 4000), 4000, format="WAV")
    with pytest.raises(media.MediaError, match="sample rate 4000 Hz"):
        media.decode_audio(b64(buf.getvalue()), "wav")


def test_audio_longer_than_the_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(media, "MAX_AUDIO_SECONDS", 0.25)
    with pytest.raises(media.MediaTooLarge, match=r"longer than 0\.25 seconds"):
        media.decode_audio(b64(media.encode_audio(sine(), RATE, "wav")), "wav")


# --------------------------------------------------------------------------- images in


def png(size: tuple[int, int], mode: str = "RGB", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 200).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize(("mode", "fmt", "mime"), [
    ("RGB", "PNG", "image/png"), ("RGBA", "PNG", "image/png"), ("L", "JPEG", "image/jpeg"),
    ("RGB", "WEBP", "image/webp")])
def test_images_decode_to_rgb_uint8(mode: str, fmt: str, mime: str) -> None:
    got = media.decode_image_url(f"data:{mime};base64,{b64(png((32, 24), mode, fmt))}")
    assert got.shape == (24, 32, 3) and got.dtype == np.uint8


def test_bad_images_are_refused() -> None:
    good = b64(png((8, 8)))
    for url, words in [
        ("https://example.com/x.png", "must be a data URL"),
        (f"data:text/plain;base64,{good}", "media type 'text/plain'"),
        (f"data:image/png,{good}", "must be base64"),
        ("data:image/png;base64,!!!!", "not valid base64"),
        ("data:image/png;base64," + b64(b"\x89PNG\r\n\x1a\n" + bytes(50)), "not a readable"),
    ]:
        with pytest.raises(media.MediaError, match=words):
            media.decode_image_url(url)
    with pytest.raises(media.MediaTooLarge, match=f"larger than {media.MAX_IMAGE_BYTES}"):
        media.decode_image_url("data:image/png;base64," + "A" * (media.MAX_IMAGE_BYTES * 2))
    big = png((media.MAX_IMAGE_PIXELS // 1000 + 1, 1000), "L")  # compresses to little
    with pytest.raises(media.MediaTooLarge, match="pixels"):
        media.decode_image_url(f"data:image/png;base64,{b64(big)}")


@pytest.mark.parametrize("fmt", media.AUDIO_OUTPUT_FORMATS)
@pytest.mark.parametrize("samples", [0, 1, 5])
def test_tiny_and_empty_audio_still_encode(fmt: str, samples: int) -> None:
    """A stage may speak nothing (an empty answer): every format still makes a file that the
    libraries read (the lossy ones pad to one codec frame of silence)."""
    data = media.encode_audio(np.zeros(samples, np.float32), RATE, fmt)
    if fmt in ("mp3", "opus"):
        back, _, _ = read_av(data)
        assert np.abs(back).max() < 1e-3
    elif fmt == "pcm":
        assert len(data) == 2 * round(samples * media.PCM_SAMPLE_RATE / RATE)
    else:
        assert soundfile.read(io.BytesIO(data))[0].size == (samples or (fmt == "flac"))


def test_speed_of_a_short_clip_keeps_its_share_of_samples() -> None:
    clip = sine(0.02)  # shorter than atempo's window
    for speed in (0.25, 3.0):
        assert media.change_speed(clip, RATE, speed).size == round(clip.size / speed)
