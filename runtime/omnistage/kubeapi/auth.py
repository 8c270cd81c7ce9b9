"""Credentials: where the API server is and how to authenticate to it.

In a pod, the service account; elsewhere kubeconfig as kubectl reads it (merged $KUBECONFIG
list, contexts, certificates, token files, exec plugins), through the `kubernetes` package's
loader, imported only then. The loader supplies server, CA, client certificate and a token; an
exec plugin's token is renewed on expiry or a 401; a plugin that fails is one ConfigError
whose message names the plugin and carries its stderr, logged as one line wherever it surfaces
(at start-up, in a reconcile, in kopf's login). Why apart from the client: kopf's own watches
take the same credentials (`KubeConfig.connection_info()`) without any of the REST code.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from omnistage.kubeapi.errors import ConfigError
from omnistage.kubeapi.resources import Obj

log = logging.getLogger("omnistage.kubeapi")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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
#: kopf's next login after the credentials could not be had (an exec plugin failed).
LOGIN_RETRY_S = 5.0


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
        # `from None`: the message says all (the plugin, its exit and its stderr); the
        # ExecProvider's own traceback would only lengthen every log line that reports it.
        except FileNotFoundError as exc:
            hint = f"; {self.install_hint}" if self.install_hint else ""
            raise ConfigError(f"{what} not found: {exc}{hint}") from None
        except (ConfigException, OSError) as exc:
            raise ConfigError(f"{what} failed: {exc}") from None
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

        try:
            token = self.bearer_token()
            if token is not None and token == self._kopf_token and self.renew(token):
                token = self.bearer_token()
        except ConfigError as exc:
            # kopf logs a TemporaryError as one line and tries again; any other exception
            # with its traceback.
            raise kopf.TemporaryError(str(exc), delay=LOGIN_RETRY_S) from None
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

