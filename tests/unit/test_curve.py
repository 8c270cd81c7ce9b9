"""omnistage.curve's key files: what loads, what is refused and how it is named, and that a
written pair is private and reads back as the same pair."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from omnistage import curve


def test_a_written_pair_reads_back_and_is_private(tmp_path: Path) -> None:
    pair = curve.generate()
    d = curve.write(pair, tmp_path / "keys")
    assert curve.load(d) == pair
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "secret").stat().st_mode) == 0o600
    assert sorted(p.name for p in d.iterdir()) == ["public", "secret"]  # no temp files left
    assert pair.secret.decode() not in repr(pair)
    assert zmq.curve_public(pair.secret) == pair.public


def test_a_default_directory_is_new_and_private() -> None:
    d = curve.write(curve.generate())
    try:
        assert d.name.startswith("omnistage-curve-")
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


@pytest.mark.parametrize(("public", "secret", "message"), [
    (None, "ok", "public: no such file"),
    ("ok", None, "secret: no such file"),
    ("short", "ok", "public: a CurveZMQ key is 40 Z85 characters, this is 5"),
    ("ok", "\x7f" * 40, "secret: not Z85 text"),
    ("other", "ok", "'public' is not the public key of 'secret'"),
])
def test_bad_key_directories_are_refused_naming_the_file(tmp_path: Path, public: str | None,
                                                       secret: str | None, message: str) -> None:
    pair, other = curve.generate(), curve.generate()
    values = {"ok": None, "other": other.public.decode()}
    for name, text in (("public", public), ("secret", secret)):
        if text is None:
            continue
        value = values.get(text) or text
        if text == "ok":
            value = getattr(pair, name).decode()
        (tmp_path / name).write_text(value + "\n")
    with pytest.raises(curve.CurveKeyError) as err:
        curve.load(tmp_path)
    assert message in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_the_environment_names_the_directory(tmp_path: Path) -> None:
    assert curve.keys_from_env({}) is None
    assert curve.keys_from_env({curve.CURVE_KEYS_ENV: ""}) is None
    pair = curve.generate()
    d = curve.write(pair, tmp_path / "k")
    assert curve.keys_from_env({curve.CURVE_KEYS_ENV: str(d)}) == pair
    with pytest.raises(curve.CurveKeyError, match=r"^\$OMNISTAGE_CURVE_KEYS: .*no such file"):
        curve.keys_from_env({curve.CURVE_KEYS_ENV: str(tmp_path / "missing")})


def test_z85_is_rfc_32() -> None:
    from omnistage.curve_keys import z85_decode, z85_encode

    hello = bytes([0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B])
    assert z85_encode(hello) == b"HelloWorld"  # the RFC's own test vector
    assert z85_decode(b"HelloWorld") == hello
    for bad in (b"Hell", b"Hello~orld", b"#####"):  # length, alphabet, range
        with pytest.raises(ValueError):
            z85_decode(bad)


def test_the_operator_makes_pairs_without_zmq_that_zmq_accepts() -> None:
    """The operator has no ZMQ: its pairs come from cryptography's X25519, and must be pairs
    to libzmq (the workers load them with zmq.curve_public)."""
    import subprocess
    import sys

    code = ("import sys\nsys.modules['zmq'] = None\n"
            "from omnistage import curve_keys\nk = curve_keys.generate()\n"
            "print(k.public.decode(), k.secret.decode())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    public, secret = out.stdout.split()
    assert zmq.curve_public(secret.encode()) == public.encode()
