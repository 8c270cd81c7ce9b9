"""The one Kubernetes client: async REST on plain dicts, list+watch, every write counted.

Why one client: the operator's writes and lists, the orchestrator's Pod watch, the test harness
and the benches all talk to the API server. They share this module, so credentials, errors,
retries and watch semantics are the same everywhere. kopf still runs the operator's own watches;
`KubeConfig.connection_info()` feeds it the same credentials. Objects stay JSON dicts exactly as
the API server sends them: no generated model classes. Counting writes (every non-GET) is how the
operator's idle-resync goal, zero writes, is measured.

Credentials: in a pod, the service account; elsewhere kubeconfig as kubectl reads it (merged
$KUBECONFIG list, contexts, certificates, token files, exec plugins), through the `kubernetes`
package's loader, imported only then. The loader supplies server, CA, client certificate and a
token; an exec plugin's token is renewed on expiry or a 401, and this client sends every request.

Synchronous code (tests, benches) uses `SyncKubeApi`: this same client on a private event loop in
a daemon thread, not a second HTTP implementation.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import queue
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import aiohttp
import yaml

from omnistage import kube
from omnistage.backoff import Backoff

log = logging.getLogger("omnistage.kubeapi")
write_log = logging.getLogger("omnistage.kubeapi.writes")

Obj = dict[str, Any]
T = TypeVar("T")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}
#: Server-side apply: the body is YAML to the API server, and JSON is YAML.
APPLY_PATCH = "application/apply-patch+yaml"


class ConfigError(RuntimeError):
    """No usable credentials, or a kubeconfig this client cannot use (says which field)."""


class ApiError(RuntimeError):
    """A non-2xx answer from the API server; the Status body is kept for callers and tests."""

    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        self.status = status
        self.body = body
        self.method, self.path = method, path
        self.reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
        self.message = (
            str(body.get("message", body)) if isinstance(body, dict) else str(body)[:500]
        )
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.message}")


async def gather_all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await independent calls together; once all have ended, raise the first failure (so
    none is left running unobserved), else return their results in order."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def namespace_terminating(exc: BaseException) -> bool:
    """The API server refused a write because the namespace is being deleted: told by the
    Status's cause (NamespaceLifecycle admission; a StatusCause's type travels as `reason`),
    not by the message's English."""
    if not isinstance(exc, ApiError) or exc.status != 403 or not isinstance(exc.body, dict):
        return False
    details = exc.body.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    return any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating"
               for c in causes or [])


class WatchExpired(ApiError):
    """410 Gone: the watch's resourceVersion is older than the server keeps; list again."""


# ---- REST paths ------------------------------------------------------------------------------


