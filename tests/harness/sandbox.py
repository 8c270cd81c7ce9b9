"""Run one command inside an image's root filesystem: the container half of the pod runner's
image mode.

Why: the e2e suite must run the built images, not the checkout. hack/build-images.sh unpacks
each image once into a root filesystem that every container shares and nobody writes. The pod
runner starts ``python -m tests.harness.sandbox SPEC.json`` as root for each container; this
process, in a mount namespace of its own:

1. mounts an overlay: the image rootfs (the shared lower layer) plus a per-container upper
   directory, which only ever receives the mount points the container needs;
2. mounts /proc, a minimal /dev (null, zero, full, random, urandom, tty and a private /dev/shm),
   a read-only /sys, and the pod's volumes (bind mounts, read-only where the pod says so);
3. remounts the root read-only when ``readOnlyRootFilesystem`` is set;
4. chroots into it, drops to the pod's uid/gid/groups (no_new_privs when privilege escalation is
   off), changes to the working directory and execs the command with exactly the given
   environment, nothing inherited from the host.

After the exec the process IS the container's main process: it keeps the pid, the process group
and the signals the runner sends (SIGTERM, SIGKILL), so graceful termination works as on a
kubelet. There is no network namespace: pods keep their loopback pod IPs (127.0.0.0/8).

If the command cannot be started (not found in the image, not executable) the launcher writes
``{"reason": ..., "message": ...}`` to the spec's ``error_file`` and exits 128, so the runner
can report a kubelet-like RunContainerError instead of a plain crash.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
START_ERROR_EXIT = 128


@dataclass
class Mount:
    """A host path bind-mounted at ``target`` inside the container."""

    source: str
    target: str
    read_only: bool = False


@dataclass
class SandboxSpec:
    """Everything the launcher needs; written as JSON by the pod runner."""

    rootfs: str  # the image's shared, never-written root filesystem
    scratch: str  # per-container directory for the overlay's upper and work dirs
    argv: list[str]
    env: dict[str, str]
    uid: int
    gid: int
    groups: list[int] = field(default_factory=list)
    workdir: str = "/"
    read_only_root: bool = True
    no_new_privs: bool = True
    mounts: list[Mount] = field(default_factory=list)
    error_file: str = ""

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> SandboxSpec:
        data = json.loads(path.read_text())
        data["mounts"] = [Mount(**m) for m in data.get("mounts", [])]
        return cls(**data)


def launcher_argv(spec_file: Path) -> list[str]:
    """The command the runner starts (as root) for one container."""
    return [sys.executable, "-m", "tests.harness.sandbox", str(spec_file)]


# ---- the launcher (runs as root in the new mount namespace, then execs) -------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode() if source else None, target.encode(),
        fstype.encode() if fstype else None, ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {source or fstype} on {target}")


def _bind(source: str, target: str, read_only: bool, recursive: bool = False) -> None:
    _mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def in_root(root: Path, target: str, max_links: int = 40) -> Path:
    """``target`` inside ``root``, following symlinks as the container would see them: an
    absolute link (Debian's /var/run -> /run) restarts at ``root``, never at the host's /."""
    parts = [p for p in target.split("/") if p not in ("", ".")]
    current = root
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = current.parent if current != root else root
            continue
        candidate = current / part
        if candidate.is_symlink():
            links += 1
            if links > max_links:
                raise OSError(f"too many symlinks resolving {target} in the image")
            link = os.readlink(candidate)
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
            if link.startswith("/"):
                current = root
            continue
        current = candidate
    return current


def _mountpoint(root: Path, target: str, is_dir: bool) -> str:
    """Create the mount point under the new root (lands in the container's upper dir)."""
    path = in_root(root, target)
    if is_dir:
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.touch()
    return str(path)


def _setup_dev(root: Path) -> None:
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    _mount("tmpfs", str(dev), "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEVICES:
        (dev / name).touch()
        _mount(f"/dev/{name}", str(dev / name), None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        (dev / name).symlink_to(target)
    (dev / "shm").mkdir()
    _mount("shm", str(dev / "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=1g")


def enter(spec: SandboxSpec) -> Path:
    """Build the container's mount namespace; returns the new root (not yet chrooted)."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    scratch = Path(spec.scratch)
    upper, work, root = scratch / "upper", scratch / "work", scratch / "root"
    for d in (upper, work, root):
        d.mkdir(parents=True, exist_ok=True)
    _mount("overlay", str(root), "overlay", 0,
           f"lowerdir={spec.rootfs},upperdir={upper},workdir={work}")
    proc = _mountpoint(root, "/proc", True)
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _setup_dev(root)
    _bind("/sys", _mountpoint(root, "/sys", True), read_only=True)
    for m in spec.mounts:
        is_dir = Path(m.source).is_dir()
        _bind(m.source, _mountpoint(root, m.target, is_dir), m.read_only)
    if spec.read_only_root:
        _mount(None, str(root), None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    return root


def _start_error(error_fd: int | None, reason: str, message: str) -> None:
    print(f"sandbox: {reason}: {message}", file=sys.stderr, flush=True)
    if error_fd is not None:
        os.write(error_fd, json.dumps({"reason": reason, "message": message}).encode())
    os._exit(START_ERROR_EXIT)


def launch(spec: SandboxSpec) -> None:
    """Enter the sandbox and exec the command; never returns."""
    # Opened before the chroot (the file is on the host); closed by the exec.
    error_fd = (os.open(spec.error_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                        0o600) if spec.error_file else None)
    try:
        root = enter(spec)
        os.chroot(root)
        os.chdir("/")
    except OSError as e:
        _start_error(error_fd, "CreateContainerError", f"cannot set up the container: {e}")
    try:
        os.setgroups(spec.groups)
        os.setgid(spec.gid)
        os.setuid(spec.uid)
        if spec.no_new_privs:
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        os.chdir(spec.workdir)
    except OSError as e:
        _start_error(error_fd, "CreateContainerError", f"cannot enter the container: {e}")
    try:
        os.execvpe(spec.argv[0], spec.argv, spec.env)
    except FileNotFoundError:
        _start_error(error_fd, "RunContainerError",
                     f'exec: "{spec.argv[0]}": executable file not found in $PATH '
                     f"({spec.env.get('PATH', '')})")
    except OSError as e:
        _start_error(error_fd, "RunContainerError", f'exec: "{spec.argv[0]}": {e.strerror}')


if __name__ == "__main__":
    launch(SandboxSpec.read(Path(sys.argv[1])))
