"""The one stand-in for orchestrator pods' GET /v1/load, for tests and benches.

Documents are built from the orchestrator's own types (omnistage.orchestrator.load:
PipelineLoad, StageLoad, RevisionLoad), so a field the orchestrator adds or renames reaches
every fake at once and a misspelt figure is an error, not a silently ignored key.
`FakeLoadServer` serves them over real HTTP on loopback (JsonServer: keep-alive, counted reads),
as orchestrator pods or the API server's service proxy would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from omnistage.kube import LOAD_PATH
from omnistage.orchestrator.load import PipelineLoad, RevisionLoad, StageLoad
from tests.harness.jsonhttp import JsonServer

Obj = dict[str, Any]

#: An idle stage with one replica: what `stage_load()` starts from.
IDLE_STAGE = StageLoad(replicas=1, inflight=0, held=0, arrivals_per_s=0.0, service_s=0.0,
                       exec_s=0.0, queue_wait_p95_s=0.0, ttfo_p95_s=0.0,
                       last_request_unix=None, wake_pending=False)
#: A revision with one replica that takes no new requests: what `revision_load()` starts from.
LEAVING_REVISION = RevisionLoad(order=1, newest=False, replicas=1, routable=0)


def stage_load(**figures: Any) -> StageLoad:
    """IDLE_STAGE with these figures (an unknown figure's name is a TypeError)."""
    return msgspec.structs.replace(IDLE_STAGE, **figures)


def revision_load(**figures: Any) -> RevisionLoad:
    return msgspec.structs.replace(LEAVING_REVISION, **figures)


def load_document(stages: Mapping[str, StageLoad] | None = None, *,
                  revisions: Mapping[str, Mapping[str, RevisionLoad]] | None = None,
                  now: float = 0.0, window_s: float = 60.0,
                  without: tuple[str, ...] = ()) -> Obj:
    """GET /v1/load's JSON. `without` drops these fields from every revision (an older
    orchestrator's document, for example one that does not report `pinned`)."""
    doc = msgspec.to_builtins(PipelineLoad(
        window_s=window_s, now=now, stages=dict(stages or {}),
        revisions={s: dict(r) for s, r in (revisions or {}).items()}))
    for by_revision in doc["revisions"].values():
        for entry in by_revision.values():
            for name in without:
                entry.pop(name, None)
    return doc  # type: ignore[no-any-return]


class FakeLoadServer:
    """Orchestrator pods' GET /v1/load on loopback.

    By default it serves `load_document` of `stages` and of `pinned` ((stage, revision) ->
    requests pinned, each as a leaving revision), on LOAD_PATH only (any other path is a 500),
    and a 500 while `broken`. `document(path)` replaces that for fakes that answer per path
    (for example per pipeline behind `url`). Several servers may share a port at different
    loopback addresses (several orchestrator pods). `clock` gives the document's `now` (0 by
    default; time.time for a fake whose `last_request_unix` is a wall time)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 document: Callable[[str], Obj] | None = None) -> None:
        self.stages: dict[str, StageLoad] = {}
        self.pinned: dict[tuple[str, str], int] = {}
        self.without: tuple[str, ...] = ()
        self.broken = False
        self.clock: Callable[[], float] = lambda: 0.0
        self._per_path = document
        self.server = JsonServer(self._reply, host, port)
        self.host, self.port = host, self.server.port
        #: A URL template for the operator's OMNISTAGE_AUTOSCALER_LOAD_URL, one path a pipeline.
        self.url = self.server.base_url + "/{namespace}/{pipeline}" + LOAD_PATH

    @property
    def reads(self) -> int:
        return self.server.reads

    def document(self) -> Obj:
        revisions: dict[str, dict[str, RevisionLoad]] = {}
        for (stage, revision), n in self.pinned.items():
            revisions.setdefault(stage, {})[revision] = revision_load(pinned=n)
        return load_document(self.stages, revisions=revisions, without=self.without,
                             now=self.clock())

    def _reply(self, path: str) -> tuple[int, Obj]:
        if self.broken:
            return 500, {"error": "broken on purpose"}
        if self._per_path is not None:
            return 200, self._per_path(path)
        if path != LOAD_PATH:
            return 500, {"error": f"no route {path}"}
        return 200, self.document()

    def close(self) -> None:
        self.server.close()
