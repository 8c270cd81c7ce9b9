"""Which pipeline revision a request runs on: the pinning rule (pure; docs/architecture.md,
"Revisions").

Why: stages hand each other model-private payloads, so every hop of a request must run on one
pipeline revision. At admission the engine pins each request, per stage, to one stage revision
(omnistage.revision.stage_revision) and routes every hop, retries included, to replicas of it.

A pipeline revision is a release: the operator gives every stage revision a release order (the
pipeline's generation when the stage got it; a revert gets a new, higher one, and the replicas
already running the reverted-to revision are given it too). The pipeline revision of order G
runs, at each stage, the revision of the highest order not above G. Two matter at once: the
newest (G, the highest order among the replicas) and the previous one (the next lower order).
So a request's pins are always one release's, never the newest of one stage and the previous
of another, even when a revert finds the stages at different points of the release.

A request goes to the newest pipeline revision when every stage on which the two differ has a
routable replica of its newest revision, then with the probability min over those stages of
newest_routable / all_routable, so traffic shifts in proportion to the new capacity; to the
previous one when only it has a routable replica on every such stage; when neither has, to the
one whose missing replicas are on their way (joining: the engine holds a task pinned to a
revision until its replica there is routable), the newest when both or neither are. A stage with
one revision serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from omnistage.orchestrator.pools import Replica

__all__ = ["NEWEST", "PREVIOUS", "RevisionCount", "Track", "at_order", "count_revisions",
           "newest", "orders", "pin", "previous"]

Track = Literal["newest", "previous"]
NEWEST: Track = "newest"
PREVIOUS: Track = "previous"


@dataclass(frozen=True)
class RevisionCount:
    """One revision of one stage, as the orchestrator's replicas show it now."""

    order: int  # the highest release order among its replicas
    replicas: int  # replicas of it the orchestrator knows (joining, ready or draining)
    routable: int  # of those, the ones a task can go to now
    coming: int = 0  # of the others, those on their way (joining, or not handshaken yet)


def count_revisions(replicas: Iterable[Replica]) -> dict[str, RevisionCount]:
    """A stage's revisions, from its replicas: the ones whose revision is known and that took
    our protocol (a refused replica is never routed to, so it is no revision of the stage)."""
    out: dict[str, RevisionCount] = {}
    for r in replicas:
        rev = r.revision
        if rev is None or r.refused:
            continue
        seen = out.get(rev, RevisionCount(r.info.order, 0, 0))
        coming = (not r.routable and r.alive and r.info.state in ("joining", "ready"))
        out[rev] = RevisionCount(max(seen.order, r.info.order), seen.replicas + 1,
                                 seen.routable + (1 if r.routable else 0),
                                 seen.coming + (1 if coming else 0))
    return out


def newest(counts: Mapping[str, RevisionCount]) -> str | None:
    """The revision of the highest release order (ties: the greatest name, so every
    orchestrator agrees); None when there is none."""
    if not counts:
        return None
    return max(counts, key=lambda rev: (counts[rev].order, rev))


def at_order(counts: Mapping[str, RevisionCount], order: int) -> str | None:
    """The stage's revision in the pipeline revision of this order: the one of the highest
    order not above it (ties: the greatest name); the stage's lowest when all are above."""
    if not counts:
        return None
    below = [rev for rev in counts if counts[rev].order <= order]
    if not below:
        return min(counts, key=lambda rev: (counts[rev].order, rev))
    return max(below, key=lambda rev: (counts[rev].order, rev))


def orders(stages: Mapping[str, Mapping[str, RevisionCount]]) -> tuple[int, int]:
    """(newest, previous) release orders among every stage's revisions; previous is the newest
    when there is only one."""
    seen = sorted({c.order for counts in stages.values() for c in counts.values()})
    if not seen:
        return 0, 0
    return seen[-1], seen[-2] if len(seen) > 1 else seen[-1]


def previous(counts: Mapping[str, RevisionCount]) -> str | None:
    """One stage's previous revision on its own (the next lower order than its newest); the
    newest itself when it is the only one. `pin` decides across stages."""
    top = newest(counts)
    if top is None:
        return None
    return at_order(counts, counts[top].order - 1) if len(counts) > 1 else top


def pin(stages: Mapping[str, Mapping[str, RevisionCount]], draw: Callable[[], float]
        ) -> tuple[Track, dict[str, str | None]]:
    """The track (newest or previous) of one request and its revision at each stage (None: the
    stage has no known revision, so any replica serves it, unchecked).

    draw() gives a number in [0, 1) (random.random); it is called only when a choice is made,
    so a seeded source gives the same pins for the same sequence of states.
    """
    new_order, old_order = orders(stages)
    new = {stage: at_order(counts, new_order) for stage, counts in stages.items()}
    old = {stage: at_order(counts, old_order) for stage, counts in stages.items()}
    differ = [stage for stage in stages if new[stage] != old[stage]]
    track = NEWEST
    if differ:
        new_ok = _every(stages, differ, new, soon=False)
        old_ok = _every(stages, differ, old, soon=False)
        if new_ok and old_ok:
            shares = [_of(stages, s, new[s]).routable
                      / sum(c.routable for c in stages[s].values()) for s in differ]
            track = NEWEST if draw() < min(shares) else PREVIOUS
        elif old_ok:
            track = PREVIOUS  # a stage has no new-revision capacity yet: nothing moves
        elif not new_ok and _every(stages, differ, old, soon=True) \
                and not _every(stages, differ, new, soon=True):
            # Neither serves everywhere now: the one whose missing replicas are on their way
            # (the engine holds a task for them), the newest when both or neither are.
            track = PREVIOUS
    pins: dict[str, str | None] = dict(new if track == NEWEST else old)
    return track, pins


_NONE = RevisionCount(0, 0, 0)


def _of(stages: Mapping[str, Mapping[str, RevisionCount]], stage: str,
        rev: str | None) -> RevisionCount:
    return stages[stage].get(rev or "", _NONE)


def _every(stages: Mapping[str, Mapping[str, RevisionCount]], differ: Iterable[str],
           pins: Mapping[str, str | None], *, soon: bool) -> bool:
    """Whether each of these stages has a routable replica of its pinned revision (soon: or
    one on its way)."""
    return all(_of(stages, s, pins[s]).routable > 0
               or (soon and _of(stages, s, pins[s]).coming > 0) for s in differ)
