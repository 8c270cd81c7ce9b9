"""The validating admission webhook: `kubectl apply` runs the validator `omnistage serve` runs.

kopf serves it (`settings.admission.server`) and keeps the ValidatingWebhookConfiguration
`validation.omnistage.io` up to date (`settings.admission.managed`): one webhook per kind, on
CREATE and UPDATE, each calling omnistage.spec.validate_manifest with the old object on updates,
so immutable fields are refused there too. The denial lists every error as `path: message`, the
lines `omnistage validate` prints.

- An update that leaves spec unchanged (finalizers, labels, annotations) is not re-validated,
  so objects stored before a rule was tightened can still be finalized and deleted.
- failurePolicy defaults to Ignore: the webhook lives in the operator, and while the operator is
  down the CRD's CEL rules still refuse the simple mistakes; what gets past them is reported by
  the operator as InvalidSpec once it is back. Fail is a flag away for clusters that prefer
  refusing every write while the operator is down.
- TLS: a self-signed CA and serving certificate generated at every start (the CA goes into the
  configuration's caBundle), or the files of a cert-manager Certificate (tls.crt, tls.key,
  ca.crt), which kopf re-reads when they are renewed.
- With leader election only the leader runs kopf, hence the webhook server. Behind a Service,
  the leader labels its own pod (SERVING_LABEL) and the chart's Service selects that label, so
  the API server never reaches a standby (which has no server, and whose self-signed CA the
  caBundle would not trust anyway).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import kopf
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_operator.models import GROUP, VERSION
from omnistage.kubeapi import ApiError, KubeApi, path
from omnistage.params import describe
from omnistage.spec import SpecError, validate_manifest

log = logging.getLogger("omnistage.operator")
CONFIGURATION = "validation.omnistage.io"  # the managed ValidatingWebhookConfiguration
KINDS = ("omnipipelines", "stagepools")
#: on the leader's own pod while it serves the webhook; the chart's webhook Service selects it
SERVING_LABEL = "omnistage.io/webhook"
FailurePolicy = Literal["Ignore", "Fail"]


@dataclass(frozen=True)
class WebhookSettings:
    """Where the webhook listens and how the API server reaches it."""

    enabled: bool = True
    addr: str = "127.0.0.1"
    port: int = 9443
    #: host of a `url` clientConfig (the local control plane reaches the webhook on loopback)
    host: str | None = None
    #: "namespace/name[:port]" of the Service in front of the operator: a `service` clientConfig
    service: str | None = None
    #: a directory with tls.crt, tls.key and ca.crt (a cert-manager Secret); else self-signed
    cert_dir: str | None = None
    failure_policy: FailurePolicy = "Ignore"


def review(body: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Admit or refuse one object: kopf.AdmissionError with every `path: message` line."""
    if old is not None and old.get("spec") == body.get("spec"):
        return  # metadata-only update (finalizers, labels): nothing the validator checks changed
    try:
        validate_manifest(body, old=old)
    except SpecError as exc:
        meta = body.get("metadata") or {}
        log.info("refused %s %s/%s: %s", body.get("kind"), meta.get("namespace"),
                 meta.get("name"), str(exc).replace("\n", "; "))
        raise kopf.AdmissionError(str(exc), code=422) from None


class _QuietDenials(logging.Filter):
    """kopf logs every refused object as an ERROR of a failed handler; a refusal is the
    webhook doing its job, logged at INFO by review() instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Webhook ") and "failed permanently" in text)


def register(registry: kopf.OperatorRegistry, settings: WebhookSettings) -> None:
    """One validating webhook per kind. Called before kopf.operator() spawns its tasks (the
    startup handler, where configure() runs, is too late for validating_only())."""
    validating_only()

    def check(body: Any, old: Any, operation: str, **_: Any) -> None:
        review(_plain(body), _plain(old) if operation == "UPDATE" and old else None)

    for plural in KINDS:
        kopf.on.validate(
            GROUP, VERSION, plural, id=plural, operations=["CREATE", "UPDATE"],
            ignore_failures=settings.failure_policy == "Ignore", registry=registry,
        )(check)


def _plain(body: Any) -> dict[str, Any]:
    """kopf's Body as the plain dict the validator expects."""
    return {key: body[key] for key in body}


