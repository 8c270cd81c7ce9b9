"""The one Kubernetes client without a cluster: credentials loading, condition lookup, and the
HTTP behaviour (ignored statuses, write counting, watch streaming, the synchronous adapter)
against a loopback aiohttp server. tests/cluster/test_kubeapi.py runs it against kube-apiserver."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from omnistage import kubeapi
from omnistage.kube import condition, condition_status
from omnistage.kubeapi import (
    ApiError,
    ConfigError,
    KubeApi,
    KubeConfig,
    Listed,
    SyncKubeApi,
    WatchEvent,
    WatchExpired,
    path,
    resource_path,
)
from omnistage.kubeapi import auth as kubeauth
from tests.harness.execplugin import API_VERSION, ExecPluginScript

# ---- conditions ------------------------------------------------------------------------------


def test_condition_lookup() -> None:
    pod = {"status": {"conditions": [{"type": "PodScheduled", "status": "True"},
                                     {"type": "Ready", "status": "False", "reason": "Gate"}]}}
    assert condition(pod, "Ready") == {"type": "Ready", "status": "False", "reason": "Gate"}
    assert condition_status(pod, "Ready") == "False"
    assert condition_status(pod, "PodScheduled") == "True"
    for sparse in (None, {}, {"status": None}, {"status": {"conditions": None}}):
        assert condition(sparse, "Ready") is None
        assert condition_status(sparse, "Ready") is None


def test_paths() -> None:
    assert path("Pod", "ns", "p-0", "status") == "/api/v1/namespaces/ns/pods/p-0/status"
    assert path("StagePool", "ns") == "/apis/omnistage.io/v1alpha1/namespaces/ns/stagepools"
    assert path("Deployment") == "/apis/apps/v1/deployments"
    assert resource_path("v1", "nodes", name="n") == "/api/v1/nodes/n"


# ---- credentials -----------------------------------------------------------------------------


def _kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None,
                namespace: str | None = None, name: str = "kubeconfig") -> Path:
    ctx: dict[str, Any] = {"cluster": "c", "user": "u"}
    if namespace:
        ctx["namespace"] = namespace
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "main",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://127.0.0.1:6443/"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "other", "context": {"cluster": "missing"}},
                     {"name": "main", "context": ctx}],
    }
    out = tmp_path / name
    out.write_text(yaml.safe_dump(doc))
    return out


def test_kubeconfig_files_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    for name in ("ca.crt", "u.crt", "u.key"):
        (tmp_path / "pki" / name).write_text(name)
    path_ = _kubeconfig(
        tmp_path, {"client-certificate": "pki/u.crt", "client-key": "pki/u.key"},
        {"server": "https://127.0.0.1:6443/", "certificate-authority": "pki/ca.crt"},
        namespace="team")
    cfg = KubeConfig.from_kubeconfig(path_)
    assert cfg.server == "https://127.0.0.1:6443"
    assert cfg.ca_file == str(tmp_path / "pki" / "ca.crt")
    assert (cfg.cert_file, cfg.key_file) == (str(tmp_path / "pki/u.crt"),
                                             str(tmp_path / "pki/u.key"))
    assert cfg.namespace == "team" and cfg.bearer_token() is None and not cfg.insecure


def test_kubeconfig_embedded_data_and_token(tmp_path: Path) -> None:
    data = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(
        tmp_path, {"token": "abc"},
        {"server": "https://127.0.0.1:6443", "certificate-authority-data": data,
         "insecure-skip-tls-verify": True}))
    assert cfg.ca_file is not None
    assert Path(cfg.ca_file).read_bytes() == b"-----BEGIN CERTIFICATE-----\n"
    assert Path(cfg.ca_file).stat().st_mode & 0o077 == 0
    assert cfg.bearer_token() == "abc" and cfg.insecure


def test_token_file_is_reread_when_it_rotates(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"tokenFile": "token"}))
    assert cfg.bearer_token() == "first"
    assert not cfg.renew("first")  # a 401 with an unchanged file: no new credentials
    token.write_text("second\n")
    import os

    os.utime(token, (time.time() + 5, time.time() + 5))  # a new mtime even on coarse clocks
    assert cfg.bearer_token() == "second"


def test_kubeconfig_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no cluster named 'missing'"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"token": "t"}), context="other")
    with pytest.raises(ConfigError, match="no context named 'nope'"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"token": "t"}), context="nope")
    with pytest.raises(ConfigError, match="has no server"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"token": "t"}, {"server": ""}))
    with pytest.raises(ConfigError, match="sets 'proxy-url', which omnistage does not"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"token": "t"}, {
            "server": "https://127.0.0.1:6443", "proxy-url": "http://127.0.0.1:3128"}))
    with pytest.raises(ConfigError, match="'username'"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"username": "a", "password": "b"}))
    with pytest.raises(ConfigError, match=r"File does not exist: .*absent\.crt"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {}, {
            "server": "https://127.0.0.1:6443", "certificate-authority": "absent.crt"}))
    with pytest.raises(ConfigError, match=r"kubeconfig .*nowhere does not exist"):
        KubeConfig.from_kubeconfig(tmp_path / "nowhere")


def test_kubeconfig_needs_the_kubernetes_package(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes.config", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'omnistage\[operator\]'"):
        KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, {"token": "t"}))


def test_kubeconfig_list_is_merged_as_kubectl_does(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """$KUBECONFIG's files merge: the first to name an entry wins, current-context comes from
    the first file that sets one, and --context picks an entry of any file."""
    first = _kubeconfig(tmp_path, {"token": "first"}, name="first")
    (tmp_path / "second").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "prod",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.9:1"}},
                     {"name": "prod", "cluster": {"server": "https://127.0.0.2:6443"}}],
        "users": [{"name": "u", "user": {"token": "shadowed"}},
                  {"name": "ops", "user": {"token": "ops-token"}}],
        "contexts": [{"name": "prod", "context": {"cluster": "prod", "user": "ops",
                                                 "namespace": "live"}}],
    }))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join(
        [str(first), str(tmp_path / "absent"), str(tmp_path / "second")]))
    cfg = KubeConfig.load()
    assert (cfg.server, cfg.bearer_token()) == ("https://127.0.0.1:6443", "first")
    prod = KubeConfig.load(context="prod")
    assert (prod.server, prod.bearer_token(), prod.namespace) == (
        "https://127.0.0.2:6443", "ops-token", "live")
    both = os.pathsep.join([str(tmp_path / "second"), str(first)])
    assert KubeConfig.load(both).server == "https://127.0.0.2:6443"  # an explicit list too


@pytest.fixture
def plugin(tmp_path: Path) -> ExecPluginScript:
    return ExecPluginScript(tmp_path / "plugin", ["one", "two", "three"], ttl_s=3600)


def test_exec_plugin_token_is_cached_until_it_expires(tmp_path: Path,
                                                      plugin: ExecPluginScript) -> None:
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, plugin.user()))
    assert plugin.calls() == []  # loading runs nothing: the plugin runs when a token is needed
    assert cfg.bearer_token() == "one" and cfg.bearer_token() == "one"
    calls = plugin.calls()
    assert len(calls) == 1
    assert calls[0]["args"] == ["--cluster", "test"] and calls[0]["env"] == "from-kubeconfig"
    info = json.loads(calls[0]["info"])
    assert (info["apiVersion"], info["kind"]) == (API_VERSION, "ExecCredential")
    expiry = cfg.token_expiry()
    assert expiry is not None and cfg.exec_plugin is not None
    assert cfg.exec_plugin.expires_at is not None
    assert expiry.timestamp() == pytest.approx(cfg.exec_plugin.expires_at - 30)  # renewed early
    plugin.ttl_s = -1  # from now on each token handed out has expired already
    plugin.save()
    assert cfg.renew("one") and len(plugin.calls()) == 2  # a 401: the plugin runs again
    assert cfg.bearer_token() == "three"  # "two" had expired at once: again
    assert len(plugin.calls()) == 3
    assert cfg.renew("stale")  # a token that was renewed meanwhile: no extra run
    assert len(plugin.calls()) == 3


def test_exec_plugin_failure_names_the_plugin(tmp_path: Path, plugin: ExecPluginScript) -> None:
    plugin.fail = "token service unreachable"
    plugin.save()
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, plugin.user()))
    with pytest.raises(ConfigError) as failed:
        cfg.bearer_token()
    message = str(failed.value)
    assert f"exec credential plugin `{plugin.command} --cluster test` failed" in message
    assert "returned 1" in message and "token service unreachable" in message
    missing = {"exec": {"apiVersion": API_VERSION, "command": str(tmp_path / "no-such-plugin"),
                        "installHint": "install it with: pip install no-such-plugin"}}
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, missing))
    with pytest.raises(ConfigError, match=r"no-such-plugin` not found.*install it with"):
        cfg.bearer_token()


def test_connection_info_for_kopf_renews_a_refused_token(tmp_path: Path,
                                                         plugin: ExecPluginScript) -> None:
    """kopf logs in again on expiry or after a 401; a token it was given before means the
    latter, so the plugin runs again."""
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(tmp_path, plugin.user()))
    first = cfg.connection_info()
    assert (first.token, first.scheme) == ("one", "Bearer")
    assert first.expiration == cfg.token_expiry() and first.expiration is not None
    again = cfg.connection_info()
    assert again.token == "two" and len(plugin.calls()) == 2


def test_every_command_that_talks_to_a_cluster_takes_context_and_kubeconfig() -> None:
    """`omnistage operator|drain|status` and `kubectl omnistage drain|status`, flags placed
    after the arguments as kubectl passes them to a plugin."""
    import tomllib
    from importlib.metadata import EntryPoint

    from omni_operator import kubectl_plugin
    from omnistage.cli import COMMANDS_GROUP, build_parser

    table = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "project"]["entry-points"][COMMANDS_GROUP]
    omnistage = build_parser(plugins=[EntryPoint(n, v, COMMANDS_GROUP) for n, v in table.items()])
    flags = ["--context", "prod", "--kubeconfig", "/k"]
    for parser, argv in ((omnistage, ["operator"]), (omnistage, ["drain", "p-s-0"]),
                         (omnistage, ["status", "p"]),
                         (kubectl_plugin.build_parser(), ["drain", "p-s-0"]),
                         (kubectl_plugin.build_parser(), ["status", "p", "-n", "ns"])):
        args = parser.parse_args(argv + flags)
        assert (args.context, args.kubeconfig) == ("prod", "/k"), argv


@pytest.fixture
def service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("sa-token\n")
    (sa / "namespace").write_text("prod\n")
    (sa / "ca.crt").write_text("ca")
    monkeypatch.setattr(kubeauth, "SA_DIR", sa)  # read where it is used
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "8443")
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    return sa


def test_in_cluster_config(service_account: Path) -> None:
    cfg = KubeConfig.load()
    assert cfg.server == "https://[fd00::1]:8443"
    assert cfg.ca_file == str(service_account / "ca.crt")
    assert cfg.bearer_token() == "sa-token" and cfg.namespace == "prod"
    assert kubeapi.default_namespace() == "prod"


def test_load_precedence(service_account: Path, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = _kubeconfig(tmp_path, {"token": "explicit"})
    assert KubeConfig.load(explicit).bearer_token() == "explicit"  # an explicit file wins
    monkeypatch.setenv("KUBECONFIG", str(explicit))
    assert KubeConfig.load().bearer_token() == "sa-token"  # in a pod: the service account
    assert KubeConfig.load(context="main").bearer_token() == "explicit"  # unless a context
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert KubeConfig.load().bearer_token() == "explicit"  # else $KUBECONFIG
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no Kubernetes credentials"):
        KubeConfig.load()
    monkeypatch.setenv("POD_NAMESPACE", "mine")
    assert kubeapi.default_namespace() == "mine"


# ---- HTTP against a loopback server ----------------------------------------------------------


class Server:
    """Records requests; answers from `routes` (method, path) -> (status, body or lines)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], dict[str, str], Any]] = []
        self.routes: dict[tuple[str, str], tuple[int, Any]] = {}
        self.accept: set[str] | None = None  # bearer tokens let in; None: all
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.text()
        self.requests.append((request.method, request.path, dict(request.query),
                              dict(request.headers), json.loads(body) if body else None))
        status, answer = self.routes.get((request.method, request.path), (404, {
            "kind": "Status", "code": 404, "reason": "NotFound", "message": "not here"}))
        if self.accept is not None and request.headers.get("Authorization", "").removeprefix(
                "Bearer ") not in self.accept:
            status, answer = 401, {"kind": "Status", "code": 401, "reason": "Unauthorized"}
        if isinstance(answer, list):  # a watch stream: one JSON document per line
            resp = web.StreamResponse(status=status)
            await resp.prepare(request)
            for doc in answer:
                await resp.write((json.dumps(doc) + "\n").encode())
            await resp.write_eof()
            return resp
        if isinstance(answer, str):
            return web.Response(status=status, text=answer)
        return web.json_response(answer, status=status)


