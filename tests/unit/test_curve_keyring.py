"""CurveKeyring (omnistage.curve_keys): a pipeline's keys while they rotate. The file names of
each generation, the admitted set from a Secret-shaped directory (its hidden `..data` skipped,
its symlinked layout followed), a reload only once a second and only on a change, a bad reload
keeping the keys in force with one warning, and the generation from the environment."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from omnistage import curve_keys as ck


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def raw(keys: ck.CurveKeys) -> bytes:
    return ck.z85_decode(keys.public)


def kubelet_dir(root: Path, files: dict[str, bytes], n: int = 0) -> Path:
    """A Secret volume as the kubelet writes it: the files in a hidden timestamped folder,
    `..data` a symlink to it, each visible name a symlink through `..data`. Called again, it
    swaps `..data` atomically and mends the visible links (new ones made, old ones removed)."""
    root.mkdir(exist_ok=True)
    folder = root / f"..2026_01_01_00_00_0{n}.{n:04d}"
    folder.mkdir()
    for name, value in files.items():
        (folder / name).write_bytes(value + b"\n")
    tmp = root / "..data_tmp"
    os.symlink(folder.name, tmp)
    os.replace(tmp, root / "..data")
    for name in files:
        if not (root / name).is_symlink():
            os.symlink(f"..data/{name}", root / name)
    for entry in root.iterdir():
        if not entry.name.startswith(".") and entry.name not in files:
            entry.unlink()
    return root


def pair_files(keys: ck.CurveKeys, generation: int) -> dict[str, bytes]:
    return {ck.public_file(generation): keys.public, ck.secret_file(generation): keys.secret}


def test_file_names_per_generation() -> None:
    assert (ck.public_file(0), ck.secret_file(0)) == ("public", "secret")
    assert (ck.public_file(), ck.secret_file()) == (ck.PUBLIC_FILE, ck.SECRET_FILE)
    assert (ck.public_file(1), ck.secret_file(1)) == ("public-1", "secret-1")
    assert ck.public_file(12) == "public-12"
    for bad in (-1, True, "1", 1.0):
        with pytest.raises(ValueError):
            ck.public_file(bad)  # type: ignore[arg-type]


def test_a_generations_pair_is_written_and_loaded_under_its_names(tmp_path: Path) -> None:
    zero, one = ck.generate(), ck.generate()
    ck.write(zero, tmp_path)
    ck.write(one, tmp_path, generation=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["public", "public-1", "secret",
                                                          "secret-1"]
    assert ck.load(tmp_path) == zero and ck.load(tmp_path, 1) == one
    with pytest.raises(ck.CurveKeyError, match=r"public-2: no such file .*'public-2' and "
                                               r"'secret-2'"):
        ck.load(tmp_path, 2)


def test_the_admitted_set_is_every_generations_public_key(tmp_path: Path) -> None:
    zero, one = ck.generate(), ck.generate()
    d = kubelet_dir(tmp_path / "curve", {**pair_files(zero, 0), **pair_files(one, 1),
                                         "public-x": b"not a generation", "README": b"hi"})
    assert (d / "..data").is_symlink()
    ring = ck.CurveKeyring(d, 0, clock=Clock())
    assert ring.own == zero and ring.generation == 0
    assert ring.admitted() == frozenset({raw(zero), raw(one)})
    assert all(len(k) == 32 for k in ring.admitted())  # what a ZAP request carries
    assert ring.server_key(None) == zero.public
    assert ring.server_key(0) == zero.public
    assert ring.server_key(1) == one.public
    assert ring.server_key(2) is None
    # The same directory seen from generation 1: its own pair is the other one.
    ring1 = ck.CurveKeyring(d, 1, clock=Clock())
    assert ring1.own == one and ring1.server_key(None) == one.public
    assert ring1.server_key(0) == zero.public


def test_a_change_is_seen_only_after_a_second_and_follows_the_symlink_swap(
        tmp_path: Path) -> None:
    zero, one = ck.generate(), ck.generate()
    clock = Clock()
    d = kubelet_dir(tmp_path / "curve", pair_files(zero, 0), 0)
    ring = ck.CurveKeyring(d, 0, clock=clock)
    assert ring.admitted() == {raw(zero)} and ring.server_key(1) is None
    kubelet_dir(d, {**pair_files(zero, 0), **pair_files(one, 1)}, 1)  # the operator's add
    clock.now += 0.5
    assert ring.admitted() == {raw(zero)} and ring.server_key(1) is None  # not looked yet
    clock.now += 0.5
    assert ring.admitted() == {raw(zero), raw(one)}
    assert ring.server_key(1) == one.public
    kubelet_dir(d, pair_files(one, 1), 2)  # the operator's drop of generation 0
    clock.now += 0.99
    assert ring.admitted() == {raw(zero), raw(one)}
    clock.now += 0.01
    assert ring.admitted() == {raw(one)}
    assert ring.server_key(0) == zero.public  # our own pair: we hold it, whatever the files
    assert ring.own == zero  # the identity never changes under a running process


def test_an_unchanged_directory_is_not_read_again(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    ring = ck.CurveKeyring(ck.write(ck.generate(), tmp_path / "k"), clock=clock)
    reads = []
    real = ck._read_key
    monkeypatch.setattr(ck, "_read_key", lambda *a: reads.append(a) or real(*a))
    for _ in range(5):
        clock.now += 1
        ring.admitted()
    assert reads == []  # only the signature (stat) was looked at


def test_a_bad_reload_keeps_the_last_good_set_and_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    zero, one = ck.generate(), ck.generate()
    clock = Clock()
    d = ck.write(zero, tmp_path / "k")
    ring = ck.CurveKeyring(d, clock=clock)
    ck.write(one, d, generation=1)
    (d / "public-1").write_text("x" * 39 + "~\n")  # not Z85
    caplog.set_level(logging.WARNING, logger="omnistage.curve")
    for _ in range(5):
        clock.now += 1
        assert ring.admitted() == {raw(zero)}
        assert ring.server_key(1) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "public-1: not Z85 text" in warnings[0].getMessage()
    assert "keys in force stay" in warnings[0].getMessage()
    # A directory with no public key at all (or gone) is a failed read too, not a lockout.
    (d / "public-1").write_bytes(one.public)
    (d / "public").unlink()
    (d / "public-1").unlink()
    clock.now += 1
    assert ring.admitted() == {raw(zero)}
    # Mended: read again, and a later failure is warned about again.
    (d / "public-1").write_bytes(one.public)
    clock.now += 1
    assert ring.admitted() == {raw(one)}
    caplog.clear()
    (d / "public-1").write_text("short")
    clock.now += 1
    assert ring.admitted() == {raw(one)}
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"CurveZMQ keys not reloaded, the keys in force stay: {d / 'public-1'}: a CurveZMQ key "
        "is 40 Z85 characters, this is 5"]


def test_a_missing_or_bad_own_pair_is_refused_at_start_naming_the_file(
        tmp_path: Path) -> None:
    d = ck.write(ck.generate(), tmp_path / "k")
    with pytest.raises(ck.CurveKeyError, match=r"public-1: no such file"):
        ck.CurveKeyring(d, 1)
    ck.write(ck.generate(), d, generation=1)
    (d / "secret-1").write_bytes(ck.generate().secret)  # another pair's secret
    with pytest.raises(ck.CurveKeyError, match=r"'public-1' is not the public key of "
                                               r"'secret-1'"):
        ck.CurveKeyring(d, 1)
    with pytest.raises(ck.CurveKeyError, match=r"no such file"):
        ck.CurveKeyring(tmp_path / "missing")


def test_the_generation_comes_from_the_environment(tmp_path: Path) -> None:
    zero, one = ck.generate(), ck.generate()
    d = ck.write(zero, tmp_path / "k")
    ck.write(one, d, generation=1)
    env = {ck.CURVE_KEYS_ENV: str(d)}
    assert ck.generation_from_env({}) == 0
    assert ck.generation_from_env({ck.CURVE_GENERATION_ENV: ""}) == 0
    assert ck.generation_from_env({ck.CURVE_GENERATION_ENV: " 7 "}) == 7
    assert ck.keys_from_env(env) == zero
    assert ck.keys_from_env({**env, ck.CURVE_GENERATION_ENV: "1"}) == one
    ring = ck.keyring_from_env({**env, ck.CURVE_GENERATION_ENV: "1"})
    assert ring is not None and ring.own == one and ring.generation == 1
    assert ck.keyring_from_env({}) is None
    assert ck.keyring_from_env({ck.CURVE_KEYS_ENV: "", ck.CURVE_GENERATION_ENV: "1"}) is None
    for bad in ("-1", "one", "1.0", "²"):
        with pytest.raises(ck.CurveKeyError, match=r"^\$OMNISTAGE_CURVE_GENERATION: .*"
                                                   r"integer >= 0"):
            ck.keyring_from_env({**env, ck.CURVE_GENERATION_ENV: bad})
        with pytest.raises(ck.CurveKeyError, match=r"^\$OMNISTAGE_CURVE_GENERATION"):
            ck.keys_from_env({**env, ck.CURVE_GENERATION_ENV: bad})
    with pytest.raises(ck.CurveKeyError, match=r"^\$OMNISTAGE_CURVE_KEYS: .*public-2: no such"):
        ck.keyring_from_env({**env, ck.CURVE_GENERATION_ENV: "2"})


def test_a_fixed_keyring_holds_one_pair() -> None:
    pair = ck.generate()
    ring = ck.CurveKeyring.fixed(pair)
    assert ring.own == pair and ring.directory is None
    assert ring.admitted() == {raw(pair)}
    assert ring.server_key(None) == ring.server_key(0) == pair.public
    assert ring.server_key(1) is None
    assert pair.secret.decode() not in repr(ring)
