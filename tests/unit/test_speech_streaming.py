"""The speech executors' streaming side, in-process over the tiny built-ins: the talker hands
its frames on in chunks of chunk_frames, and the vocoder's audio does not depend on how its
codes arrive (whole, or fed in chunks of any size): byte-identical, chunk by chunk."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omnistage.admission import ExecutionContext
from omnistage.executors.ar import ThinkerExecutor
from omnistage.executors.base import BadRequest, InputChunk, StageIO
from omnistage.executors.talker import TalkerExecutor
from omnistage.executors.vocoder import LEFT_CONTEXT, VocoderExecutor
from omnistage.models import TINY_QUANTIZERS
from omnistage.protocol import WireTensor
from omnistage.spec import EngineOptions

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")


class Sink:
    """A StageIO's downstream: the chunks it was handed, each credited at once."""

    def __init__(self, fed: list[Any] | None = None) -> None:
        """fed: codes arrays (a talker's chunks) or dicts of tensors, fed in order."""
        self.chunks: list[dict[str, Any]] = []
        self.io = StageIO(send_chunk=self.take, window=4, fed=fed is not None)
        for seq, item in enumerate(fed or [], start=1):
            tensors = item if isinstance(item, dict) else {"codec_codes": item}
            chunk = InputChunk(seq, tensors={k: wire(v) for k, v in tensors.items()})
            assert self.io.feed(chunk, False)
        if fed is not None:
            self.io.feed(InputChunk(len(fed) + 1), True)  # the end of input

    def take(self, seq: int, text: str | None, tensors: dict[str, Any]) -> None:
        assert seq == len(self.chunks) + 1 and text is None
        self.chunks.append(tensors)
        self.io.credit(seq)


def wire(value: Any) -> WireTensor:
    return WireTensor.from_any(value)


@pytest.fixture(scope="module")
def talker() -> TalkerExecutor:
    ex = TalkerExecutor("tiny-omni-talker", EngineOptions(max_frames=23, chunk_frames=5), CPU)
    ex.load()
    return ex


@pytest.fixture(scope="module")
def vocoder() -> VocoderExecutor:
    ex = VocoderExecutor("tiny-omni-vocoder", EngineOptions(chunk_frames=6), CPU)
    ex.load()
    return ex