@pytest.fixture
async def server() -> Any:
    srv = Server()
    srv.url = await srv.start()  # type: ignore[attr-defined]
    yield srv
    await srv.stop()


async def test_requests_ignore_count_and_errors(server: Server) -> None:
    pods = path("Pod", "ns")
    server.routes[("POST", pods)] = (409, {"kind": "Status", "reason": "AlreadyExists",
                                          "message": "exists"})
    server.routes[("PATCH", pods + "/p")] = (200, {"metadata": {"name": "p"}})
    server.routes[("GET", "/readyz")] = (200, "ok")
    api = KubeApi(KubeConfig(server=server.url, token="t0k"))  # type: ignore[attr-defined]
    try:
        assert await api.create(pods, {"kind": "Pod"}, ignore=(409,)) is None
        with pytest.raises(ApiError) as exists:
            await api.create(pods, {"kind": "Pod"})
        assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
        assert "exists" in str(exists.value)
        assert await api.patch(pods + "/p", {"a": 1}, "strategic") == {"metadata": {"name": "p"}}
        assert await api.get(pods + "/q", ignore=(404,)) is None
        with pytest.raises(ApiError, match="HTTP 404 NotFound: not here"):
            await api.get(pods + "/q", labelSelector="a=b", limit=None, watch=False)
        assert await api.request("GET", "/readyz") == "ok"
        assert await api.delete(pods + "/q", {"gracePeriodSeconds": 0}, ignore=(404,)) is None
    finally:
        await api.close()
    assert api.writes == 4 and api.writes_by_verb == {"POST": 2, "PATCH": 1, "DELETE": 1}
    method, _, _, headers, body = server.requests[2]
    assert method == "PATCH" and body == {"a": 1}
    assert headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert headers["Authorization"] == "Bearer t0k"
    assert server.requests[4][2] == {"labelSelector": "a=b", "watch": "false"}


