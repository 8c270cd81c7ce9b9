"""Part B of bench/bench_autoscale.py: the operator's autoscaler at fleet size, on kwok.

Why: issue 21 asks that the built-in autoscaler stay cheap at 500 pipelines (it adds at most 10%
to the operator's CPU) and that it write nothing for a pool whose desired size did not change.
Both only mean something with many pools, so this runs the real operator on the real control
plane with kwok nodes (bench/bench_operator_scale.py's Bench: cluster, operator process,
counters), every stage autoscaled, and a fake load (the operator's load hook,
omni_operator.autoscaler.LOAD_URL_ENV) served on loopback by this process: kwok pods have no
orchestrator to read.

The run:
  1. N pipelines a -> b -> c (echo, 1 replica each, `autoscaling: {minReplicas: 1, maxReplicas:
     4}`, the default 15 s period), every stage at a steady load whose optimum is its 1 replica;
     wait for every pipeline Ready, then for the write counter to go quiet;
  2. restart the operator with --no-autoscaler, let it settle, and measure its CPU over a window
     (the baseline: the same operator, the same fleet, the same resyncs);
  3. restart it with the autoscaler, let it settle, and measure the same window: CPU, the load
     reads served, and the operator's writes (goal 0: no pool's desired size changed);
  4. raise the load of stage b of a few pipelines (--fleet-changed) to 3 replicas' worth and
     measure one more window: every write is to those pools (scale, status, their pods), none
     to any other pool.
Goals: added CPU = (on - off) / off <= 10%; writes for unchanged pools = 0 (steps 3 and 4).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import bench_operator_scale as scale
import msgspec
from goals import Goal

sys.path.insert(0, str(scale.REPO))  # tests/harness
from tests.harness.fakeload import FakeLoadServer, load_document, stage_load

LOAD_URL_ENV = "OMNISTAGE_AUTOSCALER_LOAD_URL"  # omni_operator.autoscaler.LOAD_URL_ENV
OPERATOR = "omnistage-operator"  # the reportingComponent of the operator's events
CPU_GOAL = 0.10  # the autoscaler adds at most this share to the operator's CPU
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 4, "target": {"inflightPerReplica": 1.0}}
PERIOD_S = 15.0  # autoscaling.periodSeconds' default, which the fleet keeps
STEADY = stage_load(arrivals_per_s=0.2, service_s=1.0, exec_s=1.0)
# 2.5 requests/s of 1 s each at 1 in flight per replica: 3 replicas.
RAISED = msgspec.structs.replace(STEADY, inflight=3, arrivals_per_s=2.5)


class FleetLoad(FakeLoadServer):
    """GET /<namespace>/<pipeline>/v1/load: STEADY for every stage, RAISED for stage b of the
    pipelines in `raised`. HTTP/1.1 keep-alive, as the API server's service proxy is."""

    def __init__(self) -> None:
        super().__init__(document=self._fleet_document)
        self.raised: set[str] = set()

    def _fleet_document(self, path: str) -> dict[str, Any]:
        parts = path.strip("/").split("/")
        pipeline = parts[1] if len(parts) > 2 else ""
        b = RAISED if pipeline in self.raised else STEADY
        now = time.time()
        return load_document({s: msgspec.structs.replace(figures, last_request_unix=now)
                              for s, figures in (("a", STEADY), ("b", b), ("c", STEADY))},
                             now=now)

    def stop(self) -> None:
        self.close()


@dataclass
class FleetFigures:
    pipelines: int = 0
    cpu_off_s: float | None = None
    cpu_on_s: float | None = None
    window_s: float = 0.0
    reads_on: int = 0
    steady_writes: int | None = None  # writes in the window with no desired size changed
    changed_pools: int = 0
    changed_writes: int = 0  # writes to the changed pipelines' pools (and their pods)
    other_writes: int | None = None  # writes to any other pool in the change window
    other_examples: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def added(self) -> float | None:
        if self.cpu_on_s is None or self.cpu_off_s is None or self.cpu_off_s <= 0:
            return None
        return (self.cpu_on_s - self.cpu_off_s) / self.cpu_off_s

    def goals(self) -> list[Goal]:
        unchanged = None
        if self.steady_writes is not None and self.other_writes is not None:
            unchanged = float(self.steady_writes + self.other_writes)
        return [
            Goal(f"fleet CPU added at {self.pipelines} pipelines",
                 None if self.added is None else 100 * self.added, 100 * CPU_GOAL,
                 at_least=False, unit="%", digits=1),
            Goal("fleet writes for unchanged pools", unchanged, 0, at_least=False, unit="",
                 digits=0),
        ]


