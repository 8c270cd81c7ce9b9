"""The controller's server-side apply path against a recording fake API: when it applies (only
on a changed intent or a drifted field), what the intent holds (its digest; a StagePool's
replicas only while the operator owns them), and how the finalizer is released. The real API
server's side is tests/cluster/test_operator_writes.py."""

from __future__ import annotations

import copy
import json
from typing import Any

from omni_operator import builders
from omni_operator import controller as ctl
from omni_operator.controller import ANNOTATION_APPLIED, Controller, applied_intent, owners, owns
from omnistage.kubeapi import ApiError, Applied

Obj = dict[str, Any]
MANAGER = "omnistage-operator"


class RecordingApi:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any, dict[str, Any]]] = []

    async def apply(self, url: str, obj: Obj, **kwargs: Any) -> Applied:
        self.calls.append(("apply", url, obj, kwargs))
        return Applied(obj, created=True)

    async def patch(self, url: str, body: Obj, kind: str = "merge", **kwargs: Any) -> Obj:
        self.calls.append(("patch", url, body, kwargs))
        return body

    async def get(self, url: str, **kwargs: Any) -> Obj:
        """Lists only (the chart grants list and watch, no get): a list that finds nothing."""
        self.calls.append(("get", url, None, kwargs))
        if url.rsplit("/", 1)[-1] != "omnipipelines":
            raise ApiError(403, {"kind": "Status", "reason": "Forbidden"}, "GET", url)
        return {"items": []}

    async def close(self) -> None:
        pass


def _entry(manager: str, operation: str, fields: Obj, subresource: str = "") -> Obj:
    entry = {"manager": manager, "operation": operation, "fieldsType": "FieldsV1",
             "fieldsV1": fields}
    if subresource:
        entry["subresource"] = subresource
    return entry


def _live(intent: Obj, *entries: Obj) -> Obj:
    """The object as the API server would return it after the apply."""
    live = copy.deepcopy(intent)
    live["metadata"].update(uid="u", resourceVersion="7", managedFields=list(entries))
    return live


CONFIGMAP = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "p-pipeline", "namespace": "ns", "labels": {"a": "1"}},
             "data": {"pipeline.json": "{}", "old": "x"}}


async def test_ensure_applies_on_a_changed_intent_or_drift_and_never_otherwise() -> None:
    """Kills: patching instead of applying, no force or another manager, writing a converged
    object, and missing a field the intent dropped (the live object is still a superset)."""
    api = RecordingApi()
    c = Controller(api=api)  # type: ignore[arg-type]
    created: list[bool] = []

    async def on_create() -> None:
        created.append(True)

    await c.writes.ensure(CONFIGMAP, None, on_create)
    [(verb, url, intent, kwargs)] = api.calls
    assert (verb, url) == ("apply", "/api/v1/namespaces/ns/configmaps/p-pipeline")
    assert kwargs == {"field_manager": MANAGER, "force": True} and created == [True]
    assert intent["metadata"]["annotations"][ANNOTATION_APPLIED]
    live = _live(intent, _entry(MANAGER, "Apply", {"f:data": {}}))

    await c.writes.ensure(CONFIGMAP, live)  # converged (a restarted operator sees the same)
    assert len(api.calls) == 1

    dropped = copy.deepcopy(CONFIGMAP)
    del dropped["data"]["old"]
    await c.writes.ensure(dropped, live)  # the live object still has "old": only the digest tells
    assert len(api.calls) == 2 and "old" not in api.calls[-1][2]["data"]

    drifted = copy.deepcopy(live)
    drifted["data"]["pipeline.json"] = "edited by hand"
    await c.writes.ensure(CONFIGMAP, drifted)
    assert len(api.calls) == 3 and api.calls[-1][2]["data"]["pipeline.json"] == "{}"
    assert created == [True]  # applies that did not create report nothing


def _pool(replicas: int, seed: int) -> Obj:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
            "metadata": {"name": "p-a", "namespace": "ns",
                         "annotations": {builders.ANNOTATION_SEED_REPLICAS: str(seed)}},
            "spec": {"pipeline": "p", "replicas": replicas, "stage": {"name": "a"}}}


OWNER = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
         "metadata": {"name": "p", "namespace": "ns", "uid": "u0"}}


