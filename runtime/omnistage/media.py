"""Media in and out of the HTTP API: base64 images and audio decoded to tensors, PCM encoded.

Why here, pure and in one place: the chat and speech routes (orchestrator/http_api.py) decode
what clients send and encode what the speech stage returns, and the bounds below are the ones
/openapi.json and docs/http-api.md state. Decoding and encoding use well-kept libraries
(Pillow for images, PyAV for compressed audio and resampling, soundfile for WAV/FLAC); nothing
here parses a container by hand. Every failure is a MediaError whose message says what is wrong,
so the caller can answer 400 naming the field.

Tensor contract with the entry stage (omnistage.kinds.Payload): an input image is a
uint8 [H, W, 3] RGB array; input audio is float32 mono PCM in [-1, 1], shape [samples], at
INPUT_AUDIO_SAMPLE_RATE Hz (resampled here when the client's audio has another rate).
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import re
import warnings
from typing import Any, Literal

import numpy as np

__all__ = [
    "AUDIO_INPUT_FORMATS",
    "AUDIO_OUTPUT_FORMATS",
    "INPUT_AUDIO_SAMPLE_RATE",
    "MAX_AUDIO_BYTES",
    "MAX_AUDIO_SECONDS",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_MEDIA_PARTS",
    "MAX_SAMPLE_RATE",
    "MIN_SAMPLE_RATE",
    "PCM_SAMPLE_RATE",
    "STREAMED_FORMATS",
    "AudioFileStream",
    "MediaError",
    "MediaTooLarge",
    "PcmStream",
    "b64decode",
    "change_speed",
    "decode_audio",
    "decode_image_url",
    "encode_audio",
    "pcm16",
    "resample",
]

#: The rate of every `input_audio.<i>` tensor the entry stage receives (Qwen-Omni's encoders).
INPUT_AUDIO_SAMPLE_RATE = 16000

# ---- the bounds (stated once: the schemas' descriptions and docs/http-api.md quote these) ----
#: Decoded bytes of one image content part (base64 text is 4/3 of this).
MAX_IMAGE_BYTES = 8 * 1024 * 1024
#: Width x height of a decoded image (Pillow's decompression-bomb guard uses the same idea).
MAX_IMAGE_PIXELS = 4096 * 4096
#: Decoded bytes of one input_audio part.
MAX_AUDIO_BYTES = 8 * 1024 * 1024
#: Duration of one decoded input_audio part.
MAX_AUDIO_SECONDS = 600.0
#: image_url and input_audio parts in one request, all messages together.
MAX_MEDIA_PARTS = 16
#: Sample rates accepted, in input audio and from the speech stage.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000
#: OpenAI's raw `pcm` / `pcm16` output: 16-bit signed little-endian mono at this rate.
PCM_SAMPLE_RATE = 24000

AudioInputFormat = Literal["wav", "mp3"]
AudioOutputFormat = Literal["wav", "flac", "mp3", "opus", "pcm"]
AUDIO_INPUT_FORMATS: tuple[str, ...] = ("wav", "mp3")
AUDIO_OUTPUT_FORMATS: tuple[str, ...] = ("wav", "flac", "mp3", "opus", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg", "pcm": "audio/pcm"}

_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[^,;]*)*?),(?P<data>.*)$",
                       re.DOTALL)
_IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
# Lossy encoders take only some rates; the nearest one at or above the stage's is used.
_CODEC_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
                "opus": (8000, 12000, 16000, 24000, 48000)}


class MediaError(ValueError):
    """Input or output media this module cannot take; the message says why (no field name:
    the caller knows which field it decoded)."""


class MediaTooLarge(MediaError):
    """Media beyond the bounds above (bytes, pixels, seconds)."""


def b64decode(text: str, limit: int) -> bytes:
    """Strict base64 (standard alphabet; whitespace tolerated), refusing more than `limit`
    decoded bytes before decoding them."""
    compact = "".join(text.split())
    if len(compact) * 3 // 4 > limit + 2:
        raise MediaTooLarge(f"is larger than {limit} bytes once decoded "
                         f"(about {len(compact) * 3 // 4} bytes)")
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("is not valid base64") from None
    if not data:
        raise MediaError("is empty")
    if len(data) > limit:
        raise MediaTooLarge(f"is larger than {limit} bytes once decoded ({len(data)} bytes)")
    return data


# --------------------------------------------------------------------------- images


def decode_image_url(url: str) -> np.ndarray:
    """A `data:image/...;base64,...` URL as a uint8 [H, W, 3] RGB array.

    Remote URLs are the caller's business (refused unless the pipeline allows fetching);
    here anything but a base64 data URL of an image is a MediaError."""
    from PIL import Image

    match = _DATA_URL.match(url)
    if match is None:
        raise MediaError("must be a data URL (data:image/png;base64,...)")
    mime = (match.group("type") or "").lower()
    if mime not in _IMAGE_TYPES:
        raise MediaError(f"has media type {mime or 'none'!r}; expected one of "
                         f"{', '.join(_IMAGE_TYPES)}")
    if ";base64" not in match.group("params").lower():
        raise MediaError("must be base64-encoded (data:<type>;base64,...)")
    raw = b64decode(match.group("data"), MAX_IMAGE_BYTES)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise MediaTooLarge(f"is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} "
                                     "pixels are accepted")
                rgb = image.convert("RGB")
                rgb.load()
    except MediaError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise MediaError(f"is not a readable image ({type(exc).__name__}: "
                         f"{str(exc)[:120]})") from None
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))


# --------------------------------------------------------------------------- audio in


def resample(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    """float32 mono at `rate` to `to` Hz, through PyAV's (libswresample's) resampler."""
    if rate == to or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    import av

    expected = round(samples.size * to / rate)
    # The resampler keeps back its filter's delay; silence after the end flushes it all.
    padded = np.concatenate([np.asarray(samples, np.float32), np.zeros(rate // 10, np.float32)])
    frame = av.AudioFrame.from_ndarray(padded.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to)
    out = [f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame),
                                                 *resampler.resample(None)]]
    got = np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
    return np.concatenate([got, np.zeros(max(0, expected - got.size), np.float32)])[:expected]


def decode_audio(data: str, fmt: str) -> np.ndarray:
    """Base64 WAV or MP3 as float32 mono in [-1, 1] at INPUT_AUDIO_SAMPLE_RATE Hz.

    PyAV (FFmpeg) reads the container and downmixes; audio at another rate is resampled, so
    any rate in MIN_SAMPLE_RATE..MAX_SAMPLE_RATE is taken. The container must match `fmt`."""
    import av

    if fmt not in AUDIO_INPUT_FORMATS:
        raise MediaError(f"format {fmt!r} is not one of {', '.join(AUDIO_INPUT_FORMATS)}")
    raw = b64decode(data, MAX_AUDIO_BYTES)
    demuxer = {"wav": "wav", "mp3": "mp3"}[fmt]
    chunks: list[np.ndarray] = []
    limit = int(MAX_AUDIO_SECONDS * INPUT_AUDIO_SAMPLE_RATE)
    total = 0
    try:
        with av.open(io.BytesIO(raw), mode="r", format=demuxer) as container:
            if not container.streams.audio:
                raise MediaError(f"holds no audio stream in its {fmt} container")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate or 0
            if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
                raise MediaError(f"has sample rate {rate} Hz; accepted: "
                                 f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
            resampler = av.AudioResampler(format="flt", layout="mono",
                                          rate=INPUT_AUDIO_SAMPLE_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    total += chunk.size
                    if total > limit:
                        raise MediaTooLarge(f"is longer than {MAX_AUDIO_SECONDS:g} seconds")
                    chunks.append(chunk)
            chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise MediaError(f"is not readable {fmt} audio ({str(exc)[:120]})") from None
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise MediaError(f"holds no audio samples in its {fmt} container")
    if not np.isfinite(samples).all():
        raise MediaError("decodes to samples that are not finite")
    return np.clip(samples, -1.0, 1.0)


# --------------------------------------------------------------------------- audio out


def _checked(samples: np.ndarray, rate: int) -> np.ndarray:
    arr = np.asarray(samples)
    if arr.ndim == 2 and 1 in arr.shape:
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise MediaError(f"audio must be mono [samples], got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise MediaError(f"audio must be floating point PCM, got {arr.dtype}")
    if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or \
            not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise MediaError(f"sample rate {rate!r} is not in {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}")
    arr = np.nan_to_num(arr.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(arr, -1.0, 1.0)


def pcm16(samples: np.ndarray, rate: int, to: int = PCM_SAMPLE_RATE) -> bytes:
    """Raw 16-bit signed little-endian mono at `to` Hz (OpenAI's pcm and pcm16)."""
    arr = resample(_checked(samples, rate), int(rate), to)
    return np.rint(arr * 32767.0).astype("<i2").tobytes()


class PcmStream:
    """pcm16 of audio that arrives in chunks (a streamed speech stage), chunk by chunk.

    One resampler keeps its state across the chunks, so the bytes of every feed() and then
    close() together are pcm16() of the whole audio, whatever the chunk sizes: a client that
    joins the streamed chunks gets the same bytes as the audio rendered whole.
    """

    def __init__(self, rate: int, to: int = PCM_SAMPLE_RATE) -> None:
        _checked(np.zeros(0, np.float32), rate)  # names a bad rate
        self.rate, self.to = int(rate), to
        self.taken = 0  # input samples so far
        self.given = 0  # output samples so far
        self._resampler: Any = None
        if self.rate != to:
            import av

            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=to)

    def _run(self, samples: np.ndarray | None) -> np.ndarray:
        import av

        if samples is None:
            frames = self._resampler.resample(None)
        else:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt",
                                               layout="mono")
            frame.sample_rate = self.rate
            frames = self._resampler.resample(frame)
        out = [f.to_ndarray().reshape(-1) for f in frames]
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)

    @staticmethod
    def _pcm(arr: np.ndarray) -> bytes:
        return np.rint(arr * 32767.0).astype("<i2").tobytes()

    def feed(self, samples: np.ndarray) -> bytes:
        """The pcm16 of this chunk that is ready (a resampler holds back its filter's delay)."""
        arr = _checked(samples, self.rate)
        self.taken += arr.size
        if self._resampler is None or arr.size == 0:
            out = arr
        else:
            out = self._run(arr)
        self.given += out.size
        return self._pcm(out)

    def close(self) -> bytes:
        """The rest: what the resampler held back, cut (or padded) to the whole's length."""
        if self._resampler is None:
            return b""
        expected = round(self.taken * self.to / self.rate)
        # As resample(): silence after the end flushes the filter's delay.
        out = np.concatenate([self._run(np.zeros(self.rate // 10, np.float32)),
                              self._run(None)])
        want = max(0, expected - self.given)
        out = np.concatenate([out, np.zeros(max(0, want - out.size), np.float32)])[:want]
        self.given += out.size
        return self._pcm(out)


#: Formats whose file /v1/audio/speech (stream_format audio) sends as the stage makes the audio.
#: Not flac: a FLAC file starts with its STREAMINFO, which holds the total sample count; sent
#: before the end it says "unknown" (0), which FFmpeg reads but libsndfile (soundfile) refuses
#: to read whole, so flac is sent once it is complete, with its length.
STREAMED_FORMATS: tuple[str, ...] = ("wav", "mp3", "opus", "pcm")
#: An Ogg page per this many microseconds of Opus, so its pages go out as they are made (the
#: muxer's default holds one second of audio back).
_OGG_PAGE_US = 20_000
#: RIFF and data chunk sizes of a WAV whose length is not known when its header is sent (what
#: FFmpeg writes to a pipe); readers take the data to the end of the file.
_WAV_UNKNOWN_SIZE = 0xFFFFFFFF


class _Drain:
    """A write-only file for a PyAV container: what it wrote since the last take()."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class AudioFileStream:
    """An audio file of format `fmt` (AUDIO_OUTPUT_FORMATS) made from audio that arrives in
    chunks: feed() returns the file's bytes that are ready, close() the rest. The joined bytes
    are one file that decodes to the whole audio.

    pcm: PcmStream's bytes. wav: a 16-bit PCM header with unknown sizes, then the samples at
    the stage's rate as they come (converted by libsndfile, as encode_audio's wav: the same
    samples bit for bit). mp3, opus, flac: PyAV's encoder and muxer writing into
    memory that feed() drains, at the rate encode_audio picks; the last codec frame is padded
    with silence, as encode_audio's. Compressed bytes lag the audio by what the encoder holds
    (a codec frame, an Ogg page of _OGG_PAGE_US; flac: a block of 4608 samples).
    """

    def __init__(self, fmt: str, rate: int) -> None:
        if fmt not in AUDIO_OUTPUT_FORMATS:
            raise MediaError(f"format {fmt!r} is not one of {', '.join(AUDIO_OUTPUT_FORMATS)}")
        _checked(np.zeros(0, np.float32), rate)  # names a bad rate
        self.fmt, self.rate = fmt, int(rate)
        self._pcm = PcmStream(self.rate) if fmt == "pcm" else None
        self._header = fmt == "wav"
        self._av: Any = None
        if fmt in ("mp3", "opus", "flac"):
            self._av = self._open_av()

    def _open_av(self) -> Any:
        import av

        fmt = self.fmt
        target = self.rate if fmt == "flac" else next(
            (r for r in _CODEC_RATES[fmt] if r >= self.rate), _CODEC_RATES[fmt][-1])
        codec, container_format = {"mp3": ("libmp3lame", "mp3"), "opus": ("libopus", "ogg"),
                                   "flac": ("flac", "flac")}[fmt]
        self._out = _Drain()
        options = {"page_duration": str(_OGG_PAGE_US)} if fmt == "opus" else {}
        container = av.open(self._out, mode="w", format=container_format, options=options)
        self._stream = container.add_stream(codec, rate=target, layout="mono")
        self._frame_size = {"mp3": 1152, "opus": 960 * target // 48000, "flac": 4608}[fmt]
        # Into the encoder's sample format, in whole codec frames, at the codec's rate.
        self._resampler = av.AudioResampler(format=self._stream.codec_context.format.name,
                                            layout="mono", rate=target,
                                            frame_size=self._frame_size)
        self._pts = 0
        return container

    def _encode(self, frames: list[Any]) -> bytes:
        for frame in frames:
            frame.pts = self._pts
            self._pts += frame.samples
            self._av.mux(self._stream.encode(frame))
        return self._out.take()

    def _frame(self, samples: np.ndarray) -> Any:
        import av

        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.reshape(1, -1)),
                                           format="flt", layout="mono")
        frame.sample_rate = self.rate
        return frame

    def feed(self, samples: np.ndarray) -> bytes:
        """The file's bytes that this chunk makes ready."""
        arr = _checked(samples, self.rate)
        if self._pcm is not None:
            return self._pcm.feed(arr)
        if self._av is None:  # wav: the samples as encode_audio's wav holds them
            import soundfile

            head = self._wav_header() if self._header else b""
            self._header = False
            buf = io.BytesIO()
            soundfile.write(buf, arr, self.rate, format="RAW", subtype="PCM_16",
                            endian="LITTLE")
            return head + buf.getvalue()
        if arr.size == 0:
            return b""
        return self._encode(self._resampler.resample(self._frame(arr)))

    def _wav_header(self) -> bytes:
        import struct

        fmt = struct.pack("<HHIIHH", 1, 1, self.rate, self.rate * 2, 2, 16)  # PCM mono 16-bit
        return (b"RIFF" + struct.pack("<I", _WAV_UNKNOWN_SIZE) + b"WAVE" + b"fmt "
                + struct.pack("<I", len(fmt)) + fmt + b"data"
                + struct.pack("<I", _WAV_UNKNOWN_SIZE))

    def close(self) -> bytes:
        """The rest of the file: what the encoder (or resampler) held back, and its end."""
        if self._pcm is not None:
            return self._pcm.close()
        if self._av is None:
            head = self._wav_header() if self._header else b""
            self._header = False
            return head
        frames = list(self._resampler.resample(None))
        if not frames and self._pts == 0:  # no audio at all: one frame of silence
            frames = list(self._resampler.resample(self._frame(
                np.zeros(self._frame_size, np.float32)))) + list(self._resampler.resample(None))
        if frames and frames[-1].samples < self._frame_size:
            # The encoders refuse a short last frame: pad it with silence (encode_audio's rule).
            import av

            last = frames.pop()
            data = last.to_ndarray()
            padded = np.zeros((data.shape[0], self._frame_size), data.dtype)
            padded[:, :data.shape[1]] = data
            frame = av.AudioFrame.from_ndarray(padded, format=last.format.name, layout="mono")
            frame.sample_rate = last.sample_rate
            frames.append(frame)
        out = self._encode(frames)
        self._av.mux(self._stream.encode(None))
        self._av.close()
        return out + self._out.take()


def _encode_av(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    import av

    target = next((r for r in _CODEC_RATES[fmt] if r >= rate), _CODEC_RATES[fmt][-1])
    arr = resample(samples, rate, target)
    codec, container_format = {"mp3": ("libmp3lame", "mp3"), "opus": ("libopus", "ogg")}[fmt]
    frame_size = 960 * target // 48000 if fmt == "opus" else 1152
    # Whole codec frames only (silence after the end, under one frame): the encoders refuse
    # a partial or empty last frame.
    arr = np.concatenate([arr, np.zeros(-arr.size % frame_size or (0 if arr.size else
                                                                   frame_size), np.float32)])
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=target, layout="mono")
        encoder_format = stream.codec_context.format.name
        resampler = av.AudioResampler(format=encoder_format, layout="mono", rate=target,
                                      frame_size=frame_size)
        pts = 0
        frames = []
        for start in range(0, max(arr.size, 1), frame_size * 64):
            piece = arr[start:start + frame_size * 64].reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece), format="flt",
                                               layout="mono")
            frame.sample_rate = target
            frames.extend(resampler.resample(frame))
        frames.extend(resampler.resample(None))
        for frame in frames:
            frame.pts = pts
            pts += frame.samples
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def change_speed(samples: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """Tempo times `speed`, pitch kept: FFmpeg's atempo filter through PyAV (one atempo
    takes 0.5..2.0, so larger changes chain two)."""
    arr = _checked(samples, rate)
    if speed == 1.0 or arr.size == 0:
        return arr
    if not 0.25 <= speed <= 4.0:
        raise MediaError(f"speed {speed!r} is not in 0.25..4.0")
    import av

    steps = [speed] if 0.5 <= speed <= 2.0 else [speed ** 0.5] * 2
    expected = round(arr.size / speed)
    # atempo keeps back a window of input; silence after the end flushes all of it through.
    arr = np.concatenate([arr, np.zeros(int(rate), np.float32)])
    graph = av.filter.Graph()
    src = graph.add_abuffer(format="flt", sample_rate=int(rate), layout="mono")
    nodes = [src, *(graph.add("atempo", f"{s:.6f}") for s in steps), graph.add("abuffersink")]
    for a, b in itertools.pairwise(nodes):
        a.link_to(b)
    graph.configure()
    frame = av.AudioFrame.from_ndarray(arr.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = int(rate)
    frame.pts = 0
    graph.push(frame)
    graph.push(None)
    out: list[np.ndarray] = []
    while True:
        try:
            got = graph.pull()
        except (av.BlockingIOError, av.EOFError):
            break
        out.append(got.to_ndarray().reshape(-1).astype(np.float32))
    got = np.concatenate(out) if out else np.zeros(0, np.float32)
    return np.concatenate([got, np.zeros(max(0, expected - got.size), np.float32)])[:expected]


def encode_audio(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """float PCM (mono, [-1, 1]) at `rate` Hz as a file of format `fmt`.

    wav (16-bit) and flac keep the stage's rate (soundfile); mp3 and opus go through PyAV at
    the nearest rate the codec takes; pcm is raw 16-bit LE at PCM_SAMPLE_RATE, as OpenAI's."""
    arr = _checked(samples, rate)
    rate = int(rate)
    if fmt == "pcm":
        return pcm16(arr, rate)
    if fmt in ("wav", "flac"):
        import soundfile

        if fmt == "flac" and arr.size == 0:
            arr = np.zeros(1, np.float32)  # libsndfile cannot read back an empty FLAC
        buf = io.BytesIO()
        soundfile.write(buf, arr, rate, format=fmt.upper(), subtype="PCM_16")
        return buf.getvalue()
    if fmt in _CODEC_RATES:
        return _encode_av(arr, rate, fmt)
    raise MediaError(f"format {fmt!r} is not one of {', '.join(AUDIO_OUTPUT_FORMATS)}")
