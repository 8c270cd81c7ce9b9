"""The speech examples validate as shipped, and the voices each offers come from the spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.spec import load_pipeline, stage_voices

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name,kinds,voices", [
    ("tts", ["talker", "vocoder"], ["default"]),
    ("omni-speech", ["thinker", "talker", "vocoder"], ["default"]),
    ("qwen3-omni-gpu", ["thinker", "talker", "vocoder"], ["Ethan", "Chelsie", "Aiden"]),
])
def test_speech_examples_validate(name: str, kinds: list[str], voices: list[str]) -> None:
    pipe = load_pipeline(EXAMPLES / f"{name}.yaml", check_paths=True)
    spec = pipe.spec
    assert [s.kind for s in spec.stages] == kinds
    assert list(spec.final_stages()) == ["vocoder"]
    talker = next(s for s in spec.stages if s.kind == "talker")
    assert stage_voices(talker) == voices
    assert all(stage_voices(s) == [] for s in spec.stages if s is not talker)


def test_the_startup_banner_names_the_speech_route_only_where_a_stage_speaks() -> None:
    """`omnistage serve` prints the routes it serves: /v1/audio/speech for a pipeline whose
    stage emits audio (examples/tts.yaml), not for one without (examples/echo.yaml)."""
    from omnistage.orchestrator.main import api_routes
    from omnistage.spec import load_pipeline

    examples = Path(__file__).resolve().parents[2] / "examples"
    assert "/v1/audio/speech" in api_routes(load_pipeline(examples / "tts.yaml"))
    assert "/v1/audio/speech" not in api_routes(load_pipeline(examples / "echo.yaml"))
