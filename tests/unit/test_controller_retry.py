"""How the controller's workers fail: per-key exponential backoff with jitter and a cap, the
traceback logged once per run of failures, a permanent error reported on the object (one
Warning event) instead of retried in a loop, and a terminating namespace told by the API's
structured Status. The clock is fake: delayed re-enqueues are recorded and run at once, and the
parked keys' clock is a number the test moves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from omni_operator import controller as ctl
from omni_operator.controller import Controller, namespace_terminating, permanent
from omnistage.backoff import Backoff
from omnistage.kubeapi import ApiError, Applied

Obj = dict[str, Any]
KEY = ("OmniPipeline", "ns", "p")


def _terminating_body(message: str) -> Obj:
    """The NamespaceLifecycle admission's answer, as kube-apiserver v1.36 sends it (a
    StatusCause's type goes on the wire as "reason")."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": "Forbidden",
            "details": {"name": "p-a-0", "kind": "pods", "causes": [{
                "reason": "NamespaceTerminating", "message": "namespace ns is being terminated",
                "field": "metadata.namespace"}]}, "code": 403}


def test_terminating_namespace_is_read_from_the_status_cause_not_the_text() -> None:
    german = ApiError(403, _terminating_body("Namespace ns wird gerade beendet"), "PATCH", "/x")
    assert namespace_terminating(german)
    rbac = ApiError(403, {"kind": "Status", "reason": "Forbidden", "code": 403,
                          "message": "... because it is being terminated"}, "PATCH", "/x")
    assert not namespace_terminating(rbac)  # the English text alone proves nothing
    assert not namespace_terminating(RuntimeError("being terminated"))


def test_permanent_errors_carry_the_api_servers_field_causes() -> None:
    invalid = ApiError(422, {"kind": "Status", "reason": "Invalid", "code": 422,
                             "message": "StagePool.omnistage.io \"p-a\" is invalid",
                             "details": {"name": "p-a", "kind": "StagePool", "causes": [
                                 {"field": "spec.replicas", "message": "must be >= 0"}]}},
                       "PATCH", "/apis/omnistage.io/v1alpha1/namespaces/ns/stagepools/p-a")
    refused = permanent(invalid)
    assert refused is not None and refused.errors == [("StagePool p-a: spec.replicas",
                                                       "must be >= 0")]
    bare = permanent(ApiError(400, "not json", "PATCH", "/api/v1/x"))
    assert bare is not None and bare.errors[0][0] == "/api/v1/x"
    own = ctl.PermanentError([("spec.x", "never")])
    assert permanent(own) is own
    for transient in (ApiError(409, {}, "PATCH", "/x"), ApiError(500, {}, "GET", "/x"),
                      TimeoutError()):
        assert permanent(transient) is None


class FakeApi:
    """Records writes; `refuse` answers the apply of that kind with 422 Invalid."""

    def __init__(self, controller: Callable[[], Controller]) -> None:
        self.controller = controller
        self.refuse: str | None = None
        self.applied: list[Obj] = []
        self.status: list[Obj] = []
        self.created: list[Obj] = []

    async def apply(self, url: str, obj: Obj, **_: Any) -> Applied:
        if obj["kind"] == self.refuse:
            raise ApiError(422, {"kind": "Status", "reason": "Invalid", "code": 422,
                                 "details": {"kind": obj["kind"],
                                             "name": obj["metadata"]["name"], "causes": [
                                                 {"field": "spec.image",
                                                  "message": "Invalid value: \"!\""}]}},
                           "PATCH", url)
        self.applied.append(obj)
        return Applied(obj, created=True)

    async def create(self, url: str, obj: Obj, **_: Any) -> Obj:
        self.created.append(obj)  # the pipeline's CurveZMQ Secret, made once
        return obj

    async def patch(self, url: str, body: Obj, *_: Any, **__: Any) -> Obj:
        if url.endswith("/status"):  # the watch would bring our own write back
            self.status.append(body["status"])
            c = self.controller()
            obj = c.pipelines[("ns", "p")]
            c.view.observe("OmniPipeline", "MODIFIED", {**obj, "status": body["status"]})
        return body

    async def close(self) -> None:
        pass


def _pipeline(generation: int) -> Obj:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": generation,
                         "finalizers": [ctl.FINALIZER]},
            "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}}


class Harness:
    """A controller with one worker, a fake API, recorded retries and events."""

    def __init__(self, retry: Backoff | None = None) -> None:
        self.now = 0.0
        self.api = FakeApi(lambda: self.c)
        self.c = Controller(api=self.api, workers=1, resync_seconds=3600,  # type: ignore[arg-type]
                            retry=retry, clock=lambda: self.now)
        self.delays: list[tuple[Any, float]] = []
        self.events: list[tuple[str, str, str]] = []
        self.reconciled: list[Any] = []
        self.idle = asyncio.Event()
        real = self.c.reconcile

        async def reconcile(key: Any) -> None:
            self.reconciled.append(key)
            await real(key)

        def later(key: Any, delay: float) -> None:  # the fake clock: record, run at once
            self.delays.append((key, delay))
            if delay < ctl.RETRY_CAP:
                self.c.enqueue(key)

        self.c.reconcile = reconcile  # type: ignore[method-assign]
        self.c.enqueue_later = later  # type: ignore[method-assign]
        self.c.writes.event = lambda obj, etype, reason, msg: self.events.append(  # type: ignore[method-assign]
            (etype, reason, msg))

    async def settle(self) -> None:
        """Until the queue is empty and no reconcile runs (each pass yields to the loop)."""
        for _ in range(1000):
            await asyncio.sleep(0)
            if self.c.queue._queue.empty() and not self.c.queue._running:
                for _ in range(5):
                    await asyncio.sleep(0)
                if self.c.queue._queue.empty() and not self.c.queue._running:
                    return
        raise AssertionError("the work queue never drained")


