"""The orchestrator's Prometheus metrics, read from its live state at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from omnistage.metrics import family, summary
from omnistage.orchestrator.holds import HoldCause
from omnistage.orchestrator.load import PipelineLoad
from omnistage.orchestrator.pools import StagePool

# The load signal's figures as gauges: (family, StageLoad field, help). HPA or KEDA users scale
# a StagePool on these instead of the built-in autoscaler; GET /v1/load serves the same numbers.
LOAD_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("omnistage_stage_inflight", "inflight",
     "Tasks admitted to the stage's replicas (queued in workers included)"),
    ("omnistage_stage_held", "held",
     "Tasks held by the orchestrator for the stage, every cause together (by cause: "
     "omnistage_stage_held_requests)"),
    ("omnistage_stage_arrivals_per_second", "arrivals_per_s",
     "Tasks that needed the stage per second, over the load window"),
    ("omnistage_stage_service_seconds", "service_s",
     "Mean time from dispatch to the stage's last reply, over the load window"),
    ("omnistage_stage_exec_seconds", "exec_s",
     "Mean queue-free service time (service less the replica's admission queue), over the "
     "load window"),
    ("omnistage_stage_queue_wait_p95_seconds", "queue_wait_p95_s",
     "p95 of the time from needing the stage to dispatch to a replica, over the load window"),
    ("omnistage_stage_ttfo_p95_seconds", "ttfo_p95_s",
     "p95 of the time from dispatch to the stage's first output, over the load window"),
)

# Failovers by stage (failover.Failover.counts, the engine's `failovers`): (kind, help).
FAILOVER_COUNTERS: tuple[tuple[str, str], ...] = (
    ("retries", "Stage tasks sent again to another replica after their replica was lost"),
    ("resumes", "Of those retries, streams that went on from the tokens the client already "
                "had"),
)


class OrchestratorCollector:
    """Every family carries the label pipeline.

    It holds references, not copies: `outcomes`, `requests`, `pools` and `counters` are the
    orchestrator's own containers, which it keeps mutating.
    """

    def __init__(self, *, pipeline: str, outcomes: Mapping[str, int], requests: Sized,
                 pools: Mapping[str, StagePool], counters: Mapping[str, float],
                 load: Callable[[], PipelineLoad] | None = None,
                 failovers: Mapping[str, Mapping[str, int]] | None = None,
                 admissions: Mapping[tuple[str, str], int] | None = None,
                 hold_refusals: Mapping[tuple[str, HoldCause], int] | None = None) -> None:
        """hold_refusals: holds.Holds.refused, (stage, HoldCause) -> tasks refused at the
        stage's hold bound."""
        self.common = {"pipeline": pipeline}
        self.outcomes = outcomes
        self.requests = requests
        self.pools = pools
        self.counters = counters
        self.load = load
        self.failovers = failovers or {}
        self.admissions = admissions if admissions is not None else {}
        self.hold_refusals = hold_refusals if hold_refusals is not None else {}

    def collect(self) -> Iterator[Metric]:
        c, common = self.counters, self.common
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        by_state: list[tuple[tuple[str, str], float]] = []
        inflight: list[tuple[tuple[str, str], float]] = []
        for stage, pool in self.pools.items():
            states: dict[str, int] = {}
            for r in pool.replicas.values():
                states[r.info.state] = states.get(r.info.state, 0) + 1
                inflight.append(((stage, r.name), r.inflight))
            by_state += [((stage, state), n) for state, n in sorted(states.items())]
        yield family(counter, "omnistage_orchestrator_requests_total",
                     "Requests by terminal status", common,
                     [((status,), n) for status, n in sorted(self.outcomes.items())], ["status"])
        yield family(gauge, "omnistage_orchestrator_inflight_requests", "Requests not terminal",
                     common, [((), len(self.requests))])
        yield family(gauge, "omnistage_orchestrator_replicas", "Replicas by stage and state",
                     common, by_state, ["stage", "state"])
        yield family(gauge, "omnistage_orchestrator_replica_inflight",
                     "Tasks bound to each replica", common, inflight, ["stage", "replica"])
        yield family(counter, "omnistage_orchestrator_late_messages_total",
                     "Replies for finished requests, dropped", common,
                     [((), c["late_messages"])])
        yield family(counter, "omnistage_orchestrator_late_aborts_total",
                     "Aborts for finished requests, dropped", common, [((), c["late_aborts"])])
        yield family(counter, "omnistage_orchestrator_replicas_lost_total",
                     "Replicas lost to a fault (missed heartbeats, or gone from the "
                     "membership without a drain); planned retirements are not counted here",
                     common, [((), c["replicas_lost"])])
        yield family(counter, "omnistage_orchestrator_replica_restarts_total",
                     "Replica processes seen gone unplanned (connection closed or a new "
                     "incarnation); the work bound to each was failed over or failed", common,
                     [((), c["replica_restarts"])])
        yield family(counter, "omnistage_orchestrator_replicas_retired_total",
                     "Replicas that left after a drain (scale-down, rollout, node drain): "
                     "planned, not faults", common, [((), c.get("replicas_retired", 0))])
        yield family(counter, "omnistage_orchestrator_hold_refusals_total",
                     "Tasks refused because their stage's hold queue (holdQueue) was full, by "
                     "the cause they would have been held for", common,
                     sorted(((stage, cause.value), n)
                            for (stage, cause), n in self.hold_refusals.items()),
                     ["stage", "cause"])
        for kind, help_text in FAILOVER_COUNTERS:
            yield family(counter, f"omnistage_orchestrator_{kind}_total", help_text, common,
                         [((stage,), n) for stage, n in
                          sorted(self.failovers.get(kind, {}).items())], ["stage"])
        yield family(counter, "omnistage_orchestrator_suspect_requests_total",
                     "Requests failed as suspects: they lost two replicas of one stage",
                     common, [((), c.get("suspect_requests", 0))])
        yield family(counter, "omnistage_orchestrator_revision_admissions_total",
                     "Requests admitted, by stage and the stage revision each was pinned to",
                     common, [(key, n) for key, n in sorted(self.admissions.items())],
                     ["stage", "revision"])
        yield family(counter, "omnistage_orchestrator_revision_refusals_total",
                     "Tasks a worker refused as a cross-revision hop (revision_mismatch); "
                     "each failed its request", common, [((), c.get("revision_refusals", 0))])
        yield summary("omnistage_orchestrator_request_seconds",
                      "Request latency, admission to terminal outcome", common,
                      sum(self.outcomes.values()), c["latency_sum"])
        if self.load is not None:
            load = self.load()
            stages = load.stages
            for name, field, help_text in LOAD_GAUGES:
                yield family(gauge, name, help_text, common,
                             [((stage,), float(getattr(fig, field)))
                              for stage, fig in stages.items()], ["stage"])
            yield family(gauge, "omnistage_stage_held_requests",
                         "Tasks held by the orchestrator for the stage, by cause (wake: at "
                         "zero replicas; revision: a replica of their revision on its way; "
                         "window: no replica with room)", common,
                         [((stage, cause), float(n))
                          for stage, causes in load.held_by_cause.items()
                          for cause, n in sorted(causes.items())],
                         ["stage", "cause"])
            yield family(gauge, "omnistage_stage_revision_replicas",
                         "Routable replicas of each stage revision", common,
                         [((stage, rev, "true" if r.newest else "false"), float(r.routable))
                          for stage, revs in load.revisions.items()
                          for rev, r in sorted(revs.items())],
                         ["stage", "revision", "newest"])
            yield family(gauge, "omnistage_stage_revision_pinned",
                         "Requests in flight pinned to each stage revision (admitted, not yet "
                         "terminal)", common,
                         [((stage, rev), float(r.pinned))
                          for stage, revs in load.revisions.items()
                          for rev, r in sorted(revs.items())],
                         ["stage", "revision"])