def configure(settings: kopf.OperatorSettings, webhook: WebhookSettings) -> None:
    """Point kopf's admission machinery at our server and configuration name."""
    settings.admission.server = server(webhook)
    settings.admission.managed = CONFIGURATION
    logging.getLogger("kopf.objects").addFilter(_QuietDenials())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def validating_only() -> None:
    """Keep kopf from managing a MutatingWebhookConfiguration.

    With ``settings.admission.managed`` set, kopf runs two configuration managers, validating
    and mutating, and the mutating one creates a MutatingWebhookConfiguration of the same name
    even when no mutating handler exists. That needs `create` on mutatingwebhookconfigurations,
    which RBAC cannot limit by name: the power to intercept every write in the cluster. We
    register no mutating webhook, so its manager is replaced by one that idles (kopf's runner
    looks the function up on its admission module when it spawns the task, before the startup
    handlers run). A kopf release that renames it fails tests/unit/test_validate.py.
    """
    from kopf._core.engines import admission

    if getattr(admission.mutating_configuration_manager, "omnistage_idle", False):
        return

    async def idle(**_: Any) -> None:
        await asyncio.Event().wait()

    idle.omnistage_idle = True  # type: ignore[attr-defined]
    # Private kopf API (kopf has no switch for it), kept while test_validate.py guards it.
    admission.mutating_configuration_manager = idle  # type: ignore[assignment]


