"""API keys: who may call the orchestrator's OpenAI and pipeline routes (issue 43).

Keys come from a file, a directory (a mounted Secret: every file in it holds keys), or the
OMNISTAGE_API_KEY environment variable; never from a command-line value, which any local user
could read in `ps`. A file or directory that changes is read again within RELOAD_S, so a rotated
Secret takes effect without a restart; a read that fails or finds no key keeps the keys in force
(a rotation caught half-way never opens the door, nor locks everyone out) and is logged once.

A request presents its key as OpenAI clients send it, `Authorization: Bearer KEY`. Only
SHA-256 digests of the keys are kept, and every presented key is compared with every digest by
hmac.compare_digest, so neither a key's content nor its length shows in the time a refusal
takes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from omnistage.filewatch import Signature, Throttle, signature, visible_files
from omnistage.kube import ADMIN_KEY_DIGESTS_ENV, ADMIN_KEY_HEADER, API_KEY_FILE_ENV

log = logging.getLogger(__name__)

ENV_KEYS = "OMNISTAGE_API_KEY"  # one key, or several separated by newlines or commas
ENV_ADMIN_KEYS = "OMNISTAGE_ADMIN_KEY"  # the admin listener's, the same way
RELOAD_S = 1.0  # how often a key file or directory is looked at again (at most)
MIN_KEY_CHARS = 16


class ApiKeyError(ValueError):
    """A key source that gives no usable key: the message names the source."""


def parse_keys(text: str, where: str) -> list[str]:
    """Keys from text: one per line or comma-separated; blank lines and `#` comments skipped.
    A key is at least MIN_KEY_CHARS visible ASCII characters."""
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for key in (k.strip() for k in line.split(",")):
            if not key:
                continue
            if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
                raise ApiKeyError(f"{where}, line {n}: a key is visible ASCII without spaces")
            if len(key) < MIN_KEY_CHARS:
                raise ApiKeyError(f"{where}, line {n}: a key of {len(key)} characters is too "
                                  f"short (at least {MIN_KEY_CHARS})")
            keys.append(key)
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("ascii", "replace")).digest()


def key_digest_hex(key: str) -> str:
    """The SHA-256 digest of a key in hex: what the operator hands an orchestrator pod in
    $OMNISTAGE_ADMIN_KEY_DIGESTS for the admin key it presents, so the pod never holds it."""
    return _digest(key).hex()


def _read(path: Path) -> tuple[Signature, list[str]]:
    files = visible_files(path)
    found = signature(files)
    keys = []
    for f in files:
        keys += parse_keys(f.read_text(encoding="utf-8", errors="replace"), str(f))
    if not keys:
        raise ApiKeyError(f"{path}: no API key in it")
    return found, keys


class ApiKeys:
    """The keys in force and the check of a request's Authorization header."""

    def __init__(self, keys: list[str], source: str, *, path: Path | None = None,
                 signature: Signature = (), clock: Callable[[], float] = time.monotonic,
                 digests: list[bytes] | None = None) -> None:
        self.source = source  # for the start line and logs: never a key
        self._digests = [_digest(k) for k in keys] + list(digests or [])
        self._path = path
        self._signature = signature
        self._throttle = Throttle(RELOAD_S, clock)
        self._failed: str | None = None  # the last reload error logged (logged once)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str],
                  clock: Callable[[], float] = time.monotonic) -> ApiKeys:
        p = Path(path)
        try:
            found, keys = _read(p)
        except OSError as exc:
            raise ApiKeyError(f"API key file {p}: {exc.strerror or exc}") from None
        return cls(keys, f"file {p}", path=p, signature=found, clock=clock)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 name: str = ENV_KEYS) -> ApiKeys | None:
        """The keys in $name (OMNISTAGE_API_KEY), or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(name, "")
        if not text.strip():
            return None
        keys = parse_keys(text, f"${name}")
        if not keys:
            raise ApiKeyError(f"${name}: no {'API' if name == ENV_KEYS else 'admin'} key in it")
        return cls(keys, f"${name}")

    @classmethod
    def from_digests(cls, text: str, where: str) -> ApiKeys:
        """Keys given only by their SHA-256 digests (hex, comma-separated), as the operator
        hands an orchestrator pod the admin key it presents: the pod never holds the key."""
        digests = []
        for item in (t.strip() for t in text.split(",")):
            if not item:
                continue
            try:
                raw = bytes.fromhex(item)
            except ValueError:
                raw = b""
            if len(raw) != hashlib.sha256().digest_size:
                raise ApiKeyError(f"{where}: {item[:12]!r}... is not a SHA-256 digest in hex "
                                  "(64 hex digits)")
            digests.append(raw)
        if not digests:
            raise ApiKeyError(f"{where}: no digest in it")
        return cls([], where, digests=digests)

    @property
    def count(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether the header presents a key in force (reading a changed source first)."""
        self._maybe_reload()
        if not authorization:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(presented.strip())
        ok = False
        for digest in self._digests:  # no early exit: every digest is compared
            ok |= hmac.compare_digest(given, digest)
        return ok

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        if not self._throttle.due():
            return
        try:
            if signature(visible_files(self._path)) == self._signature:
                return
            found, keys = _read(self._path)
        except (OSError, ApiKeyError) as exc:
            reason = str(exc) if isinstance(exc, ApiKeyError) else f"{self._path}: {exc}"
            if reason != self._failed:
                log.warning("API keys not reloaded (the %d in force stay): %s",
                            len(self._digests), reason)
                self._failed = reason
            return
        self._digests = [_digest(k) for k in keys]
        self._signature = found
        self._failed = None
        log.info("API keys reloaded from %s: %d in force", self.source, len(keys))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def resolve(key_file: str | None, *, no_auth: bool, host: str, secret: str | None = None,
            disabled: bool = False,
            environ: Mapping[str, str] | None = None) -> tuple[ApiKeys | None, str]:
    """The keys a command serves with (None: none asked) and the line that says so at start.

    key_file defaults to $OMNISTAGE_API_KEY_FILE (where the operator mounts the pipeline's key
    Secret: spec.orchestrator.auth.apiKeySecret, named by `secret`, which then requires keys,
    or the one it made). disabled: spec.orchestrator.auth.disabled, the pipeline's own "off".
    Off needs --no-auth (or `disabled`), unless the API listens on loopback only.
    """
    env = os.environ if environ is None else environ
    key_file = key_file if key_file is not None else (env.get(API_KEY_FILE_ENV) or None)
    env_keys = ApiKeys.from_env(env)
    if key_file is not None and env_keys is not None:
        raise ApiKeyError(f"--api-key-file (or ${API_KEY_FILE_ENV}) and ${ENV_KEYS} both give "
                          "API keys: give one")
    if no_auth and (key_file is not None or env_keys is not None):
        raise ApiKeyError(f"--no-auth with API keys (--api-key-file or ${ENV_KEYS}): give one")
    keys = ApiKeys.from_file(key_file) if key_file is not None else env_keys
    if keys is not None:
        plural = "s" if keys.count != 1 else ""
        return keys, (f"API keys: on ({keys.count} key{plural} from {keys.source}; send "
                      "Authorization: Bearer KEY)")
    how = f"set ${ENV_KEYS} or --api-key-file PATH to require one"
    if secret is not None:
        raise ApiKeyError(f"spec.orchestrator.auth.apiKeySecret ({secret!r}) asks for API keys "
                          f"and none were given: set ${ENV_KEYS} or --api-key-file PATH (on a "
                          "cluster the operator mounts the Secret)")
    if no_auth:
        return None, "API keys: off (--no-auth): anyone who reaches the API may call it"
    if disabled:
        return None, ("API keys: off (spec.orchestrator.auth.disabled): anyone who reaches the "
                      "API may call it")
    if is_loopback(host):
        return None, f"API keys: off (the API listens on loopback {host} only; {how})"
    raise ApiKeyError(f"the API would listen on {host} without API keys: {how} (on a cluster "
                      "the operator mounts the pipeline's key Secret), or pass --no-auth "
                      "(spec.orchestrator.auth.disabled) to serve without them")


