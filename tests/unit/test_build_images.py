"""hack/build_images.py without building: what is forwarded to a build, and what the cache key
covers; and the flags hack/build_k8s.py links helm with. The builds themselves run in
hack/test.sh (and tests/e2e runs what they produced)."""

from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import subprocess
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


class FakeBuilder:
    """An image store in memory: what build_all asks of docker or buildah, and the builds."""

    kind = "fake"

    def __init__(self, rootfs: Path) -> None:
        self.tags: dict[str, str] = {"base": "sha256:base"}
        self.builds: list[tuple[str, dict[str, str]]] = []
        self.root = rootfs

    def image_id(self, ref: str) -> str | None:
        return self.tags.get(ref)

    def pull(self, ref: str) -> bool:
        return False

    def build(self, image: object, tags: list[str], args: dict[str, str],
              secrets: dict[str, Path], volumes: list[str]) -> None:
        name = image.name  # type: ignore[attr-defined]
        self.builds.append((name, args))
        for tag in tags:
            self.tags[tag] = f"sha256:{name}-{len(self.builds)}"

    def tag(self, image_id: str, ref: str) -> None:
        self.tags[ref] = image_id

    def size(self, image_id: str) -> str:
        return "1 MB"

    def config(self, image_id: str) -> dict[str, object]:
        return {}

    def rootfs(self, name: str, image_id: str) -> Path:
        path = self.root / image_id.split(":")[-1]
        (path / "etc").mkdir(parents=True, exist_ok=True)
        return path

    def prune(self, keep: set[str]) -> None:
        pass


def _checkout(bi: ModuleType, dest: Path) -> Path:
    """A checkout with everything the two images are built from."""
    for path in bi.input_files() + [REPO / i.dockerfile for i in bi.IMAGES]:
        rel = path.relative_to(REPO)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest / rel)
    return dest


