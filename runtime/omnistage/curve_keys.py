"""A pipeline's CurveZMQ keypair as data: generated, written to and read from a key directory.

Apart from omnistage.curve (the sockets) so the operator, which has no ZMQ, makes a pipeline's
pair for its Secret with the same code the runtime reads it with. The directory holds the files
`public` and `secret`, Z85 text (ZeroMQ RFC 32) of 40 characters each: the shape of a
Kubernetes Secret with those two keys mounted as a volume.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CURVE_KEYS_ENV",
    "PUBLIC_FILE",
    "SECRET_FILE",
    "CurveKeyError",
    "CurveKeys",
    "generate",
    "keys_from_env",
    "load",
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


#: The directory holding `public` and `secret`; unset: plain ZMQ (and said so at start).
CURVE_KEYS_ENV = "OMNISTAGE_CURVE_KEYS"
PUBLIC_FILE, SECRET_FILE = "public", "secret"
_KEY_CHARS = 40  # a 32-byte key in Z85


class CurveKeyError(ValueError):
    """The key directory is missing, unreadable, or its keys are not a pair."""


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


def _read_key(directory: Path, name: str) -> bytes:
    path = directory / name
    try:
        text = path.read_bytes().strip()
    except FileNotFoundError:
        raise CurveKeyError(f"{path}: no such file (the key directory needs {PUBLIC_FILE!r} "
                            f"and {SECRET_FILE!r})") from None
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


def load(directory: str | Path) -> CurveKeys:
    """The pair in `directory`; refuses a public key that is not the secret key's."""
    path = Path(directory)
    public, secret = _read_key(path, PUBLIC_FILE), _read_key(path, SECRET_FILE)
    if z85_encode(_public_of(z85_decode(secret))) != public:
        raise CurveKeyError(f"{path}: {PUBLIC_FILE!r} is not the public key of {SECRET_FILE!r}")
    return CurveKeys(public, secret)


def keys_from_env(env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The pair $OMNISTAGE_CURVE_KEYS names, or None when it is unset or empty."""
    directory = (os.environ if env is None else env).get(CURVE_KEYS_ENV, "")
    if not directory:
        return None
    try:
        return load(directory)
    except CurveKeyError as exc:
        raise CurveKeyError(f"${CURVE_KEYS_ENV}: {exc}") from None


def write(keys: CurveKeys, directory: str | Path | None = None) -> Path:
    """Write the pair (owner-only files) into `directory`, by default a new private temporary
    one; returns it. Each file is renamed into place whole, so a reader sees an old or a new
    key, never half of one."""
    path = Path(directory) if directory is not None else Path(
        tempfile.mkdtemp(prefix="omnistage-curve-"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, value in ((SECRET_FILE, keys.secret), (PUBLIC_FILE, keys.public)):
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