def resource_path(
    api_version: str,
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """REST path: ``("apps/v1", "deployments", "ns", "x")`` -> /apis/apps/v1/namespaces/ns/..."""
    parts = [f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(resource)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the REST API."""

    kind: str
    group: str
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None,
             sub: str | None = None) -> str:
        return resource_path(self.api_version, self.plural, namespace, name, sub)


RESOURCES: dict[str, Resource] = {r.kind: r for r in (
    Resource("Pod", "", "v1", "pods"),
    Resource("Service", "", "v1", "services"),
    Resource("ConfigMap", "", "v1", "configmaps"),
    Resource("ServiceAccount", "", "v1", "serviceaccounts"),
    Resource("Event", "", "v1", "events"),
    Resource("Namespace", "", "v1", "namespaces"),
    Resource("Node", "", "v1", "nodes"),
    Resource("Deployment", "apps", "v1", "deployments"),
    Resource("PodDisruptionBudget", "policy", "v1", "poddisruptionbudgets"),
    Resource("Role", "rbac.authorization.k8s.io", "v1", "roles"),
    Resource("RoleBinding", "rbac.authorization.k8s.io", "v1", "rolebindings"),
    Resource("OmniPipeline", kube.GROUP, kube.VERSION, "omnipipelines"),
    Resource("StagePool", kube.GROUP, kube.VERSION, "stagepools"),
)}


def path(kind: str, namespace: str | None = None, name: str | None = None,
         sub: str | None = None) -> str:
    """REST path of a kind this project uses: ``path("Pod", "ns", "p-0", "status")``."""
    return RESOURCES[kind].path(namespace, name, sub)


# ---- credentials -----------------------------------------------------------------------------


def in_cluster() -> bool:
    """Running in a pod with a mounted service account."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (SA_DIR / "token").exists()


def default_namespace() -> str:
    """$POD_NAMESPACE, else the service account's namespace, else "default"."""
    ns = os.environ.get("POD_NAMESPACE")
    if ns:
        return ns
    try:
        return (SA_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def _kube_config_module() -> Any:
    """The `kubernetes` package's kubeconfig loader, imported only when a kubeconfig is read:
    in a pod the service account needs nothing beyond this module."""
    try:
        from kubernetes.config import kube_config
    except ImportError as exc:
        raise ConfigError(
            "reading a kubeconfig needs the `kubernetes` package: pip install "
            f"'omnistage[operator]' ({exc})") from exc
    return kube_config


def kubeconfig_paths(spec: str | os.PathLike[str] | None = None) -> list[str]:
    """The kubeconfig files kubectl would read: ``spec`` (one file, or a list joined by the
    path separator), else $KUBECONFIG's list, else ~/.kube/config."""
    text = os.fspath(spec) if spec else os.environ.get("KUBECONFIG", "")
    paths = [os.path.expanduser(p) for p in text.split(os.pathsep) if p]
    return paths or [str(Path.home() / ".kube" / "config")]


#: A plugin's token is renewed this long before its expirationTimestamp (at most a quarter
#: of its lifetime, so a short-lived token is not renewed on every call).
EXEC_RENEW_EARLY_S = 30.0


class ExecPlugin:
    """A kubeconfig user's ``exec`` credential plugin (``aws eks get-token``,
    ``gke-gcloud-auth-plugin``, ``kubelogin``), run through the `kubernetes` package's
    ExecProvider exactly as kubectl runs it (ExecCredential in $KUBERNETES_EXEC_INFO, the
    kubeconfig's args and env). Its token is cached until its expirationTimestamp and renewed
    then, or when the API server refuses it (401). Thread-safe: one run serves all callers."""

    def __init__(self, user: str, exec_node: Any, cwd: str | None, cluster_node: Any) -> None:
        self.user = user
        self._exec, self._cwd, self._cluster = exec_node, cwd, cluster_node
        exec_cfg = exec_node.value
        self.command = " ".join(str(a) for a in [exec_cfg.get("command", ""),
                                                  *(exec_cfg.get("args") or [])])
        self.install_hint = str(exec_cfg.get("installHint") or "").strip()
        self.runs = 0
        self.expires_at: float | None = None  # epoch seconds; None: no expiry given
        self._renew_at: float | None = None
        self._token: str | None = None
        self._lock = threading.Lock()

    def token(self) -> str:
        """The cached token, or a new one when there is none yet or it is about to expire."""
        with self._lock:
            if self._token is None or (self._renew_at is not None
                                       and time.time() >= self._renew_at):
                self._run()
            assert self._token is not None
            return self._token

    def renew(self, rejected: str | None) -> bool:
        """The API server refused ``rejected``: run the plugin again (once for all callers
        that saw the same token refused). True when there is a token to try."""
        with self._lock:
            if self._token is None or self._token == rejected:
                self._run()
            return True

    @property
    def renew_at(self) -> float | None:
        """When the current token will be replaced (epoch seconds), if it expires."""
        return self._renew_at

    def _run(self) -> None:
        from kubernetes.config.config_exception import ConfigException
        from kubernetes.config.exec_provider import ExecProvider

        what = f"kubeconfig user {self.user!r}: exec credential plugin `{self.command}`"
        self.runs += 1
        try:
            status = ExecProvider(self._exec, self._cwd, self._cluster).run()
        except FileNotFoundError as exc:
            hint = f"; {self.install_hint}" if self.install_hint else ""
            raise ConfigError(f"{what} not found: {exc}{hint}") from exc
        except (ConfigException, OSError) as exc:
            raise ConfigError(f"{what} failed: {exc}") from exc
        token = status.get("token") if isinstance(status, dict) else None
        if not token:
            got = "a client certificate" if isinstance(status, dict) and status.get(
                "clientCertificateData") else "no token"
            raise ConfigError(f"{what} returned {got}; omnistage needs a plugin that returns "
                              "status.token")
        expiry = status.get("expirationTimestamp")
        now = time.time()
        if expiry:
            try:
                stamp = datetime.fromisoformat(str(expiry).replace("Z", "+00:00"))
            except ValueError as exc:
                raise ConfigError(f"{what} returned expirationTimestamp {expiry!r}, not an "
                                  "RFC 3339 time") from exc
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=UTC)
            self.expires_at = stamp.timestamp()
            early = min(EXEC_RENEW_EARLY_S, max(self.expires_at - now, 0.0) / 4)
            self._renew_at = self.expires_at - early
        else:
            self.expires_at = self._renew_at = None
        self._token = str(token)
        log.debug("%s: new token%s", what, f", expires {expiry}" if expiry else "")


@dataclass
class KubeConfig:
    """Where the API server is and how to authenticate: what a REST client and kopf need."""

    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    token_file: str | None = None  # re-read when it changes (in-cluster tokens rotate)
    insecure: bool = False
    namespace: str | None = None  # the context's namespace, when it names one
    exec_plugin: ExecPlugin | None = field(default=None, repr=False, compare=False)
    _token_cache: tuple[float, str] | None = field(default=None, repr=False, compare=False)
    _kopf_token: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, kubeconfig: str | os.PathLike[str] | None = None,
             context: str | None = None) -> KubeConfig:
        """An explicit kubeconfig wins; else in-cluster credentials when running in a pod (and
        no context is asked for); else the kubeconfig files kubectl reads ($KUBECONFIG's list,
        merged, else ~/.kube/config)."""
        if kubeconfig:
            return cls.from_kubeconfig(kubeconfig, context)
        if in_cluster() and not context:
            return cls.in_cluster()
        candidates = kubeconfig_paths()
        if not any(Path(p).is_file() for p in candidates):
            raise ConfigError(
                "no Kubernetes credentials: not in a pod (KUBERNETES_SERVICE_HOST and a "
                f"service account token at {SA_DIR}), and no kubeconfig at "
                f"{', '.join(candidates)}")
        return cls.from_kubeconfig(os.pathsep.join(candidates), context)

    @classmethod
    def in_cluster(cls) -> KubeConfig:
        """The pod's service account: its token (re-read as it rotates), CA and namespace."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError("in-cluster config: KUBERNETES_SERVICE_HOST is not set")
        if not (SA_DIR / "token").exists():
            raise ConfigError(f"in-cluster config: no service account token at {SA_DIR}/token")
        ca = SA_DIR / "ca.crt"
        try:
            namespace = (SA_DIR / "namespace").read_text().strip() or None
        except OSError:
            namespace = None
        return cls(
            server=f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}",
            ca_file=str(ca) if ca.exists() else None,
            token_file=str(SA_DIR / "token"),
            namespace=namespace,
        )

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str],
                        context: str | None = None) -> KubeConfig:
        """One context of a kubeconfig, read by the `kubernetes` package's loader as kubectl
        reads it: ``path`` is one file or a list joined by the path separator (merged, the
        first file to name a context, cluster or user wins), with client certificates, tokens
        (inline or tokenFile), embedded *-data fields and exec credential plugins."""
        kc = _kube_config_module()
        from kubernetes.client import Configuration
        from kubernetes.config.config_exception import ConfigException

        files = kubeconfig_paths(path)
        source = os.pathsep.join(files)
        if len(files) == 1 and not Path(files[0]).is_file():
            raise ConfigError(f"kubeconfig {files[0]} does not exist")
        try:
            merged = kc.KubeConfigMerger(source).config
            if merged is None:
                raise ConfigError(f"no kubeconfig file found at {source}")
            ctx_name = context or _current_context(files)
            if not ctx_name:
                raise ConfigError(f"{source}: no current-context; name one with --context")
            ctx = _named_node(merged, "contexts", ctx_name, "context", source)["context"]
            cluster = _named_node(merged, "clusters", ctx.safe_get("cluster"), "cluster",
                                  source)
            cluster_spec: Obj = cluster.safe_get("cluster") or {}
            if not cluster_spec.get("server"):
                raise ConfigError(f"{source}: cluster {ctx.safe_get('cluster')!r} has no server")
            for unsupported in ("proxy-url", "tls-server-name"):
                if cluster_spec.get(unsupported):
                    raise ConfigError(f"{source}: cluster {ctx.safe_get('cluster')!r} sets "
                                      f"{unsupported!r}, which omnistage does not support")
            user_name = ctx.safe_get("user")
            user = (_named_node(merged, "users", user_name, "user", source)
                    if user_name else None)
            spec: Obj = dict(user.safe_get("user") or {}) if user is not None else {}
            if spec.get("username") or spec.get("password"):
                raise ConfigError(f"{source}: user {user_name!r} authenticates with 'username' "
                                  "(basic auth, which Kubernetes removed); use a token, a "
                                  "client certificate or an exec plugin")
            base = str(Path(user.path).resolve().parent) if user is not None and user.path \
                else None
            plugin = None
            if spec.get("exec") and not (spec.get("token") or spec.get("tokenFile")
                                         or spec.get("auth-provider")):
                # The loader would run the plugin once and log its failure; we run it
                # ourselves, when a token is first needed, and renew it.
                plugin = ExecPlugin(str(user_name), user["user"]["exec"], base,
                                    cluster["cluster"])
                del spec["exec"]
                merged = _with_user(merged, user, {**user.value, "user": spec})
            loaded = Configuration()
            kc.KubeConfigLoader(config_dict=merged, active_context=ctx_name,
                                config_base_path=None).load_and_set(loaded)
        except ConfigException as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read kubeconfig {source}: {exc}") from exc
        token = next((str(v) for v in (loaded.api_key or {}).values() if v), None)
        if token and token.startswith("Bearer "):
            token = token[len("Bearer "):]
        token_file = None
        if spec.get("tokenFile") and not spec.get("token") and base is not None:
            token_file, token = str(Path(base) / spec["tokenFile"]), None  # re-read on change
        return cls(
            server=str(loaded.host).rstrip("/"),
            ca_file=loaded.ssl_ca_cert or None,
            cert_file=loaded.cert_file or None,
            key_file=loaded.key_file or None,
            token=token or None,
            token_file=token_file,
            insecure=not loaded.verify_ssl,
            namespace=ctx.safe_get("namespace"),
            exec_plugin=plugin,
        )

    def bearer_token(self) -> str | None:
        """The token to send now: the exec plugin's (run when none is cached or it is about
        to expire), inline, or the token file's current content. Blocks while a plugin runs."""
        if self.exec_plugin is not None:
            return self.exec_plugin.token()
        if self.token or not self.token_file:
            return self.token
        try:
            mtime = os.stat(self.token_file).st_mtime
            if self._token_cache is None or self._token_cache[0] != mtime:
                self._token_cache = (mtime, Path(self.token_file).read_text().strip())
        except OSError as exc:
            if self._token_cache is None:
                raise ConfigError(f"cannot read token file {self.token_file}: {exc}") from exc
        return self._token_cache[1]

    def renew(self, rejected: str | None) -> bool:
        """The API server answered 401 to ``rejected``: get new credentials if there is a way
        (the exec plugin runs again; a token file is read again). True: worth one more try."""
        if self.exec_plugin is not None:
            return self.exec_plugin.renew(rejected)
        if self.token_file and not self.token:
            self._token_cache = None
            return self.bearer_token() != rejected
        return False

    def token_expiry(self) -> datetime | None:
        """When the current token will be replaced (UTC), for kopf to log in again then."""
        at = self.exec_plugin.renew_at if self.exec_plugin is not None else None
        return None if at is None else datetime.fromtimestamp(at, UTC)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=None if self.insecure else self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def connection_info(self) -> Any:
        """The same credentials for kopf's watches, so both halves talk to one server. kopf
        calls its login handler (this) again when the expiration passes or after the server
        refused the token; in the latter case the token is still the one handed out before,
        so an exec plugin runs again."""
        import kopf

        token = self.bearer_token()
        if token is not None and token == self._kopf_token and self.renew(token):
            token = self.bearer_token()
        self._kopf_token = token
        return kopf.ConnectionInfo(
            server=self.server, ca_path=self.ca_file, insecure=self.insecure,
            certificate_path=self.cert_file, private_key_path=self.key_file,
            token=token, scheme="Bearer" if token else None, default_namespace=self.namespace,
            expiration=self.token_expiry(),
        )


