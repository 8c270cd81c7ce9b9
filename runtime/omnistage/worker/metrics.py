"""The stage worker's Prometheus metrics, read from its live state at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from omnistage.admission import BoundedAdmission, SerialScheduler
from omnistage.batching import BatchScheduler
from omnistage.executors.prefix_cache import PrefixStats
from omnistage.metrics import family, summary


class WorkerCollector:
    """Every family carries the labels stage and replica.

    It holds references, not copies: `requests`, `counters` and `outcomes` are the worker's own
    containers, which the worker keeps mutating.
    """

    def __init__(self, *, stage: str, replica: str, ready: Callable[[], bool],
                 admission: BoundedAdmission, scheduler: SerialScheduler | BatchScheduler,
                 requests: Sized,
                 counters: Mapping[str, int], outcomes: Mapping[str, int],
                 refused: Callable[[], Mapping[str, int]] = dict,
                 prefix: Callable[[], PrefixStats | None] = lambda: None) -> None:
        self.common = {"stage": stage, "replica": replica}
        self.ready = ready
        self.admission = admission
        self.scheduler = scheduler
        self.requests = requests
        self.counters = counters
        self.outcomes = outcomes
        self.refused = refused  # peers the CurveZMQ gate turned away, by reason
        self.prefix = prefix  # the executor's prefix cache (ar, thinker), None without one

    def collect(self) -> Iterator[Metric]:
        c, common = self.counters, self.common
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        stats = self.scheduler.stats
        yield family(gauge, "omnistage_worker_ready", "1 when loaded, warmed up and not draining",
                     common, [((), 1 if self.ready() else 0)])
        yield family(gauge, "omnistage_worker_queue_depth",
                     "Requests waiting for the execution permit", common,
                     [((), self.scheduler.queued)])
        yield family(gauge, "omnistage_worker_inflight_requests",
                     "Admitted requests not yet answered", common, [((), len(self.requests))])
        yield family(gauge, "omnistage_worker_admission_units_in_use",
                     "Admission cost units held", common,
                     [((), self.admission.report().units_in_use)])
        yield family(counter, "omnistage_worker_admitted_total", "Requests admitted", common,
                     [((), c["admitted"])])
        yield family(counter, "omnistage_worker_rejected_total", "Requests refused, by reason",
                     common, [(("budget",), c["rejected_budget"]),
                              (("queue",), c["rejected_queue"]),
                              (("draining",), c["rejected_draining"])], ["reason"])
        yield family(counter, "omnistage_worker_malformed_messages_total",
                     "Frames that failed to parse", common, [((), c["malformed"])])
        refused = self.refused()
        yield family(counter, "omnistage_worker_refused_peers_total",
                     "ZMQ peers refused before any message was read (CurveZMQ): reason key is "
                     "a sound CURVE client with another key, handshake one whose handshake "
                     "fails (no CURVE, or keys it does not hold)", common,
                     [((reason,), refused.get(reason, 0)) for reason in ("handshake", "key")],
                     ["reason"])
        yield family(counter, "omnistage_worker_stale_messages_total",
                     "Submits and aborts for a previous process at this address, refused",
                     common, [((), c["stale_messages"])])
        yield family(counter, "omnistage_worker_late_aborts_total",
                     "Aborts for a request this replica does not hold (unknown or finished), "
                     "dropped", common, [((), c["late_aborts"])])
        yield family(counter, "omnistage_worker_revision_refusals_total",
                     "Submits and fed chunks of another payload revision than this replica's "
                     "or than the request expects, refused with revision_mismatch", common,
                     [((), c.get("revision_refusals", 0))])
        yield family(counter, "omnistage_worker_replies_total", "Terminal replies, by type",
                     common, [((kind,), n) for kind, n in sorted(self.outcomes.items())],
                     ["type"])
        yield summary("omnistage_worker_execution_seconds", "Executor time per request", common,
                      stats.completed, stats.exec_seconds_total)
        yield from self._prefix_families()

    def _prefix_families(self) -> Iterator[Metric]:
        """The prefix cache's counters (absent on a stage without one). Its hit rate is
        saved_tokens over prompt_tokens (the share of prompt tokens not computed), or hits
        over lookups (the share of prompt passes that reused something)."""
        p = self.prefix()
        if p is None:
            return
        common, gauge, counter = self.common, GaugeMetricFamily, CounterMetricFamily
        for name, doc, value in (
                ("lookups_total", "Prompt passes that looked up the prefix cache", p.lookups),
                ("hits_total", "Prompt passes that reused at least one cached block", p.hits),
                ("prompt_tokens_total", "Prompt tokens of the passes that looked up",
                 p.prompt_tokens),
                ("saved_tokens_total", "Prompt tokens taken from the cache, not computed",
                 p.saved_tokens),
                ("evicted_blocks_total", "Blocks dropped to stay within the budget",
                 p.evicted_blocks)):
            yield family(counter, f"omnistage_worker_prefix_cache_{name}", doc, common,
                         [((), value)])
        yield family(gauge, "omnistage_worker_prefix_cache_blocks", "Blocks kept", common,
                     [((), p.blocks)])
        yield family(gauge, "omnistage_worker_prefix_cache_bytes",
                     "Bytes the kept blocks hold (keys, values, hidden rows)", common,
                     [((), p.bytes)])
        yield family(gauge, "omnistage_worker_prefix_cache_capacity_bytes",
                     "The budget (engine.prefixCacheMib)", common, [((), p.capacity_bytes)])