async def test_a_proxied_service_s_headers_go_along_but_never_replace_the_credentials(
        server: Server) -> None:
    """The autoscaler's read of an orchestrator's admin listener through the service proxy:
    its admin key header reaches the server beside the API server's own Authorization."""
    proxy = "/api/v1/namespaces/ns/services/p-orchestrator-admin:admin/proxy/v1/load"
    server.routes[("GET", proxy)] = (200, '{"stages": {}}')
    api = KubeApi(KubeConfig(server=server.url, token="t0k"))  # type: ignore[attr-defined]
    try:
        text = await api.request("GET", proxy, raw=True, headers={
            "X-Omnistage-Admin-Key": "k" * 64, "Authorization": "Bearer forged"})
    finally:
        await api.close()
    assert text == '{"stages": {}}' and api.writes == 0
    headers = server.requests[0][3]
    assert headers["X-Omnistage-Admin-Key"] == "k" * 64
    assert headers["Authorization"] == "Bearer t0k"


async def test_a_refused_token_is_renewed_once(server: Server, tmp_path: Path) -> None:
    """A 401 runs the exec plugin again and retries once (a write still counts once); a
    second 401 stands."""
    plugin = ExecPluginScript(tmp_path / "plugin", ["revoked", "good"], ttl_s=3600)
    cfg = KubeConfig.from_kubeconfig(_kubeconfig(
        tmp_path, plugin.user(), {"server": server.url}))  # type: ignore[attr-defined]
    pods = path("Pod", "ns")
    server.routes[("POST", pods)] = (201, {"kind": "Pod"})
    server.routes[("GET", pods)] = (200, [{"type": "ADDED", "object": {"metadata": {}}}])
    server.accept = {"good"}
    api = KubeApi(cfg)
    try:
        assert await api.create(pods, {"kind": "Pod"}) == {"kind": "Pod"}
        assert [r[3]["Authorization"] for r in server.requests] == ["Bearer revoked",
                                                                   "Bearer good"]
        assert api.writes == 1 and len(plugin.calls()) == 2
        assert [e.type async for e in api.watch(pods)] == ["ADDED"]  # the same for a watch
        server.accept = {"another"}
        with pytest.raises(ApiError) as refused:
            await api.create(pods, {"kind": "Pod"})
        assert refused.value.status == 401 and len(plugin.calls()) == 3
    finally:
        await api.close()