def _current_context(files: list[str]) -> str | None:
    """The first current-context set in ``files``, as kubectl merges them (the `kubernetes`
    package's merger lets the last file win)."""
    for name in files:
        if Path(name).is_file():
            doc = yaml.safe_load(Path(name).read_text()) or {}
            if isinstance(doc, dict) and doc.get("current-context"):
                return str(doc["current-context"])
    return None


def _named_node(merged: Any, section: str, name: Any, what: str, source: str) -> Any:
    """The entry ``name`` of a merged kubeconfig's ``section`` (a ConfigNode), or a
    ConfigError naming what is missing."""
    node = merged.safe_get(section) and merged[section].get_with_name(name, safe=True)
    if not name or not node:
        raise ConfigError(f"{source}: no {what} named {name!r}")
    return node


def _with_user(merged: Any, user: Any, value: Obj) -> Any:
    """A merged kubeconfig whose entry ``user`` reads ``value`` (the others untouched)."""
    node_type = type(merged)
    users = [node_type(user.name, value, user.path) if item is user.value
             or getattr(item, "value", None) is user.value else item
             for item in merged.value["users"]]
    return node_type(merged.name, {**merged.value, "users": users}, merged.path)


# ---- views: the part of an object a cache keeps ----------------------------------------------

#: What a view keeps of an object: each field name maps to True (its whole value) or to the
#: fields to keep of it, applied to every item when the value is a list.
Fields = dict[str, "Fields | bool"]


