"""The per-stage load signal: what an autoscaler (the operator, `omnistage serve`, HPA/KEDA
through Prometheus) needs to size each stage's pool.

Why here: the orchestrator is the one place that sees every request enter and leave every
stage, so it measures; deciding is elsewhere (omnistage.autoscaling). The engine feeds a
LoadTracker at four points of a task's life (it needs the stage, it is dispatched to a replica,
the replica's first output, its end), and GET /v1/load and the `omnistage_stage_*` gauges read
one PipelineLoad built from it. A task's queue wait has two parts: the orchestrator's (need to
dispatch, held time included) and the worker's (its admission queue, which the worker reports
on the first output, protocol `queue_wait_s`); the sample is their sum, taken at the first
output, so a task that fails before any output leaves none. The service time less the worker's
part is `exec_s`, the queue-free service time the autoscaler's Little's law needs.

Cost is bounded whatever the traffic: each figure keeps a ring of its last RING_SIZE samples
(time, value), read only when someone asks (once per autoscaler period). Under more than
RING_SIZE samples per window the figures cover the most recent RING_SIZE of them: the rate is
then measured over the span those samples cover, not the whole window.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated

import msgspec

if TYPE_CHECKING:
    from omnistage.spec import PipelineSpec

__all__ = [
    "DEFAULT_WINDOW_S",
    "RING_SIZE",
    "LoadTracker",
    "PipelineLoad",
    "RevisionLoad",
    "StageLoad",
    "StageTracker",
    "p95",
    "window_of",
]

DEFAULT_WINDOW_S = 60.0
RING_SIZE = 1024
Clock = Callable[[], float]


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class RevisionLoad(msgspec.Struct, kw_only=True):
    """One revision of a stage (docs/architecture.md, "Revisions")."""

    order: Annotated[int, _doc("Its release order: the highest among its replicas.")]
    newest: Annotated[bool, _doc("It is the stage's newest revision (the highest order).")]
    replicas: Annotated[int, _doc("Replicas of it the orchestrator knows (joining, ready or "
                                  "draining).")]
    routable: Annotated[int, _doc("Of those, the routable ones.")]
    pinned: Annotated[int, _doc("Requests in flight pinned to this revision (admitted, not yet "
                                "terminal): the operator retires the last replica of a "
                                "revision a release leaves only once this is 0.")] = 0


class StageLoad(msgspec.Struct, kw_only=True):
    """One stage's figures (the JSON keys of GET /v1/load, per stage)."""

    replicas: Annotated[int, _doc("Routable replicas.")]
    inflight: Annotated[int, _doc("Tasks admitted to the stage's replicas (queued in workers "
                                  "included).")]
    held: Annotated[int, _doc("Tasks the orchestrator holds for the stage, every cause "
                              "together (held_by_cause splits them): it is at zero replicas "
                              "(wake), a replica of their revision is on its way (revision), "
                              "or no replica they may go to has room (window).")]
    arrivals_per_s: Annotated[float, _doc("Tasks that needed the stage, per second over the "
                                          "window.")]
    service_s: Annotated[float, _doc("Mean time from dispatch to the stage's last reply over "
                                     "the window; 0 if none.")]
    exec_s: Annotated[float, _doc("Mean queue-free service time over the window: service_s "
                                  "less the replica's admission-queue wait it reported; 0 if "
                                  "none.")]
    queue_wait_p95_s: Annotated[float, _doc("p95 of the time from needing the stage to a "
                                            "replica's executor taking it: held time, and the "
                                            "replica's admission queue as it reports it.")]
    ttfo_p95_s: Annotated[float, _doc("p95 of the time from dispatch to the stage's first "
                                      "output (the replica's queue included).")]
    last_request_unix: Annotated[float | None, _doc("Unix time a task last needed the stage; "
                                                    "null if never.")]
    wake_pending: Annotated[bool, _doc("A wake was asked for and no replica is routable yet.")]


class PipelineLoad(msgspec.Struct, kw_only=True):
    """GET /v1/load: every stage's figures over one window."""

    window_s: Annotated[float, _doc("The window the rates and percentiles cover, seconds.")]
    now: Annotated[float, _doc("Unix time of this snapshot.")]
    stages: dict[str, StageLoad]
    # Apart from `stages`: the operator's autoscaler mirrors StageLoad field by field, so a
    # figure it does not need lives out here (it ignores what it does not know).
    revisions: Annotated[dict[str, dict[str, RevisionLoad]], _doc(
        "Per stage, its payload revisions among its replicas, by revision (docs/architecture.md, "
        "\"Revisions\"); a stage whose replicas say no revision is left out.")] = {}
    held_by_cause: Annotated[dict[str, dict[str, int]], _doc(
        "Per stage, its held tasks by cause (wake, revision, window; every cause named): "
        "they add up to the stage's `held`, and together they count against its one bound, "
        "holdQueue.")] = {}


