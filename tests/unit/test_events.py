"""Event aggregation and the controller's intake rules, without an API server.

The same paths run against the real API server in tests/cluster (test_validation counts an
InvalidSpec event to 2 on one object; test_operator sees ReplicaLost for a deleted pod).
"""

from __future__ import annotations

import logging
from typing import Any

from omni_operator.controller import Controller
from omni_operator.events import EventRecorder, event_name
from omnistage import kube
from omnistage.kubeapi import ApiError
from tests.harness.waiting import until

POOL = {"apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
        "metadata": {"name": "p-a", "namespace": "ns", "uid": "u1"},
        "spec": {"pipeline": "p", "replicas": 2, "stage": {"name": "a", "kind": "echo"}}}


class FakeEvents:
    """Just enough of KubeApi for Event objects: a dict of stored events."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.writes = 0
        self.writes_by_verb: dict[str, int] = {}

    async def create(self, url: str, body: dict[str, Any], ignore: tuple[int, ...] = ()) -> Any:
        self.calls.append("create")
        name = body["metadata"]["name"]
        if name in self.stored:
            if 409 in ignore:
                return None
            raise ApiError(409, {}, "POST", url)
        self.stored[name] = dict(body)
        return body

    async def get(self, url: str, ignore: tuple[int, ...] = ()) -> Any:
        self.calls.append("get")
        return self.stored.get(url.rsplit("/", 1)[-1])

    async def close(self) -> None:
        pass

    async def patch(self, url: str, patch: dict[str, Any], ignore: tuple[int, ...] = ()) -> Any:
        self.calls.append("patch")
        name = url.rsplit("/", 1)[-1]
        if name not in self.stored:
            return None
        self.stored[name].update(patch)
        return self.stored[name]


async def test_repeats_are_counted_on_one_event() -> None:
    api = FakeEvents()
    recorder = EventRecorder(api)  # type: ignore[arg-type]
    for _ in range(3):
        await recorder.record(POOL, "Warning", "ReplicaLost", "replica p-a-1 disappeared")
    await recorder.record(POOL, "Normal", "ScalingDown", "retiring p-a-1")
    assert len(api.stored) == 2
    lost = api.stored[event_name(POOL, "Warning", "ReplicaLost", "replica p-a-1 disappeared")]
    assert lost["count"] == 3 and lost["involvedObject"]["uid"] == "u1"
    assert api.calls == ["create", "patch", "patch", "create"]


async def test_a_restarted_operator_counts_on_from_the_stored_event() -> None:
    api = FakeEvents()
    await EventRecorder(api).record(POOL, "Warning", "InvalidSpec", "spec.image: bad")  # type: ignore[arg-type]
    fresh = EventRecorder(api)  # type: ignore[arg-type]
    await fresh.record(POOL, "Warning", "InvalidSpec", "spec.image: bad")
    await fresh.record(POOL, "Warning", "InvalidSpec", "spec.image: bad")
    [event] = api.stored.values()
    assert event["count"] == 3
    assert api.calls == ["create", "create", "get", "patch", "patch"]


async def test_an_expired_event_starts_a_new_series() -> None:
    api = FakeEvents()
    recorder = EventRecorder(api)  # type: ignore[arg-type]
    await recorder.record(POOL, "Normal", "Created", "created p-a")
    api.stored.clear()  # --event-ttl passed
    await recorder.record(POOL, "Normal", "Created", "created p-a")
    [event] = api.stored.values()
    assert event["count"] == 1


def test_event_names_are_stable_and_tell_events_apart() -> None:
    a = event_name(POOL, "Warning", "ReplicaLost", "x")
    assert a == event_name(POOL, "Warning", "ReplicaLost", "x") and a.startswith("p-a.")
    assert a != event_name(POOL, "Warning", "ReplicaLost", "y")
    other = {**POOL, "metadata": {**POOL["metadata"], "uid": "u2"}}
    assert a != event_name(other, "Warning", "ReplicaLost", "x")


# ---------------------------------------------------------------------------- controller intake


class Recorded(Controller):
    """A controller whose events are collected instead of sent."""

    def __init__(self) -> None:
        super().__init__(FakeEvents())  # type: ignore[arg-type]
        self.sent: list[tuple[str, str]] = []
        self.writes.event = self._record  # type: ignore[method-assign]

    def _record(self, obj: dict[str, Any], etype: str, reason: str, message: str) -> None:
        self.sent.append((etype, reason))

    def enqueue(self, key: Any) -> None:
        pass


def replica(ordinal: int, uid: str, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"p-a-{ordinal}", "namespace": "ns", "uid": uid,
                         "labels": {kube.LABEL_POOL: "p-a", kube.LABEL_ORDINAL: str(ordinal),
                                    kube.LABEL_COMPONENT: "stage"}, **meta},
            "status": {"conditions": []}}


def test_only_unintended_deletions_are_a_replica_lost_warning() -> None:
    c = Recorded()
    c.view.observe("StagePool", None, POOL)
    c.view.observe("Pod", "DELETED", replica(1, "lost"))
    retired = replica(1, "retired", annotations={kube.ANNOTATION_DRAINING: "true"})
    c.view.observe("Pod", "DELETED", retired)
    evicted = replica(0, "evicted", deletionTimestamp="2026-01-01T00:00:00Z")
    evicted["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "EvictionByEvictionAPI"}]
    c.view.observe("Pod", "MODIFIED", evicted)
    c.view.observe("Pod", "DELETED", {**evicted, "status": {}})  # the mark was seen before
    c.view.observe("Pod", "DELETED", replica(5, "scaled-down"))  # beyond replicas: scale-down
    assert c.sent == [("Warning", "ReplicaLost"), ("Normal", "ReplicaEvicted")]
    deleting = {**POOL, "metadata": {**POOL["metadata"], "deletionTimestamp": "x"}}
    c.view.observe("StagePool", None, deleting)
    c.view.observe("Pod", "DELETED", replica(1, "with-its-pool"))
    assert len(c.sent) == 2


async def test_delayed_reenqueues_are_coalesced_per_key() -> None:
    c = Recorded()
    key = ("OmniPipeline", "ns", "p")
    for _ in range(100):
        c.enqueue_later(key, 5.0)
    assert len(c.queue._timers) == 1
    c.enqueue_later(key, 0.01)  # an earlier one replaces it
    c.enqueue_later(("StagePool", "ns", "p-a"), 5.0)
    assert len(c.queue._timers) == 2
    await until(lambda: len(c.queue._timers) == 1, "the 0.01 s timer to fire")
    await c.stop()
    assert len(c.queue._timers) == 0


def test_forget_drops_a_stale_entry_as_a_deletion_would() -> None:
    c = Recorded()
    c.view.observe("StagePool", None, POOL, primed=True)
    c.view.observe("Pod", None, replica(0, "u"), primed=True)
    assert c.view.get("Pod", "ns", "p-a-0") is not None
    c.forget("Pod", "ns", "p-a-0")
    c.forget("StagePool", "ns", "p-a")
    assert c.view.get("Pod", "ns", "p-a-0") is None and c.view.get("StagePool", "ns", "p-a") is None
    assert not c.view._unconfirmed


async def test_an_event_for_a_terminating_namespace_is_dropped_quietly(caplog) -> None:
    """Deleting a namespace deletes its pipelines, whose Terminating event can no longer be
    written there: dropped without a warning (an operator log full of 403s hides real RBAC
    gaps). Any other refusal still warns. Known by the Status cause, not the message."""

    # As kube-apiserver 1.36 answers (captured from the local control plane).
    terminating = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": 'events "x" is forbidden: unable to create new content in '
                              "namespace ns because it is being terminated",
                   "reason": "Forbidden", "code": 403,
                   "details": {"name": "x", "kind": "events", "causes": [
                       {"reason": "NamespaceTerminating", "message": "namespace ns is being "
                        "terminated", "field": "metadata.namespace"}]}}
    rbac = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
            "message": "events is forbidden: User cannot create resource"}

    class Refusing:
        def __init__(self, body: dict[str, Any]) -> None:
            self.body = body

        async def create(self, url: str, body: dict[str, Any], **_: Any) -> Any:
            raise ApiError(403, self.body, "POST", url)

    obj = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
    with caplog.at_level(logging.DEBUG, logger="omnistage.operator"):
        await EventRecorder(Refusing(terminating)).record(  # type: ignore[arg-type]
            obj, "Normal", "Terminating", "going")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "namespace is terminating" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="omnistage.operator"):
        await EventRecorder(Refusing(rbac)).record(  # type: ignore[arg-type]
            obj, "Normal", "Terminating", "going")
    assert [r for r in caplog.records if r.levelno == logging.WARNING], caplog.text
