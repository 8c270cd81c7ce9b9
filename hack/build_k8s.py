#!/usr/bin/env python3
"""Build the local Kubernetes test components from their official Go modules.

Why: this machine has Go and the module proxy but no Docker, so kind cannot run. We build the
real kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, kwok and helm and cache
them outside the repository (``$OMNISTAGE_CACHE/bin/<component>-<version>``). A warm run only
checks that the cached binaries exist, so it is safe to call before every test run.

``go install k8s.io/kubernetes/...`` cannot work because its go.mod replaces the staging modules
with local paths. We therefore generate a tiny main module that requires k8s.io/kubernetes at the
pinned version and replaces every staging module with its published ``v0.X.Y`` twin. The replace
list is read from kubernetes' own go.mod, so a version bump is one edit in hack/versions.env.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HACK = Path(__file__).resolve().parent
VERSIONS_FILE = HACK / "versions.env"
K8S_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
STAGING_RE = re.compile(r"^\s*(k8s\.io/[\w.\-/]+)\s*=>\s*\./staging/", re.M)


def log(msg: str) -> None:
    """Progress goes to stderr with a timestamp so a slow cold build is visibly alive."""
    print(f"[build-k8s {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse the KEY=VALUE pins shared with the shell scripts."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def cache_dir() -> Path:
    """The cache lives outside the repo so every checkout and CI run can share it."""
    base = os.environ.get("OMNISTAGE_CACHE") or str(Path.home() / ".cache" / "omnistage")
    return Path(base)


def go_env() -> dict[str, str]:
    """Static, reproducible builds: no cgo, no VCS stamping."""
    env = dict(os.environ)
    env.update({"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod -buildvcs=false", "GOTOOLCHAIN": "local"})
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command, echoing it; on failure show its output so a broken build is debuggable."""
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=cwd, env=env or go_env(), text=True, capture_output=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-10000:])
        raise SystemExit(f"build-k8s: command failed ({proc.returncode}): {' '.join(cmd)}")
    return proc.stdout


def run_build(cmd: list[str], cwd: Path) -> None:
    """Run ``go build -v`` and report progress every 20s; cold builds take minutes."""
    log("$ " + " ".join(cmd))
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=go_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    tail: list[str] = []
    count, started, last_report = 0, time.monotonic(), time.monotonic()
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-199:], line]
        count += 1
        if time.monotonic() - last_report >= 20:
            last_report = time.monotonic()
            log(f"  ... {count} packages built in {last_report - started:.0f}s (now: {line})")
    if proc.wait() != 0:
        sys.stderr.write("\n".join(tail) + "\n")
        raise SystemExit(f"build-k8s: command failed ({proc.returncode}): {' '.join(cmd)}")


@dataclass
class Target:
    """One Go main module producing one or more binaries."""

    name: str
    version: str
    binaries: tuple[str, ...]
    packages: tuple[str, ...]
    requires: dict[str, str]
    replaces: dict[str, str] = field(default_factory=dict)
    ldflags: list[str] = field(default_factory=list)
    main_src: Path | None = None
    # Only built when named on the command line (benchmark baselines, not test components).
    optional: bool = False
    # Rebuild a cached binary when its ldflags change (they must then be deterministic: no
    # build date). Off by default so binaries built before stamps existed stay cached.
    stamped: bool = False

    def outputs(self, bindir: Path) -> list[Path]:
        return [bindir / f"{b}-{self.version}" for b in self.binaries]

    def stamp(self) -> str:
        return hashlib.sha256(" ".join(self.ldflags).encode()).hexdigest()[:16]

    def stamp_file(self, bindir: Path) -> Path:
        return bindir / f".{self.name}-{self.version}.ldflags"

    def cached(self, bindir: Path) -> bool:
        """Every binary is there (and, when stamped, was linked with today's ldflags)."""
        if not all(p.exists() for p in self.outputs(bindir)):
            return False
        if not self.stamped:
            return True
        try:
            return self.stamp_file(bindir).read_text().strip() == self.stamp()
        except OSError:
            return False


