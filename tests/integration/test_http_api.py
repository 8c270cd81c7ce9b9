"""The HTTP API end to end: `omnistage serve examples/text-to-image.yaml` and the openai client.

One served pipeline (real worker processes, tiny models on the CPU) is shared by the module,
because starting it dominates the cost. Tests that change server state (control) restore it.
What the acceptance criteria name is covered here: the official openai client gets a chat
completion (streamed and not) and an image; an unencodable value is a 400 and the server keeps
serving; a client that disconnects aborts its request through the pipeline.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from PIL import Image

from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.http_api import serve_http
from omnistage.orchestrator.membership import StaticMembership
from omnistage.spec import load_pipeline
from tests.harness.local import free_port
from tests.harness.metrics import sample

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "text-to-image.yaml"
MODEL = "text-to-image"
MESSAGES = [{"role": "user", "content": "Tell me about cats"}]
# About 8 s of CPU work for the tiny model: long enough that only an abort ends it early.
LONG = {"model": MODEL, "messages": MESSAGES, "max_tokens": 960, "ignore_eos": True, "n": 8}



def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


#: The admin listener (control, /v1/load, /metrics) of each served API URL.
ADMIN: dict[str, str] = {}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`omnistage serve examples/text-to-image.yaml`, exactly as a user runs it; yields the
    base URL once /readyz says ready (its admin listener's URL is ADMIN[url])."""
    log_dir = tmp_path_factory.mktemp("serve")
    port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    ADMIN[url] = f"http://127.0.0.1:{admin_port}"
    with open(log_dir / "serve.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.cli", "serve", str(EXAMPLE), "--port", str(port),
             "--admin-port", str(admin_port), "--log-dir", str(log_dir)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 240
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                text = (log_dir / "serve.out").read_text(errors="replace")
                pytest.fail(f"omnistage serve did not become ready (rc={proc.poll()}):\n"
                            f"{text[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
async def oai(served: str) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=served + "/v1", api_key="x", max_retries=0,
                                timeout=120)
    try:
        yield client
    finally:
        await client.close()


async def _metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent), on its admin listener."""
    async with aiohttp.ClientSession() as s, s.get(ADMIN.get(url, url) + "/metrics") as resp:
        text = await resp.text()
    return sample(text, name, **labels) or 0.0


async def test_openai_client_chat_completion(oai: openai.AsyncOpenAI) -> None:
    got = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                            temperature=0, n=2, seed=3)
    assert got.object == "chat.completion" and got.model == MODEL
    assert [c.index for c in got.choices] == [0, 1]
    for choice in got.choices:
        assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length")
    assert got.usage is not None and got.usage.prompt_tokens > 0
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


async def test_openai_client_streams_what_the_non_streaming_call_returns(
        oai: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = await oai.chat.completions.create(**kwargs)
    stream = await oai.chat.completions.create(**kwargs, stream=True,
                                               stream_options={"include_usage": True})
    roles, pieces, finishes, usage = [], [], [], None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert roles[0] == "assistant"
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: same text
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == 8


async def test_openai_client_generates_png_images(oai: openai.AsyncOpenAI) -> None:
    got = await oai.images.generate(model=MODEL, prompt="a red cat", size="48x32", n=2,
                                    response_format="b64_json")
    assert len(got.data) == 2
    for item in got.data:
        assert item.b64_json
        img = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert (img.format, img.size, img.mode) == ("PNG", (48, 32), "RGB")
    # Extensions go through extra_body; the negative prompt runs a companion request.
    got = await oai.images.generate(model=MODEL, prompt="a red cat", response_format="b64_json",
                                    extra_body={"negative_prompt": "blurry", "seed": 5,
                                                "guidance_scale": 3.0,
                                                "num_inference_steps": 2})
    img = Image.open(io.BytesIO(base64.b64decode(got.data[0].b64_json or "")))
    assert img.size == (32, 32)  # the stage's default size


async def test_bad_input_is_400_naming_the_field(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.images.generate(model=MODEL, prompt="x", response_format="url")
    assert info.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        await oai.images.generate(model=MODEL, prompt="x", size="33x33")  # type: ignore[arg-type]
    assert info.value.param == "size"
    # Above the document's bound the orchestrator refuses it; test_max_tokens_bound_* below.
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100_000)
    assert info.value.param == "max_tokens" and "less than or equal to 1023" in info.value.message
    # A prompt longer than the encoder's context (1024 tokens) is the prompt's fault: the
    # images API has no max_tokens, and a chat request that sets none is blamed on messages.
    with pytest.raises(openai.BadRequestError) as info:
        await oai.images.generate(model=MODEL, prompt="cat " * 2000)
    assert info.value.param == "prompt" and "context" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "cat " * 2000}])
    assert info.value.param == "messages" and "context" in info.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        await oai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert nf.value.code == "model_not_found"


async def test_unencodable_values_are_400_and_the_server_keeps_serving(
        served: str, oai: openai.AsyncOpenAI) -> None:
    bad = [
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}', "messages[0].content"),
        ("/v1/chat/completions",
         json.dumps({"messages": MESSAGES, "seed": 2**70}).encode(), "seed"),
        ("/v1/images/generations", b'{"prompt": "\\udfff"}', "prompt"),
        ("/v1/pipelines/text-to-image/requests",
         json.dumps({"prompt": "x", "params": {"encoder": {"seed": 2**70}}}).encode(),
         "params.encoder.seed"),
        ("/v1/pipelines/text-to-image/requests",
         b'{"prompt": "x", "params": {"encoder": {"prompt": "\\ud800"}}}',
         "params.encoder.prompt"),
    ]
    async with aiohttp.ClientSession() as s:
        for path, raw, param in bad:
            async with s.post(served + path, data=raw,
                              headers={"Content-Type": "application/json"}) as resp:
                body = await resp.json()
                assert resp.status == 400, (path, body)
                assert body["error"]["param"] == param, body
    got = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert got.choices[0].finish_reason in ("stop", "length")


async def test_max_tokens_bound_in_the_document_is_the_one_the_server_applies(
        served: str, oai: openai.AsyncOpenAI) -> None:
    """Regression (schemathesis ST202): /openapi.json allowed max_tokens up to 2**20 while the
    worker refuses prompt + max_tokens beyond its model's context. The document now states the
    chat stage's bound (tiny-llama: 1024 tokens, less one prompt token): the real worker serves
    it for the shortest prompt, one more is refused, and a longer prompt at the bound gets the
    worker's 400 naming max_tokens, as the document's description says."""
    async with aiohttp.ClientSession() as s:
        async with s.get(served + "/openapi.json") as resp:
            doc = await resp.json()
        props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        most = props["max_tokens"]["anyOf"][0]["maximum"]
        assert most == props["max_completion_tokens"]["anyOf"][0]["maximum"] == 1023
        url = served + "/v1/pipelines/text-to-image/requests"
        # An empty prompt is one token (BOS): the worker takes the bound and no more.
        for max_tokens, status in ((most, 200), (most + 1, 400)):
            body = {"prompt": "", "finals": ["encoder"],
                    "params": {"encoder": {"max_tokens": max_tokens}}}
            async with s.post(url, json=body) as resp:
                got = await resp.json()
                assert resp.status == status, got
        assert got["error"]["param"] == "params.encoder.max_tokens"
        assert f"max_tokens ({most + 1}) exceeds the model context of 1024" in \
            got["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=most + 1)
    assert info.value.param == "max_tokens" and str(most) in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # the prompt takes more than one token
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=most)
    assert info.value.param == "max_tokens" and "context" in info.value.message


async def test_generic_route_returns_fields_and_tensors(served: str) -> None:
    body = {"prompt": "a cat", "finals": ["encoder"],
            "params": {"encoder": {"max_tokens": 3, "ignore_eos": True}}}
    async with aiohttp.ClientSession() as s:
        async with s.post(served + "/v1/pipelines/text-to-image/requests", json=body) as resp:
            assert resp.status == 200, await resp.text()
            got = await resp.json()
        assert got["status"] == "ok" and got["id"] == resp.headers["X-Request-Id"]
        (child,) = got["children"]
        out = child["outputs"]["encoder"]
        assert out["fields"]["completion_tokens"] == 3
        hidden = out["tensors"]["hidden_states"]  # returnHiddenStates is on in the example
        assert hidden["dtype"] == "float32" and len(hidden["shape"]) == 2
        assert len(base64.b64decode(hidden["data"])) == 4 * hidden["shape"][0] * hidden["shape"][1]

        async with s.post(served + "/v1/pipelines/text-to-image/requests",
                          json={"prompt": "x", "n": 2}) as resp:
            got = await resp.json()
        image = got["children"][1]["outputs"]["denoiser"]["tensors"]["image"]
        assert (image["dtype"], image["shape"]) == ("uint8", [32, 32, 3])


async def test_operational_routes(served: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(served + "/livez") as resp:
            assert resp.status == 200
        async with s.get(served + "/readyz") as resp:
            assert resp.status == 200, await resp.text()
        async with s.get(served + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with s.get(served + "/openapi.json") as resp:
            doc = await resp.json()
        assert "/v1/chat/completions" in doc["paths"]
        async with s.get(served + "/metrics") as resp:
            assert resp.status == 404  # on the admin listener only
        async with s.get(ADMIN[served] + "/metrics") as resp:
            text = await resp.text()
        assert "omnistage_orchestrator_requests_total" in text  # the engine's
        assert "omnistage_http_requests_total" in text  # the HTTP layer's


async def test_control_pause_and_resume(served: str, oai: openai.AsyncOpenAI) -> None:
    url = ADMIN[served] + "/v1/pipelines/text-to-image/control"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"op": "pause", "stages": ["ghost"]}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "stages[0]"
        async with s.post(url, json={"op": "pause", "stages": ["denoiser"]}) as resp:
            assert resp.status == 200, await resp.text()
            assert list((await resp.json())["results"]) == ["text-to-image-denoiser-0"]
        async with s.post(url, json={"op": "resume", "stages": ["denoiser"]}) as resp:
            assert resp.status == 200, await resp.text()
    got = await oai.images.generate(model=MODEL, prompt="x", response_format="b64_json")
    assert got.data[0].b64_json


async def test_streaming_client_disconnect_aborts_the_request(served: str) -> None:
    before = await _metric(served, "omnistage_orchestrator_requests_total", status="abort")
    gone = await _metric(served, "omnistage_http_client_disconnects_total")
    body = {**LONG, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(served + "/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()  # the stream is running
        resp.close()  # hang up mid-stream
    await _until(lambda: _metric(served, "omnistage_orchestrator_requests_total",
                                 status="abort"), before + 1)
    assert await _metric(served, "omnistage_http_client_disconnects_total") == gone + 1


async def test_non_streaming_client_disconnect_aborts_the_request(served: str) -> None:
    before = await _metric(served, "omnistage_orchestrator_requests_total", status="abort")
    async with aiohttp.ClientSession() as s:
        post = asyncio.ensure_future(s.post(served + "/v1/chat/completions", json=LONG))
        # Hang up only once the request is really in the pipeline (a loaded CI box may take
        # longer than any fixed client timeout just to deliver it).
        await _until(lambda: _metric(served, "omnistage_orchestrator_inflight_requests"), 1)
        post.cancel()  # the client gives up and hangs up
        with pytest.raises(asyncio.CancelledError):
            await post
    await _until(lambda: _metric(served, "omnistage_orchestrator_requests_total",
                                 status="abort"), before + 1)


async def _until(probe, target: float, timeout: float = 30.0) -> None:
    value = None
    for _ in range(int(timeout / 0.1)):
        value = await probe()
        if value >= target:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"metric stayed at {value}, expected {target}")


async def test_no_live_replica_is_503_and_not_ready() -> None:
    """The real engine with an empty membership: requests fail at once, readiness says why."""
    orch = Orchestrator(load_pipeline(EXAMPLE), StaticMembership())
    await orch.start()
    runner, url = await serve_http(orch, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions",
                              json={"messages": MESSAGES}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_replica"
            async with s.get(url + "/readyz") as resp:
                assert resp.status == 503 and "replica" in await resp.text()
    finally:
        await orch.stop(drain_timeout=1)
        await runner.cleanup()