@pytest.fixture
def store(bi: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeBuilder:
    builder = FakeBuilder(tmp_path / "rootfs")
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMNISTAGE_BASE_IMAGE", "base")
    monkeypatch.delenv(bi.BREAK_ENV, raising=False)
    monkeypatch.setattr(bi, "pick_builder", lambda: builder)
    monkeypatch.setattr(bi, "git_revision", lambda: "abc")
    return builder


def test_two_checkouts_of_the_same_sources_share_the_images(
    bi: ModuleType, store: FakeBuilder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is keyed by the inputs' hash, never by the checkout's path: a second worktree
    reuses the 6 GB image; a source change in one rebuilds there, and the other keeps its own."""
    first, second = _checkout(bi, tmp_path / "a"), _checkout(bi, tmp_path / "b")
    monkeypatch.setattr(bi, "REPO", first)
    index_a = bi.build_all([], False, "cuda")
    assert [name for name, _ in store.builds] == ["runtime", "operator"]
    path_a = bi.index_path()
    monkeypatch.setattr(bi, "REPO", second)
    assert bi.index_path() != path_a  # each checkout says which images ITS sources mean
    index_b = bi.build_all([], False, "cuda")
    assert len(store.builds) == 2  # nothing built for the second checkout
    assert {r: e["id"] for r, e in index_b.items()} == {r: e["id"] for r, e in index_a.items()}

    (second / "runtime" / "omnistage" / "new.py").write_text("x = 1\n")
    index_b = bi.build_all([], False, "cuda")
    assert [name for name, _ in store.builds[2:]] == ["runtime", "operator"]
    ref = next(r for r, e in index_b.items() if e["name"] == "runtime")
    monkeypatch.setattr(bi, "REPO", first)
    saved_a = bi.read_json(bi.index_path())["images"]
    assert saved_a[ref]["id"] == index_a[ref]["id"] != index_b[ref]["id"]
    # The first checkout, built again, gets its own image back (retagged), without a build.
    assert bi.build_all([], False, "cuda")[ref]["id"] == index_a[ref]["id"]
    assert len(store.builds) == 4 and store.tags[ref] == index_a[ref]["id"]


def test_the_break_argument_reaches_only_the_runtime_build_and_its_key(
    bi: ModuleType, store: FakeBuilder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bi, "REPO", _checkout(bi, tmp_path / "a"))
    healthy = bi.build_all([], False, "cuda")
    monkeypatch.setenv(bi.BREAK_ENV, "1")
    broken = bi.build_all([], False, "cuda")
    assert [(n, a.get(bi.BREAK_ENV)) for n, a in store.builds] == [
        ("runtime", None), ("operator", None), ("runtime", "1")]  # a cache entry of its own
    ref = next(r for r, e in broken.items() if e["name"] == "runtime")
    assert broken[ref]["id"] != healthy[ref]["id"]
    monkeypatch.setenv(bi.BREAK_ENV, "0")
    assert bi.build_all([], False, "cuda")[ref]["id"] == healthy[ref]["id"]  # no rebuild
    assert len(store.builds) == 3
    monkeypatch.setenv(bi.BREAK_ENV, "yes")
    with pytest.raises(SystemExit, match=r"OMNISTAGE_BREAK_IMAGE must be 0 or 1.*'yes'"):
        bi.build_all([], False, "cuda")
    dockerfile = (REPO / "runtime" / "Dockerfile").read_text()
    assert "ARG OMNISTAGE_BREAK_IMAGE=0" in dockerfile  # the Dockerfile takes the argument


# ---- hack/build_k8s.py: the helm it builds knows the control plane's Kubernetes version -------


@pytest.fixture(scope="module")
def bk() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_k8s", REPO / "hack" / "build_k8s.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_k8s"] = module
    spec.loader.exec_module(module)
    return module


def test_helm_is_linked_with_the_control_planes_kubernetes_version(
    bk: ModuleType, tmp_path: Path
) -> None:
    """Without these, `helm template charts/omnistage` assumes v1.20 and fails the chart's
    kubeVersion; a cached helm linked without them (no stamp) is rebuilt."""
    versions = bk.read_versions()
    major, minor = versions["K8S_VERSION"].removeprefix("v").split(".")[:2]
    [helm] = [t for t in bk.targets(versions, tmp_path) if t.name == "helm"]
    for pkg in ("pkg/chartutil", "pkg/lint/rules"):
        assert f"-X helm.sh/helm/v3/{pkg}.k8sVersionMajor={major}" in helm.ldflags
        assert f"-X helm.sh/helm/v3/{pkg}.k8sVersionMinor={minor}" in helm.ldflags
    (tmp_path / f"helm-{helm.version}").write_text("old helm")
    assert not helm.cached(tmp_path)  # built before the flags: relinked
    helm.stamp_file(tmp_path).write_text(helm.stamp() + "\n")
    assert helm.cached(tmp_path)
    other = bk.targets({**versions, "K8S_VERSION": "v1.99.0"}, tmp_path)
    assert not next(t for t in other if t.name == "helm").cached(tmp_path)
    [kubernetes] = [t for t in bk.targets(versions, tmp_path) if t.name == "kubernetes"]
    for out in kubernetes.outputs(tmp_path):
        out.write_text("")
    assert kubernetes.cached(tmp_path)  # unstamped targets: the binaries alone decide


@pytest.mark.binaries
def test_the_helm_variables_exist_in_the_pinned_helm(bk: ModuleType) -> None:
    """-X on a variable that does not exist links silently: check the pinned helm's source."""
    gomodcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                check=False).stdout.strip() if shutil.which("go") else ""
    version = bk.read_versions()["HELM_VERSION"]
    src = Path(gomodcache or "/nonexistent") / f"helm.sh/helm/v3@{version}"
    if not src.is_dir():
        pytest.skip(f"helm {version}'s module source is not in the Go module cache")
    for pkg in ("pkg/chartutil", "pkg/lint/rules"):
        text = "".join(p.read_text() for p in (src / pkg).glob("*.go"))
        assert 'k8sVersionMajor = "' in text and 'k8sVersionMinor = "' in text, pkg
