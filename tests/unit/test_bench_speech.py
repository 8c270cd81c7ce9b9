"""bench/bench_speech.py without its workers: the summary's verdicts and reasons from fake
figures, its bench-only kinds against the spec, and the fixed-length talker's one change."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import omnistage.kinds as stage_kinds
from omnistage.admission import ExecutionContext
from omnistage.executors.talker import TalkerExecutor
from omnistage.spec import EngineOptions
from tests.harness.benches import bench_module


@pytest.fixture(scope="module")
def bench() -> Any:
    return bench_module("bench_speech")


@pytest.fixture
def bench_kinds(bench: Any) -> Iterator[None]:
    talker, sink = bench.KINDS
    with stage_kinds.registered(talker), stage_kinds.registered(sink):
        yield


def test_summary_passes_every_goal_and_gives_no_reason(bench: Any) -> None:
    line, goals = bench.summary(0.1, 2.5, unbatched_ratio=1.1, omni_ratio=3.5,
                                omni_unbatched=1.2)
    assert line == ("summary: ttfa streaming/off=0.10x (goal <= 0.25x: PASS); "
                    "speech requests/s c8/c1=2.50x (goal >= 2x: PASS); "
                    "omni requests/s c8/c1=3.50x (goal >= 3x: PASS)")
    assert bench.exit_status(goals, check=True) == 0


def test_a_requests_per_second_miss_says_what_batching_added(bench: Any) -> None:
    line, goals = bench.summary(0.3, 1.5, unbatched_ratio=1.2)
    assert "ttfa streaming/off=0.30x (goal <= 0.25x: MISS)" in line
    assert "speech requests/s c8/c1=1.50x (goal >= 2x: MISS)" in line
    assert line.endswith("; requests/s MISS: c8/c1 with engine.maxBatchSize 1 is 1.20x, so "
                         "batching added 1.25x")
    line, _ = bench.summary(0.1, 2.5, 1.1, omni_ratio=2.0, omni_unbatched=1.6)
    assert "omni requests/s c8/c1=2.00x (goal >= 3x: MISS)" in line
    assert line.endswith("; omni requests/s MISS: c8/c1 with engine.maxBatchSize 1 is 1.60x, "
                         "so batching added 1.25x")
    assert bench.exit_status(goals, check=True) == 1
    assert bench.exit_status(goals, check=False) == 0
    # Without the unbatched figure (its run failed) the miss stands without a reason.
    line, _ = bench.summary(0.1, 1.5, unbatched_ratio=None, omni_ratio=3.5)
    assert line.endswith("(goal >= 3x: PASS)") and "batching added" not in line


def test_a_figure_not_measured_is_a_miss(bench: Any) -> None:
    line, goals = bench.summary(None, None, unbatched_ratio=None)
    assert "ttfa streaming/off=n/a (goal <= 0.25x: MISS)" in line
    assert "speech requests/s c8/c1=n/a (goal >= 2x: MISS)" in line
    assert bench.exit_status(goals, check=True) == 1


def test_batching_is_on_in_the_bench_pipelines_unless_asked_off(bench: Any,
                                                                bench_kinds: None) -> None:
    for batch in (8, 1):
        pipe = bench._pipeline("tts", bench._stages("tts", 500, 25, True, 3, batch))
        assert {s.name: s.engine.max_batch_size for s in pipe.spec.stages} == {
            "talker": batch, "vocoder": batch}
        pipe = bench._pipeline("omni", bench._stages("omni", 500, 25, True, 3, batch))
        assert {s.name: s.engine.max_batch_size for s in pipe.spec.stages} == {
            "thinker": batch, "talker": batch, "vocoder": batch}
    with pytest.raises(SystemExit):
        bench.main(["--batch-size", "1"])


@pytest.mark.parametrize("shape", ["ttfa", "tts", "omni"])
@pytest.mark.parametrize("streaming", [True, False])
def test_the_bench_pipelines_parse_with_its_kinds(bench: Any, bench_kinds: None, shape: str,
                                                  streaming: bool) -> None:
    pipe = bench._pipeline(shape, bench._stages(shape, 500, 25, streaming, 3))
    stages = {s.name: s for s in pipe.spec.stages}
    assert stages["talker"].kind == "bench-talker"
    assert stages["talker"].engine.max_frames == 500
    assert all(s.streaming.enabled is streaming for s in pipe.spec.stages)
    assert [s.name for s in pipe.spec.stages if s.final_output] == (
        ["sink"] if shape == "ttfa" else ["vocoder"])


def test_the_fixed_length_talker_speaks_every_frame_asked(bench: Any) -> None:
    """The built-in talker with this seed samples its end code early; the bench's never does."""
    import torch

    def speak(cls: type[TalkerExecutor]) -> Any:
        ex = cls("tiny-omni-talker", EngineOptions(max_frames=60, voices=["default"]),
                 torch.device("cpu"))
        ex.load()
        job = ex.prepare({"prompt": "hello there", "seed": 2}, {})
        return ex.execute(job, ExecutionContext(), lambda _d: None)

    builtin = speak(TalkerExecutor)
    assert builtin.fields["finish_reason"] == "stop"
    assert builtin.tensors["codec_codes"].shape[0] < 60
    fixed = speak(bench.FixedLengthTalker)
    assert fixed.fields["finish_reason"] == "length"
    assert fixed.tensors["codec_codes"].shape[0] == 60


