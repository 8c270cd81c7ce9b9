"""Schemathesis hooks for the HTTP fuzz suite (tests/integration/test_fuzz_api.py).

Loaded by `schemathesis run` through SCHEMATHESIS_HOOKS=tests.harness.fuzz_hooks.

One hook, before every call: a request that is valid and expensive is made cheap while staying
valid, so a CI runner with two CPU cores serves every generated case in about a second. A value
that is invalid is never touched, so negative cases stay negative and still meet the validators.
What is capped, and why it is no loss of coverage:

- samples (`n`), images' `size`, `num_inference_steps`, `max_tokens`/`max_completion_tokens`
  and the same knobs inside the generic route's `params`: their bounds are the validators'
  (schemas.py, EngineOptions), exercised at both ends by tests/unit/test_http_api.py and
  tests/unit/test_params.py; running the tiny UNet at 2048x2048 for 1000 steps ten times over
  tests only the CPU.
- the generic route's `timeout_s`: a deadline the client sets and that passes is answered 504
  `deadline` by design (docs/http-api.md); `not_a_server_error` counts every 5xx, so a
  generated deadline of a microsecond would be reported as a server fault. The 504 path is
  tested in tests/unit/test_http_api.py and tests/integration/test_orchestrator.py.
- integral numbers written as floats (`9.0`): the server reads them as integers (JSON has one
  number type; docs/http-api.md), so they are capped as the integers they are.
- the text of chat messages, cut to MAX_CHAT_CHARS in all: a prompt beyond the chat model's
  context is refused by design (400 `param: messages`; the schema cannot count tokens), which
  tests/unit/test_http_api.py and the worker's tests cover.
- media and audio (chat and /v1/audio/speech), where a schema cannot say what is valid: the
  bytes inside a valid-looking base64 image or audio part (replaced by a real tiny PNG / WAV),
  the total of media parts over all messages (cut to omnistage.media.MAX_MEDIA_PARTS), the
  pairing of `modalities` with `audio` and of `stream` with `audio.format: pcm16` (completed),
  and the speech `input` length (cut to MAX_SPEECH_CHARS: the tone kind speaks 20 ms a
  character). What is refused when they are wrong is tested in
  tests/integration/test_audio_api.py and tests/unit/test_media.py.
"""

from __future__ import annotations

import base64
import copy
import io
import re
from typing import Any

import numpy as np
import schemathesis
import soundfile
from PIL import Image

from omnistage.media import MAX_MEDIA_PARTS
from omnistage.orchestrator.schemas import SIZE_PATTERN

MAX_N = 2
MAX_STEPS = 4
MAX_TOKENS = 8
MAX_SIDE = 64
MIN_TIMEOUT_S = 60.0
_SIZE = re.compile(SIZE_PATTERN)
MAX_SPEECH_CHARS = 64


def _tiny_png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (1, 2, 3)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _tiny_wav() -> str:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(160, np.float32), 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


PNG_URL, WAV_B64 = _tiny_png(), _tiny_wav()


def _real_media(body: dict[str, Any]) -> None:
    """Valid parts get real media; beyond MAX_MEDIA_PARTS over all messages, parts are cut."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    seen = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        kept = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and isinstance(part.get("image_url"), dict):
                part = {**part, "image_url": {**part["image_url"], "url": PNG_URL}}
            elif kind == "input_audio" and isinstance(part.get("input_audio"), dict):
                part = {**part, "input_audio": {**part["input_audio"], "data": WAV_B64,
                                                "format": "wav"}}
            else:
                kept.append(part)
                continue
            seen += 1
            if seen <= MAX_MEDIA_PARTS:
                kept.append(part)
        message["content"] = kept


def _paired_audio(body: dict[str, Any]) -> None:
    modalities, audio = body.get("modalities"), body.get("audio")
    if isinstance(audio, dict):
        body["modalities"] = ["text", "audio"]
        if body.get("stream") is True:
            body["audio"] = {**audio, "format": "pcm16"}
    elif isinstance(modalities, list) and "audio" in modalities:
        body["modalities"] = ["text"]


def _is_int(value: Any) -> bool:
    """An integer as the server reads JSON: 4 and 4.0 alike, never a boolean."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _cap(body: dict[str, Any], key: str, most: int, least: int = 1) -> None:
    """Lower a valid integer knob to `most`; an invalid one (wrong type, out of bounds) stays."""
    value = body.get(key)
    if _is_int(value) and least <= value and value > most:
        body[key] = most


MAX_CHAT_CHARS = 128


def _short_messages(body: dict[str, Any]) -> None:
    """Cut the messages' text to MAX_CHAT_CHARS in all (strings and text parts)."""
    left = MAX_CHAT_CHARS
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = content[:left]
            left -= len(message["content"])
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = part["text"][:left]
                    left -= len(part["text"])


def _cheap_knobs(knobs: dict[str, Any]) -> None:
    for key in ("num_inference_steps", "max_tokens", "max_completion_tokens"):
        _cap(knobs, key, MAX_STEPS if key == "num_inference_steps" else MAX_TOKENS, 0)
    for key in ("width", "height"):
        value = knobs.get(key)
        if _is_int(value) and value > MAX_SIDE and value % 8 == 0 and value <= 2048:
            knobs[key] = MAX_SIDE


def _cheap(path: str, body: dict[str, Any]) -> None:
    _cap(body, "n", MAX_N)
    _cheap_knobs(body)
    size = body.get("size")
    if isinstance(size, str) and (m := _SIZE.fullmatch(size)) and m.group(1) is not None \
            and int(m.group(1)) * int(m.group(2)) > MAX_SIDE * MAX_SIDE:
        body["size"] = f"{MAX_SIDE}x{MAX_SIDE}"
    if path.endswith("/chat/completions"):
        if isinstance(body.get("messages"), list):
            _short_messages(body)
        _real_media(body)
        _paired_audio(body)
    if path.endswith("/audio/speech") and isinstance(body.get("input"), str):
        body["input"] = body["input"][:MAX_SPEECH_CHARS] or "x"
    if path.endswith("/requests"):
        timeout = body.get("timeout_s")
        if isinstance(timeout, int | float) and not isinstance(timeout, bool) \
                and 0 < timeout < MIN_TIMEOUT_S:
            body["timeout_s"] = MIN_TIMEOUT_S
        params = body.get("params")
        if isinstance(params, dict):
            for knobs in params.values():
                if isinstance(knobs, dict):
                    _cap(knobs, "n", MAX_N)
                    _cheap_knobs(knobs)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    meta = getattr(case, "meta", None)
    if meta is not None and meta.generation.mode.is_negative:
        # The validators refuse it before any model runs, so it is cheap already; and _cap only
        # knows lower bounds: it would turn max_tokens above the pipeline's bound (1023 for
        # tiny-llama, /openapi.json's maximum) into a valid 8.
        return
    if isinstance(case.body, dict):
        body = copy.deepcopy(case.body)
        _cheap(case.operation.path, body)
        if body != case.body:
            case.body = body