async def test_apply_is_a_counted_server_side_apply_patch(server: Server) -> None:
    """PATCH with the apply content type, the field manager and force in the query, the JSON
    body as is; 201 means the apply created the object, 200 that it updated it."""
    cm = path("ConfigMap", "ns", "c")
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    api = KubeApi(KubeConfig(server=server.url))  # type: ignore[attr-defined]
    try:
        server.routes[("PATCH", cm)] = (201, {**obj, "metadata": {"name": "c", "uid": "u"}})
        made = await api.apply(cm, obj, field_manager="omnistage-operator", force=True)
        server.routes[("PATCH", cm)] = (200, obj)
        again = await api.apply(cm, obj, field_manager="omnistage-operator")
        server.routes[("PATCH", cm)] = (404, {"kind": "Status", "code": 404})
        assert await api.apply(cm, obj, field_manager="m", ignore=(404,)) is None
    finally:
        await api.close()
    assert made is not None and made.created and made.object["metadata"]["uid"] == "u"
    assert again is not None and not again.created
    assert api.writes == 3 and api.writes_by_verb == {"PATCH": 3}
    (method, _, query, headers, body), (_, _, query2, _, _) = server.requests[:2]
    assert method == "PATCH" and body == obj
    assert headers["Content-Type"] == "application/apply-patch+yaml"
    assert query == {"fieldManager": "omnistage-operator", "force": "true"}
    assert query2 == {"fieldManager": "omnistage-operator"}  # no force unless asked


