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
"""

from __future__ import annotations

import re
from typing import Any

import schemathesis

from omnistage.orchestrator.schemas import SIZE_PATTERN

MAX_N = 2
MAX_STEPS = 4
MAX_TOKENS = 8
MAX_SIDE = 64
MIN_TIMEOUT_S = 60.0
_SIZE = re.compile(SIZE_PATTERN)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cap(body: dict[str, Any], key: str, most: int, least: int = 1) -> None:
    """Lower a valid integer knob to `most`; an invalid one (wrong type, out of bounds) stays."""
    value = body.get(key)
    if _is_int(value) and least <= value and value > most:
        body[key] = most


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
        body = dict(case.body)
        _cheap(case.operation.path, body)
        if body != case.body:
            case.body = body
