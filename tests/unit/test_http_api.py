"""HTTP API against a fake orchestrator: validation, error shape, SSE framing, disconnects.

The fake implements the engine's interface (submit -> handle with events/abort/outcome) in
memory, so these tests pin the HTTP layer's behaviour without processes. The real engine is
exercised in tests/integration/test_http_api.py.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import openai
import pytest
from aiohttp import ClientPayloadError, ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image
from prometheus_client import CollectorRegistry, Gauge
from pydantic import Field

from omnistage.client import ControlError
from omnistage.metrics import HttpMetrics
from omnistage.orchestrator import http_api as h
from omnistage.orchestrator import http_streaming as st
from omnistage.orchestrator import render as rd
from omnistage.orchestrator import request_parsing as rp
from omnistage.orchestrator import requests as rq
from omnistage.orchestrator.errors import (
    ApiError,
    chat_param,
    error_from_request_error,
    images_param,
    outcome_error,
)
from omnistage.orchestrator.images import ImageEncodeError, png_base64, to_hwc_uint8
from omnistage.orchestrator.openapi import ROUTES, openapi_document
from omnistage.orchestrator.schemas import ChatCompletionRequest
from omnistage.protocol import WireTensor
from omnistage.spec import OmniPipeline, load_pipeline, parse_pipeline
from tests.harness.metrics import sample
from tests.harness.waiting import HANG_GUARD

pytestmark = pytest.mark.timeout(120)  # a hang guard, above the waits' HANG_GUARD

ROOT = Path(__file__).resolve().parents[2]
T2I = load_pipeline(ROOT / "examples/text-to-image.yaml")  # chat, images, generic
CHAT = load_pipeline(ROOT / "examples/chat.yaml")  # chat, generic


# --------------------------------------------------------------------------- the fake engine

Behaviour = Callable[["FakeHandle", rq.PipelineRequest], None]


class FakeHandle:
    """An engine RequestHandle in memory; the test's behaviour pushes events into it."""

    def __init__(self, rid: str, req: rq.PipelineRequest) -> None:
        self.id = rid
        self.req = req
        self.queue: asyncio.Queue[rq.Delta | rq.Outcome] = asyncio.Queue()
        self.aborts: list[int | None] = []
        self.aborted = asyncio.Event()
        self.terminal = False

    def push(self, event: rq.Delta | rq.Outcome) -> None:
        if self.terminal:
            return
        self.terminal = isinstance(event, rq.Outcome)
        self.queue.put_nowait(event)

    async def events(self) -> AsyncIterator[rq.Delta | rq.Outcome]:
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, rq.Outcome):
                return

    def abort(self, child: int | None = None) -> None:
        self.aborts.append(child)
        self.aborted.set()
        self.push(rq.Outcome(self.id, "abort", [
            rq.ChildOutcome(i, "abort", {}) for i in range(self.req.n)]))

    async def outcome(self) -> rq.Outcome:
        async for event in self.events():
            if isinstance(event, rq.Outcome):
                return event
        raise AssertionError("no outcome")


def ar_output(stage: str, text: str, finish: str = "stop") -> rq.StageOutput:
    return rq.StageOutput(stage, {"text": text, "token_ids": list(range(len(text.split()))),
                                  "finish_reason": finish, "prompt_tokens": 5,
                                  "completion_tokens": len(text.split())}, {})


def image_output(stage: str, width: int, height: int) -> rq.StageOutput:
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, :, 0] = 200
    return rq.StageOutput(stage, {"height": height, "width": width, "steps": 4,
                                  "finish_reason": "stop"},
                          {"image": WireTensor.from_any(pixels)})


def default_behaviour(handle: FakeHandle, req: rq.PipelineRequest) -> None:
    """Answer at once: AR finals say 'hello world' (streamed in two deltas), diffusion finals
    return a red image of the requested size, anything else echoes its params."""
    children = []
    for i in range(req.n):
        outputs = {}
        for stage in req.finals or ["denoiser"]:
            kind = T2I.spec.stage(stage).kind if stage in T2I.spec.stage_names() else "echo"
            if kind == "ar":
                if req.stream:
                    handle.push(rq.Delta(i, stage, "hello", [1]))
                    handle.push(rq.Delta(i, stage, " world", [2]))
                outputs[stage] = ar_output(stage, "hello world")
            elif kind == "diffusion":
                p = req.stage_params(stage)
                outputs[stage] = image_output(stage, p.get("width", 32), p.get("height", 32))
        children.append(rq.ChildOutcome(i, "ok", outputs))
    handle.push(rq.Outcome(handle.id, "ok", children))


def fail_with(code: str, message: str = "boom", retry_after: float | None = None,
              stage: str | None = None) -> Behaviour:
    def behaviour(handle: FakeHandle, req: rq.PipelineRequest) -> None:
        err = rq.RequestError(code, message, stage=stage, retry_after=retry_after)
        handle.push(rq.Outcome(handle.id, err.kind, [], err))
    return behaviour


def hang(handle: FakeHandle, req: rq.PipelineRequest) -> None:
    """Never answer; only an abort ends the request."""


class FakeOrchestrator:
    def __init__(self, pipeline: OmniPipeline = T2I, behaviour: Behaviour = default_behaviour):
        self.pipeline = pipeline
        self.behaviour = behaviour
        self.accepting = True
        self.ready_state = (True, "")
        self.handles: list[FakeHandle] = []
        self.control_calls: list[tuple[str, list[str] | None]] = []
        self.control_result: Any = {"encoder-0": {"state": "paused"}}
        self._ids = itertools.count(1)
        self.submitted = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.ready_state[0]

    def readiness(self) -> tuple[bool, str]:
        return self.ready_state

    def submit(self, req: rq.PipelineRequest) -> FakeHandle:
        handle = FakeHandle(f"r{next(self._ids)}", req)
        self.handles.append(handle)
        self.submitted.set()
        self.behaviour(handle, req)
        return handle

    @functools.cached_property
    def registry(self) -> CollectorRegistry:
        """The engine's registry, with one engine-side metric the API must serve too."""
        registry = CollectorRegistry()
        Gauge("fake_engine_up", "x", registry=registry).set(1)
        return registry

    async def control(self, op: str, stages: list[str] | None = None) -> dict[str, dict]:
        self.control_calls.append((op, stages))
        if isinstance(self.control_result, Exception):
            raise self.control_result
        return self.control_result


@pytest.fixture
def orch() -> FakeOrchestrator:
    return FakeOrchestrator()


@pytest.fixture
async def client(orch: FakeOrchestrator) -> AsyncIterator[TestClient]:
    app = h.build_app(orch, disconnect_poll_s=0.02)
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.fixture
async def admin(orch: FakeOrchestrator) -> AsyncIterator[TestClient]:
    """The same orchestrator's admin listener (control, load, metrics)."""
    app = h.build_app(orch, disconnect_poll_s=0.02, listener="admin")
    async with TestClient(TestServer(app)) as c:
        yield c


def assert_error(body: dict, *, param: Any = "skip", code: Any = "skip") -> dict:
    """OpenAI's error shape: exactly these four keys (control errors add two)."""
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    if param != "skip":
        assert err["param"] == param, err
    if code != "skip":
        assert err["code"] == code, err
    return err


