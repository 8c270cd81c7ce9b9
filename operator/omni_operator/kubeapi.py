"""A small async Kubernetes REST client: explicit patch types, and every write counted.

kopf watches; this writes. Counting writes is how the idle-resync goal (zero writes) is measured.
"""

from __future__ import annotations

import json
import logging
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger("omnistage.operator.writes")

Obj = dict[str, Any]

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}

_PATHS = {
    "Pod": ("api/v1", "pods"),
    "Service": ("api/v1", "services"),
    "ConfigMap": ("api/v1", "configmaps"),
    "ServiceAccount": ("api/v1", "serviceaccounts"),
    "Event": ("api/v1", "events"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
    "Role": ("apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "OmniPipeline": ("apis/omnistage.io/v1alpha1", "omnipipelines"),
    "StagePool": ("apis/omnistage.io/v1alpha1", "stagepools"),
}


class ApiError(RuntimeError):
    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        msg = body.get("message") if isinstance(body, dict) else str(body)[:300]
        super().__init__(f"{method} {path}: HTTP {status}: {msg}")
        self.status = status
        self.body = body


def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = _PATHS[kind]
    out = f"/{prefix}/namespaces/{namespace}/{plural}"
    if name:
        out += f"/{name}"
    if sub:
        out += f"/{sub}"
    return out


@dataclass
class Config:
    host: str
    ssl: ssl.SSLContext | bool
    headers: dict[str, str]
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    token: str | None = None
    insecure: bool = False

    def connection_info(self) -> Any:
        """The same credentials for kopf's watches, so both halves talk to one server."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.host, ca_path=self.ca_path, insecure=self.insecure,
            certificate_path=self.cert_path, private_key_path=self.key_path,
            token=self.token, scheme="Bearer" if self.token else None,
        )

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> Config:
        """In-cluster config when running in a pod, else the kubeconfig."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        ctx: ssl.SSLContext | bool = False
        if cfg.verify_ssl:
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        else:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file and isinstance(ctx, ssl.SSLContext):
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        headers = {}
        token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        if token:
            token = token.removeprefix("Bearer ").strip()
            headers["Authorization"] = f"Bearer {token}"
        return cls(cfg.host.rstrip("/"), ctx, headers, cfg.ssl_ca_cert, cfg.cert_file,
                   cfg.key_file, token or None, not cfg.verify_ssl)


class KubeApi:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.writes = 0
        self.writes_by_verb: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None

    async def _request(
        self, method: str, url_path: str, *, body: Any = None, content_type: str | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.config.ssl, limit=32),
                headers=self.config.headers,
            )
        if method != "GET":
            self.writes += 1
            self.writes_by_verb[method] = self.writes_by_verb.get(method, 0) + 1
            log.info("%s %s", method, url_path)
        headers = {"Content-Type": content_type or "application/json"}
        data = None if body is None else json.dumps(body)
        async with self._session.request(
            method, self.config.host + url_path, data=data, headers=headers, params=params
        ) as resp:
            text = await resp.text()
            payload = json.loads(text) if text else None
            if resp.status >= 400:
                raise ApiError(resp.status, payload, method, url_path)
            return payload

    async def get(self, url_path: str) -> Obj | None:
        try:
            return await self._request("GET", url_path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, url_path: str, selector: str | None = None) -> list[Obj]:
        params = {"labelSelector": selector} if selector else None
        return list((await self._request("GET", url_path, params=params))["items"])

    async def create(self, obj: Obj) -> Obj | None:
        """Create; None when it already exists (names are deterministic, so that is success)."""
        ns = obj["metadata"]["namespace"]
        try:
            return await self._request("POST", path(obj["kind"], ns), body=obj)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    async def patch(self, url_path: str, body: Any, kind: str = "merge") -> Obj | None:
        try:
            return await self._request("PATCH", url_path, body=body,
                                       content_type=PATCH_TYPES[kind])
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, url_path: str, body: Obj | None = None) -> bool:
        try:
            await self._request("DELETE", url_path, body=body)
            return True
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