def _run_output(bench: Any, ttfa_s: float, c1_rps: float, c8_rps: float) -> str:
    """What one run prints, from the bench's own line formatters."""
    def rtf(c: int, rps: float) -> str:
        r = bench.Rtf("tts pipeline", c, latencies=[0.5] * c, audio_s=[1.0] * c, wall=c / rps)
        return r.line()

    line, _ = bench.summary(0.2, c8_rps / c1_rps, None)
    return "\n".join([bench.ttfa_line("on ", [ttfa_s, ttfa_s], 10.0),
                      bench.ttfa_line("off", [1.0], 10.0), rtf(1, c1_rps), rtf(8, c8_rps),
                      line]) + "\n"


def test_the_comparison_reads_each_figure_from_what_a_run_prints(bench: Any) -> None:
    got = bench.figures(_run_output(bench, 0.15, 0.5, 2.5), 8)
    assert got == pytest.approx({"ttfa streaming on": 150.0, "tts requests/s c=8": 2.5,
                                 "speech requests/s c8/c1": 5.0})
    assert bench.figures("speech ttfa failed: boom\n", 8) == {}


def test_the_comparison_is_no_worse_within_ten_percent_on_the_medians(bench: Any) -> None:
    base = [bench.figures(_run_output(bench, t, 0.5, r), 8)
            for t, r in ((0.150, 2.5), (0.160, 2.4), (0.155, 2.45))]
    same = [bench.figures(_run_output(bench, t, 0.5, r), 8)  # one slow TTFA: the median decides
            for t, r in ((0.158, 2.45), (0.400, 2.5), (0.152, 2.4))]
    goals = bench.compared({"this": same, "base": base}, 8)
    assert [g.label for g in goals] == ["ttfa streaming on this/base",
                                        "tts requests/s c=8 this/base",
                                        "speech requests/s c8/c1 this/base"]
    assert all(g.met for g in goals), bench.verdicts(goals)
    worse = [bench.figures(_run_output(bench, 0.2, 0.5, 2.0), 8)] * 2
    goals = bench.compared({"this": worse, "base": base}, 8)
    assert [g.met for g in goals] == [False, False, False], bench.verdicts(goals)
    goals = bench.compared({"this": [{}], "base": base}, 8)  # this tree's run failed
    assert [g.value for g in goals] == [None, None, None] and not any(g.met for g in goals)


def test_the_comparison_refuses_a_tree_without_the_bench(tmp_path: Any) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "runtime" / "omnistage").mkdir(parents=True)
    out = subprocess.run([sys.executable, "bench/bench_speech.py", "--baseline-tree",
                          str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "has no bench/bench_speech.py" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "bench/bench_speech.py", "--baseline-tree",
                          str(tmp_path / "nowhere")], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "has no runtime/omnistage" in out.stderr, out.stderr