def staging_replaces(k8s_version: str, workdir: Path) -> dict[str, str]:
    """Derive ``staging module => published v0.X.Y`` from k8s.io/kubernetes' own go.mod."""
    out = run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{k8s_version}"], cwd=workdir)
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    staging_version = "v0." + k8s_version.removeprefix("v").split(".", 1)[1]
    mods = STAGING_RE.findall(gomod)
    if not mods:
        raise SystemExit("build-k8s: found no './staging' replaces in kubernetes go.mod")
    return {m: staging_version for m in mods}


def k8s_ldflags(version: str) -> list[str]:
    """Version stamps that `kubectl version` and the apiserver's /version report."""
    major, minor = version.removeprefix("v").split(".")[:2]
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        for key, value in (
            ("gitVersion", version),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitCommit", "omnistage-module-build"),
            ("gitTreeState", "clean"),
            ("buildDate", date),
        ):
            flags.append(f"-X {pkg}.{key}={value}")
    return flags


def helm_ldflags(module: str, version: str, k8s_version: str) -> list[str]:
    """What helm's own release build (its Makefile) links in: its version, and the Kubernetes
    version that ``helm template`` and ``helm lint`` assume without a cluster. A module build
    without them believes Kubernetes is v1.20, and the chart's ``kubeVersion: >=1.30`` fails;
    here it is the control plane's version (K8S_VERSION). The paths are helm v3's."""
    if not module.endswith("/v3"):
        raise SystemExit(f"build-k8s: helm_ldflags knows helm v3's package paths, not {module} "
                         "(see that helm's Makefile for its k8sVersionMajor/Minor variables)")
    major, minor = k8s_version.removeprefix("v").split(".")[:2]
    flags = [f"-X {module}/internal/version.version={version}"]
    for pkg in ("pkg/chartutil", "pkg/lint/rules"):
        flags += [f"-X {module}/{pkg}.k8sVersionMajor={major}",
                  f"-X {module}/{pkg}.k8sVersionMinor={minor}"]
    return flags


def targets(v: dict[str, str], workdir: Path) -> list[Target]:
    """All components; the Kubernetes replace list is only computed when that target is stale."""
    k8s = v["K8S_VERSION"]
    kwok, helm, etcd = v["KWOK_VERSION"], v["HELM_VERSION"], v["ETCD_VERSION"]
    lws = v["LWS_VERSION"]
    helm_major = helm.split(".")[0]
    helm_mod = "helm.sh/helm/v3" if helm_major == "v3" else f"helm.sh/helm/{helm_major}"
    return [
        Target(
            name="kubernetes",
            version=k8s,
            binaries=K8S_COMPONENTS,
            packages=tuple(f"k8s.io/kubernetes/cmd/{c}" for c in K8S_COMPONENTS),
            requires={"k8s.io/kubernetes": k8s},
            ldflags=k8s_ldflags(k8s),
        ),
        Target(
            name="etcd",
            version=etcd,
            binaries=("etcd",),
            packages=(".",),
            requires={"go.etcd.io/etcd/server/v3": etcd},
            main_src=HACK / "k8s-build" / "etcd" / "main.go",
        ),
        Target(
            name="kwok",
            version=kwok,
            binaries=("kwok",),
            packages=("sigs.k8s.io/kwok/cmd/kwok",),
            requires={"sigs.k8s.io/kwok": kwok},
            ldflags=[f"-X sigs.k8s.io/kwok/pkg/consts.Version={kwok}"],
        ),
        Target(
            name="helm",
            version=helm,
            binaries=("helm",),
            packages=(f"{helm_mod}/cmd/helm",),
            requires={helm_mod: helm},
            ldflags=helm_ldflags(helm_mod, helm, k8s),
            stamped=True,  # a K8S_VERSION bump relinks helm
        ),
        # LeaderWorkerSet's controller: the Go controller-runtime baseline of
        # bench/bench_operator_scale.py --lws (`hack/build-k8s.sh lws`).
        Target(
            name="lws",
            version=lws,
            binaries=("lws-controller",),
            packages=("sigs.k8s.io/lws/cmd",),
            requires={"sigs.k8s.io/lws": lws},
            ldflags=[f"-X sigs.k8s.io/lws/pkg/version.GitVersion={lws}"],
            optional=True,
        ),
    ]


