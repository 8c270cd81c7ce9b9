"""The local image store of the pod runner's image mode: what hack/build-images.sh built.

Why: a kubelet pulls an image and runs its entrypoint as its user in its root filesystem. Here
no registry is reachable; hack/build-images.sh builds the images, unpacks each one once, and
writes an index (image reference -> rootfs and image config). This module reads that index and
applies the Kubernetes rules that combine an image with a container spec (command/args against
ENTRYPOINT/CMD, runAsUser against USER, workingDir against WORKDIR). An image that is not in
the index is an error the runner reports as ErrImagePull, never a silent fallback.

``python -m tests.harness.images canary`` is hack/test.sh's image canary: it runs each image's
entry point (and an import of what its pods need) once, the way image mode runs a container, so
an image that cannot start ends the CI run in seconds instead of after the e2e suite's timeouts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness.sandbox import START_ERROR_EXIT, Mount, SandboxSpec, launcher_argv

REPO = Path(__file__).resolve().parents[2]
INDEX_ENV = "OMNISTAGE_IMAGE_INDEX"


class ImageError(Exception):
    """A container cannot be created from its image; ``reason`` is the kubelet's word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ImageInfo:
    ref: str
    id: str
    rootfs: str
    config: dict[str, Any]

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config.get("Env") or [])

    def user(self) -> tuple[str, str]:
        """The image's USER as (user, group) strings; empty means root."""
        user, _, group = (self.config.get("User") or "").partition(":")
        return user, group


class LocalImages:
    """The index, re-read when hack/build-images.sh rewrites it."""

    def __init__(self, index: Path) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._mtime = -1.0
        self._images: dict[str, ImageInfo] = {}

    def _load(self) -> dict[str, ImageInfo]:
        with self._lock:
            try:
                mtime = self.index.stat().st_mtime
            except OSError:
                return {}
            if mtime != self._mtime:
                data = json.loads(self.index.read_text())
                self._images = {
                    ref: ImageInfo(ref, e["id"], e["rootfs"], e.get("config") or {})
                    for ref, e in data.get("images", {}).items()
                }
                self._mtime = mtime
            return self._images

    def refs(self) -> list[str]:
        return sorted(self._load())

    def lookup(self, ref: str) -> ImageInfo:
        """The image for a container's ``image`` field, or ErrImagePull."""
        images = self._load()
        info = images.get(ref) or images.get(_qualified(ref))
        if info is None:
            raise ImageError(
                "ErrImagePull",
                f'failed to pull image "{ref}": not in the local image store {self.index} '
                "(the local pod runner cannot reach a registry; build it with "
                "hack/build-images.sh)",
            )
        if not Path(info.rootfs, "etc").is_dir():
            raise ImageError(
                "ErrImagePull",
                f'image "{ref}" is in {self.index} but its rootfs {info.rootfs} is gone '
                "(rerun hack/build-images.sh)",
            )
        return info


def _qualified(ref: str) -> str:
    """docker.io's implicit prefixes: ``python:3.11`` is ``docker.io/library/python:3.11``."""
    name = ref.split("/", 1)
    if len(name) == 1:
        return f"docker.io/library/{ref}"
    if "." not in name[0] and ":" not in name[0] and name[0] != "localhost":
        return f"docker.io/{ref}"
    return ref


def container_argv(image: ImageInfo, spec: dict[str, Any]) -> list[str]:
    """Kubernetes' rule: command replaces ENTRYPOINT (and drops CMD); args replace CMD."""
    entrypoint = list(image.config.get("Entrypoint") or [])
    cmd = list(image.config.get("Cmd") or [])
    if spec.get("command"):
        argv = list(spec["command"]) + list(spec.get("args") or [])
    elif spec.get("args"):
        argv = entrypoint + list(spec["args"])
    else:
        argv = entrypoint + cmd
    if not argv:
        raise ImageError("CreateContainerError",
                         f'image "{image.ref}" has no entrypoint and the container no command')
    return argv


