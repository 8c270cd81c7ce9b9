"""A pipeline's CurveZMQ keypair as data: generated, written to and read from a key directory.

Apart from omnistage.curve (the sockets) so the operator, which has no ZMQ, makes a pipeline's
pair for its Secret with the same code the runtime reads it with. The directory holds the files
`public` and `secret`, Z85 text (ZeroMQ RFC 32) of 40 characters each: the shape of a
Kubernetes Secret with those two keys mounted as a volume.

Rotation (issue 43): the operator adds generation N's pair to the same Secret as `public-N` and
`secret-N` (N >= 1; generation 0 is `public`/`secret`), the kubelet refreshes the mounted
directory in every running pod, the pods roll to generation N ($OMNISTAGE_CURVE_GENERATION),
and generation N-1's files go. A CurveKeyring follows that: its own pair, read once at start,
and the public keys of every generation in the directory, read again when the directory
changes (looked at once a second at most).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.filewatch import Signature, Throttle, signature, visible_files

__all__ = [
    "CURVE_GENERATION_ENV",
    "CURVE_KEYS_ENV",
    "PUBLIC_FILE",
    "RELOAD_S",
    "SECRET_FILE",
    "CurveKeyError",
    "CurveKeyring",
    "CurveKeys",
    "generate",
    "generation_from_env",
    "keyring_from_env",
    "keys_from_env",
    "load",
    "public_file",
    "secret_file",
    "write",
    "z85_decode",
    "z85_encode",
]

_Z85 = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_INDEX = {c: i for i, c in enumerate(_Z85)}


def z85_encode(raw: bytes) -> bytes:
    """ZeroMQ's Z85 (RFC 32): 4 bytes to 5 characters; the length must be a multiple of 4."""
    if len(raw) % 4:
        raise ValueError(f"Z85 encodes a multiple of 4 bytes, not {len(raw)}")
    out = bytearray()
    for i in range(0, len(raw), 4):
        value = int.from_bytes(raw[i:i + 4], "big")
        chunk = bytearray(5)
        for j in range(4, -1, -1):
            value, chunk[j] = divmod(value, 85)[0], _Z85[value % 85]
        out += chunk
    return bytes(out)


def z85_decode(text: bytes) -> bytes:
    """The bytes of Z85 text; ValueError for a length or character Z85 does not have."""
    if len(text) % 5:
        raise ValueError(f"Z85 text is a multiple of 5 characters, not {len(text)}")
    out = bytearray()
    for i in range(0, len(text), 5):
        value = 0
        for c in text[i:i + 5]:
            digit = _Z85_INDEX.get(c)
            if digit is None:
                raise ValueError(f"{chr(c)!r} is not a Z85 character")
            value = value * 85 + digit
        if value >= 1 << 32:
            raise ValueError("Z85 group out of range")
        out += value.to_bytes(4, "big")
    return bytes(out)


log = logging.getLogger("omnistage.curve")

#: The directory holding `public` and `secret`; unset: plain ZMQ (and said so at start).
CURVE_KEYS_ENV = "OMNISTAGE_CURVE_KEYS"
#: The generation of the pair a process holds as its own (absent or empty: 0).
CURVE_GENERATION_ENV = "OMNISTAGE_CURVE_GENERATION"
PUBLIC_FILE, SECRET_FILE = "public", "secret"
RELOAD_S = 1.0  # how often a keyring looks at its directory again (at most)
_KEY_CHARS = 40  # a 32-byte key in Z85
_PUBLIC_NAME = re.compile(r"public(?:-([1-9][0-9]*))?")


class CurveKeyError(ValueError):
    """The key directory is missing, unreadable, or its keys are not a pair."""


def _generation(generation: int) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"a key generation is an integer >= 0, not {generation!r}")
    return generation


def public_file(generation: int = 0) -> str:
    """The file (the Secret's key) of a generation's public key: `public`, then `public-N`."""
    return PUBLIC_FILE if _generation(generation) == 0 else f"{PUBLIC_FILE}-{generation}"


def secret_file(generation: int = 0) -> str:
    """The file (the Secret's key) of a generation's secret key: `secret`, then `secret-N`."""
    return SECRET_FILE if _generation(generation) == 0 else f"{SECRET_FILE}-{generation}"


