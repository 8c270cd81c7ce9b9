"""Many long streams between stages on a small shared-memory segment (issue 37, defect 3).

An upstream's chunk tensors are lent from its segment. If the orchestrator kept every chunk's
block until its request ended, a segment smaller than what all live streams ever send would
fill, every sender would wait for room that only a request's end gives back, and the requests
would wait on each other until their deadlines. Here 32 streams of `drip` (a test-only kind
registered below: a batching producer and a batching fed consumer, so all 32 really stream at
once) share an upstream segment of 32 pages, far below the 768 pages they send, and all finish:
a chunk's block goes back once its downstream credits it, and a chunk that finds no room soon
goes as frames. The consumer keeps its chunks' tensors and reads them only at its end, after
their blocks went back and were reused, so the digests also prove it copied what it was fed.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import time
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import omnistage.kinds as stage_kinds
from omnistage.admission import DeadlineExceeded
from omnistage.batching import Emit
from omnistage.executors.base import BatchExecutor, Outcome, StageIO
from omnistage.kinds import Payload, StageKind
from omnistage.orchestrator.requests import Outcome as Done
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.protocol import WireTensor
from tests.integration.test_orchestrator import _until, pipeline
from tests.integration.test_orchestrator import launch as launch  # the fixture
from tests.integration.test_shm import config, segments, worker_state
from tests.integration.test_shm import shm_dir as shm_dir  # the fixture
from tests.integration.test_stage_kinds import _pythonpath

pytestmark = pytest.mark.timeout(300)

PAGE = mmap.PAGESIZE
TENSOR = "drip"
STREAMS = 32
CHUNKS = 24  # per stream: 768 chunks of one page each through a 32-page segment
CAP_PAGES = 32
WINDOW = 2  # chunks a stream may have out


def piece(tag: int, i: int) -> np.ndarray:
    """Chunk i of stream tag: one page of one byte value, so a reused block shows."""
    return np.full(PAGE, (tag * 31 + i) % 251, np.uint8)


def digest(pieces: list[bytes]) -> str:
    return hashlib.sha256(b"".join(pieces)).hexdigest()[:16]


def expected(tag: int, n: int = CHUNKS) -> str:
    return digest([piece(tag, i).tobytes() for i in range(n)])


@dataclass
class _Seq:
    io: StageIO
    n: int
    tag: int
    made: int = 0
    kept: list[WireTensor] = field(default_factory=list)  # a consumer's fed tensors, as fed


class _DripBatch:
    """Every sequence advances one chunk a step: a producer emits its next chunk when its
    window has room (never blocking the batch), a fed consumer takes what arrived."""

    def __init__(self) -> None:
        self.seqs: dict[int, _Seq] = {}

    def add(self, seq: int, job: tuple[int, int], emit: Emit) -> None:
        self.seqs[seq] = _Seq(StageIO.of(emit), *job)

    def abort(self, seq: int) -> Outcome:
        self.seqs.pop(seq)
        return Outcome({"finish_reason": "abort"}, aborted=True)

    def expire(self, seq: int) -> DeadlineExceeded:
        s = self.seqs.pop(seq)
        return DeadlineExceeded(f"deadline passed after {s.made} chunks")

    def step(self) -> dict[int, Any]:
        done: dict[int, Any] = {}
        moved = False
        for sid, s in list(self.seqs.items()):
            try:
                if s.io.fed:
                    chunks, ended = s.io.poll()
                    s.kept.extend(c.tensors[TENSOR] for c in chunks)
                    moved |= bool(chunks)
                    if ended:  # read only now, long after each chunk was credited
                        text = digest([bytes(wt.numpy()) for wt in s.kept])
                        done[sid] = Outcome({"text": text, "finish_reason": "stop"})
                elif s.made == s.n or not s.io.streams_output:
                    text = digest([piece(s.tag, i).tobytes() for i in range(s.n)])
                    done[sid] = Outcome({"text": text, "finish_reason": "stop"})
                elif s.io.sent - s.io.acked < s.io.window:
                    s.io.emit_chunk(tensors={TENSOR: piece(s.tag, s.made)})
                    s.made += 1
                    moved = True
            except Exception as exc:  # this sequence alone
                done[sid] = exc
            if sid in done:
                del self.seqs[sid]
        if not moved and not done:
            time.sleep(0.002)  # nothing to do until a credit or a chunk comes
        return done


class DripExecutor(BatchExecutor):
    """Prompt `N:TAG`: N one-page chunks; fed: takes chunks until the end of its input. Its
    text is the digest of its chunks' bytes either way."""

    kind = "drip"

    def load(self) -> None:
        pass

    def prepare(self, params: Mapping[str, Any], tensors: Mapping[str, WireTensor]) -> Any:
        n, _, tag = str(params.get("prompt") or "0:0").partition(":")
        return int(n), int(tag)

    def cost(self, job: Any) -> int:
        return 1

    def batch_key(self, job: Any) -> Hashable:
        return None

    def new_batch(self) -> _DripBatch:
        return _DripBatch()