CHAT_BODY = {"model": "text-to-image", "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- pure: parsing


@pytest.mark.parametrize(("patch", "param", "code"), [
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
     "messages[0].content[0]", "unsupported_parameter"),
    # The text-to-image pipeline's entry stage (ar) takes no images: not in its schema either.
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text", "invalid_type"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content",
     "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"n": 17}, "n", "invalid_value"),
    ({"n": 1.5}, "n", "invalid_type"),
    ({"max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"max_completion_tokens": True}, "max_completion_tokens", "invalid_type"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"seed": 2**70}, "seed", "invalid_value"),
    ({"seed": True}, "seed", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
    ({"user": 5}, "user", "invalid_type"),
    ({"user": "\udfff"}, "user", "invalid_value"),
    ({"stop": ["\n"]}, "stop", "unsupported_parameter"),
    ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
])
def test_parse_chat_names_the_bad_field(patch: dict, param: str, code: str) -> None:
    with pytest.raises(ApiError) as info:
        rp.parse_chat({**CHAT_BODY, **patch}, T2I)
    assert info.value.status == 400
    assert (info.value.param, info.value.code) == (param, code), info.value.message
    assert param.split("[")[0].split(".")[0] in info.value.message


def test_parse_chat_wrong_model_is_404_model_not_found() -> None:
    with pytest.raises(ApiError) as info:
        rp.parse_chat({**CHAT_BODY, "model": "gpt-4"}, T2I)
    assert (info.value.status, info.value.code, info.value.param) == (
        404, "model_not_found", "model")


def test_parse_chat_builds_the_pipeline_request() -> None:
    call = rp.parse_chat({
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 3, "max_completion_tokens": 7, "temperature": 0.5, "seed": 2**53 - 1,
        "n": 3, "stream": True, "stream_options": {"include_usage": True}, "user": "alice",
        "top_p": 0.9, "presence_penalty": 0.1, "my_extension": 1, "ignore_eos": True,
    }, T2I)
    req = call.request
    assert call.stage == "encoder" and req.finals == ["encoder"]
    assert req.params == {"encoder": {"max_tokens": 7, "temperature": 0.5,
                                      "seed": 2**53 - 1, "ignore_eos": True,
                                      "messages": [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "a\nb"}],
                                      "return_hidden_states": False}}
    assert (req.n, req.stream, req.session) == (3, True, "alice")
    assert req.prompt == "<|system|>\nbe brief\n<|user|>\na\nb\n<|assistant|>\n"
    assert call.include_usage and call.model == "text-to-image"
    assert call.ignored == ["my_extension"]  # top_p etc. are known and silently ignored


def test_parse_chat_defaults_leave_stage_defaults_alone() -> None:
    call = rp.parse_chat({"messages": [{"role": "user", "content": "x"}]}, CHAT)
    # Only hidden states are switched off (chat returns text); the rest stays stage defaults.
    assert call.request.params == {"llm": {"messages": [{"role": "user", "content": "x"}],
                                           "return_hidden_states": False}}
    assert (call.request.n, call.request.stream, call.request.session) == (1, False, None)
    assert call.model == "chat"


@pytest.mark.parametrize(("patch", "param"), [
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a"]}, "prompt"),
    ({"size": "big"}, "size"),
    ({"size": "0x32"}, "size"),
    ({"size": "30x32"}, "size"),
    ({"size": "32x99999"}, "size"),
    ({"size": 32}, "size"),
    ({"response_format": "url"}, "response_format"),
    ({"output_format": "jpeg"}, "output_format"),
    ({"n": 11}, "n"),
    ({"negative_prompt": 1}, "negative_prompt"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"guidance_scale": -1}, "guidance_scale"),
    ({"seed": 2**64}, "seed"),
])
def test_parse_images_names_the_bad_field(patch: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        rp.parse_images({"prompt": "a cat", **patch}, T2I)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_parse_images_builds_the_pipeline_request() -> None:
    call = rp.parse_images({"prompt": "a cat", "negative_prompt": "blurry", "n": 2,
                            "size": "64x32", "response_format": "b64_json", "seed": 7,
                            "num_inference_steps": 2, "guidance_scale": 3.0,
                            "quality": "hd", "user": "bob"}, T2I)
    req = call.request
    assert call.stages == ["denoiser"] and req.finals == ["denoiser"]
    assert req.params == {"denoiser": {"width": 64, "height": 32, "num_inference_steps": 2,
                                       "guidance_scale": 3.0, "seed": 7}}
    assert (req.prompt, req.negative_prompt, req.n, req.session) == ("a cat", "blurry", 2, "bob")
    assert rp.parse_images({"prompt": "x", "size": "auto"}, T2I).request.params == {
        "denoiser": {}}


def test_images_on_a_pipeline_without_diffusion_is_404() -> None:
    with pytest.raises(ApiError) as info:
        rp.parse_images({"prompt": "x"}, CHAT)
    assert info.value.status == 404


@pytest.mark.parametrize(("body", "param"), [
    ({"promt": "x"}, "promt"),
    ({"prompt": 1}, "prompt"),
    ({"params": []}, "params"),
    ({"params": {"nope": {}}}, "params.nope"),
    ({"params": {"encoder": 1}}, "params.encoder"),
    ({"params": {"encoder": {"seed": 2**70}}}, "params.encoder.seed"),
    ({"params": {"*": {"a": [1, {"b": "\ud800"}]}}}, "params.*.a[1].b"),
    ({"finals": []}, "finals"),
    ({"finals": ["encoder", "encoder"]}, "finals[1]"),
    ({"finals": ["ghost"]}, "finals[0]"),
    ({"n": 99}, "n"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": "1"}, "timeout_s"),
])
def test_parse_generic_names_the_bad_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        rp.parse_generic(body, T2I)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_parse_generic_builds_the_pipeline_request() -> None:
    req = rp.parse_generic({"prompt": "p", "negative_prompt": "n", "n": 2, "finals": ["encoder"],
                            "params": {"encoder": {"max_tokens": 2}, "*": {"seed": 1}},
                            "timeout_s": 1.5, "session": "s"}, T2I)
    assert req.stage_params("encoder") == {"max_tokens": 2, "seed": 1}
    assert (req.prompt, req.negative_prompt, req.n, req.finals, req.timeout_s, req.session) == (
        "p", "n", 2, ["encoder"], 1.5, "s")


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'{"a": NaN}', b'{"a": 1e999}',
                                 b"\xff\xfe\x00", b"[" * 100_000])
def test_parse_json_body_rejects_what_is_not_a_json_object(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        rp.parse_json_body(raw)
    assert info.value.status == 400 and info.value.param is None


def test_parse_control() -> None:
    assert rp.parse_control({"op": "pause"}, T2I) == ("pause", None)
    assert rp.parse_control({"op": "sleep", "stages": ["denoiser"]}, T2I) == (
        "sleep", ["denoiser"])
    for body, param in [({}, "op"), ({"op": "explode"}, "op"),
                        ({"op": "pause", "stages": ["x"]}, "stages[0]"),
                        ({"op": "pause", "extra": 1}, "extra")]:
        with pytest.raises(ApiError) as info:
            rp.parse_control(body, T2I)
        assert info.value.param == param


# --------------------------------------------------------------------------- pure: rendering


def test_error_mapping_follows_the_engine_table() -> None:
    cases = {"bad_request": 400, "overloaded": 429, "deadline": 504, "no_replica": 503,
             "replica_lost": 502, "stage_failed": 502, "internal": 500, "shutting_down": 503,
             "drain_timeout": 503}
    for code, status in cases.items():
        err = error_from_request_error(rq.RequestError(code, "m"))
        assert (err.status, err.code) == (status, code)
    types = {400: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             502: "upstream_error", 503: "service_unavailable_error", 504: "timeout_error"}
    for status, kind in types.items():
        assert ApiError(status, "m").type == kind
    # A worker names the bad parameter; the client sees the field it sent.
    err = error_from_request_error(
        rq.RequestError("bad_request", "params.height must be a multiple of 16, got 40",
                        stage="denoiser"), images_param)
    assert err.param == "size"


def test_outcome_error_treats_a_failed_child_as_the_response_error() -> None:
    ok = rq.ChildOutcome(0, "ok", {"encoder": ar_output("encoder", "a")})
    bad = rq.ChildOutcome(1, "fatal", {}, rq.RequestError("replica_lost", "gone"))
    err = outcome_error(rq.Outcome("r", "ok", [ok, bad]))
    assert err is not None and (err.status, err.code) == (502, "replica_lost")
    aborted_empty = rq.Outcome("r", "abort", [rq.ChildOutcome(0, "abort", {})])
    assert outcome_error(aborted_empty).status == 503
    prefix = rq.ChildOutcome(0, "abort", {"encoder": ar_output("encoder", "a b", "abort")})
    assert outcome_error(rq.Outcome("r", "abort", [prefix])) is None


def test_render_chat_completion_and_usage() -> None:
    call = rp.parse_chat({**CHAT_BODY, "n": 2}, T2I)
    outcome = rq.Outcome("r", "ok", [
        rq.ChildOutcome(1, "ok", {"encoder": ar_output("encoder", "x y z", "length")}),
        rq.ChildOutcome(0, "abort", {"encoder": ar_output("encoder", "w", "abort")}),
    ])
    body = rd.render_chat_completion(outcome, call, "chatcmpl-r", 123)
    assert body["object"] == "chat.completion" and body["model"] == "text-to-image"
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in body["choices"]] == [(0, "w", "abort"), (1, "x y z", "length")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_chat_stream_chunk_order() -> None:
    call = rp.parse_chat({**CHAT_BODY, "n": 2, "stream": True,
                          "stream_options": {"include_usage": True}}, T2I)
    s = rd.ChatStream(call, "id", 1)
    start = s.start()
    assert [c["choices"][0]["delta"] for c in start] == [
        {"role": "assistant", "content": ""}] * 2
    assert s.delta(rq.Delta(1, "encoder", "", [5])) == []  # held-back bytes: nothing to send
    (chunk,) = s.delta(rq.Delta(1, "encoder", "he", [5]))
    assert chunk["choices"][0] == {"index": 1, "delta": {"content": "he"}, "logprobs": None,
                                   "finish_reason": None}
    assert chunk["usage"] is None
    end = s.finish(rq.Outcome("r", "ok", [
        rq.ChildOutcome(0, "ok", {"encoder": ar_output("encoder", "ok")}),
        rq.ChildOutcome(1, "ok", {"encoder": ar_output("encoder", "hello", "length")}),
    ]))
    # Child 0 streamed nothing, child 1 streamed a prefix: the rest is flushed before finishing.
    described = [(c["choices"][0]["index"], c["choices"][0]["delta"],
                  c["choices"][0]["finish_reason"]) if c["choices"] else ("usage", c["usage"])
                 for c in end]
    assert described == [
        (0, {"content": "ok"}, None), (0, {}, "stop"),
        (1, {"content": "llo"}, None), (1, {}, "length"),
        ("usage", {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
    ]
    assert rd.sse_event("[DONE]") == b"data: [DONE]\n\n"


def test_render_images_refuses_what_is_not_an_image() -> None:
    call = rp.parse_images({"prompt": "x"}, T2I)

    def outcome(tensors: dict[str, Any]) -> rq.Outcome:
        out = rq.StageOutput("denoiser", {}, tensors)
        return rq.Outcome("r", "ok", [rq.ChildOutcome(0, "ok", {"denoiser": out})])

    for tensors in ({}, {"a": WireTensor.from_any(np.zeros(3)), "b": WireTensor.from_any(
            np.zeros(3))}, {"image": WireTensor.from_any(np.zeros((5, 5, 7), np.uint8))}):
        with pytest.raises(ApiError) as info:
            rd.render_images(outcome(tensors), call, 0)
        assert (info.value.status, info.value.code) == (502, "stage_failed")
    # A single tensor under another name is taken as the image.
    got = rd.render_images(outcome({"pixels": WireTensor.from_any(
        np.zeros((8, 16, 3), np.uint8))}), call, 0)
    assert Image.open(io.BytesIO(base64.b64decode(got["data"][0]["b64_json"]))).size == (16, 8)


def test_render_generic_encodes_tensors_as_base64() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = rq.StageOutput("b", {"text": "t", "blob": b"\x00\x01", "x": float("nan")},
                         {"h": WireTensor.from_any(arr)})
    err = rq.RequestError("deadline", "late", stage="a")
    body = rd.render_generic(rq.Outcome("r", "ok", [rq.ChildOutcome(0, "ok", {"b": out}),
                                                   rq.ChildOutcome(1, "request_error", {},
                                                                   err)]), "r")
    tensor = body["children"][0]["outputs"]["b"]["tensors"]["h"]
    assert (tensor["dtype"], tensor["shape"]) == ("float32", [2, 3])
    decoded = np.frombuffer(base64.b64decode(tensor["data"]), "<f4").reshape(2, 3)
    assert np.array_equal(decoded, arr)
    assert body["children"][0]["outputs"]["b"]["fields"] == {"text": "t", "blob": "AAE=",
                                                             "x": None}
    assert body["children"][1]["error"] == {"code": "deadline", "message": "late", "stage": "a"}
    json.dumps(body, allow_nan=False)


def test_png_encoding_accepts_common_layouts() -> None:
    def size(value: Any) -> tuple[tuple[int, int], str]:
        img = Image.open(io.BytesIO(base64.b64decode(png_base64(value))))
        return img.size, img.mode

    assert size(np.zeros((16, 24, 3), np.uint8)) == ((24, 16), "RGB")
    assert size(np.ones((3, 8, 8), np.float32)) == ((8, 8), "RGB")  # CHW floats in [0, 1]
    assert size(np.zeros((1, 8, 8, 4), np.uint8)) == ((8, 8), "RGBA")
    assert size(np.zeros((8, 8), np.uint8)) == ((8, 8), "L")
    assert size(WireTensor.from_any(np.zeros((8, 16, 3), np.uint8))) == ((16, 8), "RGB")
    assert to_hwc_uint8(np.array([[[2.0, -1.0, 0.5]]]))[0, 0].tolist() == [255, 0, 128]
    for bad in (np.zeros((8,)), np.zeros((8, 8, 5)), np.zeros((0, 8, 3))):
        with pytest.raises(ImageEncodeError):
            png_base64(bad)


# --------------------------------------------------------------------------- over HTTP


async def test_chat_non_streaming(client: TestClient, orch: FakeOrchestrator) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "n": 2, "foo": 1})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert [c["message"]["content"] for c in body["choices"]] == ["hello world"] * 2
    assert body["id"] == f"chatcmpl-{orch.handles[0].id}"
    assert resp.headers["X-Omnistage-Ignored-Fields"] == "foo"
    assert orch.handles[0].aborts == []


async def test_invalid_json_and_wrong_types_use_openai_error_shape(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", data=b"{not json")
    assert resp.status == 400
    err = assert_error(await resp.json(), param=None, code="invalid_json")
    assert err["type"] == "invalid_request_error"
    resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "n": 100})
    assert resp.status == 400
    assert_error(await resp.json(), param="n", code="invalid_value")


@pytest.mark.parametrize(("code", "retry_after", "status", "header"), [
    ("overloaded", 2.2, 429, "3"),
    ("overloaded", None, 429, "1"),
    ("deadline", None, 504, None),
    ("no_replica", None, 503, None),
    ("replica_lost", None, 502, None),
    ("stage_failed", None, 502, None),
    ("internal", None, 500, None),
    ("bad_request", None, 400, None),
])
async def test_engine_errors_map_to_statuses(orch: FakeOrchestrator, client: TestClient,
                                             code: str, retry_after: float | None,
                                             status: int, header: str | None) -> None:
    orch.behaviour = fail_with(code, retry_after=retry_after)
    for path, body in [("/v1/chat/completions", CHAT_BODY),
                       ("/v1/chat/completions", {**CHAT_BODY, "stream": True}),
                       ("/v1/images/generations", {"prompt": "x"}),
                       ("/v1/pipelines/text-to-image/requests", {"prompt": "x"})]:
        resp = await client.post(path, json=body)
        assert resp.status == status, (path, await resp.text())
        assert resp.headers.get("Retry-After") == header
        assert resp.content_type == "application/json"
        assert_error(await resp.json(), code=code)


async def test_worker_param_errors_name_the_client_field(orch: FakeOrchestrator,
                                                         client: TestClient) -> None:
    orch.behaviour = fail_with("bad_request", "params.max_tokens: prompt (9 tokens) + "
                               "max_tokens (999) exceeds the model context of 128",
                               stage="encoder")
    resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "max_tokens": 999})
    assert_error(await resp.json(), param="max_tokens", code="bad_request")
    resp = await client.post("/v1/pipelines/text-to-image/requests", json={"prompt": "x"})
    assert_error(await resp.json(), param="params.encoder.max_tokens")


