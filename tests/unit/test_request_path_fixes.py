"""The pure parts of issue 37's request-path defects (4-7), and the engine's seeding against the
fake replicas of test_engine.py. The same through real processes and HTTP:
tests/integration/test_omni_http.py.

- Seeds: a request without one gets one at admission, fixed before any task goes out (a
  failover retry reuses it); the client's seed and a seed pinned in the spec are kept.
- Media: each kind is numbered from 0, and each tensor remembers the part it came from.
- Usage: speech.audio.done counts every stage the request ran, not only the final one.
- Errors: a stage's refusal that names an input tensor is answered naming the request field.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from omnistage import protocol as p
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.errors import error_from_request_error, outcome_error
from omnistage.orchestrator.render import MediaPart, speech_usage
from omnistage.orchestrator.request_parsing import media_inputs, media_tensors, parse_chat
from omnistage.params import seed_defaults
from omnistage.spec import load_pipeline
from tests.unit import test_engine
from tests.unit.test_engine import Make, ar, diffusion, outcome, pipeline

pytestmark = pytest.mark.timeout(30)
make = test_engine.make  # the rig's fixture
OMNI = load_pipeline(Path(__file__).resolve().parents[2] / "examples" / "omni-speech.yaml")


# --------------------------------------------------------------------------- seeds (defect 4)


def _draws(*values: int) -> tuple[list[int], Callable[[int], int]]:
    asked: list[int] = []
    it = iter(values)

    def draw(most: int) -> int:
        asked.append(most)
        return next(it)

    return asked, draw


def test_seeded_keeps_the_client_s_seed_then_the_spec_s_then_draws_one_for_all() -> None:
    req = rq.PipelineRequest(params={"a": {"seed": 3}, "c": {"max_tokens": 2}}, n=4)
    asked, draw = _draws(77)
    out = req.seeded({"a": None, "b": 9, "c": None, "d": None}, draw)
    assert out.params == {"a": {"seed": 3}, "b": {"seed": 9}, "c": {"max_tokens": 2, "seed": 77},
                          "d": {"seed": 77}}
    assert asked == [rq.SEED_MAX - 3]  # seed + i of sample 3 stays in range
    assert req.params == {"a": {"seed": 3}, "c": {"max_tokens": 2}}  # the caller's is untouched
    # A "*" seed is the client's for every stage; nothing missing: the same object, no draw.
    star = rq.PipelineRequest(params={"*": {"seed": 1}})
    assert star.seeded({"a": None}, _draws()[1]) is star
    # Only spec seeds missing: no draw.
    asked, draw = _draws()
    assert rq.PipelineRequest().seeded({"a": 5}, draw).params == {"a": {"seed": 5}}
    assert asked == []


def test_seed_defaults_are_the_stages_that_take_a_seed() -> None:
    pipe = pipeline([ar("enc"), {**diffusion("img", ("enc",)), "engine": {"seed": 4}},
                     test_engine.echo("e", ("enc",), final=True)])
    assert seed_defaults(pipe.spec.stages) == {"enc": None, "img": 4}  # echo takes none


async def test_unseeded_requests_each_get_a_seed_and_a_retry_keeps_it(make: Make) -> None:
    rig = await make([ar("a", final=True)], {"a": 2}, seed_rng=random.Random(1))
    seeds = []
    for _ in range(3):
        h = rig.submit("x")
        seeds.append(rig.link_of(h, "a").of(p.Submit)[-1].params["seed"])
        rig.answer(h, "a", text="t")
        assert outcome(h).status == "ok"
    assert len(set(seeds)) == 3 and all(0 <= s <= rq.SEED_MAX for s in seeds), seeds
    # The client's seed goes as it is; a failover retry carries the seed of the first attempt.
    h = rig.submit("x", params={"a": {"seed": 42}})
    assert rig.link_of(h, "a").of(p.Submit)[-1].params["seed"] == 42
    rig.answer(h, "a", text="t")
    h = rig.submit("x", request_id="lost")
    first = rig.task(h, "a").replica.name
    drawn = rig.net.link(first).of(p.Submit)[-1].params["seed"]
    rig.net.link(first).on_disconnect()
    other = "a-1" if first == "a-0" else "a-0"
    [retry] = [s for s in rig.net.link(other).of(p.Submit) if s.id.startswith("lost/")]
    assert retry.id == "lost/0/a~1" and retry.params["seed"] == drawn


async def test_a_seed_pinned_in_the_spec_counts_as_given(make: Make) -> None:
    rig = await make([{**ar("a", final=True), "engine": {"seed": 11}}])
    h = rig.submit("x", n=2)
    subs = {s.id: s.params["seed"] for s in rig.net.link("a-0").of(p.Submit)}
    assert subs == {f"{h.id}/0/a": 11, f"{h.id}/1/a": 12}  # sample i: seed + i


# --------------------------------------------------------------------------- media (defect 5)


def _parts(*kinds: str) -> list[MediaPart]:
    field = {"image": "image_url.url", "audio": "input_audio.data"}
    return [MediaPart(k, f"messages[{i // 2}].content[{i % 2}].{field[k]}", "")
            for i, k in enumerate(kinds)]


def test_each_media_kind_is_numbered_from_0_and_remembers_its_part() -> None:
    parts = _parts("audio", "image", "image", "audio")
    assert media_tensors(parts) == ["input_audio.0", "input_image.0", "input_image.1",
                                    "input_audio.1"]
    assert media_inputs(parts) == {
        "input_audio.0": "messages[0].content[0].input_audio",
        "input_image.0": "messages[0].content[1].image_url",
        "input_image.1": "messages[1].content[0].image_url",
        "input_audio.1": "messages[1].content[1].input_audio"}


def test_a_chat_request_carries_where_each_tensor_came_from() -> None:
    png = "data:image/png;base64,AAAA"  # decoded later, off the loop
    body = {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": png}}]}]}
    call = parse_chat(body, OMNI)
    assert call.request.inputs == {"input_audio.0": "messages[0].content[0].input_audio",
                                   "input_image.0": "messages[0].content[2].image_url"}


# --------------------------------------------------------------------------- usage (defect 6)


def test_speech_usage_counts_every_stage_the_request_ran() -> None:
    vocoder = rq.StageOutput("vocoder", {"sample_rate": 16000}, {})
    child = rq.ChildOutcome(0, "ok", {"vocoder": vocoder}, usage={
        "thinker": {"prompt_tokens": 35, "completion_tokens": 16},
        "talker": {"completion_tokens": 32}})
    assert speech_usage(rq.Outcome("r", "ok", [child])) == {
        "input_tokens": 35, "output_tokens": 48, "total_tokens": 83}


# --------------------------------------------------------------------------- errors (defect 7)

INPUTS = {"input_audio.0": "messages[0].content[0].input_audio",
          "input_image.0": "messages[1].content[2].image_url"}


@pytest.mark.parametrize("message,param,said", [
    ("stage thinker: tensors.input_audio.0: the audio is too short for this model: at least "
     "13 ms, got 6.2 ms", "messages[0].content[0].input_audio",
     "messages[0].content[0].input_audio: the audio is too short for this model: at least "
     "13 ms, got 6.2 ms"),
    ("stage thinker: tensors.input_image.0: the model's image processor refused it: absolute "
     "aspect ratio must be smaller than 200", "messages[1].content[2].image_url",
     "messages[1].content[2].image_url: the model's image processor refused it: absolute "
     "aspect ratio must be smaller than 200"),
    ("stage thinker: tensors.input_audio.0 must be float32 mono PCM [samples], got int16 [3]",
     "messages[0].content[0].input_audio",
     "messages[0].content[0].input_audio must be float32 mono PCM [samples], got int16 [3]"),
])
def test_a_refused_input_tensor_is_named_as_the_client_sent_it(message: str, param: str,
                                                               said: str) -> None:
    err = rq.RequestError("bad_request", message, "thinker")
    api = error_from_request_error(err, inputs=INPUTS)
    assert (api.status, api.param, api.message, api.code) == (400, param, said, "bad_request")
    child = rq.ChildOutcome(0, "request_error", error=err)
    got = outcome_error(rq.Outcome("r", "request_error", [child], err), inputs=INPUTS)
    assert got is not None and got.param == param


def test_a_tensor_the_request_did_not_send_is_left_as_it_is() -> None:
    err = rq.RequestError("bad_request", "stage thinker: tensors.input_audio.3: bad", "thinker")
    api = error_from_request_error(err, inputs=INPUTS)
    assert api.param is None and api.message == err.message
    five = rq.RequestError("stage_failed", "stage thinker: tensors.input_audio.0: x", "thinker")
    assert error_from_request_error(five, inputs=INPUTS).param is None  # only a 400 names it