DRIP = StageKind(name="drip", executor=f"{__name__}:DripExecutor", summary="test only",
                 needs_model=False, engine_options=("max_batch_size",),
                 consumes=frozenset({Payload.TEXT}), emits=frozenset({Payload.TEXT}),
                 chunked_output=True, chunked_input=True)


@pytest.fixture
def drip_kind() -> Iterator[StageKind]:
    with stage_kinds.registered(DRIP) as kind:
        yield kind


async def run_drip(launch: Any, shm_dir: Any, *, streams: int, chunks: int, cap_pages: int,
                   down_batch: int, timeout_s: float) -> tuple[Any, Any, list[Done], dict]:
    """a (drip, every chunk tensor lent from a segment of cap_pages) -> b (drip, fed, final,
    batches of down_batch); `streams` requests of `chunks` chunks each, all submitted at once.
    Asserts every one finished ok with every byte as sent; returns the orchestrator, a's
    worker, the outcomes and when each request had its first chunk and its end."""
    small = config(shm_dir, session="drip", min_bytes=0, cap_bytes=cap_pages * PAGE)
    roomy = config(shm_dir, session="drip", min_bytes=0)
    kind_env = {stage_kinds.ENV_VAR: f"{__name__}:DRIP", "PYTHONPATH": _pythonpath()}
    pipe = pipeline("drip", [
        {"name": "a", "kind": "drip", "streaming": {"enabled": True, "window": WINDOW},
         "engine": {"maxBatchSize": streams}},
        {"name": "b", "kind": "drip", "inputs": ["a"], "finalOutput": True,
         "engine": {"maxBatchSize": down_batch}},
    ])
    orch, procs, _ = await launch(pipe, {"a": [{"env": {**kind_env, **small.env()}}],
                                         "b": [{"env": {**kind_env, **roomy.env()}}]},
                                  shm=roomy)
    times: dict[str, dict[str, float]] = {"first_chunk": {}, "ended": {}}
    on_chunk = orch._on_chunk

    def chunk(task: Any, msg: Any) -> None:
        times["first_chunk"].setdefault(task.child.request.id, time.monotonic())
        on_chunk(task, msg)

    orch._on_chunk = chunk  # type: ignore[method-assign]
    handles = [orch.submit(PipelineRequest(prompt=f"{chunks}:{i}", timeout_s=timeout_s))
               for i in range(streams)]

    async def finish(h: Any) -> Done:
        out = await h.outcome()
        times["ended"][h.id] = time.monotonic()
        return out

    outs = await asyncio.wait_for(asyncio.gather(*(finish(h) for h in handles)), 120)
    failed = [(h.id, o.status, o.error) for h, o in zip(handles, outs, strict=True)
              if o.status != "ok"]
    assert not failed, f"{len(failed)} of {streams} failed, e.g. {failed[:3]}"
    for i, out in enumerate(outs):  # every byte arrived as sent, read after blocks were reused
        assert out.children[0].outputs["b"].fields["text"] == expected(i, chunks), i
    a = procs["a"][0]
    assert worker_state(a)["chunks"]["sent"] == streams * chunks
    assert worker_state(a)["shm"]["capacity"] == cap_pages * PAGE
    # No block outlives its request: the upstream got every one back, nothing else is left.
    await _until(lambda: worker_state(a)["shm"]["lent"] == 0, "a got every block back")
    assert orch.shm is not None and orch.shm.segment.live == 0
    assert len(segments(shm_dir)) == 3  # two workers and the orchestrator
    return orch, a, outs, times


async def test_32_long_streams_on_a_small_segment_all_finish(drip_kind, launch, shm_dir) -> None:
    """Both stages batch all 32: every stream is live at once, and a 32-page segment serves
    768 pages of chunks because each block goes back at its chunk's credit."""
    _, a, _, times = await run_drip(launch, shm_dir, streams=STREAMS, chunks=CHUNKS,
                                    cap_pages=CAP_PAGES, down_batch=STREAMS, timeout_s=20.0)
    first, ended = times["first_chunk"], times["ended"]
    assert len(first) == STREAMS and max(first.values()) < min(ended.values())  # all at once
    assert worker_state(a)["shm"]["placed"] > CAP_PAGES  # blocks went back and were reused


async def test_streams_whose_downstream_waits_do_not_stall_the_running_one(
    drip_kind, launch, shm_dir,
) -> None:
    """The downstream runs one request at a time: the streams queued behind it hold their
    window's blocks (nothing credits them yet) and fill the upstream's segment. The running
    stream's chunks then wait only a moment for room and go as frames, instead of waiting
    behind the queued streams' chunks until every deadline."""
    _, a, _, _ = await run_drip(launch, shm_dir, streams=8, chunks=6, cap_pages=4,
                                down_batch=1, timeout_s=15.0)
    assert worker_state(a)["shm"]["fallbacks"] >= 1  # frames where the segment had no room
