"""The local image store of the pod runner's image mode: what hack/build-images.sh built.

Why: a kubelet pulls an image and runs its entrypoint as its user in its root filesystem. Here
no registry is reachable; hack/build-images.sh builds the images, unpacks each one once, and
writes an index (image reference -> rootfs and image config). This module reads that index and
applies the Kubernetes rules that combine an image with a container spec (command/args against
ENTRYPOINT/CMD, runAsUser against USER, workingDir against WORKDIR). An image that is not in
the index is an error the runner reports as ErrImagePull, never a silent fallback.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