async def test_unencodable_values_are_400_and_the_server_keeps_serving(
        client: TestClient, orch: FakeOrchestrator) -> None:
    bad = [
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ("/v1/chat/completions", json.dumps({**CHAT_BODY, "seed": 2**70}).encode(), "seed"),
        ("/v1/images/generations", b'{"prompt": "a\\udc00"}', "prompt"),
        ("/v1/pipelines/text-to-image/requests",
         json.dumps({"params": {"encoder": {"x": 2**70}}}).encode(), "params.encoder.x"),
    ]
    for path, raw, param in bad:
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400, (path, await resp.text())
        assert_error(await resp.json(), param=param)
    assert orch.handles == []  # nothing unencodable reached the engine
    resp = await client.post("/v1/chat/completions", json=CHAT_BODY)
    assert resp.status == 200


def parse_sse(raw: str) -> list[str]:
    """The data payloads of an SSE body; asserts the framing on the way."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        out.append(event[len("data: "):])
    return out


async def test_chat_streaming_sse_framing(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json={
        **CHAT_BODY, "stream": True, "n": 2, "stream_options": {"include_usage": True}})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    payloads = parse_sse(await resp.text())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    text: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks[2:-1]:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert text == {0: "hello world", 1: "hello world"}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_error_after_stream_started_is_an_sse_error_event(orch: FakeOrchestrator,
                                                                client: TestClient) -> None:
    def behaviour(handle: FakeHandle, req: rq.PipelineRequest) -> None:
        handle.push(rq.Delta(0, "encoder", "par", [1]))
        err = rq.RequestError("replica_lost", "replica encoder-1 died", stage="encoder")
        handle.push(rq.Outcome(handle.id, "fatal", [], err))

    orch.behaviour = behaviour
    resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "stream": True})
    assert resp.status == 200
    payloads = parse_sse(await resp.text())
    assert "[DONE]" not in payloads
    assert_error(json.loads(payloads[-1]), code="replica_lost")
    assert json.loads(payloads[1])["choices"][0]["delta"] == {"content": "par"}


async def test_stream_events_match_the_documented_event_schema(orch: FakeOrchestrator,
                                                               client: TestClient) -> None:
    """Regression (fuzzing): the document gave a chunk's schema as the event stream's schema,
    which OpenAPI 3.1 reads as the schema of each event ({data, event, id, retry}), so every
    streamed answer failed validation. Each event's data is now a JSON chunk or error, or
    [DONE]; check a whole stream and an error event against the served document."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    doc = await (await client.get("/openapi.json")).json()
    content = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    event = content["text/event-stream"]["schema"]
    done, as_json = event["properties"]["data"]["anyOf"]
    assert done == {"const": "[DONE]"} and as_json["contentMediaType"] == "application/json"
    payload = jsonschema_rs.validator_for({"components": doc["components"],
                                           **as_json["contentSchema"]})
    seen = []
    for behaviour in (None, "error"):
        if behaviour == "error":
            def fail_later(handle: FakeHandle, req: rq.PipelineRequest) -> None:
                handle.push(rq.Delta(0, "encoder", "par", [1]))
                handle.push(rq.Outcome(handle.id, "fatal", [], rq.RequestError(
                    "replica_lost", "replica encoder-1 died", stage="encoder")))
            orch.behaviour = fail_later
        resp = await client.post("/v1/chat/completions", json={
            **CHAT_BODY, "stream": True, "n": 2, "stream_options": {"include_usage": True}})
        for data in parse_sse(await resp.text()):
            assert jsonschema_rs.validator_for(event).is_valid({"data": data}), data
            if data != "[DONE]":
                assert payload.is_valid(json.loads(data)), data
            seen.append("error" if '"error"' in data else data[:6])
    assert {"[DONE]", "error", '{"id":'} <= set(seen)
    assert not jsonschema_rs.validator_for(event).is_valid({"data": 3})