async def test_failures_back_off_per_key_with_jitter_cap_and_reset(
        caplog: pytest.LogCaptureFixture) -> None:
    """Kills: a fixed retry delay, a delay that never stops growing, jitter that shortens a
    wait, a success that does not reset the key, one key's failures slowing another, and a
    traceback logged on every failure (or never)."""
    h = Harness(Backoff(1.0, 8.0, jitter=0.5, rand=lambda: 0.5))
    script: dict[str, list[Exception | None]] = {
        "a": [*(RuntimeError(f"boom {i}") for i in range(1, 6)), None, RuntimeError("x"), None],
        "b": [KeyError("once"), None]}

    async def reconcile(key: Any) -> None:
        step = script[key[2]].pop(0)
        if step is not None:
            raise step

    h.c.reconcile = reconcile  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="omnistage.operator")
    h.c.start()
    try:
        h.c.enqueue(("StagePool", "ns", "a"))
        h.c.enqueue(("StagePool", "ns", "b"))
        await h.settle()
        assert len(script["a"]) == 2  # five failures, then a success
        h.c.enqueue(("StagePool", "ns", "a"))  # a later failure of the same key
        await h.settle()
    finally:
        await h.c.stop()
    assert script == {"a": [], "b": []}
    waits = [d for k, d in h.delays if k[2] == "a"]
    # 1, 2, 4, 8, 8 (the cap) stretched by half the 50% jitter; after the success: 1 again
    assert waits == [1.25, 2.5, 5.0, 10.0, 10.0, 1.25]
    assert [d for k, d in h.delays if k[2] == "b"] == [1.25]
    lines = [r for r in caplog.records if "'a')" in r.getMessage()]
    assert len(lines) == 6
    first, *repeats, after_reset = lines
    assert first.exc_info is not None and "boom 1" in caplog.text and "Traceback" in caplog.text
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in repeats)
    assert [f"({n} in a row)" in r.getMessage() for n, r in enumerate(repeats, 2)] == [True] * 4
    assert "boom 5" in repeats[-1].getMessage()
    assert after_reset.exc_info is not None  # a new run of failures starts with its traceback


async def test_a_refused_child_parks_the_key_with_a_condition_and_one_event() -> None:
    """The API server answers 422 for a child the spec builds: the pipeline's status says
    InvalidSpec naming the field, one Warning event, and the key is not reconciled again
    until its generation changes or the cap passes (then once, with no new event).

    Kills: retrying a 422 in a loop, an event per retry, parking that survives a new
    generation, and parking that never retries at the cap."""
    h = Harness()
    h.api.refuse = "StagePool"
    h.c.start()
    try:
        h.c.view.observe("OmniPipeline", "ADDED", _pipeline(1))
        await h.settle()
        assert h.reconciled == [KEY]
        # The CurveZMQ and the API-key Secrets, before the refused child.
        assert [(s["kind"], s["metadata"]["name"]) for s in h.api.created] == [
            ("Secret", "p-curve-u1"), ("Secret", "p-api-keys-u1")]
        [status] = h.api.status
        [ready] = [c for c in status["conditions"] if c["type"] == "Ready"]
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert "StagePool p-a: spec.image" in ready["message"]
        assert [e[1] for e in h.events if e[0] == "Warning"] == ["InvalidSpec"]
        assert (KEY, ctl.RETRY_CAP) in h.delays  # the one rare retry

        for _ in range(3):  # resyncs and watch events: parked, nothing runs
            h.c.enqueue(KEY)
            await h.settle()
        assert h.reconciled == [KEY]

        h.now += ctl.RETRY_CAP  # the cap passed: tried once more, still refused, no new event
        h.c.enqueue(KEY)
        await h.settle()
        assert h.reconciled == [KEY, KEY]
        assert [e[1] for e in h.events if e[0] == "Warning"] == ["InvalidSpec"]
        assert len(h.api.created) == 2  # the Secrets made once, never again
        h.c.enqueue(KEY)
        await h.settle()
        assert len(h.reconciled) == 2  # parked again

        h.api.refuse = None  # the user fixes the spec: a new generation runs at once
        h.c.view.observe("OmniPipeline", "MODIFIED", {**h.c.pipelines[("ns", "p")],
                                                      **{"metadata": _pipeline(2)["metadata"]}})
        await h.settle()
        assert len(h.reconciled) >= 3 and KEY not in h.c.queue._parked  # (+1: its status write)
        assert h.c.queue.retry.failures(KEY) == 0
        assert any(o["kind"] == "StagePool" for o in h.api.applied)
    finally:
        await h.c.stop()


async def test_a_terminating_namespace_is_not_retried_but_a_forbidden_write_is() -> None:
    """Kills: matching the English message (the German one below would be retried) and
    treating every 403 as a terminating namespace (a missing grant would never be retried)."""
    h = Harness(Backoff(1.0, 8.0))
    answers = [ApiError(403, _terminating_body("Namespace ns wird gerade beendet"), "PATCH", "/x"),
               ApiError(403, {"kind": "Status", "reason": "Forbidden", "code": 403,
                              "message": "cannot patch stagepools"}, "PATCH", "/x"),
               None]

    async def reconcile(key: Any) -> None:
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    h.c.reconcile = reconcile  # type: ignore[method-assign]
    h.c.start()
    try:
        h.c.enqueue(KEY)
        await h.settle()
        assert h.delays == [] and len(answers) == 2  # terminating: no retry scheduled
        h.c.enqueue(KEY)
        await h.settle()
        assert h.delays == [(KEY, 1.0)] and answers == []  # forbidden: retried, then fine
    finally:
        await h.c.stop()
