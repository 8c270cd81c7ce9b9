#!/usr/bin/env python3
"""Build (or reuse) the Omnistage container images: the runtime image and the operator image.

Why a script: the Helm chart and the e2e suite run these images, so CI builds them on a fresh
machine, and developers rebuild them after a change. It works with Docker where a Docker engine
runs and with buildah (daemonless: ``--isolation chroot``) everywhere else. Where no registry is
reachable, the public base image cannot be pulled, so it builds an equivalent Debian base with
mmdebstrap first. Each image is cached by a content hash of its inputs (Dockerfile, install
script, pyproject.toml, README.md, the sources, the base image id, the build arguments), the way
hack/build_k8s.py caches binaries: a warm run only hashes and checks, in seconds. The cache is
keyed by that hash alone (the image's ``<repository>:<hash>`` tag), never by the checkout's
path, so a second checkout of the same sources reuses the image instead of rebuilding it.

``OMNISTAGE_BREAK_IMAGE=1`` (test-only) builds a runtime image whose entry point fails, to prove
that hack/test.sh's image canary stops the run (docs/testing.md).

After a build each image is unpacked ONCE into a read-only root filesystem that every pod of the
local pod runner shares (tests/harness/podrunner.py, image mode); ``index.json`` maps each image
reference to that rootfs and the image's config (Env, User, WorkingDir, Entrypoint, Cmd).
"""

from __future__ import annotations

import argparse
import ast
import configparser
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parent
REPO = HACK.parent
VERSION_FILE = REPO / "runtime" / "omnistage" / "__init__.py"

#: Files every image build copies, besides the sources below (see .dockerignore).
COMMON_INPUTS = ("pyproject.toml", "README.md", ".dockerignore", "hack/image-install.sh")
SOURCE_DIRS = ("runtime", "operator")
SKIP_PARTS = ("__pycache__", ".pytest_cache", ".ruff_cache")
SKIP_SUFFIXES = (".pyc", ".pyo")

#: The public base the Dockerfiles name (pinned by digest); used where it can be pulled.
PUBLIC_BASE = (
    "docker.io/library/python:3.11-slim-bookworm"
    "@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91"
)
#: The equivalent base built with mmdebstrap where no registry is reachable: the same Debian
#: release as python:3.11-slim-bookworm, with Debian's CPython 3.11 and venv.
LOCAL_BASE_REPO = "localhost/omnistage-base"
DEBIAN_SUITE = "bookworm"
#: A stable name for "the Python base", whichever base was used (test pods run python3 in it).
BASE_ALIAS = f"{LOCAL_BASE_REPO}:{DEBIAN_SUITE}"
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEBIAN_MIRROR = os.environ.get("OMNISTAGE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_SECURITY = os.environ.get(
    "OMNISTAGE_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security"
)
MMDEBSTRAP_OPTIONS = (
    "--variant=minbase",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    '--aptopt=Acquire::Languages "none"',
    '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin',
)
#: The config a container runtime needs from an image (OCI image config keys).
CONFIG_KEYS = ("Env", "User", "WorkingDir", "Entrypoint", "Cmd", "Labels")


@dataclass(frozen=True)
class Image:
    """One image this script builds."""

    name: str
    dockerfile: str
    repository: str
    torch: bool  # takes the TORCH_VARIANT build argument

    def ref(self, version: str) -> str:
        return f"{self.repository}:{version}"


IMAGES = (
    Image("runtime", "runtime/Dockerfile", "ghcr.io/omnistage/omnistage", torch=True),
    Image("operator", "operator/Dockerfile", "ghcr.io/omnistage/omnistage-operator", torch=False),
)