def _lookup_id(rootfs: str, db: str, name: str) -> int | None:
    """A user or group name from the image's /etc/passwd or /etc/group."""
    try:
        for line in Path(rootfs, "etc", db).read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 2 and fields[0] == name:
                return int(fields[2])
    except OSError:
        pass
    return None


def _passwd_gid(rootfs: str, uid: int) -> int | None:
    try:
        for line in Path(rootfs, "etc", "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 3 and fields[2] == str(uid):
                return int(fields[3])
    except (OSError, ValueError):
        pass
    return None


def container_user(image: ImageInfo, pod_sc: dict[str, Any], sc: dict[str, Any]
                   ) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary groups) as a kubelet resolves them, with runAsNonRoot checked."""
    user, group = image.user()
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if uid is None:
        if user and not user.isdigit():
            if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                raise ImageError(
                    "CreateContainerConfigError",
                    f"container has runAsNonRoot and image has non-numeric user ({user}), "
                    "cannot verify user is non-root",
                )
            found = _lookup_id(image.rootfs, "passwd", user)
            if found is None:
                raise ImageError("CreateContainerError", f"unable to find user {user}")
            uid = found
        else:
            uid = int(user or 0)
    if uid == 0 and sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        raise ImageError("CreateContainerConfigError",
                         "container has runAsNonRoot and image will run as root")
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if gid is None:
        if group:
            gid = int(group) if group.isdigit() else _lookup_id(image.rootfs, "group", group) or 0
        else:  # the user's primary group in the image's /etc/passwd, else root's
            gid = _passwd_gid(image.rootfs, int(uid)) or 0
    groups = [gid, *pod_sc.get("supplementalGroups", [])]
    if "fsGroup" in pod_sc:
        groups.append(pod_sc["fsGroup"])
    return int(uid), int(gid), sorted(set(groups))


# ---- the image canary (hack/test.sh) ------------------------------------------------------------


@dataclass(frozen=True)
class CanaryCheck:
    """One command run once in one image: ``command`` replaces the entry point, else ``args``
    go to it (Kubernetes' rules, as a pod spec would say)."""

    image: str  # the index entry's name: runtime or operator
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()


#: What every pod of each image needs: the entry point starts, and the modules it runs import.
CANARY_CHECKS = (
    CanaryCheck("runtime", command=("python3", "-c", "import torch, omnistage.worker.server, "
                                    "omnistage.orchestrator.main")),
    CanaryCheck("runtime"),  # ENTRYPOINT + CMD: `omnistage --help`
    CanaryCheck("operator", command=("python3", "-c", "import kopf, omni_operator.main, "
                                     "omni_operator.command")),
    CanaryCheck("operator", args=("--help",)),  # ENTRYPOINT: `omnistage operator --help`
)
CANARY_TIMEOUT = 60.0
"""Seconds per check: a hang guard (a torch import, the slowest of them, takes seconds)."""


@dataclass
class CanaryResult:
    check: CanaryCheck
    ref: str
    argv: list[str]
    rc: int | None  # None: it did not finish within the limit
    seconds: float
    output: str  # stderr then stdout, or why it could not run

    @property
    def ok(self) -> bool:
        return self.rc == 0


def _entries_by_name(index: Path) -> dict[str, ImageInfo]:
    """The index's images by their name (runtime, operator), under their version reference."""
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise ImageError("ErrImagePull", f"cannot read the image index {index}: {e}") from e
    out: dict[str, ImageInfo] = {}
    for ref, e in sorted(data.get("images", {}).items()):
        if e.get("name") and e["name"] not in out:
            out[e["name"]] = ImageInfo(ref, e["id"], e["rootfs"], e.get("config") or {})
    return out


def run_check(images: LocalImages, info: ImageInfo | None, check: CanaryCheck,
              timeout: float = CANARY_TIMEOUT) -> CanaryResult:
    """Run one check as image mode runs a container: the image's rootfs read-only under an
    overlay, its USER, its Env, a writable /tmp (the emptyDir the operator mounts there)."""
    spec = {"command": list(check.command), "args": list(check.args)}
    if info is None:
        return CanaryResult(check, "?", [], -1, 0.0,
                            f"no {check.image!r} image in {images.index} (hack/build-images.sh)")
    argv: list[str] = []
    started = time.monotonic()
    try:
        info = images.lookup(info.ref)
        argv = container_argv(info, spec)
        uid, gid, groups = container_user(info, {}, {})
    except ImageError as e:
        return CanaryResult(check, info.ref, argv, -1, 0.0, f"{e.reason}: {e.message}")
    with tempfile.TemporaryDirectory(prefix="omnistage-canary-") as tmp:
        tmpdir = Path(tmp, "tmp")
        tmpdir.mkdir()
        tmpdir.chmod(0o1777)
        sandbox = SandboxSpec(
            rootfs=info.rootfs, scratch=str(Path(tmp, "fs")), argv=argv,
            env={**info.env, "HOSTNAME": f"canary-{check.image}"}, uid=uid, gid=gid,
            groups=groups, workdir=info.config.get("WorkingDir") or "/", read_only_root=True,
            no_new_privs=True, mounts=[Mount(str(tmpdir), "/tmp")],
            error_file=str(Path(tmp, "start-error.json")))
        sandbox.write(Path(tmp, "sandbox.json"))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(launcher_argv(Path(tmp, "sandbox.json")), env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, text=True,
                                errors="replace")
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = None
        if rc == START_ERROR_EXIT and Path(sandbox.error_file).is_file():
            start = json.loads(Path(sandbox.error_file).read_text() or "{}")
            err = f"{start.get('reason')}: {start.get('message')}\n{err}"
    return CanaryResult(check, info.ref, argv, rc, time.monotonic() - started,
                        (err or "") + (out or ""))


def canary(index: Path, checks: tuple[CanaryCheck, ...] = CANARY_CHECKS,
           timeout: float = CANARY_TIMEOUT) -> list[CanaryResult]:
    """Every check, all at once (the slowest one bounds the wall time)."""
    images = LocalImages(index)
    by_name = _entries_by_name(index)
    results: list[CanaryResult | None] = [None] * len(checks)

    def one(i: int) -> None:
        results[i] = run_check(images, by_name.get(checks[i].image), checks[i], timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(checks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def summary(results: list[CanaryResult], tail: int = 15) -> str:
    """One line per check; for a failed one, the image, the command and its output's tail."""
    lines = []
    for r in results:
        how = ("ok" if r.ok else "TIMED OUT" if r.rc is None else
               "CANNOT START" if r.rc == -1 else f"FAILED (exit {r.rc})")
        lines.append(f"  {how:<16} {r.check.image:<9} {r.ref}  $ {' '.join(r.argv) or '-'}  "
                     f"({r.seconds:.1f}s)")
        if not r.ok:
            lines += [f"      | {line}" for line in r.output.rstrip().splitlines()[-tail:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the image canary (hack/test.sh).")
    parser.add_argument("command", choices=("canary",))
    parser.add_argument("--index", type=Path, default=os.environ.get(INDEX_ENV) or None,
                        required=not os.environ.get(INDEX_ENV),
                        help=f"image index (hack/build-images.sh --print-index; ${INDEX_ENV})")
    parser.add_argument("--timeout", type=float, default=CANARY_TIMEOUT,
                        help="seconds each check may take (default %(default)s)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("the image canary needs root, as image mode does (overlay mounts)")
    started = time.monotonic()
    try:
        results = canary(args.index, timeout=args.timeout)
    except ImageError as e:
        print(f"image canary: FAILED: {e.message}", file=sys.stderr)
        return 1
    failed = [r for r in results if not r.ok]
    print(f"image canary: {len(results) - len(failed)} of {len(results)} checks passed in "
          f"{time.monotonic() - started:.1f}s (limit {args.timeout:g}s each)")
    print(summary(results))
    if failed:
        names = ", ".join(sorted({r.check.image for r in failed}))
        print(f"image canary: FAILED: the {names} image cannot start; see the output above",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
