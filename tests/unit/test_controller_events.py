"""Events the controller raises from its own decisions, against a recording stand-in API (the
same paths run against a real API server in tests/cluster/test_operator.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_operator import builders
from omni_operator.controller import FINALIZER, Controller
from omni_operator.models import API_VERSION

Obj = dict[str, Any]


class RecordingApi:
    """Answers every write with the object written; keeps the Events created."""

    def __init__(self) -> None:
        self.events: list[Obj] = []
        self.writes: list[tuple[str, str]] = []

    async def create(self, url: str, body: Obj, **_: Any) -> Obj:
        if body.get("kind") == "Event":
            self.events.append(body)
        self.writes.append(("create", url))
        return body

    async def patch(self, url: str, body: Any, **_: Any) -> Obj:
        self.writes.append(("patch", url))
        return {"metadata": {}}

    async def delete(self, url: str, body: Any = None, **_: Any) -> Obj:
        self.writes.append(("delete", url))
        return {}

    async def get(self, url: str, **_: Any) -> None:
        return None

    async def close(self) -> None:
        pass


def deleting_pipeline() -> Obj:
    return {"apiVersion": API_VERSION, "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1,
                         "resourceVersion": "5", "finalizers": [FINALIZER],
                         "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}}


async def _settle(controller: Controller) -> None:
    """Let the background event writes run."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_deletion_raises_one_normal_terminating_event() -> None:
    """The ordered shutdown takes many reconciles (one per second while the orchestrator
    drains); the deletion is announced once, as Normal. Kills: no event (docs/crds.md
    promises one), one per reconcile, a Warning, and a repeat after a restart once the status
    says Terminating."""
    api = RecordingApi()
    controller = Controller(api=api)  # type: ignore[arg-type]
    obj = deleting_pipeline()
    oname = builders.orchestrator_name("p")
    # An orchestrator pod still draining: each reconcile writes status and comes back later.
    controller.pods[("ns", oname)] = {f"{oname}-x": {"metadata": {"name": f"{oname}-x"}}}
    for _ in range(3):
        await controller.shutdown_pipeline(obj)
    await _settle(controller)
    announced = [e for e in api.events if e["reason"] == "Terminating"]
    assert len(announced) == 1, api.events
    [event] = announced
    assert event["type"] == "Normal"
    assert event["involvedObject"]["kind"] == "OmniPipeline"
    assert "orchestrator drains first" in event["message"]

    # A restarted operator (no memory) finds the status already Terminating: no repeat.
    restarted_api = RecordingApi()
    restarted = Controller(api=restarted_api)  # type: ignore[arg-type]
    restarted.pods = controller.pods
    await restarted.shutdown_pipeline({**obj, "status": {"phase": "Terminating"}})
    await _settle(restarted)
    assert not [e for e in restarted_api.events if e["reason"] == "Terminating"]
    for c in (controller, restarted):  # the 1 s re-checks were scheduled on this loop
        for handle in c._timers.values():
            handle.cancel()