def project(obj: Any, fields: Fields) -> Any:
    """A copy of `obj` with only `fields` (nested), for caches of thousands of objects: a view
    costs the memory of what its reader uses, not of what the API server sends (a Pod's spec
    and managedFields are most of it). Absent fields stay absent; the input is not changed."""
    if isinstance(obj, list):
        return [project(item, fields) for item in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, keep in fields.items():
        if key in obj:
            out[key] = obj[key] if keep is True else project(obj[key], keep)  # type: ignore[arg-type]
    return out


# ---- the client ------------------------------------------------------------------------------


class WatchEvent(NamedTuple):
    """One watch event: ADDED, MODIFIED, DELETED or BOOKMARK, and the object."""

    type: str
    object: Obj

    @property
    def resource_version(self) -> str:
        return str((self.object.get("metadata") or {}).get("resourceVersion") or "")


class Listed(NamedTuple):
    """A full list: the state to diff against (after a start, a 410 or a forced relist)."""

    items: list[Obj]
    resource_version: str


class Applied(NamedTuple):
    """A server-side apply's answer: the object, and whether this apply created it (HTTP 201)."""

    object: Obj
    created: bool


class WriteLimit:
    """A token bucket over API writes: at most ``burst`` at once, then ``qps`` per second.

    Why: a big fleet's ramp (thousands of pods, ~4 writes each) must not flood the API server
    that every other controller shares. Reservations: a write takes a token at once and waits
    until the bucket would have refilled to it, so concurrent writers queue in call order and
    none is starved. ``clock`` and ``sleep`` are injectable so the maths is testable without time.
    """

    def __init__(self, qps: float, burst: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        if not qps > 0:
            raise ValueError(f"write qps must be > 0, got {qps}")
        if burst < 1:
            raise ValueError(f"write burst must be >= 1, got {burst}")
        self.qps, self.burst = float(qps), int(burst)
        self.clock, self._sleep = clock, sleep
        self._tokens = float(burst)  # may go negative: writes already promised a later slot
        self._at = clock()
        self.waited = 0.0  # seconds writes spent waiting for a token, summed (for /metrics)

    def reserve(self) -> float:
        """Take one token; return how long the caller must wait before it is due."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            self.waited += delay
            await self._sleep(delay)


class KubeApi:
    """Async JSON client. Calls return the decoded object or raise ApiError; a status listed in
    ``ignore`` returns None instead (e.g. create with ignore=(409,): names are deterministic,
    so "already exists" is success)."""

    def __init__(self, config: KubeConfig, *, pool_size: int = 64,
                 user_agent: str = "omnistage", write_limit: WriteLimit | None = None) -> None:
        self.config = config
        self.write_limit = write_limit  # None: writes are not rate limited
        self.writes = 0
        self.writes_by_verb: dict[str, int] = {}
        self.pool_size = pool_size
        self.user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_ctx: ssl.SSLContext | bool = (
                self.config.ssl_context() if self.config.server.startswith("https") else False
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_ctx, limit=self.pool_size),
                headers={"Accept": "application/json", "User-Agent": self.user_agent},
            )
        return self._session

    async def _token(self) -> str | None:
        if self.config.exec_plugin is not None:  # it may run the plugin: not on the loop
            return await asyncio.to_thread(self.config.bearer_token)
        return self.config.bearer_token()

    @contextlib.asynccontextmanager
    async def _response(self, method: str, url_path: str, content_type: str | None = None,
                        **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """One HTTP exchange with the current credentials. A 401 gets new ones where there
        is a way (an exec plugin runs again) and one more try; then the 401 stands."""
        for attempt in (1, 2):
            token = await self._token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if content_type:
                headers["Content-Type"] = content_type
            async with self._http().request(method, self.config.server + url_path,
                                            headers=headers, **kwargs) as resp:
                if resp.status == 401 and attempt == 1 and await asyncio.to_thread(
                        self.config.renew, token):
                    log.info("%s %s: HTTP 401; trying again with new credentials",
                             method, url_path)
                    continue
                yield resp
                return

    @staticmethod
    def _query(params: dict[str, Any] | None) -> dict[str, str]:
        out = {}
        for k, v in (params or {}).items():
            if v is None:
                continue
            out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
        return out

    async def request(
        self, method: str, url_path: str, body: Any = None, *,
        params: dict[str, Any] | None = None, content_type: str = "application/json",
        timeout: float = 60.0, raw: bool = False, ignore: tuple[int, ...] = (),
    ) -> Any:
        """One REST call. ``params`` become the query string (None values dropped); ``raw``
        returns a 2xx body as text (proxy, log and metrics endpoints)."""
        return (await self._exchange(method, url_path, body, params=params,
                                     content_type=content_type, timeout=timeout, raw=raw,
                                     ignore=ignore))[1]

    async def _exchange(
        self, method: str, url_path: str, body: Any, *, params: dict[str, Any] | None,
        content_type: str, timeout: float, raw: bool, ignore: tuple[int, ...],
    ) -> tuple[int, Any]:
        """`request`, with the HTTP status (an ignored status answers None as its body)."""
        if method != "GET":
            if self.write_limit is not None:
                await self.write_limit.acquire()
            self.writes += 1
            self.writes_by_verb[method] = self.writes_by_verb.get(method, 0) + 1
            write_log.info("%s %s", method, url_path)
        data = None if body is None else json.dumps(body)
        async with self._response(
            method, url_path, content_type if body is not None else None, data=data,
            params=self._query(params), timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text(errors="replace")
            if resp.status < 300 and raw:
                return resp.status, text
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = text
            if resp.status >= 300:
                if resp.status in ignore:
                    log.debug("%s %s: HTTP %d, ignored", method, url_path, resp.status)
                    return resp.status, None
                raise ApiError(resp.status, payload, method, url_path)
            return resp.status, payload

    async def get(self, url_path: str, *, ignore: tuple[int, ...] = (), **params: Any) -> Any:
        return await self.request("GET", url_path, params=params, ignore=ignore)

    async def list(self, url_path: str, **params: Any) -> list[Obj]:
        """The items of a collection (``labelSelector=...``, ``fieldSelector=...``)."""
        return list((await self.get(url_path, **params))["items"])

    async def create(self, url_path: str, obj: Obj, *, ignore: tuple[int, ...] = (),
                     **params: Any) -> Any:
        return await self.request("POST", url_path, obj, params=params, ignore=ignore)

    async def replace(self, url_path: str, obj: Obj, *, ignore: tuple[int, ...] = ()) -> Any:
        return await self.request("PUT", url_path, obj, ignore=ignore)

    async def patch(self, url_path: str, patch: Any, kind: str = "merge", *,
                    ignore: tuple[int, ...] = (), **params: Any) -> Any:
        """Patch with ``kind`` in merge|strategic|json."""
        return await self.request("PATCH", url_path, patch, params=params,
                                  content_type=PATCH_TYPES[kind], ignore=ignore)

    async def delete(self, url_path: str, body: Obj | None = None, *,
                     ignore: tuple[int, ...] = (), **params: Any) -> Any:
        return await self.request("DELETE", url_path, body, params=params, ignore=ignore)

    async def apply(self, url_path: str, obj: Obj, *, field_manager: str, force: bool = False,
                    ignore: tuple[int, ...] = ()) -> Applied | None:
        """Server-side apply of ``obj``, the whole intent of ``field_manager``, at the object's
        path: it creates the object or updates it, and fields this manager applied before but
        ``obj`` leaves out are removed (unless another manager owns them too). ``force`` takes
        over fields another manager set (a 409 Conflict without it). A write, counted."""
        status, answer = await self._exchange(
            "PATCH", url_path, obj, params={"fieldManager": field_manager, "force": force or None},
            content_type=APPLY_PATCH, timeout=60.0, raw=False, ignore=ignore)
        return None if answer is None else Applied(answer, status == 201)

    async def watch(self, url_path: str, resource_version: str | None = None, *,
                    timeout_seconds: int = 300, **params: Any) -> AsyncIterator[WatchEvent]:
        """Stream watch events (bookmarks included) from ``resource_version`` until the server
        ends the watch. 410 Gone, as a status or an ERROR event, raises WatchExpired; any other
        ERROR event raises ApiError. Cancel the consuming task to stop at once."""
        query = self._query({
            **params, "watch": True, "allowWatchBookmarks": True,
            "resourceVersion": resource_version or None, "timeoutSeconds": timeout_seconds,
        })
        timeout = aiohttp.ClientTimeout(total=None, connect=15, sock_read=timeout_seconds + 30)
        async with self._response("GET", url_path, params=query, timeout=timeout) as resp:
            if resp.status >= 300:
                text = await resp.text(errors="replace")
                try:
                    body: Any = json.loads(text)
                except ValueError:
                    body = text
                cls = WatchExpired if resp.status == 410 else ApiError
                raise cls(resp.status, body, "WATCH", url_path)
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf.extend(chunk)
                while (nl := buf.find(b"\n")) != -1:
                    line, buf = bytes(buf[:nl]), buf[nl + 1:]
                    if line.strip():
                        yield _event(json.loads(line), url_path)
            if buf.strip():
                yield _event(json.loads(bytes(buf)), url_path)

    async def list_watch(
        self, url_path: str, *, resource_version: str | None = None,
        timeout_seconds: int = 300, backoff: tuple[float, float] = (0.5, 15.0), **params: Any,
    ) -> AsyncIterator[Listed | WatchEvent]:
        """An informer's loop: a Listed, then ADDED/MODIFIED/DELETED events, forever.

        Given ``resource_version`` (the caller has listed already), it watches from there first.
        The watch resumes from the last resourceVersion seen (bookmarks included), so a dropped
        connection or a restarted API server loses no update; 410 Gone relists at once (the
        consumer diffs the Listed against what it knew); other errors retry with exponential
        backoff. Bookmarks only move the resourceVersion and are not yielded.
        """
        rv = resource_version or ""
        retries = Backoff(*backoff)
        while True:
            try:
                if not rv:
                    listing = await self.get(url_path, **params)
                    rv = str((listing.get("metadata") or {}).get("resourceVersion") or "")
                    yield Listed(list(listing.get("items") or []), rv)
                started, events = time.monotonic(), 0
                async for event in self.watch(url_path, rv, timeout_seconds=timeout_seconds,
                                              **params):
                    rv = event.resource_version or rv
                    events += 1
                    if event.type != "BOOKMARK":
                        yield event
                if events or time.monotonic() - started >= 1.0:
                    retries.reset()
                    continue  # the server ended the watch (timeoutSeconds): resume from rv
                raise ConnectionError("watch ended at once without events")
            except WatchExpired:
                log.info("watch of %s expired (410 Gone); listing again", url_path)
                rv = ""
            except (ApiError, ConfigError, aiohttp.ClientError, OSError,  # OSError: timeouts
                    ValueError) as exc:  # ConfigError: an exec plugin failed for now
                delay = retries.failed()
                log.warning("list/watch of %s failed (%s: %s); retrying in %.1fs",
                            url_path, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _event(doc: Obj, url_path: str) -> WatchEvent:
    etype, obj = str(doc.get("type")), doc.get("object") or {}
    if etype == "ERROR":
        code = int(obj.get("code") or 500)
        raise (WatchExpired if code == 410 else ApiError)(code, obj, "WATCH", url_path)
    return WatchEvent(etype, obj)


# ---- the same client for synchronous code ----------------------------------------------------


class SyncKubeApi:
    """`KubeApi` for threads and scripts: each call runs on a private event loop in a daemon
    thread and blocks for its answer. Safe to call from many threads at once."""

    def __init__(self, config: KubeConfig, **kwargs: Any) -> None:
        self.config = config
        self.api = KubeApi(config, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubeapi",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def load(cls, kubeconfig: str | os.PathLike[str] | None = None,
             context: str | None = None, **kwargs: Any) -> SyncKubeApi:
        return cls(KubeConfig.load(kubeconfig, context), **kwargs)

    @property
    def writes(self) -> int:
        return self.api.writes

    def call(self, coro: Awaitable[T]) -> T:
        """Run one coroutine of the async client on its loop and wait for the result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def request(self, method: str, url_path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.call(self.api.request(method, url_path, body, **kwargs))

    def get(self, url_path: str, **params: Any) -> Any:
        return self.call(self.api.get(url_path, **params))

    def list(self, url_path: str, **params: Any) -> list[Obj]:
        return self.call(self.api.list(url_path, **params))

    def create(self, url_path: str, obj: Obj, **params: Any) -> Any:
        return self.call(self.api.create(url_path, obj, **params))

    def replace(self, url_path: str, obj: Obj, **kwargs: Any) -> Any:
        return self.call(self.api.replace(url_path, obj, **kwargs))

    def patch(self, url_path: str, patch: Any, kind: str = "merge", **params: Any) -> Any:
        return self.call(self.api.patch(url_path, patch, kind, **params))

    def delete(self, url_path: str, body: Obj | None = None, **params: Any) -> Any:
        return self.call(self.api.delete(url_path, body, **params))

    def apply(self, url_path: str, obj: Obj, **kwargs: Any) -> Applied | None:
        return self.call(self.api.apply(url_path, obj, **kwargs))

    def watch(self, url_path: str, stop: threading.Event, resource_version: str | None = None,
              **kwargs: Any) -> Iterator[WatchEvent]:
        """`KubeApi.watch` as a blocking iterator; it ends when the server ends the watch or
        ``stop`` is set."""
        return self._iterate(lambda: self.api.watch(url_path, resource_version, **kwargs), stop)

    def list_watch(self, url_path: str, stop: threading.Event,
                   **kwargs: Any) -> Iterator[Listed | WatchEvent]:
        """`KubeApi.list_watch` as a blocking iterator, until ``stop`` is set."""
        return self._iterate(lambda: self.api.list_watch(url_path, **kwargs), stop)

    def _iterate(self, make: Callable[[], AsyncIterator[T]], stop: threading.Event) -> Iterator[T]:
        items: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def pump() -> None:
            try:
                async with contextlib.aclosing(make()) as stream:  # type: ignore[type-var]
                    async for item in stream:
                        items.put(("item", item))
            except Exception as exc:
                items.put(("error", exc))
            finally:
                items.put(("end", None))

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while not stop.is_set():
                try:
                    what, value = items.get(timeout=0.1)
                except queue.Empty:
                    continue
                if what == "end":
                    return
                if what == "error":
                    raise value
                yield value
        finally:
            future.cancel()

    def close(self) -> None:
        """Close the HTTP session and stop the loop thread (idempotent)."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.api.close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        with contextlib.suppress(RuntimeError):
            self._loop.close()
        atexit.unregister(self.close)
