"""Kubernetes membership: the orchestrator learns its stage replicas by watching their Pods.

Why Pods and not EndpointSlices: the API server rejects loopback endpoint addresses, and the test
cluster's pods have loopback IPs. A Pod also carries everything routing needs in one object: the
IP, the Ready condition (which already folds in the operator's `omnistage.io/routable` readiness
gate), the deletionTimestamp of a terminating pod and the operator's drain annotation.

The official client is synchronous, so a daemon thread lists and watches, and hands each batch of
changes to the event loop with call_soon_threadsafe. The thread keeps a cache keyed by pod name and
only reports what changed; a relist (after 410 Gone or an error) is diffed against that cache so
replicas that vanished while the watch was down are reported gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage import kube
from omnistage.orchestrator.membership import Membership, OnChange, ReplicaInfo

if TYPE_CHECKING:
    from omnistage.spec import OmniPipeline

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# ---- pure parts (unit-tested with plain dicts) ----------------------------------------------


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def replica_from_pod(
    pod: Mapping[str, Any], zmq_port: int = kube.WORKER_ZMQ_PORT, *, deleted: bool = False
) -> ReplicaInfo | None:
    """What one Pod (as the API server's JSON) means for routing; None if it is not a replica yet.

    gone: deleted, or the pod finished (Succeeded/Failed) and will never serve again.
    draining: terminating (deletionTimestamp) or marked by the operator; it finishes bound work
    but takes no new requests. ready: the Ready condition is True. Anything else with an IP is
    joining. A pod without an IP cannot be reached, so it is not reported at all.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    stage = (meta.get("labels") or {}).get(kube.LABEL_STAGE)
    name = meta.get("name")
    if not stage or not name:
        return None
    ip = status.get("podIP") or ""
    endpoint = _endpoint(ip, zmq_port) if ip else ""
    if deleted or status.get("phase") in ("Succeeded", "Failed"):
        return ReplicaInfo(stage, name, endpoint, "gone")
    if not ip:
        return None
    annotations = meta.get("annotations") or {}
    if meta.get("deletionTimestamp") or (
        str(annotations.get(kube.ANNOTATION_DRAINING, "")).lower() == "true"
    ):
        return ReplicaInfo(stage, name, endpoint, "draining")
    return ReplicaInfo(stage, name, endpoint, "ready" if _ready(pod) else "joining")


@dataclass(frozen=True)
class Tracked:
    """What the cache remembers per pod name: the instance (uid) and what was last reported."""

    uid: str
    info: ReplicaInfo


def _gone(info: ReplicaInfo) -> ReplicaInfo:
    return replace(info, state="gone")


def apply_pod(
    known: dict[str, Tracked], pod: Mapping[str, Any], zmq_port: int, *, deleted: bool = False
) -> list[ReplicaInfo]:
    """Fold one pod into the cache; returns the changes to report, in order.

    A new instance under a known name (a replacement pod: different uid) first reports the old
    one gone, so work bound to it fails over even if the new pod reuses the same IP.
    """
    meta = pod.get("metadata") or {}
    name = meta.get("name") or ""
    uid = meta.get("uid") or ""
    info = replica_from_pod(pod, zmq_port, deleted=deleted)
    prev = known.get(name)
    if info is None or info.state == "gone":
        if prev is None or (deleted and uid and prev.uid and uid != prev.uid):
            return []  # never reported, or the delete of an instance we no longer track
        del known[name]
        return [_gone(prev.info)]
    known[name] = Tracked(uid, info)
    if prev is None:
        return [info]
    if prev.uid != uid:
        return [_gone(prev.info), info]
    return [] if prev.info == info else [info]


def relist_changes(
    known: dict[str, Tracked], pods: Iterable[Mapping[str, Any]], zmq_port: int
) -> list[ReplicaInfo]:
    """Diff a fresh list against the cache: changed or new replicas, then gone for vanished ones."""
    changes: list[ReplicaInfo] = []
    seen: set[str] = set()
    for pod in pods:
        changes += apply_pod(known, pod, zmq_port)
        name = (pod.get("metadata") or {}).get("name")
        if name in known:
            seen.add(name)
    for name in [n for n in known if n not in seen]:
        changes.append(_gone(known.pop(name).info))
    return changes


# ---- client configuration --------------------------------------------------------------------


def in_cluster() -> bool:
    """Running in a pod with a service account (the orchestrator Deployment)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (SA_DIR / "token").exists()


def default_namespace() -> str:
    """$POD_NAMESPACE, else the service account's namespace, else "default"."""
    ns = os.environ.get("POD_NAMESPACE")
    if ns:
        return ns
    try:
        return (SA_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def load_core_api() -> Any:
    """A CoreV1Api for exactly the cluster the in-cluster config or $KUBECONFIG names.

    A private Configuration keeps the process-wide client default untouched.
    """
    from kubernetes import client, config

    cfg = client.Configuration()
    if in_cluster():
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    return client.CoreV1Api(client.ApiClient(cfg))


# ---- the watcher -----------------------------------------------------------------------------


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): relist."""


class _Restart(Exception):
    """A forced watch restart (resync) or stop interrupted the stream."""


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _lines(resp: Any) -> Iterator[str]:
    """Newline-delimited JSON lines of a streaming response (chunk boundaries are arbitrary)."""
    buf = bytearray()
    for chunk in resp.stream(amt=None, decode_content=False):
        buf.extend(chunk if isinstance(chunk, bytes | bytearray) else str(chunk).encode())
        while (nl := buf.find(b"\n")) != -1:
            line, buf = bytes(buf[:nl]), buf[nl + 1:]
            if line.strip():
                yield line.decode("utf-8", errors="replace")
    if buf.strip():
        yield bytes(buf).decode("utf-8", errors="replace")


class KubernetesMembership(Membership):
    """Replicas of one pipeline's stages, from a list+watch of their Pods in one namespace."""

    def __init__(
        self,
        namespace: str,
        pipeline: str | OmniPipeline,
        *,
        zmq_port: int = kube.WORKER_ZMQ_PORT,
        api: Any = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.5, 15.0),
        start_timeout: float = 30.0,
    ) -> None:
        name = pipeline if isinstance(pipeline, str) else pipeline.metadata.name
        self.namespace = namespace
        self.pipeline = name
        self.selector = kube.stage_selector(name)
        self.zmq_port = zmq_port
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.start_timeout = start_timeout
        self.relists = 0  # how many lists the watcher made (the first included)
        self._api = api
        self._known: dict[str, Tracked] = {}  # written by the watcher thread only
        self._lock = threading.Lock()  # guards _known snapshots and _resp
        self._resp: Any = None
        self._stopping = threading.Event()
        self._force_relist = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: OnChange | None = None

    # -- Membership --

    async def start(self, on_change: OnChange) -> None:
        """List (retrying up to start_timeout), report every replica, then watch in a thread."""
        self._loop = asyncio.get_running_loop()
        self._on_change = on_change
        self._stopping.clear()
        self._force_relist.clear()
        with self._lock:
            self._known.clear()  # a (re)start reports everything, not a diff
        if self._api is None:
            self._api = await asyncio.to_thread(load_core_api)
        changes, rv = await asyncio.to_thread(self._initial_list)
        for info in changes:
            on_change(info)
        self._thread = threading.Thread(
            target=self._run, args=(rv,), name=f"k8s-membership-{self.pipeline}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop the watcher: interrupt its stream so the thread ends now, not at watch timeout."""
        self._stopping.set()
        self._interrupt()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
            if thread.is_alive():
                log.warning("membership watcher did not stop within 5s (left as daemon)")
        self._on_change = None

    # -- extras --

    def resync(self) -> None:
        """Drop the current watch and relist, as after 410 Gone (tests; manual recovery)."""
        self._force_relist.set()
        self._interrupt()

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """The replicas currently known (not gone)."""
        with self._lock:
            return [t.info for t in self._known.values()]

    # -- watcher thread --

    def _interrupt(self) -> None:
        with self._lock:
            resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()  # wakes a blocked read in the watcher thread (urllib3 >= 2.3)
            with contextlib.suppress(Exception):
                resp.close()

    def _initial_list(self) -> tuple[list[ReplicaInfo], str]:
        delay = self.backoff[0]
        waited = 0.0
        while True:
            try:
                return self._relist()
            except Exception as exc:  # any failure is retried, then raised
                if waited >= self.start_timeout or self._stopping.is_set():
                    raise
                log.warning("listing pods (%s) failed: %s; retrying in %.1fs",
                            self.selector, exc, delay)
                self._stopping.wait(delay)
                waited += delay
                delay = min(delay * 2, self.backoff[1])

    def _relist(self) -> tuple[list[ReplicaInfo], str]:
        resp = self._api.list_namespaced_pod(
            self.namespace, label_selector=self.selector, _preload_content=False,
            _request_timeout=(10, 60),
        )
        body = json.loads(resp.data)
        with self._lock:
            changes = relist_changes(self._known, body.get("items") or [], self.zmq_port)
        self.relists += 1
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        log.debug("listed %d pods at rv %s: %d changes", len(body.get("items") or []), rv,
                  len(changes))
        return changes, rv

    def _run(self, rv: str) -> None:
        delay = self.backoff[0]
        while not self._stopping.is_set():
            try:
                if not rv or self._force_relist.is_set():
                    self._force_relist.clear()
                    changes, rv = self._relist()
                    self._emit(changes)
                rv = self._watch(rv)
                delay = self.backoff[0]
            except _Expired:
                log.info("pod watch expired (410 Gone); relisting")
                rv = ""
            except _Restart:
                continue
            except Exception as exc:  # reconnect with backoff, whatever broke
                if self._stopping.is_set():
                    break
                if _status(exc) == 410:
                    rv = ""
                    continue
                log.warning("pod watch failed (%s): %s; reconnecting in %.1fs",
                            type(exc).__name__, exc, delay)
                self._stopping.wait(delay)
                delay = min(delay * 2, self.backoff[1])
        log.debug("membership watcher for %s stopped", self.pipeline)

    def _watch(self, rv: str) -> str:
        """Stream events from rv until the server ends the watch; returns the last rv seen."""
        resp = self._api.list_namespaced_pod(
            self.namespace, label_selector=self.selector, watch=True, resource_version=rv,
            allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout,
            _preload_content=False, _request_timeout=(10, self.watch_timeout + 30),
        )
        with self._lock:
            self._resp = resp
        try:
            if self._stopping.is_set() or self._force_relist.is_set():
                raise _Restart
            for line in _lines(resp):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    with self._lock:
                        changes = apply_pod(self._known, obj, self.zmq_port,
                                            deleted=kind == "DELETED")
                    self._emit(changes)
        except Exception:
            if self._stopping.is_set() or self._force_relist.is_set():
                raise _Restart from None
            raise
        finally:
            with self._lock:
                self._resp = None
            with contextlib.suppress(Exception):
                resp.release_conn()
        if self._stopping.is_set() or self._force_relist.is_set():
            raise _Restart
        return rv

    def _emit(self, changes: list[ReplicaInfo]) -> None:
        if not changes or self._loop is None or self._stopping.is_set():
            return
        for info in changes:
            log.info("replica %s of stage %s: %s (%s)", info.name, info.stage, info.state,
                     info.endpoint or "no endpoint")
        with contextlib.suppress(RuntimeError):  # the loop already closed: nobody to tell
            self._loop.call_soon_threadsafe(self._deliver, changes)

    def _deliver(self, changes: list[ReplicaInfo]) -> None:
        on_change = self._on_change
        if on_change is None or self._stopping.is_set():
            return
        for info in changes:
            on_change(info)