class _Loose(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Group(_Loose):
    group: Literal[GROUP]  # type: ignore[valid-type]
    version: Literal[VERSION]  # type: ignore[valid-type]


class _Kind(_Group):
    kind: str


class _Resource(_Group):
    resource: Literal[KINDS]  # type: ignore[valid-type]


class AdmissionRequest(_Loose):
    """The part of admission.k8s.io/v1's request kopf and this webhook read."""

    uid: str = Field(min_length=1)
    kind: _Kind
    resource: _Resource
    operation: Literal["CREATE", "UPDATE"]
    userInfo: dict[str, Any]
    object: dict[str, Any]
    oldObject: dict[str, Any] | None = None
    dryRun: bool | None = None


class AdmissionReview(_Loose):
    """What the API server posts. kopf reads it without checking its shape (a body that is not
    one was a 500), so the webhook server checks it first: anything else is a 400."""

    apiVersion: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


def review_problem(raw: bytes) -> str | None:
    """Why a webhook request body is not an AdmissionReview, or None when it is one."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"invalid JSON: {exc}"
    try:
        AdmissionReview.model_validate(data)
    except ValidationError as exc:
        return describe(exc.errors()[0]).message
    return None


def webhook_document() -> dict[str, Any]:
    """OpenAPI 3.1 document of the webhook's routes (one POST per kind), generated from
    AdmissionReview, the model the server checks requests with."""
    schema = AdmissionReview.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.pop("$defs", {})
    components["AdmissionReview"] = schema
    text = {"text/plain": {"schema": {"type": "string"}}}
    reply = {"type": "object", "required": ["apiVersion", "kind", "response"], "properties": {
        "response": {"type": "object", "required": ["uid", "allowed"], "properties": {
            "uid": {"type": "string"}, "allowed": {"type": "boolean"}}}}}
    paths = {f"/{plural}": {"post": {
        "operationId": f"validate_{plural}",
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/AdmissionReview"}}}},
        "responses": {
            "200": {"description": "The review: allowed, or denied with every `path: message` "
                    "line", "content": {"application/json": {"schema": reply}}},
            "400": {"description": "Not an AdmissionReview: what is wrong", "content": text},
            "404": {"description": "No handler for the review's resource", "content": text},
        }}} for plural in KINDS}
    return {"openapi": "3.1.0", "info": {"title": "Omnistage admission webhook",
                                         "version": "0.1.0"},
            "paths": paths, "components": {"schemas": components}}


class CheckedWebhookServer(kopf.WebhookServer):
    """kopf's server, refusing with 400 a body that is not an AdmissionReview."""

    @staticmethod
    async def _serve(fn: Any, request: web.Request) -> web.Response:
        problem = review_problem(await request.read())
        if problem is not None:
            raise web.HTTPBadRequest(text=problem)
        return await kopf.WebhookServer._serve(fn, request)


class _ServiceWebhookServer(CheckedWebhookServer):
    """kopf's server, announced to the API server as a Service rather than a URL."""

    def __init__(self, *, namespace: str, name: str, service_port: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = {"namespace": namespace, "name": name, "port": service_port}

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        async for config in super().__call__(fn):
            out: dict[str, Any] = {"service": dict(self.service)}
            if "caBundle" in config:
                out["caBundle"] = config["caBundle"]
            yield out


async def mark_serving(api: KubeApi, pod: tuple[str, str] | None, serving: bool) -> None:
    """Set or clear SERVING_LABEL on this operator's pod (namespace, name). Cleared at start
    too: a container restarted after losing the lease must not keep the label it had."""
    if pod is None:
        return
    namespace, name = pod
    label = {SERVING_LABEL: "true" if serving else None}
    try:
        await api.patch(path("Pod", namespace, name), {"metadata": {"labels": label}})
    except (TimeoutError, ApiError, OSError) as e:
        log.warning("pod %s/%s: %s the label %s: %s", namespace, name,
                    "setting" if serving else "clearing", SERVING_LABEL, e)


def parse_service(text: str) -> tuple[str, str, int]:
    """"namespace/name[:port]" -> (namespace, name, port); the port defaults to 443."""
    ref, _, port = text.partition(":")
    namespace, _, name = ref.partition("/")
    if not namespace or not name:
        raise ValueError(f"expected NAMESPACE/NAME[:PORT], got {text!r}")
    return namespace, name, int(port or 443)


def server(webhook: WebhookSettings) -> kopf.WebhookServer:
    """The HTTPS server kopf runs, with its certificate (cert-manager's or self-signed)."""
    service = parse_service(webhook.service) if webhook.service else None
    if service:
        namespace, name, _ = service
        names = [f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]
    else:
        names = [webhook.host or _reachable(webhook.addr)]
    if webhook.cert_dir:
        folder = Path(webhook.cert_dir)
        tls: dict[str, Any] = {
            "certfile": str(folder / "tls.crt"),
            "pkeyfile": str(folder / "tls.key"),
            "cafile": str(folder / "ca.crt"),
        }
    else:
        folder = Path(tempfile.mkdtemp(prefix="omnistage-webhook-"))
        cert, key, ca = self_signed(names)
        (folder / "tls.crt").write_bytes(cert)
        (folder / "tls.key").write_bytes(key)
        (folder / "tls.key").chmod(0o600)
        tls = {"certfile": str(folder / "tls.crt"), "pkeyfile": str(folder / "tls.key"),
               "cadata": ca}
    if service:
        namespace, name, port = service
        return _ServiceWebhookServer(namespace=namespace, name=name, service_port=port,
                                     addr=webhook.addr, port=webhook.port, **tls)
    return CheckedWebhookServer(addr=webhook.addr, port=webhook.port, host=names[0], **tls)


def _reachable(addr: str) -> str:
    return "127.0.0.1" if addr in ("0.0.0.0", "", "::") else addr


def self_signed(names: list[str], days: int = 3650) -> tuple[bytes, bytes, bytes]:
    """(serving certificate, its key, CA certificate), PEM. A fresh CA at every start: only
    the webhook configuration's caBundle trusts it, and the operator rewrites that too."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "omnistage-webhook-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return (
        cert.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ca.public_bytes(pem),
    )