def pipeline_doc(name: str) -> dict[str, Any]:
    doc = scale.pipeline_doc(name, 1)
    for stage in doc["spec"]["stages"]:
        stage["autoscaling"] = json.loads(json.dumps(AUTOSCALING))
    doc["metadata"]["labels"] = {"bench": "autoscale-fleet"}
    return doc


def _bench_args(pipelines: int, resync: float, timeout: float) -> argparse.Namespace:
    return argparse.Namespace(
        pipelines=pipelines, replicas=1, namespace="autoscale-fleet", kubeconfig=None,
        port_base=29640, keep=False, resync_seconds=resync, workers=None, write_qps=None,
        write_burst=None, timeout=timeout, teardown_timeout=600.0, raw_baseline=False,
        operator_args=[])


def _pipeline_of(url: str) -> str | None:
    """The pipeline a logged write belongs to, from its path; None for what the path cannot
    tell (a create names no object; events are counted from the API, see _made_since)."""
    tail = url.split("/namespaces/", 1)[-1].split("/")
    if len(tail) < 3 or tail[1] == "events":
        return None
    resource, name = tail[1], tail[2]
    if resource == "omnipipelines":
        return name
    if resource == "pods":  # <pipeline>-<stage>-<ordinal>
        return name.rsplit("-", 2)[0]
    return name.rsplit("-", 1)[0]  # stagepools, PDBs ...: <pipeline>-<stage>


def _owner(kind: str, name: str) -> str:
    """The pipeline of an object the operator made an event about, or a pod it created."""
    if kind == "OmniPipeline":
        return name
    if kind == "Pod":
        return name.rsplit("-", 2)[0]
    return name.rsplit("-", 1)[0]


def _writes_by_pipeline(bench: scale.Bench, offset: int) -> dict[str, int]:
    """Writes the operator logged since offset whose path names their object, by pipeline."""
    by: dict[str, int] = {}
    for m in scale.WRITE_LINE.finditer(bench.log_since(offset)):
        owner = _pipeline_of(m.group("path"))
        if owner is not None:
            by[owner] = by.get(owner, 0) + 1
    return by


def _made_since(bench: scale.Bench, since: str) -> dict[str, int]:
    """Pods created and events written (created or counted again) at or after `since`
    (RFC 3339), by pipeline: the writes whose logged path names no object."""
    by: dict[str, int] = {}
    for pod in bench.k.list(scale.path("Pod", bench.ns), labelSelector=scale.LABEL_COMPONENT):
        if pod["metadata"].get("creationTimestamp", "") >= since:
            owner = _owner("Pod", pod["metadata"]["name"])
            by[owner] = by.get(owner, 0) + 1
    for event in bench.k.list(scale.path("Event", bench.ns)):
        if event.get("reportingComponent") != OPERATOR:
            continue  # the scheduler's, kwok's: not the operator's writes
        if (event.get("lastTimestamp") or "") >= since:
            obj = event.get("involvedObject") or {}
            owner = _owner(str(obj.get("kind", "")), str(obj.get("name", "")))
            by[owner] = by.get(owner, 0) + 1
    return by


def _restart(bench: scale.Bench, autoscaler: bool, limit_s: float) -> None:
    """Restart the operator and wait until its start-up is over: it has reconciled every
    object once (its first sync: lists, then a check of each pipeline and pool) and then
    nothing for a while, so the window that follows holds only its steady work."""
    bench.stop_operator()
    bench.metrics_port = scale.free_port()
    bench.args.operator_args = [] if autoscaler else ["--no-autoscaler"]
    bench.start_operator()
    objects = 4 * bench.args.pipelines  # a pipeline and its three pools
    deadline = time.monotonic() + limit_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        reconciles = bench.counters()[1]
        if reconciles != last:
            last, since = reconciles, time.monotonic()
        elif reconciles >= objects and time.monotonic() - since >= 3.0:
            break
    else:
        scale.log(f"  the restarted operator did not settle in {limit_s:.0f}s "
                  f"({last} reconciles of {objects} objects)")
    time.sleep(2.0)