async def test_integral_numbers_meet_integer_fields(client: TestClient) -> None:
    """Regression (fuzzing): `"n": 4.0` is the integer 4 to JSON and to JSON Schema, and the
    document says integer, but the strict validator refused it as a float."""
    resp = await client.post("/v1/images/generations", json={"prompt": "x", "n": 2.0})
    assert resp.status == 200, await resp.text()
    assert len((await resp.json())["data"]) == 2
    assert rp.parse_json_body(b'{"n": 4.0, "t": 0.5, "big": 1e20, "e": 2E1}') == {
        "n": 4, "t": 0.5, "big": 10**20, "e": 20}
    assert type(rp.parse_json_body(b'{"n": 4.0}')["n"]) is int
    resp = await client.post("/v1/images/generations", json={"prompt": "x", "n": 2.5})
    assert_error(await resp.json(), param="n", code="invalid_type")


async def test_wire_values_are_accepted_exactly_when_the_document_allows_them(
        client: TestClient) -> None:
    """Regression (fuzzing): the document allowed any JSON as a generic parameter value, the
    server refused integers beyond 64 bits. The schema now says what the validator admits."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    doc = await (await client.get("/openapi.json")).json()
    value = jsonschema_rs.validator_for({"components": doc["components"],
                                         "$ref": "#/components/schemas/WireValue"})
    for raw in ("1", "-9223372036854775808", "18446744073709551615", "18446744073709551616",
                "-9223372036854775809", "294765991691294474240", "1e300", "2.5", "4.0",
                '[{"a": 294765991691294474240}]', '{"k": [true, null, "s", 1.5]}'):
        resp = await client.post("/v1/pipelines/text-to-image/requests",
                                 data=f'{{"params": {{"*": {{"x": {raw}}}}}}}'.encode(),
                                 headers={"Content-Type": "application/json"})
        documented = value.is_valid(json.loads(raw))
        assert (resp.status == 200) == documented, (raw, resp.status, await resp.text())
        if not documented:
            assert_error(await resp.json(), code="invalid_value")


async def test_stage_names_are_enumerated_in_the_document_and_enforced(
        client: TestClient, admin: TestClient) -> None:
    """Regression (fuzzing): the document allowed any string as a stage name in `finals`,
    `stages` and as a `params` key, the server refused all but the pipeline's own. The models
    the server validates with are narrowed to the pipeline's stages and are the document's."""
    doc = await (await client.get("/openapi.json")).json()
    admin_doc = await (await admin.get("/openapi.json")).json()
    generic = doc["components"]["schemas"]["GenericRequest"]
    control = admin_doc["components"]["schemas"]["ControlRequest"]
    finals = generic["properties"]["finals"]["anyOf"][0]
    assert finals["items"]["enum"] == ["encoder", "denoiser"] and finals["uniqueItems"]
    keys = generic["properties"]["params"]["anyOf"][0]["propertyNames"]["enum"]
    assert keys == ["encoder", "denoiser", "*"]
    assert control["properties"]["stages"]["anyOf"][0]["items"]["enum"] == ["encoder",
                                                                             "denoiser"]
    url = "/v1/pipelines/text-to-image"
    for path, body, param in [("requests", {"finals": ["", ""]}, "finals[0]"),
                              ("requests", {"finals": ["encoder", "encoder"]}, "finals[1]"),
                              ("requests", {"params": {"ghost": {}}}, "params.ghost"),
                              ("control", {"op": "pause", "stages": ["x"]}, "stages[0]"),
                              ("control", {"op": "pause", "stages": ["denoiser"] * 2},
                               "stages[1]")]:
        resp = await (admin if path == "control" else client).post(f"{url}/{path}", json=body)
        assert resp.status == 400, (body, await resp.text())
        assert_error(await resp.json(), param=param, code="invalid_value")


def _chat_max_tokens(doc: dict[str, Any]) -> tuple[int, int]:
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    return tuple(props[key]["anyOf"][0]["maximum"]  # type: ignore[return-value]
                 for key in ("max_tokens", "max_completion_tokens"))


@pytest.mark.parametrize(("engine", "most"), [({}, 1023), ({"maxBatchTokens": 100}, 99)])
async def test_max_tokens_bound_is_documented_and_enforced(engine: dict[str, Any],
                                                           most: int) -> None:
    """Regression (schemathesis ST202): the document allowed max_tokens up to 2**20 and the
    worker refused what its model's context cannot hold. Each pipeline's document states its
    chat stage's bound (params.max_tokens_bound: tiny-llama's 1024-token context or the
    stage's maxBatchTokens, less one prompt token), and the orchestrator's validator applies
    the same number: the maximum reaches the engine, one more is a 400 naming the field."""
    manifest = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                "metadata": {"name": "chat"},
                "spec": {"stages": [{"name": "llm", "kind": "ar", "model": "tiny-llama",
                                     "finalOutput": True, "engine": engine}]}}
    orch = FakeOrchestrator(parse_pipeline(manifest))
    async with TestClient(TestServer(h.build_app(orch))) as client:
        doc = await (await client.get("/openapi.json")).json()
        assert _chat_max_tokens(doc) == (most, most)
        body = {"messages": [{"role": "user", "content": "hi"}]}
        for key in ("max_tokens", "max_completion_tokens"):
            resp = await client.post("/v1/chat/completions", json={**body, key: most})
            assert resp.status == 200, await resp.text()
            assert orch.handles[-1].req.params["llm"]["max_tokens"] == most
            resp = await client.post("/v1/chat/completions", json={**body, key: most + 1})
            assert resp.status == 400
            err = assert_error(await resp.json(), param=key, code="invalid_value")
            assert f"less than or equal to {most}" in err["message"]
    # parse_chat without a model validates with the same pipeline's bound.
    with pytest.raises(ApiError) as info:
        rp.parse_chat({**body, "max_tokens": most + 1}, orch.pipeline)
    assert info.value.param == "max_tokens"


async def _wait_aborted(handle: FakeHandle) -> None:
    await asyncio.wait_for(handle.aborted.wait(), HANG_GUARD)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_client_disconnect_aborts_the_request(orch: FakeOrchestrator, stream: bool,
                                                    handler_cancellation: bool) -> None:
    """Kills: a disconnect that leaves the request running (no abort reaches the engine)."""
    def behaviour(handle: FakeHandle, req: rq.PipelineRequest) -> None:
        if req.stream:
            handle.push(rq.Delta(0, "encoder", "first", [1]))

    orch.behaviour = behaviour
    # Either mechanism alone must do: the watcher (aiohttp's default server) or cancellation.
    app = h.build_app(orch, disconnect_poll_s=None if handler_cancellation else 0.02)
    server = TestServer(app, handler_cancellation=handler_cancellation)
    async with TestClient(server) as client:
        started = asyncio.Event()

        async def call() -> None:
            resp = await client.post("/v1/chat/completions",
                                     json={**CHAT_BODY, "stream": stream})
            await resp.content.readany()  # the first chunks reached the client
            started.set()
            await asyncio.Event().wait()  # the client holds on until the test cancels it

        task = asyncio.create_task(call())
        await asyncio.wait_for((started if stream else orch.submitted).wait(), HANG_GUARD)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.session.close()  # drop the pooled connection: the client is gone
        await _wait_aborted(orch.handles[0])
    assert orch.handles[0].aborts == [None]
    assert orch.registry.get_sample_value("omnistage_http_client_disconnects_total") == 1


async def test_images_return_png_of_the_requested_size(client: TestClient,
                                                       orch: FakeOrchestrator) -> None:
    resp = await client.post("/v1/images/generations",
                             json={"prompt": "a cat", "size": "48x24", "n": 2})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert len(body["data"]) == 2
    for item in body["data"]:
        img = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        assert (img.format, img.size) == ("PNG", (48, 24))
        assert img.getpixel((0, 0)) == (200, 0, 0)
    resp = await client.post("/v1/images/generations",
                             json={"prompt": "a cat", "response_format": "url"})
    assert resp.status == 400
    assert_error(await resp.json(), param="response_format")


async def test_disabled_api_is_404_in_openai_shape() -> None:
    async with TestClient(TestServer(h.build_app(FakeOrchestrator(CHAT)))) as client:
        resp = await client.post("/v1/images/generations", json={"prompt": "x"})
        assert resp.status == 404
        assert_error(await resp.json(), code="api_not_enabled")
        resp = await client.get("/nowhere")
        assert resp.status == 404
        assert_error(await resp.json(), code="not_found")
        resp = await client.get("/v1/chat/completions")
        assert resp.status == 405
        assert_error(await resp.json())
        resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "model": "chat"})
        assert resp.status == 200


async def test_oversized_body_is_413_in_openai_shape(client: TestClient) -> None:
    resp = await client.post("/v1/chat/completions", data=b"x" * (h.MAX_BODY_BYTES + 1))
    assert resp.status == 413
    assert_error(await resp.json(), code="request_too_large")


async def test_models_and_model_check(client: TestClient) -> None:
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["text-to-image"]
    assert (await client.get("/v1/models/text-to-image")).status == 200
    resp = await client.get("/v1/models/other")
    assert resp.status == 404
    assert_error(await resp.json(), code="model_not_found")
    resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "model": "other"})
    assert resp.status == 404
    assert_error(await resp.json(), param="model", code="model_not_found")


async def test_served_model_name_may_contain_a_slash() -> None:
    manifest = CHAT.to_manifest()
    manifest["spec"]["orchestrator"]["servedModelName"] = "org/tiny-chat"
    orch = FakeOrchestrator(parse_pipeline(manifest))
    async with TestClient(TestServer(h.build_app(orch))) as client:
        resp = await client.get("/v1/models/org/tiny-chat")
        assert resp.status == 200 and (await resp.json())["id"] == "org/tiny-chat"
        resp = await client.post("/v1/chat/completions",
                                 json={**CHAT_BODY, "model": "org/tiny-chat"})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == "org/tiny-chat"


async def test_health_readiness_and_shutdown(client: TestClient, orch: FakeOrchestrator) -> None:
    assert (await client.get("/livez")).status == 200
    resp = await client.get("/readyz")
    assert (resp.status, await resp.text()) == (200, "ready")
    orch.ready_state = (False, "stage denoiser has no ready replica")
    resp = await client.get("/readyz")
    assert (resp.status, await resp.text()) == (503, "stage denoiser has no ready replica")
    orch.accepting = False
    resp = await client.post("/v1/chat/completions", json=CHAT_BODY)
    assert resp.status == 503
    assert_error(await resp.json(), code="shutting_down")
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/livez")).status == 200


async def test_metrics_include_engine_and_http_counters(client: TestClient,
                                                       admin: TestClient) -> None:
    """The admin listener's /metrics counts the public listener's requests (one registry)."""
    await client.post("/v1/chat/completions", json=CHAT_BODY)
    await client.post("/v1/chat/completions", json={"messages": 1})
    assert (await client.get("/metrics")).status == 404  # not on the public listener
    text = await (await admin.get("/metrics")).text()
    assert sample(text, "fake_engine_up") == 1
    route = "/v1/chat/completions"
    for status in ("200", "400"):
        assert sample(text, "omnistage_http_requests_total", route=route, method="POST",
                      status=status) == 1
    assert sample(text, "omnistage_http_request_duration_seconds_count", route=route) == 2


async def test_generic_request_and_pipeline_name(client: TestClient,
                                                 orch: FakeOrchestrator) -> None:
    resp = await client.post("/v1/pipelines/text-to-image/requests",
                             json={"prompt": "x", "n": 2, "params": {"denoiser": {"width": 16}}})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["id"] == orch.handles[0].id and body["status"] == "ok"
    image = body["children"][1]["outputs"]["denoiser"]["tensors"]["image"]
    assert (image["dtype"], image["shape"]) == ("uint8", [32, 16, 3])
    assert len(base64.b64decode(image["data"])) == 32 * 16 * 3
    resp = await client.post("/v1/pipelines/other/requests", json={"prompt": "x"})
    assert resp.status == 404
    assert_error(await resp.json(), param="name")


async def test_control_results_and_errors(admin: TestClient, orch: FakeOrchestrator) -> None:
    client = admin
    url = "/v1/pipelines/text-to-image/control"
    resp = await client.post(url, json={"op": "pause", "stages": ["encoder"]})
    assert resp.status == 200
    assert await resp.json() == {"results": {"encoder-0": {"state": "paused"}}}
    assert orch.control_calls == [("pause", ["encoder"])]
    orch.control_result = ValueError("unknown stage 'zzz'")
    resp = await client.post(url, json={"op": "pause"})
    assert resp.status == 400
    assert_error(await resp.json(), param="stages")
    orch.control_result = ControlError("denoiser-0", "sleep", "RuntimeError", "CUDA says no")
    resp = await client.post(url, json={"op": "sleep"})
    assert resp.status == 500
    err = assert_error(await resp.json(), code="control_failed")
    assert (err["exception_type"], err["replica"]) == ("RuntimeError", "denoiser-0")
    assert "CUDA says no" in err["message"]
    # Regression (fuzzing): resume while asleep was a 500, as if the replica had failed; a
    # state the caller must change first is a 409.
    orch.control_result = ControlError("encoder-0", "resume", "ControlConflict",
                                       "resume: replica is asleep; call wake_up first")
    resp = await client.post(url, json={"op": "resume"})
    assert resp.status == 409
    err = assert_error(await resp.json(), code="control_conflict")
    assert (err["exception_type"], err["replica"]) == ("ControlConflict", "encoder-0")


def _app_routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD" and r.resource is not None}


@pytest.mark.parametrize("pipeline", [T2I, CHAT])
async def test_openapi_covers_every_route(pipeline: OmniPipeline) -> None:
    app = h.build_app(FakeOrchestrator(pipeline))
    async with TestClient(TestServer(app)) as client:
        doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    documented = {(m, path) for path, ops in doc["paths"].items() for m in ops}
    assert _app_routes(app) == documented
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (method, path)
            if method == "post":
                assert "requestBody" in op and "400" in op["responses"], path
    # every $ref resolves
    text = json.dumps(doc)
    for ref in {r for r in text.split('"$ref": "')[1:]}:
        kind, name = ref.split('"')[0].split("/")[-2:]
        assert name in doc["components"][kind], ref
    full = openapi_document()
    assert {"/v1/images/generations", "/v1/chat/completions"} <= set(full["paths"])


async def test_ignored_field_names_are_percent_encoded_in_the_header(client: TestClient) -> None:
    """Regression (fuzzing): a field name with a control character was copied into a header,
    aiohttp refused to send it and the client got no response at all."""
    resp = await client.post("/v1/images/generations", json={"\u001f": None, "prompt": "0"})
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Omnistage-Ignored-Fields"] == "%1F"
    resp = await client.post("/v1/chat/completions", json={
        **CHAT_BODY, "a,b": 1, "\u00e9\n": 2, "ok-name_1.~": 4})
    assert resp.status == 200, await resp.text()
    names = resp.headers["X-Omnistage-Ignored-Fields"].split(",")
    assert sorted(names) == sorted(["a%2Cb", "%C3%A9%0A", "ok-name_1.~"])
    # A field name that is not Unicode text at all is refused, in the error shape.
    for path, raw in [("/v1/images/generations", b'{"prompt": "x", "\\ud800": 3}'),
                      ("/v1/pipelines/text-to-image/requests",
                       b'{"params": {"encoder": {"\\udc00": 1}}}')]:
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400, await resp.text()
        err = assert_error(await resp.json(), code="invalid_value")
        assert "not valid Unicode" in err["message"]


def test_ignored_header_is_bounded() -> None:
    assert rp.ignored_header([]) == {}
    many = [f"field{i}" for i in range(500)]
    value = rp.ignored_header(many)["X-Omnistage-Ignored-Fields"]
    assert len(value) <= 1024 + 4 and value.endswith(",...") and value.startswith("field0,")
    assert rp.ignored_header(["x" * 2000])["X-Omnistage-Ignored-Fields"] == "..."


async def test_document_and_validator_agree_on_required_content(client: TestClient) -> None:
    """Regression (fuzzing): the document allowed a tool message without content while the
    server refused it. Now both come from one model; check every role against the served
    document."""
    doc = await (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    variants = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["oneOf"]
    seen = set()
    for ref in variants:
        variant = schemas[ref["$ref"].rsplit("/", 1)[-1]]
        role = variant["properties"]["role"]
        roles = role.get("enum") or [role["const"]]
        required = "content" in variant.get("required", [])
        for name in roles:
            seen.add(name)
            resp = await client.post("/v1/chat/completions",
                                     json={"messages": [{"role": name}]})
            body = await resp.json()
            assert resp.status == (400 if required else 200), (name, body)
            if required:
                assert_error(body, param="messages[0].content",
                             code="missing_required_parameter")
    assert seen == {"system", "developer", "user", "assistant", "tool", "function"}


async def test_a_too_long_image_prompt_names_prompt(orch: FakeOrchestrator,
                                                    client: TestClient) -> None:
    """Regression (fuzzing): the encoder's refusal of a prompt longer than its context was
    reported as param max_tokens, a field the images API does not have."""
    for message in ("params.prompt: prompt (2000 tokens) + max_tokens (8) exceeds the model "
                    "context of 1024",
                    "params.max_tokens: prompt (2000 tokens) + max_tokens (8) exceeds the "
                    "model context of 1024"):
        orch.behaviour = fail_with("bad_request", message, stage="encoder")
        resp = await client.post("/v1/images/generations", json={"prompt": "cat " * 2000})
        assert resp.status == 400
        assert_error(await resp.json(), param="prompt", code="bad_request")
    orch.behaviour = fail_with("bad_request", "params.height must be a multiple of 16 for this "
                               "model, got 40", stage="denoiser")
    resp = await client.post("/v1/images/generations", json={"prompt": "x", "size": "40x40"})
    assert_error(await resp.json(), param="size")


async def test_405_lists_the_allowed_methods(client: TestClient, admin: TestClient) -> None:
    """Regression (fuzzing): every path answered an undeclared method with 405 and no Allow
    header (RFC 9110 requires one), on the API routes and the ops routes alike."""
    for on, method, path, allowed in [
            (client, "TRACE", "/v1/chat/completions", {"POST"}),
            (client, "GET", "/v1/images/generations", {"POST"}),
            (client, "DELETE", "/v1/models", {"GET", "HEAD"}),
            (admin, "PUT", "/v1/pipelines/text-to-image/control", {"POST"}),
            (client, "POST", "/livez", {"GET", "HEAD"}),
            (admin, "POST", "/livez", {"GET", "HEAD"}),
            (admin, "PATCH", "/metrics", {"GET", "HEAD"})]:
        resp = await on.request(method, path)
        assert resp.status == 405, (method, path)
        assert {m.strip() for m in resp.headers["Allow"].split(",")} == allowed, (method, path)
        body = assert_error(await resp.json(), code="method_not_allowed")
        assert method in body["message"]


@pytest.mark.parametrize("size", [
    "512x512", "8x2048", " 64 X 32 ", "auto", "2048x2048",  # valid
    "0x32", "30x32", "32x99999", "2056x8", "0512x512", "big", "", "AUTO", "auto\n",
    "512x512\n", "\f44X\t\n\v\t980973 \f", "\u0664\u0660x32", "16 x 16\t", "16x16x16",
])
def test_size_is_accepted_exactly_when_the_document_allows_it(size: str) -> None:
    """Regression (fuzzing): the document's size pattern allowed any WIDTHxHEIGHT of up to six
    digits (and Python-only whitespace) while the validator refused sides out of bounds, so a
    schema-valid request got 400. One regex, built from EngineOptions' bounds, is both.
    jsonschema_rs (schemathesis' validator) reads patterns as ECMA-262 does: `$` is the end of
    the text, where Python's jsonschema would also allow a trailing newline."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = openapi_document()["components"]["schemas"]["ImagesRequest"]["properties"]["size"]
    documented = jsonschema_rs.validator_for(schema).is_valid(size)
    try:
        rp.parse_images({"prompt": "x", "size": size}, T2I)
        accepted = True
    except ApiError as err:
        assert (err.status, err.param) == (400, "size")
        accepted = False
    assert accepted == documented, (size, accepted, documented)


async def test_openapi_is_generated_from_the_models_that_validate(
        orch: FakeOrchestrator) -> None:
    """Change a body model and the served document and the validator change together."""

    class NarrowChat(ChatCompletionRequest):
        n: Annotated[int, Field(ge=1, le=3)] | None = None
        house_style: Annotated[str, Field(min_length=2)]

    routes = [replace(r, body=NarrowChat) if r.handler == "chat_completions" else r
              for r in ROUTES]
    app = h.build_app(orch, routes=routes)
    async with TestClient(TestServer(app)) as client:
        doc = await (await client.get("/openapi.json")).json()
        schema = doc["components"]["schemas"]["NarrowChat"]
        op = doc["paths"]["/v1/chat/completions"]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/NarrowChat")
        assert schema["properties"]["n"]["anyOf"][0]["maximum"] == 3
        assert "house_style" in schema["required"]
        resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "n": 3})
        assert_error(await resp.json(), param="house_style", code="missing_required_parameter")
        resp = await client.post("/v1/chat/completions",
                                 json={**CHAT_BODY, "n": 4, "house_style": "terse"})
        assert_error(await resp.json(), param="n", code="invalid_value")
        resp = await client.post("/v1/chat/completions",
                                 json={**CHAT_BODY, "n": 3, "house_style": "terse"})
        assert resp.status == 200, await resp.text()
    # The default document describes the stock models, field for field.
    stock = openapi_document()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert set(stock) == set(ChatCompletionRequest.model_fields)


