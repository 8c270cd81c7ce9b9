"""Requests pinned to stage revisions: drawn at admission (revisions.pin) and counted from
admission to the request's one terminal outcome. The count is GET /v1/load's `pinned`: the
operator keeps the last replica of a revision a release leaves while requests are pinned to it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from omnistage.orchestrator.load import RevisionLoad
from omnistage.orchestrator.pools import StagePool
from omnistage.orchestrator.revisions import NEWEST, count_revisions, newest, pin
from omnistage.orchestrator.tasks import Request


class Pins:
    def __init__(self, pools: dict[str, StagePool], draw: Callable[[], float]) -> None:
        """draw: the random source of the newest/previous choice (tests seed it)."""
        self.pools = pools
        self.draw = draw
        # Requests admitted, by stage and the revision they were pinned to there.
        self.admissions: dict[tuple[str, str], int] = {}
        # Requests in flight (admitted, not terminal), by stage and the revision they are pinned
        # to there. A key leaves when its count is back to 0.
        self.pinned: dict[tuple[str, str], int] = {}

    def choose(self, request: Request) -> None:
        """Pin the request, at each stage it needs, to the newest or the previous revision.

        Outside a release every stage has at most one revision, and revisions.pin gives each
        stage that one (or None) on the newest track without a draw: that case skips counting
        (the request path's common case; tests/unit/test_revisions.py holds it to pin)."""
        only: dict[str, str | None] = {}
        for stage in request.order:
            revs = {r.revision for r in self.pools[stage].replicas.values()
                    if not r.refused and r.revision is not None}
            if len(revs) > 1:
                break
            only[stage] = revs.pop() if revs else None
        else:
            request.track, request.pins = NEWEST, only
            return
        request.track, request.pins = pin(
            {s: count_revisions(self.pools[s].replicas.values()) for s in request.order},
            self.draw)

    def admit(self, request: Request) -> None:
        """The request is admitted: it holds its revisions until release()."""
        request.counted = tuple((s, rev) for s, rev in request.pins.items() if rev is not None)
        for key in request.counted:
            self.admissions[key] = self.admissions.get(key, 0) + 1
            self.pinned[key] = self.pinned.get(key, 0) + 1

    def release(self, request: Request) -> None:
        """Its terminal outcome: it no longer holds its revisions (once, whatever the path)."""
        counted, request.counted = request.counted, ()
        for key in counted:
            left = self.pinned.get(key, 0) - 1
            if left > 0:
                self.pinned[key] = left
            else:
                self.pinned.pop(key, None)

    def revisions(self, stage: str) -> dict[str, RevisionLoad] | None:
        """The stage's revisions for the load signal; None when no replica says one."""
        counts = count_revisions(self.pools[stage].replicas.values())
        if not counts:
            return None
        top = newest(counts)
        return {rev: RevisionLoad(order=c.order, newest=rev == top, replicas=c.replicas,
                                  routable=c.routable, pinned=self.pinned.get((stage, rev), 0))
                for rev, c in counts.items()}


def pipeline_revision(pins: Mapping[str, str | None]) -> str | None:
    """A request's pipeline revision as its responses say it (the X-Omnistage-Revision
    header): `stage=revision` per stage it is pinned at, by stage name, comma-separated (a
    worker's revision, with its image and resolved hub commit: omnistage.revision); None when
    no stage names one. Two responses of one release read the same."""
    return ",".join(f"{stage}={rev}" for stage, rev in sorted(pins.items()) if rev) or None
