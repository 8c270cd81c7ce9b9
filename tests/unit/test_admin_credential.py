"""The operator's admin credential (omni_operator.admin_credential): the root key from
--admin-key-file or made for the run, and each pipeline's key derived from it, deterministic
(a restarted operator computes the same digests, so a converged fleet sees no write) and
different per pipeline identity and per root."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_operator import admin_credential
from omni_operator.admin_credential import (
    MIN_ROOT_KEY_CHARS,
    AdminCredential,
    AdminCredentialError,
    pipeline_key,
    read_root_key,
)
from omnistage.orchestrator.auth import key_digest_hex

ROOT = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEF"  # 42 characters


def test_the_key_is_hmac_sha256_of_namespace_name_and_uid() -> None:
    key = pipeline_key(ROOT, "team-a", "chat", "1f0c-uid")
    assert key == hmac.new(ROOT, b"team-a/chat/1f0c-uid", hashlib.sha256).hexdigest()
    assert len(key) == 64 and all(c in "0123456789abcdef" for c in key)
    credential = AdminCredential(ROOT, "/k")
    assert credential.key("team-a", "chat", "1f0c-uid") == key
    assert credential.digest("team-a", "chat", "1f0c-uid") == key_digest_hex(key)
    assert credential.digest("team-a", "chat", "1f0c-uid") != key


def test_the_key_is_deterministic_and_differs_per_identity_and_root() -> None:
    """The same root and pipeline: the same key, in another process too (a restarted
    operator); another uid (the pipeline made again), name, namespace or root: another."""
    here = AdminCredential(ROOT).key("ns", "p", "u1")
    script = ("from omni_operator.admin_credential import pipeline_key; "
              f"print(pipeline_key({ROOT!r}, 'ns', 'p', 'u1'))")
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, timeout=120).stdout.strip()
    assert here == there
    others = {AdminCredential(ROOT).key("ns", "p", "u2"),
              AdminCredential(ROOT).key("ns", "q", "u1"),
              AdminCredential(ROOT).key("other", "p", "u1"),
              AdminCredential(ROOT + b"x").key("ns", "p", "u1")}
    # (Namespaces and names cannot hold "/", so the separator leaves no two identities alike.)
    assert here not in others and len(others) == 4


def test_a_root_key_file_is_read_without_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "admin-key"
    path.write_text(ROOT.decode() + "\n")
    assert read_root_key(path) == ROOT
    credential = admin_credential.load(str(path))
    assert credential.root == ROOT and credential.source == str(path)
    assert not credential.ephemeral
    assert ROOT.decode() not in repr(credential)  # a log of the object shows no key


@pytest.mark.parametrize(("content", "why"), [
    (b"", "a key of 0 characters is too short (at least 32)"),
    (b"short-key\n", "a key of 9 characters is too short (at least 32)"),
    (b"x" * (MIN_ROOT_KEY_CHARS - 1), "a key of 31 characters is too short"),
    (b"two words " * 5, "visible ASCII without spaces"),
    ("k\u00e9y".encode() * 20, "not ASCII text"),
    (b"k" * 5000, "larger than 4096 bytes"),
])
def test_a_bad_root_key_file_is_refused_naming_it(tmp_path: Path, content: bytes,
                                                  why: str) -> None:
    path = tmp_path / "admin-key"
    path.write_bytes(content)
    with pytest.raises(AdminCredentialError) as caught:
        read_root_key(path)
    message = str(caught.value)
    assert message.startswith(f"--admin-key-file {path}: "), message
    assert why in message, message
    assert isinstance(caught.value, ValueError)  # main() turns it into exit 2
    assert content.decode(errors="replace")[:20] not in message or not content


def test_missing_unreadable_and_directory_files_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(AdminCredentialError, match=rf"{tmp_path}/nope: no such file"):
        read_root_key(tmp_path / "nope")
    with pytest.raises(AdminCredentialError, match=rf"{tmp_path}: a directory, not a file"):
        read_root_key(tmp_path)
    locked = tmp_path / "locked"
    locked.write_text("k" * 40)
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):  # root reads anything: nothing to refuse
            pytest.skip("running as root")
        with pytest.raises(AdminCredentialError, match=rf"{locked}: cannot read it"):
            read_root_key(locked)
    finally:
        locked.chmod(0o600)


def test_exactly_the_minimum_is_enough(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text("k" * MIN_ROOT_KEY_CHARS)
    assert read_root_key(path) == b"k" * MIN_ROOT_KEY_CHARS


def test_without_a_file_a_random_root_is_made_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omnistage.operator"):
        one = admin_credential.load(None)
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    two = admin_credential.load(None)
    assert one.ephemeral and one.source is None
    assert one.root != two.root and len(one.root) >= MIN_ROOT_KEY_CHARS
    assert "restart" in record.getMessage() and "rolls every orchestrator" in record.getMessage()
    assert one.root.decode() not in caplog.text


def test_the_flag_and_a_bad_file_exit_2_naming_the_path(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """`omnistage operator --admin-key-file PATH` with a bad file stops before it connects to
    anything, as the other flag errors do."""
    from omni_operator.main import main
    from tests.unit.test_network_policy import _args

    assert _args().admin_key_file is None
    short = tmp_path / "short"
    short.write_text("too-short")
    args = _args(f"--admin-key-file={short}")
    assert args.admin_key_file == str(short)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"error: --admin-key-file {short}: a key of 9 characters is too short" in err
    assert "too-short" not in err.replace(f"{short}", "")