@dataclass(frozen=True)
class CurveKeys:
    """A pipeline's CurveZMQ keypair, Z85-encoded (the secret never shows in a repr)."""

    public: bytes
    secret: bytes = field(repr=False)


def _public_of(secret: bytes) -> bytes:
    """The X25519 public key of a raw 32-byte secret key (CURVE's keys are X25519 keys)."""
    try:
        import zmq  # the runtime has it (libzmq's own libsodium)
    except ImportError:  # the operator: cryptography, for its webhook certificates too
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        key = X25519PrivateKey.from_private_bytes(secret)
        return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return z85_decode(zmq.curve_public(z85_encode(secret)))


def generate() -> CurveKeys:
    """A new pair from the operating system's randomness."""
    secret = os.urandom(32)
    return CurveKeys(z85_encode(_public_of(secret)), z85_encode(secret))


def _read_key(directory: Path, name: str, generation: int = 0) -> bytes:
    path = directory / name
    try:
        text = path.read_bytes().strip()
    except FileNotFoundError:
        raise CurveKeyError(f"{path}: no such file (the key directory needs "
                            f"{public_file(generation)!r} and {secret_file(generation)!r})"
                            ) from None
    except OSError as exc:
        raise CurveKeyError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(text) != _KEY_CHARS:
        raise CurveKeyError(f"{path}: a CurveZMQ key is {_KEY_CHARS} Z85 characters, this is "
                            f"{len(text)}")
    try:
        z85_decode(text)
    except ValueError:
        raise CurveKeyError(f"{path}: not Z85 text") from None
    return text


def load(directory: str | Path, generation: int = 0) -> CurveKeys:
    """Generation `generation`'s pair in `directory`; refuses a public key that is not the
    secret key's."""
    path = Path(directory)
    pub, sec = public_file(generation), secret_file(generation)
    public, secret = _read_key(path, pub, generation), _read_key(path, sec, generation)
    if z85_encode(_public_of(z85_decode(secret))) != public:
        raise CurveKeyError(f"{path}: {pub!r} is not the public key of {sec!r}")
    return CurveKeys(public, secret)


