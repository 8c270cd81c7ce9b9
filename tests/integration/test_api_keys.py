"""API keys on `omnistage serve`, exactly as a user runs it (issue 43): the openai client with
a wrong key gets AuthenticationError and with the right one its answer; an anonymous control
call on the public port is refused and pauses nothing, while the admin listener takes it with
the admin key (and refuses it without, or with an API key); a key rotated out of the key file
is refused within the reload bound while the new one serves; the probes stay open; and a
server that would listen beyond loopback without keys refuses to start, before any replica."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from omnistage.orchestrator import auth
from tests.harness.local import free_port
from tests.harness.waiting import HANG_GUARD

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
ECHO = ROOT / "examples" / "echo.yaml"
OLD, NEW = "sk-omnistage-old-0123456789abcdef", "sk-omnistage-new-0123456789abcdef"
ADMIN = "admin-omnistage-0123456789abcdef"


def _call(url: str, path: str, key: str | None = None, body: dict[str, Any] | None = None,
          header: str = "Authorization") -> tuple[int, dict[str, Any] | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[header] = f"Bearer {key}" if header == "Authorization" else key
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers=headers,
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Served:
    def __init__(self, url: str, admin: str, out: Path, keys: Path) -> None:
        self.url, self.admin, self.out, self.keys = url, admin, out, keys


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("keys")
    keys = tmp / "api-keys"
    keys.write_text(f"# the key in force\n{OLD}\n")
    admin_keys = tmp / "admin-keys"
    admin_keys.write_text(f"{ADMIN}\n")
    port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp / "serve.out"
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_KEYS}
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.cli", "serve", str(ECHO), "--port", str(port),
             "--log-dir", str(tmp / "logs"), "--api-key-file", str(keys),
             "--admin-port", str(admin_port), "--admin-key-file", str(admin_keys)],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve did not become ready (rc={proc.poll()}):\n"
                            f"{out.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        yield Served(url, f"http://127.0.0.1:{admin_port}", out, keys)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return _call(url, "/readyz")[0] == 200  # open without a key
    except OSError:  # not listening yet
        return False


def test_the_start_says_keys_are_on_and_from_where(served: Served) -> None:
    text = served.out.read_text()
    assert f"omnistage: API keys: on (1 key from file {served.keys}; send Authorization: " \
           "Bearer KEY)" in text
    assert OLD not in text  # a key never reaches a log


def test_the_openai_client_needs_the_key(served: Served) -> None:
    with openai.OpenAI(base_url=served.url + "/v1", api_key="sk-wrong-0123456789abcdef",
                       max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=served.url + "/v1", api_key=OLD, max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == ["echo"]


def test_an_anonymous_control_call_pauses_nothing(served: Served) -> None:
    for key in (None, OLD):  # not on the public port at all, with an API key or without
        status, body = _call(served.url, "/v1/pipelines/echo/control", key, {"op": "pause"})
        assert status == 404 and isinstance(body, dict), body
        assert body["error"]["code"] == "not_found"
    for key, header in ((None, "Authorization"), (OLD, "Authorization"),
                        (OLD, auth.ADMIN_KEY_HEADER)):  # an API key is no admin key
        status, body = _call(served.admin, "/v1/pipelines/echo/control", key,
                             {"op": "pause"}, header)
        assert status == 401 and isinstance(body, dict), body
        assert body["error"]["code"] == "invalid_api_key"
    # Nothing paused: a request with the key is answered at once (a paused stage would hold it).
    status, body = _call(served.url, "/v1/pipelines/echo/requests", OLD,
                         {"prompt": "still serving", "timeout_s": 10})
    assert status == 200 and isinstance(body, dict) and body["status"] == "ok", body
    for path in ("/livez", "/readyz", "/openapi.json"):
        assert _call(served.url, path)[0] == 200, path
    for path in ("/metrics", "/v1/load"):
        assert _call(served.url, path)[0] == 404, path
    for path in ("/livez", "/readyz", "/metrics", "/openapi.json"):
        assert _call(served.admin, path)[0] == 200, path
    assert "admin keys: on (1 key from file" in served.out.read_text()
    assert ADMIN not in served.out.read_text()


def test_the_admin_listener_takes_control_with_the_admin_key(served: Served) -> None:
    """pause with the admin key holds the next request; resume (the Bearer way) lets it go."""
    status, body = _call(served.admin, "/v1/load", ADMIN, header=auth.ADMIN_KEY_HEADER)
    assert status == 200 and isinstance(body, dict) and "a" in body["stages"], body
    status, body = _call(served.admin, "/v1/pipelines/echo/control", ADMIN, {"op": "pause"},
                         auth.ADMIN_KEY_HEADER)
    try:
        assert status == 200 and isinstance(body, dict), body
        assert [r["paused"] for r in body["results"].values()] == [True, True], body
        status, body = _call(served.url, "/v1/pipelines/echo/requests", OLD,
                             {"prompt": "held", "timeout_s": 1})
        assert status in (503, 504), body  # paused: it waits out its deadline
    finally:
        status, body = _call(served.admin, "/v1/pipelines/echo/control", ADMIN,
                             {"op": "resume"})
    assert status == 200, body
    status, body = _call(served.url, "/v1/pipelines/echo/requests", OLD,
                         {"prompt": "again", "timeout_s": 30})
    assert status == 200 and isinstance(body, dict) and body["status"] == "ok", body


def test_a_rotated_key_file_refuses_the_old_key_within_the_reload_bound(served: Served) -> None:
    staged = served.keys.with_name("api-keys.new")
    staged.write_text(f"{NEW}\n")
    os.replace(staged, served.keys)  # as an atomic update writes it
    rotated = time.monotonic()
    while _call(served.url, "/v1/models", OLD)[0] != 401:
        assert time.monotonic() - rotated < HANG_GUARD, "the old key is still accepted"
        time.sleep(0.05)
    took = time.monotonic() - rotated
    assert took < auth.RELOAD_S + 5, f"the rotation took {took:.1f}s"
    assert _call(served.url, "/v1/models", NEW)[0] == 200
    status, body = _call(served.url, "/v1/pipelines/echo/requests", NEW, {"prompt": "new"})
    assert status == 200 and isinstance(body, dict) and body["status"] == "ok"


def test_serving_beyond_loopback_without_keys_refuses_before_any_replica(
        tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_KEYS}
    out = subprocess.run([sys.executable, "-m", "omnistage.cli", "serve", str(ECHO), "--host",
                          "0.0.0.0", "--log-dir", str(tmp_path / "logs")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: the API would listen on 0.0.0.0 without API keys: set $OMNISTAGE_API_KEY or "
        "--api-key-file PATH to require one (on a cluster the operator mounts the pipeline's "
        "key Secret), or pass --no-auth (spec.orchestrator.auth.disabled) to serve without "
        "them")
    assert not (tmp_path / "logs").exists()  # no replica started