def log(msg: str) -> None:
    """Progress on stderr with a timestamp, so a cold build that takes minutes is visibly alive."""
    print(f"[build-images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_id(image_id: str) -> str:
    """The first 12 hex digits of an image id, with or without its ``sha256:`` prefix."""
    return image_id.split(":")[-1][:12]


def die(msg: str) -> SystemExit:
    return SystemExit(f"build-images: {msg}")


def version() -> str:
    """The package version: the one version source (runtime/omnistage/__init__.py)."""
    tree = ast.parse(VERSION_FILE.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise die(f"no __version__ in {VERSION_FILE}")


def cache_dir() -> Path:
    base = os.environ.get("OMNISTAGE_CACHE") or str(Path.home() / ".cache" / "omnistage")
    return Path(base) / "images"


def checkout_id() -> str:
    """Several checkouts (git worktrees) share one cache and its images; each has its own index
    (a small file: which image each reference means for THIS checkout's sources), so one
    checkout's build never changes the images another one's pods run. Only the index is per
    path: what is built is found by its inputs' hash (``content_ref``)."""
    return hashlib.sha256(str(REPO).encode()).hexdigest()[:12]


def index_path() -> Path:
    """Where this checkout's image index lives; the pod runner's image mode reads it."""
    return cache_dir() / "index" / f"{checkout_id()}.json"


# ---- inputs and their hash ----------------------------------------------------------------------


def input_files() -> list[Path]:
    """Every file an image build copies from the repository (a superset is safe: it only
    costs a rebuild)."""
    files = [REPO / p for p in COMMON_INPUTS]
    for top in SOURCE_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            rel = path.relative_to(REPO)
            if not path.is_file() or path.name.endswith(SKIP_SUFFIXES):
                continue
            if any(part in SKIP_PARTS or part.endswith(".egg-info") for part in rel.parts):
                continue
            files.append(path)
    return files


#: Test-only build argument of the runtime image: "1" replaces its entry point with one that
#: fails (runtime/Dockerfile), so a CI run can prove that the image canary stops it.
BREAK_ENV = "OMNISTAGE_BREAK_IMAGE"


def build_args(image: Image, base: str, variant: str,
               env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """The build arguments that decide an image's content (all of them enter its cache key)."""
    args = {"BASE_IMAGE": base}
    if image.torch:
        args["TORCH_VARIANT"] = variant
    broken = env.get(BREAK_ENV) or "0"
    if broken not in ("0", "1"):
        raise die(f"{BREAK_ENV} must be 0 or 1 (1: a runtime image whose entry point fails, "
                  f"for testing the image canary), not {broken!r}")
    if broken == "1" and image.name == "runtime":
        log(f"{BREAK_ENV}=1: building a runtime image whose entry point fails (test only)")
        args[BREAK_ENV] = "1"
    return args


def content_ref(image: Image, key: str) -> str:
    """The tag that names an image by its inputs' hash: the cache lookup of every checkout."""
    return f"{image.repository}:{key[:12]}"


def inputs_digest(image: Image, base_id: str, build_args: dict[str, str]) -> str:
    h = hashlib.sha256()
    for part in (image.name, image.dockerfile, base_id, json.dumps(build_args, sort_keys=True)):
        h.update(part.encode() + b"\0")
    for path in [REPO / image.dockerfile, *input_files()]:
        h.update(str(path.relative_to(REPO)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


# ---- the host's package-index configuration, forwarded as build secrets ------------------------

PIP_CONFIG_FILES = (
    Path("/etc/xdg/pip/pip.conf"),
    Path("/etc/pip.conf"),
    Path.home() / ".pip" / "pip.conf",
    Path.home() / ".config" / "pip" / "pip.conf",
)
SECRET_DIR = "/run/secrets"


def pip_secrets(workdir: Path) -> tuple[dict[str, Path], list[str]]:
    """A pip.conf for the build (host config files + PIP_* variables, in pip's own precedence)
    and the CA bundle it names, as build secrets; plus local find-links directories to mount.

    Paths inside the config are rewritten to where the build sees the secrets. Nothing here is
    ever written into a Dockerfile, an ENV, a build argument or a layer.
    """
    conf = configparser.ConfigParser(interpolation=None)
    files = [*PIP_CONFIG_FILES]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    for path in files:
        if path.is_file():
            conf.read(path)
    if not conf.has_section("global"):
        conf.add_section("global")
    for key, value in sorted(os.environ.items()):
        if key.startswith("PIP_") and key != "PIP_CONFIG_FILE":
            conf.set("global", key[4:].lower().replace("_", "-"), value)
    ca = conf.get("global", "cert", fallback="") or os.environ.get(
        "REQUESTS_CA_BUNDLE", os.environ.get("SSL_CERT_FILE", "")
    )
    secrets: dict[str, Path] = {}
    if ca and Path(ca).is_file():
        dest = workdir / "pipca"
        shutil.copyfile(ca, dest)
        secrets["pipca"] = dest
        conf.set("global", "cert", f"{SECRET_DIR}/pipca")
    elif conf.has_option("global", "cert"):
        conf.remove_option("global", "cert")
    volumes = []
    for section in conf.sections():
        if conf.has_option(section, "find-links"):
            links = conf.get(section, "find-links").split()
            # Local directories that exist are mounted read-only at the same path.
            # (an empty one is dropped: mounting it would only leave an empty mount point).
            local = [p for p in links if "://" not in p and Path(p).is_dir() and any(
                Path(p).iterdir())]
            volumes += local
            kept = [p for p in links if "://" in p or p in local]
            if kept:
                conf.set(section, "find-links", " ".join(kept))
            else:
                conf.remove_option(section, "find-links")
    dest = workdir / "pipconf"
    with open(dest, "w") as f:
        conf.write(f)
    secrets["pipconf"] = dest
    for p in secrets.values():
        p.chmod(0o600)
    return secrets, sorted(set(volumes))


# ---- running tools with progress ----------------------------------------------------------------


def run(cmd: list[str], *, check: bool = True, capture: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, text=True, capture_output=capture, check=False, env=env)
    if check and proc.returncode != 0:
        out = (proc.stdout or "")[-4000:] + (proc.stderr or "")[-4000:]
        raise die(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out}")
    return proc


def run_streaming(cmd: list[str], label: str, env: dict[str, str] | None = None) -> None:
    """Run a long build, echoing its steps and a heartbeat every 30 s of silence."""
    log(f"$ {' '.join(cmd)}")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, bufsize=1)
    assert proc.stdout is not None
    last = [time.monotonic()]
    tail: list[str] = []
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(5):
            if time.monotonic() - last[0] >= 30:
                last[0] = time.monotonic()
                log(f"{label}: still building ({time.monotonic() - started:.0f}s)")

    t = threading.Thread(target=heartbeat, daemon=True)
    t.start()
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-199:], line]
        if line:
            last[0] = time.monotonic()
            print(f"  {label} | {line}", file=sys.stderr, flush=True)
    rc = proc.wait()
    done.set()
    if rc != 0:
        raise die(f"{label}: build failed ({rc}) after {time.monotonic() - started:.0f}s")
    log(f"{label}: built in {time.monotonic() - started:.0f}s")


def ensure_packages(*commands: str) -> None:
    """Install missing Debian packages (command -> package of the same name) with apt-get."""
    missing = [c for c in commands if shutil.which(c) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise die(f"missing {', '.join(missing)}: install them (Debian: apt-get install "
                  f"{' '.join(missing)}) or run where Docker is available")
    log(f"installing {', '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


# ---- builders -----------------------------------------------------------------------------------


class Builder:
    """What this script needs from docker or buildah."""

    kind = ""

    def image_id(self, ref: str) -> str | None:
        raise NotImplementedError

    def pull(self, ref: str) -> bool:
        raise NotImplementedError

    def import_rootfs(self, tarball: Path, ref: str, config: dict[str, Any]) -> None:
        raise NotImplementedError

    def build(self, image: Image, tags: list[str], args: dict[str, str],
              secrets: dict[str, Path], volumes: list[str]) -> None:
        raise NotImplementedError

    def config(self, image_id: str) -> dict[str, Any]:
        raise NotImplementedError

    def tag(self, image_id: str, ref: str) -> None:
        """Point ``ref`` at ``image_id``."""
        raise NotImplementedError

    def rootfs(self, name: str, image_id: str) -> Path:
        """A read-only-use root filesystem of the image, unpacked once per image id."""
        raise NotImplementedError

    def prune(self, keep: set[str]) -> None:
        """Drop unpacked root filesystems whose image id is not in ``keep``."""

    def size(self, image_id: str) -> str:
        """Human-readable size of the image, as the builder reports it."""
        raise NotImplementedError


def overlay_works() -> bool:
    """Whether this kernel and our privileges allow overlay mounts (buildah's fast driver)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / d for d in ("lower", "upper", "work", "merged")]
        for d in dirs:
            d.mkdir()
        opts = f"lowerdir={dirs[0]},upperdir={dirs[1]},workdir={dirs[2]}"
        ok = run(["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs[3])],
                 check=False).returncode == 0
        if ok:
            run(["umount", str(dirs[3])], check=False)
        return ok


class Buildah(Builder):
    """Daemonless builds: ``--isolation chroot``, private storage under the cache.

    The storage driver is overlay where overlay mounts work (root here), else vfs, which works
    in any unprivileged sandbox but copies every layer whole; OMNISTAGE_STORAGE_DRIVER overrides.
    """

    kind = "buildah"

    def __init__(self) -> None:
        ensure_packages("buildah")
        driver = os.environ.get("OMNISTAGE_STORAGE_DRIVER") or (
            "overlay" if overlay_works() else "vfs")
        self.driver = driver
        root = cache_dir() / f"storage-{driver}"
        self.flags = ["--root", str(root / "root"), "--runroot", str(root / "run"),
                      "--storage-driver", driver]
        log(f"builder: buildah {self._version()} (isolation chroot, storage {driver} in {root})")

    def _version(self) -> str:
        return run(["buildah", "--version"]).stdout.split()[2]

    def cmd(self, *args: str) -> list[str]:
        return ["buildah", *self.flags, *args]

    def image_id(self, ref: str) -> str | None:
        proc = run(self.cmd("inspect", "--type", "image", "--format", "{{.FromImageID}}", ref),
                   check=False)
        return proc.stdout.strip() or None if proc.returncode == 0 else None

    def pull(self, ref: str) -> bool:
        proc = run(self.cmd("pull", "--quiet", ref), check=False)
        if proc.returncode != 0:
            log(f"cannot pull {ref}: {proc.stderr.strip().splitlines()[-1:]}")
        return proc.returncode == 0

    def import_rootfs(self, tarball: Path, ref: str, config: dict[str, Any]) -> None:
        ctr = run(self.cmd("from", "scratch")).stdout.strip()
        try:
            run(self.cmd("add", ctr, str(tarball), "/"))
            cfg = []
            for env in config.get("Env", []):
                cfg += ["--env", env]
            for key, value in config.get("Labels", {}).items():
                cfg += ["--label", f"{key}={value}"]
            cfg += ["--cmd", json.dumps(config.get("Cmd", []))]
            run(self.cmd("config", *cfg, ctr))
            run(self.cmd("commit", "--quiet", ctr, ref))
        finally:
            run(self.cmd("rm", ctr), check=False)

    def build(self, image: Image, tags: list[str], args: dict[str, str],
              secrets: dict[str, Path], volumes: list[str]) -> None:
        # Build containers an interrupted build left behind (we hold the build lock: no other
        # build is running in this storage).
        out = run(self.cmd("containers", "--format", "{{.ContainerName}}")).stdout.split()
        stale = [c for c in out if c.endswith("-working-container")
                 or "-working-container-" in c]
        if stale:
            log(f"removing {len(stale)} build container(s) of an interrupted build")
            run(self.cmd("rm", *stale), check=False)
        cmd = self.cmd("build", "--layers", "--isolation", "chroot", "--pull-never",
                       "-f", str(REPO / image.dockerfile))
        for tag in tags:
            cmd += ["-t", tag]
        for key, value in args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        for sid, path in secrets.items():
            cmd += ["--secret", f"id={sid},src={path}"]
        for vol in volumes:
            cmd += ["--volume", f"{vol}:{vol}:ro"]
        run_streaming([*cmd, str(REPO)], image.name)

    def config(self, image_id: str) -> dict[str, Any]:
        data = json.loads(run(self.cmd("inspect", "--type", "image", image_id)).stdout)
        cfg = data.get("OCIv1", {}).get("config", {})
        return {k: cfg.get(k) for k in CONFIG_KEYS if cfg.get(k) is not None}

    def tag(self, image_id: str, ref: str) -> None:
        run(self.cmd("tag", image_id, ref))

    def size(self, image_id: str) -> str:
        out = run(self.cmd("images", "--format", "{{.Size}}", image_id)).stdout
        return out.splitlines()[0].strip()

    def rootfs(self, name: str, image_id: str) -> Path:
        """One working container per image, mounted: its rootfs is what pods run in (read-only,
        each pod with its own writable layer and volumes). With overlay it costs nothing; with
        vfs it is one copy per image, never one per pod."""
        ctr = f"omnistage-rootfs-{short_id(image_id)}"
        proc = run(self.cmd("inspect", "--type", "container", "--format", "{{.FromImageID}}",
                            ctr), check=False)
        if proc.returncode != 0:
            log(f"{name}: unpacking the rootfs (once per image)")
            run(self.cmd("from", "--pull-never", "--name", ctr, image_id))
        return Path(run(self.cmd("mount", ctr)).stdout.strip())

    def prune(self, keep: set[str]) -> None:
        """Remove rootfs containers of images no index names any more."""
        out = run(self.cmd("containers", "--format", "{{.ContainerName}}|{{.ImageID}}")).stdout
        kept = {short_id(k) for k in keep}
        for line in out.splitlines():
            ctr, _, image_id = (part.strip() for part in line.partition("|"))
            if ctr.startswith("omnistage-rootfs-") and short_id(image_id) not in kept:
                log(f"removing the unused rootfs {ctr}")
                run(self.cmd("umount", ctr), check=False)
                run(self.cmd("rm", ctr), check=False)


class Docker(Builder):
    """A Docker engine (BuildKit for the build secrets); rootfs by ``docker export``."""

    kind = "docker"

    def __init__(self) -> None:
        log("builder: docker")

    def image_id(self, ref: str) -> str | None:
        proc = run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], check=False)
        return proc.stdout.strip() or None if proc.returncode == 0 else None

    def pull(self, ref: str) -> bool:
        return run(["docker", "pull", "--quiet", ref], check=False).returncode == 0

    def import_rootfs(self, tarball: Path, ref: str, config: dict[str, Any]) -> None:
        cmd = ["docker", "import"]
        for env in config.get("Env", []):
            cmd += ["--change", f"ENV {env.split('=', 1)[0]}={env.split('=', 1)[1]}"]
        cmd += ["--change", f"CMD {json.dumps(config.get('Cmd', []))}"]
        run([*cmd, str(tarball), ref])

    def build(self, image: Image, tags: list[str], args: dict[str, str],
              secrets: dict[str, Path], volumes: list[str]) -> None:
        cmd = ["docker", "build", "--progress=plain", "-f", str(REPO / image.dockerfile)]
        for tag in tags:
            cmd += ["-t", tag]
        for key, value in args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        for sid, path in secrets.items():
            cmd += ["--secret", f"id={sid},src={path}"]
        if volumes:
            log(f"docker cannot mount find-links directories {volumes} into a build; skipped")
        run_streaming([*cmd, str(REPO)], image.name, env={**os.environ, "DOCKER_BUILDKIT": "1"})

    def config(self, image_id: str) -> dict[str, Any]:
        data = json.loads(run(["docker", "image", "inspect", image_id]).stdout)[0]
        cfg = data.get("Config") or {}
        return {k: cfg.get(k) for k in CONFIG_KEYS if cfg.get(k) is not None}

    def tag(self, image_id: str, ref: str) -> None:
        run(["docker", "tag", image_id, ref])

    def size(self, image_id: str) -> str:
        out = run(["docker", "image", "inspect", "--format", "{{.Size}}", image_id]).stdout
        return f"{int(out.strip()) / 1e6:.0f} MB"

    def rootfs(self, name: str, image_id: str) -> Path:
        dest = cache_dir() / "rootfs" / short_id(image_id)
        if dest.is_dir():
            return dest
        tmp = dest.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cid = run(["docker", "create", image_id]).stdout.strip()
        try:
            export = subprocess.Popen(["docker", "export", cid], stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=export.stdout, check=True)
            if export.wait() != 0:
                raise die(f"docker export of {name} failed")
        finally:
            run(["docker", "rm", cid], check=False)
        tmp.rename(dest)
        return dest

    def prune(self, keep: set[str]) -> None:
        kept = {short_id(k) for k in keep}
        for path in (cache_dir() / "rootfs").glob("*"):
            if path.is_dir() and path.name[:12] not in kept:
                log(f"removing the unused rootfs {path}")
                shutil.rmtree(path, ignore_errors=True)


def pick_builder() -> Builder:
    choice = os.environ.get("OMNISTAGE_BUILDER", "auto")
    if choice == "docker" or (
        choice == "auto" and shutil.which("docker")
        and run(["docker", "info"], check=False).returncode == 0
    ):
        return Docker()
    if choice not in ("auto", "buildah"):
        raise die(f"OMNISTAGE_BUILDER must be auto, docker or buildah, not {choice!r}")
    return Buildah()


# ---- the base image -----------------------------------------------------------------------------


def local_base_key() -> str:
    h = hashlib.sha256()
    for part in (DEBIAN_SUITE, *DEBIAN_PACKAGES, DEBIAN_MIRROR, DEBIAN_SECURITY,
                 *MMDEBSTRAP_OPTIONS):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


def build_local_base(builder: Builder) -> str:
    """An equivalent of python:3.11-slim-bookworm from Debian packages (mmdebstrap)."""
    ref = f"{LOCAL_BASE_REPO}:{DEBIAN_SUITE}-{local_base_key()}"
    if builder.image_id(ref):
        log(f"base {ref}: cached")
        return ref
    ensure_packages("mmdebstrap")
    log(f"base {ref}: building {DEBIAN_SUITE} with {', '.join(DEBIAN_PACKAGES)} (mmdebstrap)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omnistage-base-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        sources = [
            f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE} main",
            f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE}-updates main",
            f"deb {DEBIAN_SECURITY} {DEBIAN_SUITE}-security main",
        ]
        cmd = ["mmdebstrap", *MMDEBSTRAP_OPTIONS, f"--include={','.join(DEBIAN_PACKAGES)}",
               DEBIAN_SUITE, str(tarball), *sources]
        run_streaming(cmd, "base")
        config = {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG=C.UTF-8"],
            "Cmd": ["python3"],
            "Labels": {
                "org.opencontainers.image.title": "omnistage-base",
                "org.opencontainers.image.description":
                    f"Debian {DEBIAN_SUITE} with {' '.join(DEBIAN_PACKAGES)} (mmdebstrap); "
                    "equivalent of python:3.11-slim-bookworm",
            },
        }
        builder.import_rootfs(tarball, ref, config)
    log(f"base {ref}: built in {time.monotonic() - started:.0f}s")
    return ref


def resolve_base(builder: Builder) -> str:
    """OMNISTAGE_BASE_IMAGE, else the pinned public base if it can be pulled, else a local one."""
    if os.environ.get("OMNISTAGE_BASE_IMAGE"):
        ref = os.environ["OMNISTAGE_BASE_IMAGE"]
        if not builder.image_id(ref) and not builder.pull(ref):
            raise die(f"OMNISTAGE_BASE_IMAGE={ref} is neither local nor pullable")
        return ref
    if builder.image_id(PUBLIC_BASE) or builder.pull(PUBLIC_BASE):
        return PUBLIC_BASE
    log("the public base cannot be pulled (no registry reachable): using a local Debian base")
    return build_local_base(builder)


# ---- state and index ----------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def git_revision() -> str:
    proc = run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False)
    return proc.stdout.strip() or "unknown"


def index_entry(builder: Builder, name: str, ref: str, image_id: str) -> dict[str, Any]:
    rootfs = builder.rootfs(name, image_id)
    if not (rootfs / "etc").is_dir():
        raise die(f"{name}: the unpacked rootfs {rootfs} looks empty")
    return {"name": name, "id": image_id, "rootfs": str(rootfs), "config": builder.config(image_id),
            "builder": builder.kind}


def build_all(only: list[str], force: bool, variant: str) -> dict[str, Any]:
    builder = pick_builder()
    ver = version()
    base = resolve_base(builder)
    base_id = builder.image_id(base) or ""
    index: dict[str, Any] = {base: index_entry(builder, "base", base, base_id)}
    index[BASE_ALIAS] = index[base]
    with tempfile.TemporaryDirectory(prefix="omnistage-pip-") as tmp:
        secrets, volumes = pip_secrets(Path(tmp))
        for image in IMAGES:
            args = build_args(image, base, variant)
            key = inputs_digest(image, base_id, args)
            ref, by_inputs = image.ref(ver), content_ref(image, key)
            # Found by the inputs' hash alone: whichever checkout built it, it is these sources.
            image_id = builder.image_id(by_inputs)
            if only and image.name not in only:
                if not image_id:
                    log(f"{image.name} {ref}: not built (out of date or missing); not indexed")
                    continue
                log(f"{image.name} {ref}: cached as {by_inputs}")
            elif image_id and not force:
                log(f"{image.name} {ref}: cached as {by_inputs}")
            else:
                log(f"{image.name} {ref}: building {by_inputs} (slow on a cold cache)")
                build = {**args, "VERSION": ver, "REVISION": git_revision()}
                builder.build(image, [ref, by_inputs], build, secrets, volumes)
                image_id = builder.image_id(by_inputs)
                if not image_id:
                    raise die(f"{image.name}: built, but {by_inputs} is not in the image store")
                log(f"{image.name}: {builder.size(image_id)}")
            if builder.image_id(ref) != image_id:
                builder.tag(image_id, ref)  # the version tag follows the last checkout built
            index[ref] = index_entry(builder, image.name, ref, image_id)
    write_json(index_path(), {"version": 1, "images": index})
    in_use = {e["id"] for path in (cache_dir() / "index").glob("*.json")
              for e in read_json(path).get("images", {}).values()}
    builder.prune(in_use)
    return index


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Concurrent callers (two test sessions) wait for one build instead of racing."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another build-images is running; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", metavar="IMAGE",
                        help=f"images to build: {', '.join(i.name for i in IMAGES)} (default: all)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--torch", choices=("cuda", "cpu"),
                        default=os.environ.get("OMNISTAGE_TORCH_VARIANT", "cuda"),
                        help="torch build in the runtime image (default cuda: PyPI's torch)")
    parser.add_argument("--print-index", action="store_true",
                        help="print the path of the image index and exit")
    parser.add_argument("--print-refs", action="store_true",
                        help="print NAME=REFERENCE of each image and exit")
    args = parser.parse_args(argv)
    unknown = set(args.only) - {i.name for i in IMAGES}
    if unknown:
        parser.error(f"unknown image(s) {', '.join(sorted(unknown))}")
    if args.print_index:
        print(index_path())
        return 0
    if args.print_refs:
        for image in IMAGES:
            print(f"{image.name}={image.ref(version())}")
        return 0
    started = time.monotonic()
    with locked():
        index = build_all(args.only, args.force, args.torch)
    for ref, entry in sorted(index.items()):
        if entry["name"] in ("runtime", "operator", "base"):
            log(f"  {ref} -> {entry['rootfs']}")
    log(f"done in {time.monotonic() - started:.1f}s; index {index_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
