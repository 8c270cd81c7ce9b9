"""A pod's volumes as host directories, for the pod runner (both modes).

Why: in image mode a container sees only its image and what the pod mounts, so the volumes must
exist as a kubelet would make them: ``emptyDir`` (a fresh world-writable directory shared by the
pod's containers), ``configMap`` and ``secret`` (files per key), ``downwardAPI``, and
``projected`` with ``serviceAccountToken`` (a TokenRequest bound to the pod, so the API server
applies the service account's RBAC exactly as on a real node), and ``persistentVolumeClaim`` (one
host directory per claim under the runner's state, shared by every pod that mounts it, as a
ReadWriteMany volume is; the claim must exist). The ServiceAccount admission
plugin adds that projected volume (``kube-api-access-*``: token, ca.crt, namespace) to every pod
that mounts a token; mounting it is what gives the process in-cluster credentials. ``hostPath``
mounts the host's own path (tests share a directory with a pod that way). In process mode the
same directories are made, for the volumes an env value names (the runner points such a value
at the volume's host directory: podrunner.PodWorker._mounted_paths).

``configMap``, ``secret``, ``downwardAPI`` and ``projected`` volumes are laid out as a kubelet's
atomic writer lays them out, and kept up to date as a kubelet keeps them: the volume directory
holds a timestamped folder (``..2026_12_07_11_00_00.123456789``) with the files, a symlink
``..data`` to it, and one symlink per top-level name (``key -> ..data/key``). While the pod runs,
``sync`` (called by the pod's worker on every loop turn) looks again every SYNC_S seconds (a
kubelet's sync period, scaled down): it GETs each ConfigMap and Secret the volumes name once
per pass, and when a volume's content or modes changed it writes a new timestamped folder,
renames a fresh ``..data_tmp`` symlink over ``..data`` (a reader sees the old files or the new
ones, never a mix) and removes the old folder. Modes and the fsGroup ownership are applied to
every write. A ConfigMap or Secret that went missing (or an API error) keeps the content in
force, as on a kubelet (logged once); an ``optional`` one that went missing empties its part.
A service-account token is requested again only after 80% of its lifetime. A ``subPath``
mount of such a volume binds the file in force when the container starts and is never
updated (as on a kubelet). The refresh runs on the worker's own thread, so it ends with the pod.

A volume type not listed here fails the container with CreateContainerConfigError naming it.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from omnistage.kubeapi import ApiError, resource_path
from tests.harness.images import ImageError
from tests.harness.kubeclient import Kube

Obj = dict[str, Any]
DEFAULT_MODE = 0o644
#: Seconds between two looks at a running pod's ConfigMaps and Secrets (a kubelet's sync period,
#: scaled down so tests see a rotated Secret within seconds).
SYNC_S = 1.0
#: The service-account volume (token, the cluster's CA, the namespace) every image-mode pod
#: mounts changes rarely: looked at this often only, so idle pods cost the API server little.
ACCESS_SYNC_S = 60.0
ACCESS_PREFIX = "kube-api-access-"
DATA_LINK = "..data"  # the atomic writer's symlink to the timestamped folder in force
DATA_TMP = "..data_tmp"  # the new symlink, renamed over DATA_LINK
TOKEN_REFRESH = 0.8  # a token is requested again after this share of its lifetime, as a kubelet
#: The volume kinds kept up to date with the atomic writer's layout.
ATOMIC_KINDS = ("configMap", "secret", "downwardAPI", "projected")

#: A volume's content: relative path -> (bytes, file mode).
Payload = dict[str, tuple[bytes, int]]

log = logging.getLogger("podrunner.volumes")


class PodVolumes:
    """Materialises a pod's volumes under ``base`` (one directory per volume) and keeps the
    configMap, secret, downwardAPI and projected ones up to date (``sync``)."""

    def __init__(self, kube: Kube, pod: Obj, base: Path, field_value: Any,
                 claims: Path | None = None, clock: Any = time.monotonic) -> None:
        self.kube = kube
        self.claims = claims if claims is not None else base / "claims"
        self.pod = pod
        self.ns: str = pod["metadata"]["namespace"]
        self.base = base
        self.field_value = field_value  # the runner's downward-API resolver (pod, path) -> str
        self.ready: dict[str, Path] = {}
        self.clock = clock
        #: atomic-writer volumes made so far: name -> (volume, the payload in force)
        self.atomic: dict[str, tuple[Obj, Payload]] = {}
        self.next_sync = 0.0
        self._tokens: dict[tuple[str, str], tuple[bytes, float]] = {}  # -> (token, renew at)
        self._pass: dict[tuple[str, str], Obj | ApiError] | None = None  # one GET per pass
        self._failed: dict[str, str] = {}  # the last refresh error logged, by volume
        self._access_due: dict[str, float] = {}  # service-account volumes: next look

    def path(self, name: str) -> Path:
        """The host directory of volume ``name``, created on first use."""
        if name in self.ready:
            return self.ready[name]
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        if name not in volumes:
            raise ImageError("CreateContainerConfigError", f"volume {name!r} is not declared")
        vol = volumes[name]
        dest = self.base / name
        if "hostPath" in vol:
            dest = self._host_path(vol)
        elif "persistentVolumeClaim" in vol:
            dest = self._claim(vol["persistentVolumeClaim"]["claimName"])
        elif "emptyDir" in vol:
            dest.mkdir(parents=True, exist_ok=True)
            dest.chmod(0o777)  # as a kubelet makes it: any container uid can write
        else:
            payload = self._payload(vol)
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            dest.chmod(0o755)
            self._write(dest, payload)
            self.atomic[name] = (vol, payload)
            if self.next_sync == 0.0:
                self.next_sync = self.clock() + SYNC_S
        self.ready[name] = dest
        return dest

    # ---- keeping configMap/secret/downwardAPI/projected volumes up to date ---------------------
    def sync(self) -> list[str]:
        """Bring every atomic-writer volume made so far up to date, at most once per SYNC_S
        (the names of those rewritten). Never raises: a volume that cannot be refreshed keeps
        its content (a kubelet does the same)."""
        now = self.clock()
        if not self.atomic or now < self.next_sync:
            return []
        self.next_sync = now + SYNC_S
        changed = []
        self._pass = {}
        try:
            for name, (vol, payload) in list(self.atomic.items()):
                if name.startswith(ACCESS_PREFIX):
                    if now < self._access_due.get(name, 0.0):
                        continue
                    self._access_due[name] = now + ACCESS_SYNC_S
                try:
                    fresh = self._payload(vol)
                    if fresh != payload:
                        self._write(self.ready[name], fresh)
                        self.atomic[name] = (vol, fresh)
                        changed.append(name)
                except Exception as e:  # a refresh must never stop the pod
                    reason = e.message if isinstance(e, ImageError) else repr(e)
                    if self._failed.get(name) != reason:
                        log.warning("pod %s/%s: volume %s not refreshed (its content stays): %s",
                                    self.ns, self.pod["metadata"]["name"], name, reason)
                        self._failed[name] = reason
                    continue
                if self._failed.pop(name, None) is not None or name in changed:
                    log.info("pod %s/%s: volume %s %s", self.ns, self.pod["metadata"]["name"],
                             name, "updated" if name in changed else "current again")
        finally:
            self._pass = None
        return changed

    def _payload(self, vol: Obj) -> Payload:
        """The files of an atomic-writer volume, each with its mode resolved."""
        mode = self._default_mode(vol)
        return {rel: (data, file_mode if file_mode is not None else mode)
                for rel, (data, file_mode) in self._files(vol).items()}

    def _write(self, dest: Path, payload: Payload) -> None:
        """A kubelet's AtomicWriter.Write: the files in a new timestamped folder, ``..data``
        swapped to it in one rename, a symlink per top-level name, the old folder removed."""
        # As the kubelet does for these volumes: the pod's fsGroup owns the files, so a
        # group-only mode (0440) is readable by the pod's non-root user.
        group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        link = dest / DATA_LINK
        old = os.readlink(link) if link.is_symlink() else None
        ts = self._timestamped_dir(dest)
        try:
            for rel, (data, file_mode) in payload.items():
                target = ts / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                target.chmod(file_mode)
                if group is not None and os.geteuid() == 0:
                    os.chown(target, -1, int(group))
            tmp = dest / DATA_TMP
            tmp.unlink(missing_ok=True)
            os.symlink(ts.name, tmp)
            os.rename(tmp, link)  # the one step readers see: all old files, or all new ones
        except BaseException:
            shutil.rmtree(ts, ignore_errors=True)  # the folder in force stays as it was
            raise
        visible = {rel.split("/", 1)[0] for rel in payload}
        for top in sorted(visible):
            entry = dest / top
            if not entry.is_symlink():
                os.symlink(f"{DATA_LINK}/{top}", entry)
        for entry in dest.iterdir():
            # Names gone from the payload: only the writer's own symlinks are ever removed.
            if not entry.name.startswith("..") and entry.name not in visible \
                    and entry.is_symlink():
                entry.unlink()
        if old is not None and old != ts.name:
            shutil.rmtree(dest / old, ignore_errors=True)

    @staticmethod
    def _timestamped_dir(dest: Path) -> Path:
        """A new ``..YYYY_MM_DD_HH_MM_SS.N`` folder, as the kubelet names them."""
        stamp = dt.datetime.now(dt.UTC).strftime("..%Y_%m_%d_%H_%M_%S")
        n = time.time_ns() % 1_000_000_000
        while True:
            ts = dest / f"{stamp}.{n:09d}"
            try:
                ts.mkdir()
            except FileExistsError:
                n += 1
                continue
            ts.chmod(0o755)
            return ts

    @staticmethod
    def _host_path(vol: Obj) -> Path:
        """The host's own path (tests use it to share a directory with a pod)."""
        src = vol["hostPath"]
        path, kind = Path(src["path"]), src.get("type", "")
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate" and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        if not path.exists() or (kind == "Directory" and not path.is_dir()) or (
                kind == "File" and not path.is_file()):
            raise ImageError("CreateContainerConfigError",
                             f"hostPath {path} (type {kind or 'any'}) does not exist")
        return path

    def _claim(self, name: str) -> Path:
        """The claim's directory; a missing claim keeps the container from being created."""
        try:
            self.kube.get(resource_path("v1", "persistentvolumeclaims", self.ns, name))
        except ApiError as e:
            raise ImageError("CreateContainerConfigError",
                             f"persistentvolumeclaim {name!r} not found") from e
        dest = self.claims / self.ns / name
        if not dest.is_dir():
            dest.mkdir(parents=True)
            dest.chmod(0o777)  # a fresh volume any pod uid may fill
        return dest

    @staticmethod
    def _default_mode(vol: Obj) -> int:
        for kind in ("configMap", "secret", "projected", "downwardAPI"):
            if kind in vol and vol[kind].get("defaultMode") is not None:
                return int(vol[kind]["defaultMode"])
        return DEFAULT_MODE

    def _files(self, vol: Obj) -> dict[str, tuple[bytes, int | None]]:
        if "configMap" in vol:
            return self._object_files("configmaps", vol["configMap"])
        if "secret" in vol:
            ref = {**vol["secret"], "name": vol["secret"].get("secretName")}
            return self._object_files("secrets", ref)
        if "downwardAPI" in vol:
            return self._downward(vol["downwardAPI"].get("items", []))
        if "projected" in vol:
            out: dict[str, tuple[bytes, int | None]] = {}
            for src in vol["projected"].get("sources", []):
                if "serviceAccountToken" in src:
                    out.update(self._token(vol["name"], src["serviceAccountToken"]))
                elif "configMap" in src:
                    out.update(self._object_files("configmaps", src["configMap"]))
                elif "secret" in src:
                    out.update(self._object_files("secrets", src["secret"]))
                elif "downwardAPI" in src:
                    out.update(self._downward(src["downwardAPI"].get("items", [])))
                else:
                    raise ImageError("CreateContainerConfigError",
                                     f"projected source {sorted(src)} is not supported by the "
                                     "local pod runner")
            return out
        kinds = sorted(k for k in vol if k != "name")
        raise ImageError("CreateContainerConfigError",
                         f"volume {vol['name']!r}: type {kinds} is not supported by the local "
                         "pod runner (emptyDir, configMap, secret, downwardAPI, projected, "
                         "hostPath, persistentVolumeClaim)")

    def _object_files(self, resource: str, ref: Obj) -> dict[str, tuple[bytes, int | None]]:
        try:
            obj = self._get(resource, ref["name"])
        except ApiError as e:
            if e.status == 404 and ref.get("optional"):
                return {}
            raise ImageError("CreateContainerConfigError",
                             f"{resource[:-1]} {ref['name']!r} not found") from e
        data: dict[str, bytes] = {}
        if resource == "secrets":
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        else:
            data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        if "items" not in ref:
            return {k: (v, None) for k, v in data.items()}
        out = {}
        for item in ref["items"]:
            if item["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ImageError("CreateContainerConfigError",
                                 f"key {item['key']!r} not in {resource[:-1]} {ref['name']!r}")
            out[item["path"]] = (data[item["key"]], item.get("mode"))
        return out

    def _get(self, resource: str, name: str) -> Obj:
        """The object, fetched at most once per sync pass however many volumes name it."""
        key = (resource, name)
        got = self._pass.get(key) if self._pass is not None else None
        if got is None:
            try:
                got = self.kube.get(resource_path("v1", resource, self.ns, name))
            except ApiError as e:
                got = e
            if self._pass is not None:
                self._pass[key] = got
        if isinstance(got, ApiError):
            raise got
        return got

    def _downward(self, items: list[Obj]) -> dict[str, tuple[bytes, int | None]]:
        out = {}
        for item in items:
            if "fieldRef" not in item:
                raise ImageError("CreateContainerConfigError",
                                 f"downwardAPI item {item.get('path')}: only fieldRef is supported")
            value = self.field_value(self.pod, item["fieldRef"]["fieldPath"])
            out[item["path"]] = (value.encode(), item.get("mode"))
        return out

    def _token(self, volume: str, src: Obj) -> dict[str, tuple[bytes, int | None]]:
        """A token bound to this pod, for its service account (what a kubelet projects); the
        one already written until TOKEN_REFRESH of its lifetime has passed."""
        key = (volume, src.get("path", "token"))
        held = self._tokens.get(key)
        if held is not None and self.clock() < held[1]:
            return {key[1]: (held[0], None)}
        meta = self.pod["metadata"]
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec: Obj = {
            "expirationSeconds": int(src.get("expirationSeconds", 3607)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "uid": meta["uid"]},
        }
        if src.get("audience"):
            spec["audiences"] = [src["audience"]]
        req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = resource_path("v1", "serviceaccounts", self.ns, sa) + "/token"
        try:
            token = self.kube.create(path, req)["status"]["token"]
        except ApiError as e:
            raise ImageError("CreateContainerConfigError",
                             f"service account token for {sa!r}: {e}") from e
        lifetime = spec["expirationSeconds"] * TOKEN_REFRESH
        self._tokens[key] = (token.encode(), self.clock() + lifetime)
        return {key[1]: (token.encode(), None)}
