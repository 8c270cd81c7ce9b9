"""orchestrator/auth.py: API keys from a file, a Secret-shaped directory or the environment;
the check of a request's Authorization header; rotation and a rotation caught half-way; which
commands may serve without keys. The HTTP side with a fake orchestrator and the openai client
are at the end; tests/integration/test_api_keys.py runs `omnistage serve` with keys."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from omnistage.orchestrator import auth
from omnistage.orchestrator import http_api as h
from omnistage.orchestrator.auth import (
    ApiKeyError,
    ApiKeys,
    key_digest_hex,
    parse_keys,
    resolve,
    resolve_admin,
)
from tests.unit.test_http_api import FakeOrchestrator, assert_error

K1, K2, K3 = "sk-first-key-0123456789", "sk-second-key-0123456789", "sk-third-key-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_keys_parse_one_a_line_or_comma_separated_with_comments() -> None:
    assert parse_keys(f"# ours\n{K1}\n\n  {K2} , {K3}\n", "f") == [K1, K2, K3]
    with pytest.raises(ApiKeyError, match=r"f, line 2: a key of 5 characters is too short"):
        parse_keys(f"{K1}\nshort\n", "f")
    with pytest.raises(ApiKeyError, match="line 1: a key is visible ASCII without spaces"):
        parse_keys("sk-key-with-é-0123456789", "f")


def test_only_a_bearer_key_in_force_is_allowed() -> None:
    keys = ApiKeys([K1, K2], "test")
    assert keys.allows(f"Bearer {K1}") and keys.allows(f"bearer {K2}")
    for header in (None, "", K1, f"Basic {K1}", f"Bearer {K3}", "Bearer ", f"Bearer {K1}x"):
        assert not keys.allows(header), header


def test_a_file_is_read_again_when_it_changes_and_not_before_reload_s(tmp_path: Path) -> None:
    path, clock = tmp_path / "keys", Clock()
    path.write_text(K1)
    keys = ApiKeys.from_file(path, clock=clock)
    assert keys.source == f"file {path}" and keys.count == 1
    path.write_text(f"{K2}\n")
    os.utime(path, ns=(1, 1))  # a new mtime whatever the clock's resolution
    assert keys.allows(f"Bearer {K1}")  # within RELOAD_S: not looked at yet
    clock.now += auth.RELOAD_S
    assert not keys.allows(f"Bearer {K1}") and keys.allows(f"Bearer {K2}")


def test_a_secret_volume_rotates_by_its_data_link(tmp_path: Path) -> None:
    """The kubelet's layout: visible names link through `..data` to a timestamped folder,
    swapped atomically on an update; hidden entries hold no keys."""
    def publish(name: str, files: dict[str, str]) -> None:
        folder = tmp_path / name
        folder.mkdir()
        for f, text in files.items():
            (folder / f).write_text(text)
        (tmp_path / "..data_tmp").symlink_to(name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

    publish("..2026_12_07_a", {"primary": K1, "secondary": K2})
    for f in ("primary", "secondary"):
        (tmp_path / f).symlink_to(f"..data/{f}")
    clock = Clock()
    keys = ApiKeys.from_file(tmp_path, clock=clock)
    assert keys.count == 2 and keys.allows(f"Bearer {K2}")
    publish("..2026_12_07_b", {"primary": K3, "secondary": K2})  # K1 rotated out
    clock.now += auth.RELOAD_S
    assert not keys.allows(f"Bearer {K1}")
    assert keys.allows(f"Bearer {K3}") and keys.allows(f"Bearer {K2}")


def test_a_rotation_caught_half_way_keeps_the_keys_in_force_and_says_so_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "keys", Clock()
    path.write_text(K1)
    keys = ApiKeys.from_file(path, clock=clock)
    path.write_text("")  # emptied (or removed) mid-rotation: never open, never locked out
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        for _ in range(3):
            clock.now += auth.RELOAD_S
            assert keys.allows(f"Bearer {K1}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"API keys not reloaded (the 1 in force stay): {path}: no API key in it"]
    path.write_text(K2)
    clock.now += auth.RELOAD_S
    assert keys.allows(f"Bearer {K2}") and not keys.allows(f"Bearer {K1}")


def test_a_source_without_a_usable_key_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match=r"API key file .*nowhere: No such file"):
        ApiKeys.from_file(tmp_path / "nowhere")
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(ApiKeyError, match=r"empty: no API key in it"):
        ApiKeys.from_file(tmp_path / "empty")
    with pytest.raises(ApiKeyError, match=r"\$OMNISTAGE_API_KEY: no API key in it"):
        ApiKeys.from_env({auth.ENV_KEYS: "# ,"})
    assert ApiKeys.from_env({auth.ENV_KEYS: "  "}) is None


def test_who_may_serve_without_keys(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(K1)
    env = {auth.ENV_KEYS: f"{K2},{K3}"}
    keys, line = resolve(None, no_auth=False, host="0.0.0.0", environ=env)
    assert keys is not None and keys.count == 2
    assert line == ("API keys: on (2 keys from $OMNISTAGE_API_KEY; send Authorization: "
                    "Bearer KEY)")
    keys, line = resolve(str(tmp_path / "keys"), no_auth=False, host="0.0.0.0",
                         environ={})
    assert keys is not None and line.startswith(f"API keys: on (1 key from file {tmp_path}")
    with pytest.raises(ApiKeyError, match=r"--api-key-file \(or \$OMNISTAGE_API_KEY_FILE\) "
                                          r"and \$OMNISTAGE_API_KEY both give API keys"):
        resolve(str(tmp_path / "keys"), no_auth=False, host="127.0.0.1",
                environ=env)
    # The orchestrator pod: the operator hands the mounted Secret's path in the environment.
    keys, line = resolve(None, no_auth=False, host="0.0.0.0",
                         secret="api-keys", environ={"OMNISTAGE_API_KEY_FILE": str(tmp_path)})
    assert keys is not None and keys.allows(f"Bearer {K1}") and f"from file {tmp_path}" in line
    # A pipeline whose spec asks for keys never serves without them, even on loopback.
    with pytest.raises(ApiKeyError, match=r"spec.orchestrator.auth.apiKeySecret \('api-keys'\) "
                                          r"asks for API keys and none were given"):
        resolve(None, no_auth=False, host="127.0.0.1", secret="api-keys",
                environ={})
    with pytest.raises(ApiKeyError, match="--no-auth with API keys"):
        resolve(None, no_auth=True, host="127.0.0.1", environ=env)
    for host in ("127.0.0.1", "127.3.4.5", "::1", "localhost"):
        keys, line = resolve(None, no_auth=False, host=host, environ={})
        assert keys is None and line.startswith(f"API keys: off (the API listens on loopback "
                                                f"{host} only;"), line
    with pytest.raises(ApiKeyError, match=r"would listen on 0.0.0.0 without API keys: set "
                                          r"\$OMNISTAGE_API_KEY or --api-key-file PATH"):
        resolve(None, no_auth=False, host="0.0.0.0", environ={})
    keys, line = resolve(None, no_auth=True, host="0.0.0.0", environ={})
    assert keys is None and line.startswith("API keys: off (--no-auth)")
    # Keys on by default everywhere beyond loopback: the orchestrator pod too, unless the
    # pipeline itself says off (spec.orchestrator.auth.disabled).
    with pytest.raises(ApiKeyError, match=r"would listen on pod\.example without API keys"):
        resolve(None, no_auth=False, host="pod.example", environ={})
    keys, line = resolve(None, no_auth=False, host="pod.example", disabled=True, environ={})
    assert keys is None and line.startswith("API keys: off (spec.orchestrator.auth.disabled)")


# ---- the HTTP side ------------------------------------------------------------------------


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[tuple[TestClient, FakeOrchestrator]]:
    orch = FakeOrchestrator()
    app = h.build_app(orch, disconnect_poll_s=0.02, api_keys=ApiKeys([K1], "test"))
    async with TestClient(TestServer(app)) as client:
        yield client, orch


@pytest.fixture
async def admin(keyed: tuple[TestClient, FakeOrchestrator]
                ) -> AsyncIterator[tuple[TestClient, FakeOrchestrator]]:
    """The admin listener of the same orchestrator, with admin key K2 given as its digest."""
    _, orch = keyed
    keys = ApiKeys.from_digests(key_digest_hex(K2), "test")
    app = h.build_app(orch, disconnect_poll_s=0.02, api_keys=keys, listener="admin")
    async with TestClient(TestServer(app)) as client:
        yield client, orch


async def test_a_keyed_route_answers_401_in_openai_shape_and_reaches_nothing(
        keyed: tuple[TestClient, FakeOrchestrator]) -> None:
    client, orch = keyed
    body = {"prompt": "a cat"}
    for headers, message in (({}, "no key: this route needs an API key; send it as the header "
                                   "Authorization: Bearer KEY"),
                             ({"Authorization": f"Bearer {K2}"},
                              "invalid key: this route needs an API key")):
        resp = await client.post("/v1/pipelines/text-to-image/requests", json=body,
                                 headers=headers)
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        err = assert_error(await resp.json(), param=None, code="invalid_api_key")
        assert err["message"] == message and err["type"] == "invalid_request_error"
        assert (await client.get("/v1/models", headers=headers)).status == 401
    assert orch.handles == []
    resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {K1}"})
    assert resp.status == 200


async def test_the_public_listener_serves_no_admin_route_even_with_a_key(
        keyed: tuple[TestClient, FakeOrchestrator]) -> None:
    client, orch = keyed
    for headers in ({}, {"Authorization": f"Bearer {K1}"}):
        resp = await client.post("/v1/pipelines/text-to-image/control", json={"op": "pause"},
                                 headers=headers)
        assert resp.status in (401, 404), headers  # refused before or at routing
        for path in ("/v1/load", "/metrics"):
            assert (await client.get(path, headers=headers)).status in (401, 404), path
    resp = await client.post("/v1/pipelines/text-to-image/control", json={"op": "pause"},
                             headers={"Authorization": f"Bearer {K1}"})
    assert_error(await resp.json(), param=None, code="not_found")
    assert orch.control_calls == []


async def test_the_admin_listener_needs_its_own_key_in_either_header(
        admin: tuple[TestClient, FakeOrchestrator]) -> None:
    client, orch = admin
    for headers in ({}, {"Authorization": f"Bearer {K1}"},  # an API key is no admin key
                    {"X-Omnistage-Admin-Key": K1}):
        resp = await client.post("/v1/pipelines/text-to-image/control", json={"op": "pause"},
                                 headers=headers)
        assert resp.status == 401, headers
        err = assert_error(await resp.json(), param=None, code="invalid_api_key")
        assert "admin key" in err["message"]
        assert (await client.get("/v1/load", headers=headers)).status == 401
    assert orch.control_calls == []
    for headers in ({"Authorization": f"Bearer {K2}"}, {"X-Omnistage-Admin-Key": K2}):
        resp = await client.post("/v1/pipelines/text-to-image/control", json={"op": "pause"},
                                 headers=headers)
        assert resp.status == 200, headers
    assert orch.control_calls == [("pause", None), ("pause", None)]
    # The public routes are not on the admin listener.
    resp = await client.post("/v1/pipelines/text-to-image/requests", json={"prompt": "x"},
                             headers={"X-Omnistage-Admin-Key": K2})
    assert resp.status == 404 and orch.handles == []


async def test_ops_routes_and_the_documents_stay_open_and_say_their_scheme(
        keyed: tuple[TestClient, FakeOrchestrator],
        admin: tuple[TestClient, FakeOrchestrator]) -> None:
    client, _ = keyed
    for path in ("/livez", "/readyz", "/openapi.json"):
        assert (await client.get(path)).status == 200, path
    assert (await client.get("/v1/nothing")).status == 404  # no route: as before
    doc = await (await client.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"] == {"apiKey": {"type": "http",
                                                               "scheme": "bearer"}}
    generic = doc["paths"]["/v1/pipelines/{name}/requests"]["post"]
    assert generic["security"] == [{"apiKey": []}] and "401" in generic["responses"]
    assert "/v1/pipelines/{name}/control" not in doc["paths"] and "/v1/load" not in doc["paths"]
    assert "security" not in doc["paths"]["/openapi.json"]["get"]
    admin_client, _ = admin
    for path in ("/livez", "/readyz", "/metrics", "/openapi.json"):
        assert (await admin_client.get(path)).status == 200, path
    doc = await (await admin_client.get("/openapi.json")).json()
    assert set(doc["paths"]) == {"/v1/pipelines/{name}/control", "/v1/load", "/livez",
                                 "/readyz", "/metrics", "/openapi.json"}
    assert doc["components"]["securitySchemes"]["adminKey"] == {
        "type": "apiKey", "in": "header", "name": "X-Omnistage-Admin-Key"}
    control = doc["paths"]["/v1/pipelines/{name}/control"]["post"]
    assert control["security"] == [{"adminKey": []}, {"bearer": []}]
    assert "security" not in doc["paths"]["/metrics"]["get"]


def test_admin_keys_beyond_loopback_are_required_and_come_from_one_source(
        tmp_path: Path) -> None:
    keys, line = resolve_admin(None, no_auth=False, host="127.0.0.1", environ={})
    assert keys is None and "off (the admin listener is on loopback" in line
    with pytest.raises(ApiKeyError, match=r"admin listener would be on 0\.0\.0\.0 without admin"):
        resolve_admin(None, no_auth=False, host="0.0.0.0", environ={})
    keys, line = resolve_admin(None, no_auth=True, host="0.0.0.0", environ={})
    assert keys is None and "--no-auth" in line
    env = {"OMNISTAGE_ADMIN_KEY_DIGESTS": f"{key_digest_hex(K1)}, {key_digest_hex(K2)}"}
    keys, line = resolve_admin(None, no_auth=False, host="0.0.0.0", environ=env)
    assert keys is not None and keys.count == 2 and "2 keys from $OMNISTAGE_ADMIN_KEY_DIGESTS" \
        in line and K1 not in line
    assert keys.allows(f"Bearer {K1}") and keys.allows(f"Bearer {K2}")
    assert not keys.allows(f"Bearer {key_digest_hex(K1)}")  # the digest is no key
    with pytest.raises(ApiKeyError, match=r"admin keys from .* and .*: give one source"):
        resolve_admin(None, no_auth=False, host="0.0.0.0",
                      environ={**env, "OMNISTAGE_ADMIN_KEY": K1})
    with pytest.raises(ApiKeyError, match="--no-auth with admin keys"):
        resolve_admin(None, no_auth=True, host="0.0.0.0", environ=env)
    for bad in ("abc", "zz" * 32, ","):
        with pytest.raises(ApiKeyError, match=r"\$OMNISTAGE_ADMIN_KEY_DIGESTS: "):
            resolve_admin(None, no_auth=False, host="0.0.0.0",
                          environ={"OMNISTAGE_ADMIN_KEY_DIGESTS": bad})
    f = tmp_path / "admin"
    f.write_text(K2 + "\n")
    keys, _ = resolve_admin(str(f), no_auth=False, host="0.0.0.0", environ={})
    assert keys is not None and keys.allows(f"Bearer {K2}") and not keys.allows(f"Bearer {K1}")


async def test_the_openai_client_raises_authentication_error_on_a_wrong_key() -> None:
    orch = FakeOrchestrator()
    runner, url = await h.serve_http(orch, "127.0.0.1", 0, ApiKeys([K1], "test"))
    try:
        for key in (K2, "x"):
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key,
                                          max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError) as caught:
                    await bad.models.list()
                assert caught.value.code == "invalid_api_key"
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=K1, max_retries=0) as good:
            assert [m.id for m in (await good.models.list()).data] == [orch.pipeline
                                                                       .served_model_name()]
    finally:
        await runner.cleanup()