async def test_watch_streams_typed_events_and_raises_expired(server: Server) -> None:
    pods = path("Pod", "ns")
    big = {"metadata": {"name": "big", "resourceVersion": "5"}, "data": "x" * 300_000}
    server.routes[("GET", pods)] = (200, [
        {"type": "ADDED", "object": big},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}},
    ])
    api = KubeApi(KubeConfig(server=server.url))  # type: ignore[attr-defined]
    got: list[WatchEvent] = []
    try:
        with pytest.raises(WatchExpired):
            async for event in api.watch(pods, "3", timeout_seconds=5):
                got.append(event)
    finally:
        await api.close()
    assert [(e.type, e.resource_version) for e in got] == [("ADDED", "5"), ("BOOKMARK", "7")]
    assert got[0].object["data"] == big["data"]  # a line far longer than one read
    assert server.requests[0][2] == {"watch": "true", "allowWatchBookmarks": "true",
                                     "resourceVersion": "3", "timeoutSeconds": "5"}
    assert api.writes == 0


async def test_list_watch_backs_off_when_a_watch_ends_at_once(server: Server) -> None:
    pods = path("Pod", "ns")
    server.routes[("GET", pods)] = (200, [])  # every watch ends at once, without events
    api = KubeApi(KubeConfig(server=server.url))  # type: ignore[attr-defined]
    try:
        async def consume() -> None:
            async for _ in api.list_watch(pods, resource_version="1", backoff=(0.2, 0.2)):
                pass

        t0 = time.monotonic()
        task = asyncio.create_task(consume())
        while len(server.requests) < 4:  # observable progress, however slow the machine
            if task.done():
                raise AssertionError(f"the watch loop ended: {task}")
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - t0
        task.cancel()
    finally:
        await api.close()
    # Three waits of at least the 0.2 s backoff lie between four watches: a loaded machine
    # only makes this longer. A watch loop without backoff would take milliseconds.
    assert elapsed >= 3 * 0.2, f"a watch that ends at once must not spin ({elapsed:.3f}s)"


@pytest.fixture
def threaded_server() -> Any:
    """The same server on its own loop thread, for synchronous tests."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    srv = Server()
    srv.url = asyncio.run_coroutine_threadsafe(srv.start(), loop).result(10)  # type: ignore[attr-defined]
    yield srv
    asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_sync_adapter_from_threads_and_watch_stop(threaded_server: Server) -> None:
    server = threaded_server
    pods = path("Pod", "ns")
    server.routes[("POST", pods)] = (201, {"kind": "Pod"})
    server.routes[("GET", pods)] = (200, {"metadata": {"resourceVersion": "1"}, "items": []})
    kube = SyncKubeApi(KubeConfig(server=server.url))  # type: ignore[attr-defined]
    try:
        threads = [threading.Thread(target=kube.create, args=(pods, {"n": i})) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert kube.writes == 16
        stop = threading.Event()
        stream = kube.list_watch(pods, stop, backoff=(0.05, 0.05))
        first = next(stream)
        assert first == Listed([], "1")
        stop.set()
        assert list(stream) == []  # ends once stop is set
    finally:
        kube.close()
        kube.close()  # idempotent
