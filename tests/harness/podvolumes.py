"""A pod's volumes as host directories, for the pod runner's image mode.

Why: in image mode a container sees only its image and what the pod mounts, so the volumes must
exist as a kubelet would make them: ``emptyDir`` (a fresh world-writable directory shared by the
pod's containers), ``configMap`` and ``secret`` (files per key), ``downwardAPI``, and
``projected`` with ``serviceAccountToken`` (a TokenRequest bound to the pod, so the API server
applies the service account's RBAC exactly as on a real node), and ``persistentVolumeClaim`` (one
host directory per claim under the runner's state, shared by every pod that mounts it, as a
ReadWriteMany volume is; the claim must exist). The ServiceAccount admission
plugin adds that projected volume (``kube-api-access-*``: token, ca.crt, namespace) to every pod
that mounts a token; mounting it is what gives the process in-cluster credentials. ``hostPath``
mounts the host's own path (tests share a directory with a pod that way).

A volume type not listed here fails the container with CreateContainerConfigError naming it.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path
from typing import Any

from omnistage.kubeapi import ApiError, resource_path
from tests.harness.images import ImageError
from tests.harness.kubeclient import Kube

Obj = dict[str, Any]
DEFAULT_MODE = 0o644


class PodVolumes:
    """Materialises a pod's volumes under ``base`` (one directory per volume)."""

    def __init__(self, kube: Kube, pod: Obj, base: Path, field_value: Any,
                 claims: Path | None = None) -> None:
        self.kube = kube
        self.claims = claims if claims is not None else base / "claims"
        self.pod = pod
        self.ns: str = pod["metadata"]["namespace"]
        self.base = base
        self.field_value = field_value  # the runner's downward-API resolver (pod, path) -> str
        self.ready: dict[str, Path] = {}

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
            files = self._files(vol)
            mode = self._default_mode(vol)
            # As the kubelet does for these volumes: the pod's fsGroup owns the files, so a
            # group-only mode (0440) is readable by the pod's non-root user.
            group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            for rel, (data, file_mode) in files.items():
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                target.chmod(file_mode if file_mode is not None else mode)
                if group is not None and os.geteuid() == 0:
                    os.chown(target, -1, int(group))
            tmp.mkdir(parents=True, exist_ok=True)
            tmp.chmod(0o755)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        self.ready[name] = dest
        return dest

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
                    out.update(self._token(src["serviceAccountToken"]))
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
            obj = self.kube.get(resource_path("v1", resource, self.ns, ref["name"]))
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

    def _downward(self, items: list[Obj]) -> dict[str, tuple[bytes, int | None]]:
        out = {}
        for item in items:
            if "fieldRef" not in item:
                raise ImageError("CreateContainerConfigError",
                                 f"downwardAPI item {item.get('path')}: only fieldRef is supported")
            value = self.field_value(self.pod, item["fieldRef"]["fieldPath"])
            out[item["path"]] = (value.encode(), item.get("mode"))
        return out

    def _token(self, src: Obj) -> dict[str, tuple[bytes, int | None]]:
        """A token bound to this pod, for its service account (what a kubelet projects)."""
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
        return {src.get("path", "token"): (token.encode(), None)}