def resolve_admin(key_file: str | None, *, no_auth: bool, host: str,
                  environ: Mapping[str, str] | None = None) -> tuple[ApiKeys | None, str]:
    """The admin listener's keys (None: open) and the line that says so at start.

    From --admin-key-file (a file or a Secret-shaped directory, re-read on change like API
    keys), $OMNISTAGE_ADMIN_KEY, or $OMNISTAGE_ADMIN_KEY_DIGESTS (the operator's: digests of
    the key it presents). Open only on loopback or with --no-auth: the admin routes pause and
    put to sleep every replica, so beyond loopback they always need a key.
    """
    env = os.environ if environ is None else environ
    sources = []
    if key_file is not None:
        sources.append(ApiKeys.from_file(key_file))
    env_keys = ApiKeys.from_env(env, ENV_ADMIN_KEYS)
    if env_keys is not None:
        sources.append(env_keys)
    digests = env.get(ADMIN_KEY_DIGESTS_ENV, "")
    if digests.strip():
        sources.append(ApiKeys.from_digests(digests, f"${ADMIN_KEY_DIGESTS_ENV}"))
    if len(sources) > 1:
        raise ApiKeyError(f"admin keys from {' and '.join(k.source for k in sources)}: give "
                          "one source")
    if no_auth and sources:
        raise ApiKeyError(f"--no-auth with admin keys ({sources[0].source}): give one")
    if sources:
        keys = sources[0]
        plural = "s" if keys.count != 1 else ""
        return keys, (f"admin keys: on ({keys.count} key{plural} from {keys.source}; send "
                      f"{ADMIN_KEY_HEADER}: KEY or Authorization: Bearer KEY)")
    if no_auth:
        return None, ("admin keys: off (--no-auth): anyone who reaches the admin listener may "
                      "pause or put the pipeline to sleep")
    how = f"set ${ENV_ADMIN_KEYS} or --admin-key-file PATH to require one"
    if is_loopback(host):
        return None, f"admin keys: off (the admin listener is on loopback {host} only; {how})"
    raise ApiKeyError(f"the admin listener would be on {host} without admin keys: {how} (on a "
                      f"cluster the operator sets ${ADMIN_KEY_DIGESTS_ENV}), or pass --no-auth")


def resolve_both(key_file: str | None, admin_key_file: str | None, *, no_auth: bool,
                 host: str, admin_host: str, secret: str | None, disabled: bool,
                 environ: Mapping[str, str] | None = None
                 ) -> tuple[ApiKeys | None, ApiKeys | None, list[str]]:
    """Both listeners' keys (API, admin) and the start lines that say so: what `omnistage
    serve` and `omnistage orchestrator` resolve before anything starts. Raises ApiKeyError."""
    api, api_line = resolve(key_file, no_auth=no_auth, host=host, secret=secret,
                            disabled=disabled, environ=environ)
    admin, admin_line = resolve_admin(admin_key_file, no_auth=no_auth, host=admin_host,
                                      environ=environ)
    return api, admin, [api_line, admin_line]
