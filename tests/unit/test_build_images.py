"""hack/build_images.py without building: what is forwarded to a build, and what the cache key
covers. The builds themselves run in hack/test.sh (and tests/e2e runs what they produced)."""

from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bi() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_images", REPO / "hack" / "build_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_images"] = module
    spec.loader.exec_module(module)
    return module


def test_pip_configuration_becomes_build_secrets(
    bi: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nsandbox\n-----END CERTIFICATE-----\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"")
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\ncert = /nowhere.pem\n")
    monkeypatch.setattr(bi, "PIP_CONFIG_FILES", (conf,))
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CERT", str(ca))
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{wheels} /empty/or/missing")
    out = tmp_path / "out"
    out.mkdir()
    secrets, volumes = bi.pip_secrets(out)
    assert set(secrets) == {"pipconf", "pipca"}
    assert secrets["pipca"].read_text() == ca.read_text()
    parsed = configparser.ConfigParser()
    parsed.read(secrets["pipconf"])
    assert parsed["global"]["index-url"] == "https://mirror.example/simple"
    assert parsed["global"]["default-timeout"] == "180"
    assert parsed["global"]["cert"] == "/run/secrets/pipca"  # where the build sees the secret
    assert parsed["global"]["find-links"] == str(wheels)  # the missing directory is dropped
    assert volumes == [str(wheels)]
    assert oct(secrets["pipconf"].stat().st_mode & 0o777) == "0o600"


def test_no_package_index_configuration_in_the_dockerfiles() -> None:
    for path in (REPO / "runtime" / "Dockerfile", REPO / "operator" / "Dockerfile",
                 REPO / "hack" / "image-install.sh"):
        text = path.read_text()
        assert "PIP_INDEX" not in text and "PIP_CERT" not in text and "trusted-host" not in text
        assert "/etc/pip.conf" not in text


def test_the_cache_key_covers_sources_but_not_bytecode(
    bi: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for rel in (*bi.COMMON_INPUTS, "runtime/Dockerfile", "runtime/omnistage/__init__.py",
                "operator/omni_operator/__init__.py"):
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest)
    monkeypatch.setattr(bi, "REPO", tmp_path)
    [runtime] = [i for i in bi.IMAGES if i.name == "runtime"]
    key = bi.inputs_digest(runtime, "sha256:base", {"TORCH_VARIANT": "cuda"})
    cache = tmp_path / "runtime" / "omnistage" / "__pycache__"
    cache.mkdir()
    (cache / "x.cpython-311.pyc").write_bytes(b"\0")
    assert bi.inputs_digest(runtime, "sha256:base", {"TORCH_VARIANT": "cuda"}) == key
    assert bi.inputs_digest(runtime, "sha256:base", {"TORCH_VARIANT": "cpu"}) != key
    assert bi.inputs_digest(runtime, "sha256:other", {"TORCH_VARIANT": "cuda"}) != key
    (tmp_path / "runtime" / "omnistage" / "new.py").write_text("x = 1\n")
    assert bi.inputs_digest(runtime, "sha256:base", {"TORCH_VARIANT": "cuda"}) != key
