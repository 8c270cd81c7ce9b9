"""The operator's admin credential (issue 43): what it presents at every orchestrator's admin
listener (control, GET /v1/load), and what each orchestrator pod is told to accept.

One root key per operator: read from `--admin-key-file` (the chart's Secret
`<fullname>-admin-key`, mounted read-only), or, without the flag, made at random when the
operator starts (a WARNING says so: a restart, or a leader of another replica, then rolls every
orchestrator, since their admitted digests change).

Per pipeline, the key is derived from the root, never stored:

    key = hex(HMAC-SHA256(root, "<namespace>/<name>/<uid>"))

The uid makes a pipeline deleted and made again a new key, and one pipeline's key opens no
other pipeline's admin listener. The orchestrator pod gets only the key's SHA-256 digest
(omnistage.orchestrator.auth.key_digest_hex, in $OMNISTAGE_ADMIN_KEY_DIGESTS, builders), so
nothing in the pipeline's namespace holds a key. Deterministic: a restarted operator with the
same root computes the same digests, so a converged fleet sees no write.

Pure, but for `load` (one file read at start) and the random root of `ephemeral`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.orchestrator.auth import key_digest_hex

__all__ = [
    "MIN_ROOT_KEY_CHARS",
    "AdminCredential",
    "AdminCredentialError",
    "load",
    "pipeline_key",
    "read_root_key",
]

log = logging.getLogger("omnistage.operator")

#: The shortest root key accepted from a file (the chart makes 48 random alphanumerics).
MIN_ROOT_KEY_CHARS = 32
#: Larger files are refused before they are read: a root key is one line.
MAX_ROOT_KEY_BYTES = 4096


class AdminCredentialError(ValueError):
    """The root key file cannot be used; the message names the path and why."""


def pipeline_key(root: bytes, namespace: str, name: str, uid: str) -> str:
    """The admin key of one pipeline: hex HMAC-SHA256 of "<namespace>/<name>/<uid>" under
    the operator's root key (64 hex characters)."""
    message = f"{namespace}/{name}/{uid}".encode()
    return hmac.new(root, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class AdminCredential:
    """The operator's root key and where it came from. repr() never shows the key."""

    root: bytes = field(repr=False)
    #: the file it was read from; None: made at random for this run (ephemeral)
    source: str | None = None

    @property
    def ephemeral(self) -> bool:
        return self.source is None

    @classmethod
    def generate(cls) -> AdminCredential:
        """A random root for this run only (no file): 48 bytes from the OS's generator."""
        return cls(secrets.token_urlsafe(48).encode())

    def key(self, namespace: str, name: str, uid: str) -> str:
        """The key the operator presents at this pipeline's admin listener."""
        return pipeline_key(self.root, namespace, name, uid)

    def digest(self, namespace: str, name: str, uid: str) -> str:
        """What the pipeline's orchestrator pods are told to accept (SHA-256 hex of the key)."""
        return key_digest_hex(self.key(namespace, name, uid))


def read_root_key(path: str | Path) -> bytes:
    """The root key in a file: its text without surrounding whitespace (a trailing newline is
    fine), at least MIN_ROOT_KEY_CHARS visible ASCII characters. AdminCredentialError, naming
    the path, for a missing, unreadable, oversized, non-ASCII or short one."""
    where = f"--admin-key-file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ROOT_KEY_BYTES + 1)
    except FileNotFoundError:
        raise AdminCredentialError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise AdminCredentialError(f"{where}: a directory, not a file") from None
    except OSError as exc:
        raise AdminCredentialError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_ROOT_KEY_BYTES:
        raise AdminCredentialError(f"{where}: larger than {MAX_ROOT_KEY_BYTES} bytes; it "
                                   "holds one key")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise AdminCredentialError(f"{where}: not ASCII text") from None
    if not text.isprintable() or any(c.isspace() for c in text):
        raise AdminCredentialError(f"{where}: the key is visible ASCII without spaces")
    if len(text) < MIN_ROOT_KEY_CHARS:
        raise AdminCredentialError(f"{where}: a key of {len(text)} characters is too short "
                                   f"(at least {MIN_ROOT_KEY_CHARS})")
    return text.encode("ascii")


def load(path: str | Path | None) -> AdminCredential:
    """The operator's credential: the root key from `path`, or (None) a random one for this
    run, with a WARNING naming the cost."""
    if path is not None:
        return AdminCredential(read_root_key(path), str(path))
    log.warning("admin key: no --admin-key-file, so the operator made a root key for this run "
                "only; an operator restart (or another replica taking the lead) then rolls "
                "every orchestrator, whose admitted key digests change (the chart mounts a "
                "Secret that keeps it)")
    return AdminCredential.generate()