def test_the_talker_streams_its_frames_in_chunks_and_returns_them_all(talker) -> None:
    whole = talker.execute(talker.prepare({"prompt": "hello there", "seed": 3}, {}),
                           ExecutionContext(), lambda _d: None)
    codes = whole.tensors["codec_codes"].numpy()
    assert codes.shape[0] >= 11, codes.shape  # long enough for two full chunks and a rest
    sink = Sink()
    out = talker.execute(talker.prepare({"prompt": "hello there", "seed": 3}, {}),
                         ExecutionContext(), sink.io)
    assert np.array_equal(out.tensors["codec_codes"].numpy(), codes)  # the reply: every frame
    sizes = [c["codec_codes"].shape[0] for c in sink.chunks]
    n = codes.shape[0]
    assert sizes == [5] * (n // 5) + ([n % 5] if n % 5 else []), sizes
    assert np.array_equal(np.concatenate([c["codec_codes"] for c in sink.chunks]), codes)
    assert all(c["codec_codes"].dtype == np.int64 for c in sink.chunks)
    # A request may choose its own chunk size.
    small = Sink()
    talker.execute(talker.prepare({"prompt": "hello there", "seed": 3, "chunk_frames": 2}, {}),
                   ExecutionContext(), small.io)
    assert small.chunks[0]["codec_codes"].shape[0] == 2
    assert len(small.chunks) == -(-n // 2)


SPEAKS_ON = 0  # after the tiny thinker, the tiny talker speaks to max_frames with this seed


def codes_of(frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 64, (frames, TINY_QUANTIZERS), dtype=np.int64)


def test_fed_and_whole_decoding_give_the_same_audio_byte_for_byte(vocoder) -> None:
    codes = codes_of(61)  # windows of 6: ten full ones and one frame
    whole = Sink()
    out = vocoder.execute(vocoder.prepare({}, {"codec_codes": wire(codes)}), ExecutionContext(),
                          whole.io)
    audio = out.tensors["audio"].numpy()
    assert audio.dtype == np.float32 and audio.size > 0
    assert len(whole.chunks) == 11  # one audio chunk per window
    assert np.array_equal(np.concatenate([c["audio"] for c in whole.chunks]), audio)

    cuts = [1, 5, 2, 9, 13, 4, 27]  # chunk sizes that never line up with the windows
    assert sum(cuts) == 61
    parts = np.split(codes, np.cumsum(cuts)[:-1])
    fed = Sink(parts)
    streamed = vocoder.execute(vocoder.prepare({}, {}), ExecutionContext(), fed.io)
    assert streamed.fields == out.fields
    assert streamed.tensors["audio"].numpy().tobytes() == audio.tobytes()  # identical
    assert [c["audio"].tobytes() for c in fed.chunks] == [c["audio"].tobytes()
                                                          for c in whole.chunks]


def test_windows_follow_the_models_chunked_decode(vocoder) -> None:
    """With one window size, the decode is the model's own chunked_decode; with another it is
    not the same audio (the window cuts matter), which is why the vocoder fixes them by frame
    index rather than by the chunks that arrive."""
    codes = codes_of(40, seed=1)
    ref = vocoder.model.chunked_decode(torch.from_numpy(codes).t().unsqueeze(0), chunk_size=6,
                                       left_context_size=LEFT_CONTEXT).reshape(-1)
    out = vocoder.execute(vocoder.prepare({}, {"codec_codes": wire(codes)}), ExecutionContext(),
                          lambda _d: None).tensors["audio"]
    assert torch.equal(out, ref)
    other = vocoder.execute(vocoder.prepare({"chunk_frames": 40}, {"codec_codes": wire(codes)}),
                            ExecutionContext(), lambda _d: None).tensors["audio"]
    assert other.numel() != out.numel() or not torch.equal(other, out)


def test_a_bad_fed_chunk_is_the_requests_error_naming_it(vocoder) -> None:
    bad = np.full((2, TINY_QUANTIZERS), 64, dtype=np.int64)
    fed = Sink([codes_of(3), bad])
    with pytest.raises(BadRequest, match=r"feed 2: tensors\.codec_codes: codes must be in"):
        vocoder.execute(vocoder.prepare({}, {}), ExecutionContext(), fed.io)
    io = StageIO(fed=True)
    io.feed(InputChunk(1, text="words"), True)
    with pytest.raises(BadRequest, match=r"feed 1: tensors\.codec_codes is required"):
        vocoder.execute(vocoder.prepare({}, {}), ExecutionContext(), io)


def test_a_talker_abort_before_its_first_frame_still_encodes(talker) -> None:
    """An abort while the talker waits for credit ends it with no frames: codes [0, groups],
    which the wire must carry (memoryview cannot cast an empty 2-D array directly)."""
    from omnistage import protocol as p

    out = talker.aborted_before_start(talker.prepare({"prompt": "hi"}, {}))
    codes = out.tensors["codec_codes"]
    assert tuple(codes.shape) == (0, TINY_QUANTIZERS)
    frames = p.encode(p.Aborted(id="x", replica="r"), out.tensors)
    assert p.WireTensor.from_any(codes).numpy().shape == (0, TINY_QUANTIZERS)
    assert frames


@pytest.fixture(scope="module")
def thinker() -> ThinkerExecutor:
    ex = ThinkerExecutor("tiny-omni-thinker", EngineOptions(max_tokens=8), CPU)
    ex.load()
    return ex


def test_the_thinker_streams_its_rows_and_the_fed_talker_speaks_the_same(thinker,
                                                                         talker) -> None:
    """The thinker hands on its prompt's rows, then one row per answer token; a talker fed
    those chunks makes the same codes as from the thinker's whole output."""
    params = {"prompt": "say something", "return_hidden_states": True, "ignore_eos": True}
    sink = Sink()
    out = thinker.execute(thinker.prepare(params, {}), ExecutionContext(), sink.io)
    whole = out.tensors
    prompt = int(whole["prompt_length"][0])
    rows = [c["hidden_states"].shape[0] for c in sink.chunks]
    assert rows == [prompt] + [1] * (whole["hidden_states"].shape[0] - prompt), rows
    assert [("prompt_length" in c) for c in sink.chunks] == [True] + [False] * (len(rows) - 1)
    for name in ("hidden_states", "token_embeds", "token_ids"):
        joined = torch.cat([c[name] for c in sink.chunks])
        assert torch.equal(joined, whole[name]), name

    conditioned = {("encoder_hidden_states" if k == "hidden_states" else k): wire(v)
                   for k, v in whole.items()}
    ask = {"seed": SPEAKS_ON, "max_frames": 23}
    ref = talker.execute(talker.prepare(ask, conditioned), ExecutionContext(), lambda _d: None)
    fed = Sink([{k: v.numpy() for k, v in c.items()} for c in sink.chunks])
    got = talker.execute(talker.prepare(ask, {}), ExecutionContext(), fed.io)
    codes = ref.tensors["codec_codes"]
    assert codes.shape[0] > len(rows), codes.shape  # it spoke past the thinker's last row
    assert torch.equal(got.tensors["codec_codes"], codes)
    assert got.fields == ref.fields
    # Not fed and no input at all: the request's error, as before.
    with pytest.raises(BadRequest, match=r"params\.prompt is required"):
        talker.execute(talker.prepare({}, {}), ExecutionContext(), lambda _d: None)
    # A fed chunk without the thinker's tensors is refused naming it.
    bad = Sink([{"token_ids": np.zeros(2, dtype=np.int64)}])
    with pytest.raises(BadRequest, match=r"feed 1: tensors\.hidden_states"):
        talker.execute(talker.prepare({}, {}), ExecutionContext(), bad.io)