# --------------------------------------------------------------------------- the openai client


@pytest.fixture
async def openai_client(orch: FakeOrchestrator) -> AsyncIterator[openai.AsyncOpenAI]:
    runner, url = await h.serve_http(orch, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


async def test_openai_client_chat_images_and_errors(openai_client: openai.AsyncOpenAI,
                                                    orch: FakeOrchestrator) -> None:
    got = await openai_client.chat.completions.create(
        model="text-to-image", messages=[{"role": "user", "content": "hi"}], n=2, seed=1)
    assert [c.message.content for c in got.choices] == ["hello world"] * 2
    assert got.usage is not None and got.usage.total_tokens == 9

    stream = await openai_client.chat.completions.create(
        model="text-to-image", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == "hello world" and finish == "stop"
    assert usage is not None and usage.completion_tokens == 2

    img = await openai_client.images.generate(model="text-to-image", prompt="a cat",
                                              size="256x256", response_format="b64_json")
    assert img.data and img.data[0].b64_json
    assert Image.open(io.BytesIO(base64.b64decode(img.data[0].b64_json))).size == (256, 256)

    # finish_reason "abort" is not in OpenAI's enum; the client must still parse it.
    def aborted(handle: FakeHandle, req: rq.PipelineRequest) -> None:
        handle.push(rq.Outcome(handle.id, "abort", [rq.ChildOutcome(
            0, "abort", {"encoder": ar_output("encoder", "pre", "abort")})]))

    orch.behaviour = aborted
    got = await openai_client.chat.completions.create(
        model="text-to-image", messages=[{"role": "user", "content": "hi"}])
    assert (got.choices[0].finish_reason, got.choices[0].message.content) == ("abort", "pre")

    orch.behaviour = fail_with("overloaded", "queue full", retry_after=1)
    with pytest.raises(openai.RateLimitError) as info:
        await openai_client.chat.completions.create(
            model="text-to-image", messages=[{"role": "user", "content": "hi"}])
    assert info.value.response.headers["Retry-After"] == "1"
    assert info.value.code == "overloaded"

    with pytest.raises(openai.BadRequestError) as bad:
        await openai_client.chat.completions.create(
            model="text-to-image", messages=[{"role": "user", "content": "hi"}], n=99)
    assert bad.value.param == "n"

    def dies_mid_stream(handle: FakeHandle, req: rq.PipelineRequest) -> None:
        handle.push(rq.Delta(0, "encoder", "x", [1]))
        handle.push(rq.Outcome(handle.id, "fatal", [], rq.RequestError("stage_failed", "oom")))

    orch.behaviour = dies_mid_stream
    stream = await openai_client.chat.completions.create(
        model="text-to-image", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(openai.APIError, match="oom"):
        async for _ in stream:
            pass


async def test_serve_http_reports_a_bound_url(orch: FakeOrchestrator) -> None:
    runner, url = await h.serve_http(orch, "127.0.0.1", 0)
    try:
        async with ClientSession() as session, session.get(url + "/livez") as resp:
            assert (resp.status, await resp.text()) == (200, "ok")
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- the stream pump

TTS = load_pipeline(ROOT / "examples/tts.yaml")  # speech, generic
SPEECH = {"input": "hello", "voice": "default"}
FORMATS = ["chat", "speech-sse", "speech-file"]


class FakeWriter:
    """http_streaming.ResponseWriter in memory; from write number `fail_at` on, writes fail as a
    closed connection does."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.writes: list[bytes] = []
        self.started = False
        self.ended = False
        self.was_cut = False
        self.fail_at = fail_at
        self.wrote = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.started = True
        if self.fail_at is not None and len(self.writes) >= self.fail_at:
            raise ConnectionResetError("Cannot write to closing transport")
        self.writes.append(data)
        self.wrote.set()

    async def end(self) -> None:
        self.ended = True

    def cut(self) -> None:
        self.was_cut = True


def _stream_format(kind: str) -> tuple[st.StreamFormat, rq.PipelineRequest, Callable]:
    """A format, its request and a good event of it (n: the event's sequence number)."""
    if kind == "chat":
        call = rp.parse_chat({**CHAT_BODY, "stream": True}, T2I)
        return (st.ChatSse(call, "chatcmpl-r1", 1), call.request,
                lambda n: rq.Delta(0, "encoder", f"w{n} ", [n]))
    sse = kind == "speech-sse"
    call = rp.parse_speech({**SPEECH, "response_format": "pcm" if sse else "wav",
                            "stream_format": "sse" if sse else "audio"}, TTS)
    assert call.request.stream
    fmt = st.SpeechSse(call) if sse else st.SpeechFile(call)
    return fmt, call.request, lambda n: rq.AudioChunk(
        0, "vocoder", n, np.full(2400, 0.25, dtype=np.float32), 24000)


class PumpRun:
    """One pump over a FakeHandle, with the Flight and metrics the handlers give it."""

    def __init__(self, kind: str, writer: FakeWriter | None = None) -> None:
        self.kind = kind
        self.fmt, req, self.event = _stream_format(kind)
        self.handle = FakeHandle("r1", req)
        self.writer = writer or FakeWriter()
        self.registry = CollectorRegistry()
        self.flight = st.Flight(self.handle, HttpMetrics(self.registry), gone=lambda: False,
                                poll_s=None)

    async def run(self) -> None:
        async with self.flight:
            await st.pump(self.flight, self.fmt, self.writer, chat_param)

    def count(self, name: str) -> float:
        return self.registry.get_sample_value(f"omnistage_http_{name}_total") or 0.0

    def events(self) -> list[str]:
        return parse_sse(b"".join(self.writer.writes).decode())

    def fail_on_call(self, number: int, exc: Exception) -> None:
        """The format's handling of its `number`th event (1-based) raises exc."""
        method = "delta" if self.kind == "chat" else "audio"
        real = getattr(self.fmt, method)
        calls = itertools.count(1)

        def handling(event: Any) -> list[bytes]:
            if next(calls) == number:
                raise exc
            return real(event)

        setattr(self.fmt, method, handling)


@pytest.mark.parametrize("kind", FORMATS)
async def test_pump_streams_each_format_to_its_end_and_credits_chunks_once_written(
        kind: str) -> None:
    run = PumpRun(kind)
    credits: list[int] = []
    for n in (1, 2):
        event = run.event(n)
        if isinstance(event, rq.AudioChunk):
            event.credit = lambda: credits.append(len(run.writer.writes))
        run.handle.push(event)
    run.handle.push(rq.Outcome("r1", "ok", [rq.ChildOutcome(0, "ok", {
        "encoder": ar_output("encoder", "w1 w2 "),
        "vocoder": rq.StageOutput("vocoder", {"sample_rate": 24000}, {
            "audio": WireTensor.from_any(np.full(4800, 0.25, dtype=np.float32))})})]))
    await run.run()
    assert run.writer.ended and not run.writer.was_cut and run.handle.aborts == []
    assert (run.count("stream_errors"), run.count("client_disconnects")) == (0, 0)
    if kind != "chat":  # each chunk's credit came after its bytes were written
        assert credits == [1, 2] if kind == "speech-file" else credits[0] >= 1
    if kind == "chat":
        assert run.events()[-1] == "[DONE]"
    elif kind == "speech-sse":
        assert json.loads(run.events()[-1])["type"] == "speech.audio.done"
    else:
        samples, rate = sf_read(b"".join(run.writer.writes))
        assert rate == 24000 and samples.size == 4800


def sf_read(data: bytes) -> tuple[np.ndarray, int]:
    """A streamed wav (its sizes say `unknown`) read to its end."""
    soundfile = pytest.importorskip("soundfile")
    return soundfile.read(io.BytesIO(data), dtype="float32")


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize(("exc", "code"), [
    (ApiError(502, "chunk 2 cannot be encoded", code="stage_failed"), "stage_failed"),
    (RuntimeError("a bug"), "internal"),
])
async def test_pump_failure_after_the_first_bytes_is_one_path_for_every_format(
        kind: str, exc: Exception, code: str) -> None:
    """Kills: a format whose mid-stream failure leaves the request running, counts it as a
    disconnect, misses stream_errors, sends [DONE], or (a file) ends the body normally."""
    run = PumpRun(kind)
    run.fail_on_call(2, exc)
    run.handle.push(run.event(1))
    run.handle.push(run.event(2))
    await run.run()
    assert run.handle.aborts == [None]  # the server gave up: the stages stop
    assert (run.count("stream_errors"), run.count("client_disconnects")) == (1, 0)
    if kind == "speech-file":  # no room for an error: the body is cut short
        assert run.writer.was_cut and not run.writer.ended
        return
    assert run.writer.ended and not run.writer.was_cut
    events = run.events()
    assert "[DONE]" not in events
    assert_error(json.loads(events[-1]), code=code)
    assert not any('"speech.audio.done"' in e for e in events)


@pytest.mark.parametrize("kind", FORMATS)
async def test_pump_failure_before_the_first_bytes_is_a_real_status(kind: str) -> None:
    """An outcome that is an error, first: raised with its status, nothing written; the
    request is terminal, so nothing is aborted."""
    run = PumpRun(kind)
    fail_with("no_replica", "no live replica")(run.handle, run.handle.req)
    with pytest.raises(ApiError) as info:
        await run.run()
    assert (info.value.status, info.value.code) == (503, "no_replica")
    assert not run.writer.started and run.handle.aborts == []
    assert run.count("stream_errors") == 0


@pytest.mark.parametrize("kind", ["speech-sse", "speech-file"])
async def test_pump_bad_first_chunk_is_a_real_status_and_aborts(kind: str) -> None:
    run = PumpRun(kind)
    chunk = run.event(1)
    chunk.sample_rate = None
    run.handle.push(chunk)
    with pytest.raises(ApiError) as info:
        await run.run()
    assert (info.value.status, info.value.code) == (502, "stage_failed")
    assert "no sample_rate" in info.value.message
    assert not run.writer.started and run.handle.aborts == [None]
    assert (run.count("stream_errors"), run.count("client_disconnects")) == (0, 0)


@pytest.mark.parametrize("kind", FORMATS)
async def test_pump_failed_write_is_a_disconnect_for_every_format(kind: str) -> None:
    run = PumpRun(kind, FakeWriter(fail_at=0))
    credited: list[int] = []
    event = run.event(1)
    if isinstance(event, rq.AudioChunk):
        event.credit = lambda: credited.append(1)
    run.handle.push(event)
    await run.run()
    assert run.handle.aborts == [None]
    assert (run.count("stream_errors"), run.count("client_disconnects")) == (0, 1)
    assert credited == [] and not run.writer.ended and not run.writer.was_cut


@pytest.mark.parametrize("kind", FORMATS)
async def test_pump_cancelled_mid_stream_aborts_once_for_every_format(kind: str) -> None:
    run = PumpRun(kind)
    run.handle.push(run.event(1))
    task = asyncio.create_task(run.run())
    await asyncio.wait_for(run.writer.wrote.wait(), HANG_GUARD)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.handle.aborts == [None]
    assert (run.count("stream_errors"), run.count("client_disconnects")) == (0, 1)


@pytest.mark.parametrize("stream_format", ["sse", "audio"])
async def test_streamed_speech_failing_mid_stream_over_http(stream_format: str) -> None:
    """The aiohttp side of the pump: an SSE error event, or a file cut before its end (the
    client sees a truncated body, not a short file); a bad first chunk is a real 502."""
    def behaviour(handle: FakeHandle, req: rq.PipelineRequest) -> None:
        audio = np.zeros(2400, dtype=np.float32)
        if req.prompt == "early":
            handle.push(rq.AudioChunk(0, "vocoder", 1, audio, None))  # no sample_rate
        else:
            handle.push(rq.AudioChunk(0, "vocoder", 1, audio, 24000))
            handle.push(rq.AudioChunk(0, "vocoder", 2, audio, 16000))  # the rate changed

    orch = FakeOrchestrator(TTS, behaviour)
    fmt = "pcm" if stream_format == "sse" else "wav"
    body = {**SPEECH, "response_format": fmt, "stream_format": stream_format}
    async with TestClient(TestServer(h.build_app(orch, disconnect_poll_s=0.02))) as client:
        resp = await client.post("/v1/audio/speech", json={**body, "input": "early"})
        assert resp.status == 502
        assert_error(await resp.json(), code="stage_failed")
        resp = await client.post("/v1/audio/speech", json={**body, "input": "late"})
        assert resp.status == 200
        if stream_format == "sse":
            events = parse_sse(await resp.text())
            assert json.loads(events[0])["type"] == "speech.audio.delta"
            assert_error(json.loads(events[-1]), code="stage_failed")
        else:
            with pytest.raises(ClientPayloadError):
                await resp.read()
    assert [hd.aborts for hd in orch.handles] == [[None], [None]]
    assert orch.registry.get_sample_value("omnistage_http_stream_errors_total") == 1
    assert orch.registry.get_sample_value("omnistage_http_client_disconnects_total") == 0


async def test_the_flight_watcher_aborts_once_the_client_is_gone_and_stops_with_the_flight(
        ) -> None:
    """The watcher alone (no handler cancellation): it looks every poll_s, aborts the request
    once gone() says so, counts one disconnect, and looks no more once the flight is over."""
    req = rq.PipelineRequest(prompt="x")
    registry = CollectorRegistry()
    looks: list[bool] = []
    gone = asyncio.Event()
    looked = {1: asyncio.Event(), 3: asyncio.Event()}  # set at the first and the third look

    def is_gone() -> bool:
        looks.append(gone.is_set())
        if len(looks) in looked:
            looked[len(looks)].set()
        return gone.is_set()

    handle = FakeHandle("r1", req)
    flight = st.Flight(handle, HttpMetrics(registry), gone=is_gone, poll_s=0.01)
    async with flight:
        await asyncio.wait_for(looked[3].wait(), HANG_GUARD)  # it keeps looking meanwhile
        assert handle.aborts == []
        gone.set()
        outcome = await asyncio.wait_for(flight.outcome(), HANG_GUARD)
    assert outcome.status == "abort" and handle.aborts == [None]
    assert registry.get_sample_value("omnistage_http_client_disconnects_total") == 1
    # A flight that ends with its outcome leaves no watcher behind.
    other = FakeHandle("r2", req)
    looks.clear()
    gone.clear()
    looked[1].clear()
    flight = st.Flight(other, HttpMetrics(CollectorRegistry()), gone=is_gone, poll_s=0.01)
    async with flight:
        await asyncio.wait_for(looked[1].wait(), HANG_GUARD)
        other.push(rq.Outcome("r2", "ok", []))
        await flight.outcome()
    seen = len(looks)
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert len(looks) == seen and other.aborts == []