def generation_from_env(env: Mapping[str, str] | None = None) -> int:
    """$OMNISTAGE_CURVE_GENERATION: this process's own generation (unset or empty: 0)."""
    text = (os.environ if env is None else env).get(CURVE_GENERATION_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit() or not text.isascii():
        raise CurveKeyError(f"${CURVE_GENERATION_ENV}: a key generation is an integer >= 0, "
                            f"not {text!r}")
    return int(text)


def keys_from_env(env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The own pair of keyring_from_env's keyring, or None when no directory is named."""
    ring = keyring_from_env(env)
    return ring.own if ring is not None else None


def keyring_from_env(env: Mapping[str, str] | None = None) -> CurveKeyring | None:
    """The keyring of $OMNISTAGE_CURVE_KEYS at generation $OMNISTAGE_CURVE_GENERATION, or None
    when no directory is named (plain ZMQ)."""
    environ = os.environ if env is None else env
    directory = environ.get(CURVE_KEYS_ENV, "")
    if not directory:
        return None
    generation = generation_from_env(environ)
    try:
        return CurveKeyring(directory, generation)
    except CurveKeyError as exc:
        raise CurveKeyError(f"${CURVE_KEYS_ENV}: {exc}") from None


def _publics(directory: Path) -> tuple[Signature, dict[int, bytes]]:
    """Every generation's public key in the directory, and the signature it was read at.
    CurveKeyError for a bad key or a directory without any; OSError when it cannot be read."""
    files = visible_files(directory)
    found = signature(files)
    publics: dict[int, bytes] = {}
    for f in files:
        match = _PUBLIC_NAME.fullmatch(f.name)
        if match is not None:
            publics[int(match.group(1) or 0)] = _read_key(directory, f.name)
    if not publics:
        raise CurveKeyError(f"{directory}: no public key in it ({PUBLIC_FILE!r} or "
                            f"'{PUBLIC_FILE}-N')")
    return found, publics


class CurveKeyring:
    """The pairs a process works with while a pipeline's keys rotate.

    own: this process's pair (generation `generation`), read once at start: a worker's server
    identity and an orchestrator's client identity, fixed for the process's life. admitted():
    the raw 32-byte public keys (the form a ZAP request carries) of every generation in the
    directory, so a worker admits the orchestrators of the old and the new generation while
    the pods roll. server_key(g): generation g's public key (Z85), what a client of a worker of
    generation g must name; None while its file is not in the directory (the mount not yet
    refreshed). The directory is looked at again at most once per RELOAD_S, on a call, and read
    again when its files changed (name, mtime, size, inode: a Secret volume's atomic swap
    changes them all); a read that fails or finds a bad key keeps what was in force and is
    logged once. Without a directory (`fixed`), it holds one pair and nothing changes.
    """

    def __init__(self, directory: str | Path, generation: int = 0, *,
                 clock: Callable[[], float] = time.monotonic,
                 reload_s: float = RELOAD_S) -> None:
        self.generation = _generation(generation)
        self.directory: Path | None = Path(directory)
        self.own = load(self.directory, self.generation)
        try:
            self._signature, publics = _publics(self.directory)
        except OSError as exc:  # pragma: no cover - load() just read it
            raise CurveKeyError(f"{self.directory}: cannot read: {exc.strerror or exc}") from None
        self._throttle = Throttle(reload_s, clock)
        self._failed: str | None = None  # the reload error logged (once)
        self._set(publics)

    @classmethod
    def fixed(cls, keys: CurveKeys, generation: int = 0) -> CurveKeyring:
        """A keyring of one pair and no directory (`omnistage serve`: a pair made for the run)."""
        ring = cls.__new__(cls)
        ring.generation, ring.directory, ring.own = _generation(generation), None, keys
        ring._signature, ring._failed = (), None
        ring._throttle = Throttle(RELOAD_S)
        ring._set({ring.generation: keys.public})
        return ring

    def __repr__(self) -> str:
        where = str(self.directory) if self.directory is not None else "fixed"
        return f"CurveKeyring({where}, generation={self.generation})"

    def _set(self, publics: dict[int, bytes]) -> None:
        self._publics = publics
        self._admitted = frozenset(z85_decode(k) for k in publics.values())

    def admitted(self) -> frozenset[bytes]:
        """The raw public keys a worker's ZAP handler admits: every generation's in the
        directory now (looked at again at most once per RELOAD_S)."""
        self._refresh()
        return self._admitted

    def server_key(self, generation: int | None = None) -> bytes | None:
        """Generation `generation`'s public key in Z85 (None: our own generation's), or None
        when the directory has no file for it (yet, or any more)."""
        if generation is None:
            return self.own.public
        self._refresh()
        key = self._publics.get(generation)
        if key is None and generation == self.generation:
            return self.own.public  # the pair we hold, whatever the directory says now
        return key

    def _refresh(self) -> None:
        if self.directory is None:
            return
        if not self._throttle.due():
            return
        try:
            if signature(visible_files(self.directory)) == self._signature:
                return
            found, publics = _publics(self.directory)
        except (OSError, CurveKeyError) as exc:
            reason = str(exc) if isinstance(exc, CurveKeyError) else (
                f"{self.directory}: cannot read: {exc.strerror or exc}")
            if reason != self._failed:
                self._failed = reason
                log.warning("CurveZMQ keys not reloaded, the keys in force stay: %s", reason)
            return
        if self._failed is not None:
            log.info("CurveZMQ keys in %s read again", self.directory)
        self._failed = None
        if publics != self._publics:
            log.info("CurveZMQ keys in %s: generations %s", self.directory,
                     ", ".join(map(str, sorted(publics))))
        self._signature = found
        self._set(publics)


def write(keys: CurveKeys, directory: str | Path | None = None, generation: int = 0) -> Path:
    """Write the pair (owner-only files) into `directory`, by default a new private temporary
    one, as generation `generation` (`public`/`secret`, or `public-N`/`secret-N`); returns it.
    Each file is renamed into place whole, so a reader sees an old or a new key, never half of
    one."""
    path = Path(directory) if directory is not None else Path(
        tempfile.mkdtemp(prefix="omnistage-curve-"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, value in ((secret_file(generation), keys.secret),
                        (public_file(generation), keys.public)):
        fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value + b"\n")
            os.replace(tmp, path / name)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path