async def test_pool_replicas_follow_their_owner() -> None:
    """Kills: leaving replicas out while the operator's apply owns them (the apply would
    remove them), keeping them in after `kubectl scale` took them (the scale would be undone),
    a digest that changes with that choice (a write after every scale), and ignoring a change
    of the stage's replicas in the pipeline."""
    api = RecordingApi()
    c = Controller(api=api)  # type: ignore[arg-type]
    c.writes.event = lambda *a: None  # type: ignore[method-assign,assignment]
    intent = applied_intent(_pool(2, 2))
    ours = _entry(MANAGER, "Apply", {"f:spec": {"f:replicas": {}, "f:stage": {}}})
    c.pools[("ns", "p-a")] = _live(intent, ours)
    assert owns(c.pools[("ns", "p-a")], ("spec", "replicas"))

    await c.pipeline_reconciler.ensure_child(OWNER, _pool(2, 2))
    assert api.calls == []  # converged, replicas ours and equal
    relabelled = _pool(2, 2)
    relabelled["metadata"]["labels"] = {"new": "label"}
    # another change: replicas stay in the intent
    await c.pipeline_reconciler.ensure_child(OWNER, relabelled)
    assert api.calls[-1][2]["spec"]["replicas"] == 2
    api.calls.clear()

    scaled = _live(intent, _entry(MANAGER, "Apply", {"f:spec": {"f:stage": {}}}),
                   _entry("kubectl", "Update", {"f:spec": {"f:replicas": {}}}, "scale"))
    scaled["spec"]["replicas"] = 5
    c.pools[("ns", "p-a")] = scaled
    assert not owns(scaled, ("spec", "replicas"))
    assert owners(scaled, ("spec", "replicas")) == {("kubectl", "Update", "scale")}
    await c.pipeline_reconciler.ensure_child(OWNER, _pool(2, 2))
    assert api.calls == []  # scaled by hand: nothing to write, and 5 stays

    scaled["metadata"]["labels"] = {"drift": "x"}  # any other write still leaves replicas out
    changed = _pool(2, 2)
    changed["metadata"]["labels"] = {"new": "label"}
    await c.pipeline_reconciler.ensure_child(OWNER, changed)
    assert "replicas" not in api.calls[-1][2]["spec"]

    # the pipeline changed the stage's replicas
    await c.pipeline_reconciler.ensure_child(OWNER, _pool(3, 3))
    assert api.calls[-1][2]["spec"]["replicas"] == 3 and api.calls[-1][3]["force"] is True


def _deleting(entries: list[Obj]) -> Obj:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u0", "generation": 2,
                         "deletionTimestamp": "2026-01-01T00:00:00Z",
                         "finalizers": ["other.io/keep", ctl.FINALIZER],
                         "managedFields": entries},
            "spec": {"stages": []}}


async def test_the_finalizer_is_released_by_apply_or_by_a_patch_when_an_old_operator_added_it(
) -> None:
    """Kills: a release that rewrites the whole list (racing other controllers) although the
    operator's apply owns the finalizer, and a release by apply of a finalizer an update owns
    (the API server would keep it and the pipeline would never go)."""
    item = {"f:metadata": {"f:finalizers": {json.dumps(ctl.FINALIZER).join(["v:", ""]): {}}}}
    api = RecordingApi()
    c = Controller(api=api)  # type: ignore[arg-type]
    await c.pipeline_reconciler.shutdown(_deleting([_entry(MANAGER, "Apply", item),
                                         _entry("other", "Update", {"f:metadata": {}})]))
    [(verb, _, intent, kwargs)] = api.calls
    assert verb == "apply" and "finalizers" not in intent["metadata"]
    assert intent["metadata"]["name"] == "p" and kwargs == {"field_manager": MANAGER}

    api.calls.clear()
    await c.pipeline_reconciler.shutdown(_deleting([_entry(MANAGER, "Update", item)]))
    [(verb, _, body, kwargs)] = api.calls
    assert verb == "patch" and body == {"metadata": {"finalizers": ["other.io/keep"]}}
    assert kwargs == {"fieldManager": MANAGER}


class GoneApi(RecordingApi):
    """The pipeline was deleted after the view saw it: the API server refuses an apply that
    names its uid with 409 (no object with that uid), and a list by name finds nothing."""

    async def apply(self, url: str, obj: Obj, **kwargs: Any) -> Applied:
        self.calls.append(("apply", url, obj, kwargs))
        raise ApiError(409, {"kind": "Status", "reason": "Conflict", "message": "uid mismatch"},
                       "PATCH", url)


async def test_a_finalizer_apply_on_a_stale_view_of_a_deleted_pipeline_is_not_invalid() -> None:
    """The intent names the object's uid (so the API server never creates a pipeline from it),
    and a 409 for an object that is gone drops it from the view: no InvalidSpec, no event, no
    error. Kills: an intent without the uid (the apply made a spec-less create, 422, reported
    as an invalid spec during a clean teardown), and a 409 raised although the object is gone."""
    api = GoneApi()
    c = Controller(api=api)  # type: ignore[arg-type]
    item = {"f:metadata": {"f:finalizers": {json.dumps(ctl.FINALIZER).join(["v:", ""]): {}}}}
    obj = _deleting([_entry(MANAGER, "Apply", item)])
    c.view.observe("OmniPipeline", "ADDED", obj)
    await c.pipeline_reconciler.shutdown(obj)
    (verb, _, intent, _), (read, url, _, params) = api.calls
    assert verb == "apply" and intent["metadata"]["uid"] == "u0" and read == "get"
    assert url.endswith("/namespaces/ns/omnipipelines")  # a list: the chart grants no get
    assert params == {"fieldSelector": "metadata.name=p"}
    assert c.view.get("OmniPipeline", "ns", "p") is None  # forgotten, as for a 404
    assert not c.writes._invalid