def run(pipelines: int, window_s: float, changed: int, resync: float = 30.0,
        timeout: float = 1200.0) -> FleetFigures:
    """The whole part B; always cleans up what it started."""
    f = FleetFigures(pipelines=pipelines, window_s=window_s)
    load = FleetLoad()
    os.environ[LOAD_URL_ENV] = load.url
    bench = scale.Bench(_bench_args(pipelines, resync, timeout))
    try:
        bench.kubectl = bench._find_kubectl()
        bench.start_cluster()
        bench.connect()
        bench.check_capacity()
        bench.apply_crds()
        bench.make_namespace()
        bench.start_operator()
        names = [f"fleet-{i:03d}" for i in range(pipelines)]
        scale.log(f"creating {pipelines} autoscaled pipelines x 3 stages (1 replica each)")
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: bench.k.create(bench.pipelines_path(), pipeline_doc(n)),
                          names))
        bench.wait_ready(t0)
        # Every pool's first decision writes its status.autoscaler once: let those land.
        time.sleep(PERIOD_S + 2)
        bench.settle(quiet=5.0, limit=120.0)

        scale.log("baseline: the operator with --no-autoscaler")
        _restart(bench, False, 180.0)
        off = bench.window(window_s, "autoscaler off")
        f.cpu_off_s = off["operator_cpu_s"]

        scale.log("the operator with its autoscaler (steady load: no size changes)")
        _restart(bench, True, 180.0)
        reads0 = load.reads
        on = bench.window(window_s, "autoscaler on")
        f.cpu_on_s = on["operator_cpu_s"]
        f.reads_on = load.reads - reads0
        f.steady_writes = on["writes"]
        if on["writes"]:
            f.notes.append(f"steady window writes: {on['writes_logged'] or on['writes_by_verb']}")

        raised = names[:changed]
        load.raised = set(raised)
        want = {f"{n}-b" for n in raised}
        f.changed_pools = len(want)
        scale.log(f"raising stage b of {len(raised)} pipelines to 3 replicas' worth")
        offset = bench.op_log.stat().st_size
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        bench.window(max(window_s, 2 * PERIOD_S + 10), "change")
        by_pipeline = _writes_by_pipeline(bench, offset)
        for owner, n in _made_since(bench, since).items():
            by_pipeline[owner] = by_pipeline.get(owner, 0) + n
        f.changed_writes = sum(v for k, v in by_pipeline.items() if k in raised)
        others = {k: v for k, v in by_pipeline.items() if k not in raised}
        f.other_writes = sum(others.values())
        f.other_examples = [f"{k}: {v}" for k, v in sorted(others.items())[:5]]
        if f.other_writes:
            f.notes.append(f"writes for unchanged pools: {', '.join(f.other_examples)}")
        if f.changed_writes < len(want):
            f.notes.append(f"only {f.changed_writes} writes for {len(want)} raised pools")
        scaled = sum(1 for p in bench.k.list(bench.pipelines_path("stagepools"))
                     if p["metadata"]["name"] in want and p["spec"].get("replicas") == 3)
        scale.log(f"  {scaled}/{len(want)} raised pools at 3 replicas; writes to them "
                  f"{f.changed_writes}, to other pools {f.other_writes}")
        if scaled != len(want):
            f.notes.append(f"{scaled}/{len(want)} raised pools reached 3 replicas")
    except Exception as exc:  # a figure that could not be measured is a MISS with its reason
        f.notes.append(f"fleet: {type(exc).__name__}: {str(exc)[:300]}")
        scale.log(f"fleet part failed: {exc}")
    finally:
        os.environ.pop(LOAD_URL_ENV, None)
        try:
            bench.cleanup()
        finally:
            load.stop()
    return f


def report(f: FleetFigures) -> str:
    added = "n/a" if f.added is None else f"{100 * f.added:+.1f}%"
    per_read = "n/a"
    if f.cpu_on_s is not None and f.cpu_off_s is not None and f.reads_on:
        per_read = f"{1e6 * (f.cpu_on_s - f.cpu_off_s) / f.reads_on:.0f}us"
    return (f"autoscale fleet: pipelines={f.pipelines} pools={3 * f.pipelines} "
            f"window={f.window_s:.0f}s cpu_off={f.cpu_off_s}s cpu_on={f.cpu_on_s}s "
            f"added={added} load_reads={f.reads_on} cpu_per_read={per_read} "
            f"steady_writes={f.steady_writes} changed_pools={f.changed_pools} "
            f"changed_writes={f.changed_writes} other_pool_writes={f.other_writes}")