def build(t: Target, bindir: Path, srcroot: Path, k8s_version: str) -> None:
    """Generate the main module for ``t`` and build its binaries into the cache atomically."""
    moddir = srcroot / f"{t.name}-{t.version}"
    moddir.mkdir(parents=True, exist_ok=True)
    if not (moddir / "go.mod").exists():
        run(["go", "mod", "init", f"omnistage.local/build/{t.name}"], cwd=moddir)
    if t.main_src is not None:
        shutil.copy(t.main_src, moddir / "main.go")
    if t.name == "kubernetes":
        t.replaces = staging_replaces(k8s_version, moddir)
        log(f"replacing {len(t.replaces)} staging modules with their published twins")
    edit = ["go", "mod", "edit"]
    edit += [f"-require={m}@{ver}" for m, ver in t.requires.items()]
    edit += [f"-replace={m}={m}@{ver}" for m, ver in t.replaces.items()]
    run(edit, cwd=moddir)
    # Resolve the module graph (and go.sum) once; 'go build -mod=mod' then fills in the rest.
    run(["go", "mod", "download", *t.requires], cwd=moddir)
    with tempfile.TemporaryDirectory(dir=bindir) as tmp:
        ldflags = " ".join(["-s", "-w", *t.ldflags])
        cmd = ["go", "build", "-v", "-trimpath", f"-ldflags={ldflags}", "-o", tmp + "/"]
        cmd += t.packages
        if len(t.packages) == 1 and len(t.binaries) == 1:  # name the binary, not its folder
            cmd[-2:] = [str(Path(tmp) / t.binaries[0]), t.packages[0]]
        started = time.monotonic()
        run_build(cmd, cwd=moddir)
        for b in t.binaries:
            os.replace(Path(tmp) / b, bindir / f"{b}-{t.version}")
        if t.stamped:
            t.stamp_file(bindir).write_text(t.stamp() + "\n")
        log(f"built {t.name} {t.version} in {time.monotonic() - started:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="targets to build (default: all)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--print-bindir", action="store_true", help="print the bin dir and exit")
    args = parser.parse_args(argv)

    versions = read_versions()
    cache = cache_dir()
    bindir, srcroot = cache / "bin", cache / "src"
    if args.print_bindir:
        print(bindir)
        return 0
    bindir.mkdir(parents=True, exist_ok=True)
    srcroot.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # Concurrent callers (two test sessions, cluster.sh) wait for one build instead of racing.
    lock = open(cache / ".build.lock", "w")  # held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log("another build-k8s is running; waiting for it")
        fcntl.flock(lock, fcntl.LOCK_EX)
    for t in targets(versions, srcroot):
        if (args.only and t.name not in args.only) or (t.optional and t.name not in args.only):
            continue
        if not args.force and t.cached(bindir):
            log(f"{t.name} {t.version}: cached")
            continue
        log(f"{t.name} {t.version}: building {', '.join(t.binaries)} (slow on a cold cache)")
        build(t, bindir, srcroot, versions["K8S_VERSION"])
    # Unversioned links so humans can put $bindir on PATH; scripts use the versioned names.
    for t in targets(versions, srcroot):
        for b, p in zip(t.binaries, t.outputs(bindir), strict=True):
            link = bindir / b
            if p.exists() and (not link.is_symlink() or os.readlink(link) != p.name):
                link.unlink(missing_ok=True)
                link.symlink_to(p.name)
    log(f"done in {time.monotonic() - started:.1f}s; binaries in {bindir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