def p95(values: Iterable[float]) -> float:
    """The 95th percentile (nearest rank); 0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class StageTracker:
    """Bounded rings of one stage's recent samples, each (monotonic time, value)."""

    __slots__ = ("arrivals", "execs", "last_arrival", "queue_waits", "services", "ttfos")

    def __init__(self, size: int = RING_SIZE) -> None:
        self.arrivals: deque[float] = deque(maxlen=size)
        self.queue_waits: deque[tuple[float, float]] = deque(maxlen=size)
        self.ttfos: deque[tuple[float, float]] = deque(maxlen=size)
        self.services: deque[tuple[float, float]] = deque(maxlen=size)
        self.execs: deque[tuple[float, float]] = deque(maxlen=size)
        self.last_arrival: float | None = None

    def arrival_rate(self, now: float, window: float, age: float) -> float:
        """Arrivals per second over the window (over the tracker's age while it is younger
        than the window, and over the span the ring covers when it holds less than the
        window)."""
        since = now - window
        n = 0
        for t in reversed(self.arrivals):
            if t < since:
                break
            n += 1
        if n == 0:
            return 0.0
        if len(self.arrivals) == self.arrivals.maxlen and self.arrivals[0] >= since:
            return n / max(now - self.arrivals[0], 1e-3)  # the ring holds less than the window
        return n / max(min(window, age), 1.0)  # a second at least: no spike at start

    @staticmethod
    def recent(ring: deque[tuple[float, float]], since: float) -> list[float]:
        out = []
        for t, v in reversed(ring):
            if t < since:
                break
            out.append(v)
        return out


class LoadTracker:
    """Per-stage trackers fed by the engine; `figures` reads one stage's windowed numbers.

    clock is monotonic (tests pass a fake one); wall gives unix time for last_request_unix.
    """

    def __init__(self, stages: Iterable[str], *, window_s: float = DEFAULT_WINDOW_S,
                 ring_size: int = RING_SIZE, clock: Clock = time.monotonic,
                 wall: Clock = time.time) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {window_s}")
        self.window_s = float(window_s)
        self.clock = clock
        self.wall = wall
        self.started = clock()
        self.stages = {s: StageTracker(ring_size) for s in stages}

    # ---- samples (the engine calls these) --------------------------------------------------

    def arrived(self, stage: str) -> float:
        """A task needs the stage (dispatched at once or held); returns the time, which the
        engine keeps to measure the task's queue wait."""
        now = self.clock()
        tracker = self.stages[stage]
        tracker.arrivals.append(now)
        tracker.last_arrival = now
        return now

    def dispatched(self, stage: str, needed_at: float) -> float:
        """The task went to a replica; returns the time, from which ttfo and service count
        (the queue-wait sample waits for the replica's part, at the first output)."""
        del stage, needed_at  # the orchestrator's wait is sent_at - needed_at, see first_output
        return self.clock()

    def first_output(self, stage: str, sent_at: float, *, needed_at: float | None = None,
                     worker_queue_s: float | None = None) -> None:
        """The replica's first output for a task sent at sent_at. With needed_at, one
        queue-wait sample: the orchestrator's wait (sent_at - needed_at) plus the replica's
        admission-queue wait it reported (worker_queue_s; None from a replica that does not
        report it, which then counts as service time, as before the field existed)."""
        now = self.clock()
        tracker = self.stages[stage]
        tracker.ttfos.append((now, max(0.0, now - sent_at)))
        if needed_at is not None:
            wait = max(0.0, sent_at - needed_at) + max(0.0, worker_queue_s or 0.0)
            tracker.queue_waits.append((now, wait))

    def finished(self, stage: str, sent_at: float, *, worker_queue_s: float | None = None) -> None:
        """The stage's work on the task ended (its final reply, or an abort's). worker_queue_s:
        the replica's admission-queue wait it reported with the first output (None: not
        reported, or no output), taken off the service time for the queue-free `exec_s` that
        the autoscaler sizes on (a queue would otherwise count as work and oversize the pool)."""
        now = self.clock()
        service = max(0.0, now - sent_at)
        tracker = self.stages[stage]
        tracker.services.append((now, service))
        tracker.execs.append((now, max(0.0, service - max(0.0, worker_queue_s or 0.0))))

    # ---- reading ---------------------------------------------------------------------------

    def figures(self, stage: str, *, replicas: int, inflight: int, held: int,
                wake_pending: bool) -> StageLoad:
        """One stage's StageLoad; the engine supplies what it knows right now."""
        now = self.clock()
        tracker = self.stages[stage]
        since = now - self.window_s
        services = tracker.recent(tracker.services, since)
        execs = tracker.recent(tracker.execs, since)
        last = tracker.last_arrival
        return StageLoad(
            replicas=replicas, inflight=inflight, held=held,
            arrivals_per_s=tracker.arrival_rate(now, self.window_s, now - self.started),
            service_s=sum(services) / len(services) if services else 0.0,
            exec_s=sum(execs) / len(execs) if execs else 0.0,
            queue_wait_p95_s=p95(tracker.recent(tracker.queue_waits, since)),
            ttfo_p95_s=p95(tracker.recent(tracker.ttfos, since)),
            last_request_unix=None if last is None else self.wall() - (now - last),
            wake_pending=wake_pending,
        )


def window_of(spec: PipelineSpec) -> float:
    """The signal's window: the longest `autoscaling.windowSeconds` among the pipeline's
    stages (one window for every stage keeps the tracker simple), else DEFAULT_WINDOW_S."""
    windows = [float(s.autoscaling.window_seconds) for s in spec.stages
               if s.autoscaling is not None]
    return max(windows, default=DEFAULT_WINDOW_S)
