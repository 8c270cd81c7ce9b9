"""A release across two stages, reverted midway, under load (issue 22, docs/architecture.md
"Releases across stages").

Why: a pipeline change that touches the models of two stages must roll as one release: no
request may pass a new encoder and an old denoiser (or the reverse), no stage may lose routable
capacity, and the surge must stay at one replica per changed stage, also when the release is
reverted halfway.

What it does, all on loopback:
  1. starts a private local control plane (hack/cluster.sh, via tests/harness/cluster.py), the
     local pod runner in process mode (pods run the checkout's Python on this machine) and
     `omnistage operator` as a process;
  2. applies a text-to-image pipeline like examples/text-to-image.yaml: encoder (ar,
     tiny-llama) -> denoiser (diffusion, tiny-unet), REPLICAS replicas each;
  3. runs closed-loop load (CLIENTS clients, POST /v1/images/generations 32x32) through the
     orchestrator pod, sent to its loopback pod IP;
  4. the release: both stages' `model` changes at once to a second copy of its built-in model,
     written to a local directory by the real save path (omnistage.models.save_builtin:
     save_pretrained) and loaded by the real from_pretrained path. Same weights, other model
     reference, so each stage's revision changes (omnistage.revision covers the model
     reference) and the outputs do not: every request can still be judged ok or not. In process
     mode a pod sees this machine's filesystem, so an absolute path is a valid model here;
  5. the revert: once a stage has replaced an old replica with a new-revision one (the gate is
     open, the release is midway), the original manifest is applied again; the bench waits
     until every replica is back on its first revision and no surge is left.

Measured: every 0.2 s one LIST of the stage pods and one GET of the pipeline (its status's
per-stage routable counts); every 0.6 s each worker's `omnistage_worker_revision_refusals_total`
(its /metrics on the worker's side port) and each orchestrator's
`omnistage_orchestrator_revision_refusals_total` (a model change rolls the orchestrator too: it
reads the stages' models), so a retired pod is read until shortly before it goes; and once
more at the end. Every request that is not ok is listed by kind, status, code and phase, with the
first such body of each kind.

Goals (summary line, PASS/MISS; `--check` exits 1 on a MISS):
  - failed 0 and refused 0 (every other non-ok outcome counts as failed: reset, hung,
    unreachable, unavailable, aborted);
  - cross-revision hops 0: the workers' refusal counters summed, every worker read;
  - the orchestrators' revision refusals 0, every orchestrator read;
  - per stage, surge <= +1: replicas not retiring minus the count, at the worst sample;
  - per stage, routable >= the count before the change at every sample, from the pods and from
    the pipeline's status;
  - the release and the revert both happened: a stage replaced an old replica, then every
    replica was back on its first revision.

Run from the repository root:  python bench/bench_release.py [--replicas 2] [--clients 2]
    [--timeout 600] [--keep] [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "operator", REPO / "runtime", REPO):  # the tree under test, first
    sys.path.insert(0, str(_p))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goals import Goal, add_check_flag, exit_status, verdicts  # noqa: E402

from omni_operator import release  # noqa: E402
from omnistage import kube as k  # noqa: E402

Obj = dict[str, Any]
STAGES = ("encoder", "denoiser")
BUILTINS = {"encoder": "tiny-llama", "denoiser": "tiny-unet"}
REFUSALS = "omnistage_worker_revision_refusals_total"
ORCH_REFUSALS = "omnistage_orchestrator_revision_refusals_total"
ORCH_PORT = 8000
ORCH_ADMIN_PORT = 8001  # spec.orchestrator.adminPort's default: /metrics (open there)


# ---- the manifest ---------------------------------------------------------------------------


def manifest(name: str, replicas: int, models: Mapping[str, str]) -> Obj:
    """examples/text-to-image.yaml's pipeline, with `replicas` per stage and the given models."""
    resources = {"cpu": "250m", "memory": "512Mi"}
    encoder = {"name": "encoder", "kind": "ar", "model": models["encoder"],
               "engine": {"maxTokens": 8, "returnHiddenStates": True}, "replicas": replicas,
               "drainTimeoutSeconds": 30, "resources": resources,
               "admission": {"maxRequests": 64, "defaultDeadlineSeconds": 60}}
    denoiser = {"name": "denoiser", "kind": "diffusion", "model": models["denoiser"],
                "inputs": ["encoder"], "finalOutput": True,
                "engine": {"height": 32, "width": 32, "numInferenceSteps": 4},
                "replicas": replicas, "drainTimeoutSeconds": 30, "resources": resources,
                "placement": {"colocateWith": ["encoder"]}}
    return {"apiVersion": k.API_VERSION, "kind": "OmniPipeline", "metadata": {"name": name},
            "spec": {"orchestrator": {"replicas": 1, "port": ORCH_PORT,
                                      "api": ["images", "generic"], "shutdownDelaySeconds": 2},
                     "stages": [encoder, denoiser]}}


# ---- pure figures (tests/unit/test_bench_release.py) -----------------------------------------


def stage_of(pod: Obj) -> str:
    return str(((pod.get("metadata") or {}).get("labels") or {}).get(k.LABEL_STAGE, ""))


def retiring(pod: Obj) -> bool:
    """Draining or deleted: on its way out, no longer part of the stage's count."""
    return k.is_draining(pod) or bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def routable(pod: Obj) -> bool:
    """Ready and not retiring: the orchestrator may send it new work."""
    return k.condition_status(pod, "Ready") == "True" and not retiring(pod)


def first_details(results: Sequence[Any]) -> dict[str, str]:
    """The body of the first request that ended not ok, per kind/status/code: the error's
    message says where it was refused (at admission, or at a hop for its pinned revision)."""
    out: dict[str, str] = {}
    for r in results:
        if r.kind != "ok":
            out.setdefault(f"{r.kind}/{r.status}/{r.code}", r.detail)
    return out


@dataclass
class StageFigures:
    """One stage over every sample: the worst surge and the fewest routable replicas."""

    surge_max: int = 0  # replicas not retiring, minus the count
    pods_peak: int = 0  # every pod, retiring ones included
    routable_min: int | None = None  # from the pods
    status_routable_min: int | None = None  # from the pipeline's status
    worst: str = ""  # the stage's pods at the first sample with routable_min (pod_state each)


def pod_state(pod: Obj) -> str:
    """name:revision:state, state one of ready, not-ready, draining, deleted (+surge)."""
    meta = pod.get("metadata") or {}
    state = ("deleted" if meta.get("deletionTimestamp") else "draining" if k.is_draining(pod)
             else "ready" if k.condition_status(pod, "Ready") == "True" else "not-ready")
    surge = "+surge" if release.is_surge(pod) else ""
    return f"{meta.get('name')}:{release.pod_revision(pod)}:{state}{surge}"


def stage_figures(pod_samples: Sequence[Sequence[Obj]], statuses: Sequence[Obj],
                  count: int, stages: Sequence[str] = STAGES) -> dict[str, StageFigures]:
    """Per stage, over pod samples (each one LIST) and pipeline status samples."""
    out = {s: StageFigures(surge_max=-count) for s in stages}
    for sample in pod_samples:
        for s in stages:
            mine = [p for p in sample if stage_of(p) == s]
            f = out[s]
            f.surge_max = max(f.surge_max, sum(1 for p in mine if not retiring(p)) - count)
            f.pods_peak = max(f.pods_peak, len(mine))
            n = sum(1 for p in mine if routable(p))
            if f.routable_min is None or n < f.routable_min:
                f.routable_min = n
                f.worst = " ".join(pod_state(p) for p in mine)
    for status in statuses:
        stages_status = status.get("stages") or {}
        for s in stages:
            per_revision = (stages_status.get(s) or {}).get("routable") or {}
            n = sum(int(v) for v in per_revision.values())
            f = out[s]
            f.status_routable_min = (n if f.status_routable_min is None
                                     else min(f.status_routable_min, n))
    if not pod_samples:
        for f in out.values():
            f.surge_max = 0
    return out


def revisions_of(sample: Sequence[Obj]) -> dict[str, set[str]]:
    """Per stage, the revisions of its replicas that still serve."""
    out: dict[str, set[str]] = {}
    for p in sample:
        rev = release.pod_revision(p)
        if rev is not None and not retiring(p):
            out.setdefault(stage_of(p), set()).add(rev)
    return out


def midway(sample: Sequence[Obj], new: Mapping[str, str]) -> bool:
    """A stage has replaced an old replica with a new-revision one (not the surge): the gate
    opened and old capacity is being retired, the release is in the middle."""
    return any(routable(p) and release.pod_revision(p) == new.get(stage_of(p))
               and not release.is_surge(p) for p in sample)


def back(sample: Sequence[Obj], first: Mapping[str, str], count: int) -> bool:
    """Every stage has exactly `count` pods, all routable, on its first revision, no surge."""
    return (len(sample) == count * len(first)
            and all(routable(p) and release.pod_revision(p) == first.get(stage_of(p))
                    and not release.is_surge(p) for p in sample))


#: tests/harness/load.py's outcomes that are neither ok nor refused: each one is a failure here.
FAILED_KINDS = ("aborted", "failed", "reset", "unreachable", "hung", "unavailable")


def failed_count(load: Mapping[str, Any]) -> int:
    """Every outcome that is neither ok nor refused (a load summary's counts by kind)."""
    return sum(int(load.get(kind, 0)) for kind in FAILED_KINDS)


def phase_of(sent: float, marks: Sequence[tuple[float, str]]) -> str:
    """The name of the last mark at or before `sent` ("before" ahead of every mark)."""
    name = "before"
    for t, mark in marks:
        if sent >= t:
            name = mark
    return name


def not_ok(results: Sequence[Any], marks: Sequence[tuple[float, str]] = ()) -> dict[str, int]:
    """The requests that did not end ok, by kind, HTTP status, error code and the phase they
    were sent in (marks: (time.monotonic(), name), in order)."""
    out: dict[str, int] = {}
    for r in results:
        if r.kind != "ok":
            key = f"{r.kind}/{r.status}/{r.code}@{phase_of(r.sent, marks)}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


@dataclass
class Readings:
    """A counter read from many pods: the last reading per pod uid, and every pod seen."""

    seen: dict[str, str] = field(default_factory=dict)  # uid -> pod name (had an IP)
    last: dict[str, float] = field(default_factory=dict)  # uid -> last value read

    @property
    def unread(self) -> list[str]:
        return sorted(name for uid, name in self.seen.items() if uid not in self.last)

    def total(self) -> float | None:
        """The sum over every pod seen; None when a pod was never read (not measured)."""
        if not self.seen or self.unread:
            return None
        return sum(self.last.values())


@dataclass
class Figures:
    """What the summary judges."""

    load: dict[str, Any]  # tests/harness/load.py summary: counts by kind, latencies
    stages: dict[str, StageFigures]
    count: int  # replicas per stage before the change
    not_ok: dict[str, int] = field(default_factory=dict)  # kind/status/code -> count
    details: dict[str, str] = field(default_factory=dict)  # kind/status/code -> first body
    workers: Readings = field(default_factory=Readings)  # their revision refusals
    orchestrators: Readings = field(default_factory=Readings)  # their revision refusals
    midway_seen: bool = False
    reverted: bool = False


def goals(f: Figures) -> list[Goal]:
    out = [
        Goal("failed", float(failed_count(f.load)) if f.load else None, 0, False, "", 0),
        Goal("refused", float(f.load.get("refused", 0)) if f.load else None, 0, False, "", 0),
        Goal("cross_revision_hops", f.workers.total(), 0, False, "", 0),
        Goal("orchestrator_revision_refusals", f.orchestrators.total(), 0, False, "", 0),
    ]
    for s, sf in f.stages.items():
        out.append(Goal(f"{s}_surge", float(sf.surge_max), 1, False, "", 0))
        out.append(Goal(f"{s}_routable_min",
                        None if sf.routable_min is None else float(sf.routable_min),
                        f.count, True, "", 0))
        out.append(Goal(f"{s}_status_routable_min",
                        None if sf.status_routable_min is None
                        else float(sf.status_routable_min), f.count, True, "", 0))
    out.append(Goal("release_midway_then_reverted",
                    1.0 if f.midway_seen and f.reverted else 0.0, 1, True, "", 0))
    return out


# ---- the run --------------------------------------------------------------------------------


def refusals(url: str, name: str) -> float | None:
    """One sample of a /metrics counter; None when it cannot be read now."""
    from tests.harness.metrics import sample
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=2) as resp:
            value = sample(resp.read().decode(), name)
    except OSError:
        return None
    return value


class Sampler:
    """In a thread: every `period` s one LIST of the stage pods and one GET of the pipeline;
    every `scrape_every` samples, each worker's and each orchestrator's revision refusal counter
    (the release rolls the orchestrator too: its config names the stages' models)."""

    def __init__(self, kube: Any, ns: str, name: str, period: float = 0.2,
                 scrape_every: int = 3) -> None:
        self.kube, self.ns, self.name = kube, ns, name
        self.period, self.scrape_every = period, scrape_every
        self.pods: list[list[Obj]] = []
        self.statuses: list[Obj] = []
        self.workers = Readings()
        self.orchestrators = Readings()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def latest(self) -> list[Obj]:
        return self.pods[-1] if self.pods else []

    def scrape(self) -> None:
        """Read every worker's and orchestrator's counter now."""
        from tests.harness.cluster import pods
        orchestrator = f"{k.LABEL_PIPELINE}={self.name},{k.LABEL_COMPONENT}=orchestrator"
        for selector, port, metric, readings in (
                (k.stage_selector(self.name), k.WORKER_HTTP_PORT, REFUSALS, self.workers),
                (orchestrator, ORCH_ADMIN_PORT, ORCH_REFUSALS, self.orchestrators)):
            for p in pods(self.kube, self.ns, selector):
                ip = (p.get("status") or {}).get("podIP")
                if not ip:
                    continue
                uid = p["metadata"]["uid"]
                readings.seen[uid] = p["metadata"]["name"]
                value = refusals(f"http://{ip}:{port}/metrics", metric)
                if value is not None:
                    readings.last[uid] = value

    def _run(self) -> None:
        from tests.harness.cluster import pods

        from omnistage.kubeapi import resource_path
        n = 0
        while not self._stop.wait(self.period):
            try:
                sample = pods(self.kube, self.ns, k.stage_selector(self.name))
                pipe = self.kube.get(resource_path(k.API_VERSION, "omnipipelines", self.ns,
                                                   self.name))
                self.pods.append(sample)
                self.statuses.append(pipe.get("status") or {})
                if n % self.scrape_every == 0:
                    self.scrape()
            except Exception:  # a transient API hiccup under load: sample again
                continue
            finally:
                n += 1


def wait_on(pred: Any, timeout: float, what: str, detail: Any = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f"\n{detail()}" if detail else ""))


@contextlib.contextmanager
def control_plane(work: Path, keep: bool) -> Iterator[tuple[Any, Any, Any]]:
    """A private control plane, the local pod runner (process mode) and the operator."""
    from tests.harness.cluster import (
        POD_MODE,
        start_local_cluster,
        start_podrunner,
        stop_local_cluster,
        stop_podrunner,
    )
    from tests.harness.kubeclient import wait_until
    from tests.harness.operator import Operator, apply_crds

    if POD_MODE != "process":  # main() sets it before anything imports tests.harness.cluster
        raise RuntimeError(f"the pod runner must run in process mode, not {POD_MODE!r}")
    cluster = start_local_cluster()
    runner = op = None
    try:
        wait_until(lambda: cluster.kube.request("GET", "/readyz") is not None, 60,
                   "API server /readyz")
        apply_crds(cluster)
        runner = start_podrunner(cluster)
        op = Operator(cluster, work / "operator.log", webhook=True)
        op.start()
        yield cluster, runner, op
    finally:
        if op is not None:
            op.stop()
        if runner is not None:
            stop_podrunner(runner)
        stop_local_cluster(cluster, purge=not keep)


def pool_revisions(cluster: Any, ns: str, name: str) -> dict[str, str]:
    from omnistage.kubeapi import resource_path
    return {s: release.pool_revision(cluster.kube.get(resource_path(
        k.API_VERSION, "stagepools", ns, f"{name}-{s}"))) for s in STAGES}


def pipeline_ready(cluster: Any, ns: str, name: str) -> bool:
    from omnistage.kubeapi import resource_path
    obj = cluster.kube.get(resource_path(k.API_VERSION, "omnipipelines", ns, name))
    cond = k.condition(obj, "Ready")
    return bool(cond and cond["status"] == "True"
                and (obj.get("status") or {}).get("observedGeneration")
                == obj["metadata"]["generation"])


def run(args: argparse.Namespace, work: Path) -> Figures:
    from tests.harness.cluster import pods, temp_namespace
    from tests.harness.load import Endpoints, Load, summary
    from tests.harness.operator import apply

    from omnistage.models import save_builtin

    copies = {s: str(save_builtin(m, work / "models" / f"{m}-copy")) for s, m in BUILTINS.items()}
    name = "t2i"
    first_doc = manifest(name, args.replicas, BUILTINS)
    with control_plane(work, args.keep) as (cluster, _runner, op), \
            temp_namespace(cluster.kube, prefix="rel-") as ns:
        t0 = time.monotonic()
        apply(cluster, ns, first_doc)
        wait_on(lambda: pipeline_ready(cluster, ns, name), args.timeout, f"{name} Ready",
                op.log_tail)
        print(f"ready: {name} with {args.replicas} replicas per stage in "
              f"{time.monotonic() - t0:.1f}s", flush=True)
        first = pool_revisions(cluster, ns, name)

        def orchestrators() -> list[str]:
            selector = f"{k.LABEL_PIPELINE}={name},{k.LABEL_COMPONENT}=orchestrator"
            return [f"http://{p['status']['podIP']}:{ORCH_PORT}"
                    for p in pods(cluster.kube, ns, selector)
                    if k.condition_status(p, "Ready") == "True"]

        body = {"model": name, "prompt": "a red square", "size": "32x32"}
        figures = Figures(load={}, stages={}, count=args.replicas)
        with Sampler(cluster.kube, ns, name) as sampler, \
                Endpoints(orchestrators, period=0.1) as endpoints, \
                Load(endpoints.pick, "/v1/images/generations", body,
                     clients=args.clients) as load:
            load.wait_for(args.warm, timeout=args.timeout)
            wait_on(lambda: sampler.pods, 30, "a first sample")
            changed = manifest(name, args.replicas, copies)
            t_release = time.monotonic()
            apply(cluster, ns, changed)
            # Every pool's spec (the operator writes the pools one after another: one that
            # changed alone would make a one-stage release, "midway" at once on the other).
            wait_on(lambda: all(rev != first[s] for s, rev in
                                pool_revisions(cluster, ns, name).items()), 60,
                    "every pool's new spec")
            new = pool_revisions(cluster, ns, name)
            print(f"release: {json.dumps(first)} -> {json.dumps(new)}", flush=True)
            wait_on(lambda: midway(sampler.latest(), new), args.timeout,
                    "the release midway", op.log_tail)
            figures.midway_seen = True
            t_mid = time.monotonic()
            apply(cluster, ns, first_doc)  # the revert: the old spec again
            wait_on(lambda: pool_revisions(cluster, ns, name) == first, 60,
                    "the pools' first spec again")
            wait_on(lambda: back(sampler.latest(), first, args.replicas), args.timeout,
                    "every replica back on its first revision", op.log_tail)
            figures.reverted = True
            t_back = time.monotonic()
            load.wait_for(load.count() + args.warm, timeout=args.timeout)
            results = load.snapshot()
        sampler.scrape()  # the end readings
        figures.load = summary(results)
        figures.details = first_details(results)
        figures.not_ok = not_ok(results, [(t_release, "release"), (t_mid, "revert"),
                                          (t_back, "after")])
        figures.stages = stage_figures(sampler.pods, sampler.statuses, args.replicas)
        figures.workers, figures.orchestrators = sampler.workers, sampler.orchestrators
        print(f"timeline: release_to_midway_s={t_mid - t_release:.1f} "
              f"revert_to_back_s={t_back - t_mid:.1f} pod_samples={len(sampler.pods)} "
              f"status_samples={len(sampler.statuses)}", flush=True)
    return figures


def report(f: Figures) -> list[str]:
    """The figure lines and the summary line."""
    load = f.load
    lines = [f"load: total={load.get('total', 0)} ok={load.get('ok', 0)} "
             f"failed={failed_count(load)} refused={load.get('refused', 0)} "
             f"ok_p50_s={load.get('ok_p50_s', 'n/a')} ok_max_s={load.get('ok_max_s', 'n/a')}",
             f"not ok (kind/status/code@phase): {json.dumps(f.not_ok) if f.not_ok else 'none'}"]
    lines += [f"first {key}: {body}" for key, body in f.details.items()]
    for s, sf in f.stages.items():
        lines.append(f"stage {s}: count={f.count} surge_max=+{sf.surge_max} "
                     f"pods_peak={sf.pods_peak} routable_min={sf.routable_min} "
                     f"status_routable_min={sf.status_routable_min} worst=[{sf.worst}]")
    for what, r in (("workers", f.workers), ("orchestrators", f.orchestrators)):
        lines.append(f"refusals of {what}: read={len(r.last)} unread={r.unread or 0} "
                     f"revision_refusals={r.total() if r.total() is not None else 'n/a'}")
    lines.append(f"summary: {verdicts(goals(f))}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="replicas per stage")
    parser.add_argument("--clients", type=int, default=2, help="closed-loop clients")
    parser.add_argument("--warm", type=int, default=10,
                        help="ok answers before the release, and again after the revert")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds for each wait (pipeline Ready, midway, back)")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's state dir")
    add_check_flag(parser)
    args = parser.parse_args()
    if args.replicas < 1 or args.clients < 1:
        parser.error("--replicas and --clients must be at least 1")
    # Process mode (pods run the checkout's Python here), read once when tests.harness.cluster
    # is first imported, so before anything imports it.
    os.environ["OMNISTAGE_POD_MODE"] = "process"
    with tempfile.TemporaryDirectory(prefix="bench-release-") as tmp:
        figures = run(args, Path(tmp))
    for line in report(figures):
        print(line, flush=True)
    return exit_status(goals(figures), args.check)


if __name__ == "__main__":
    sys.exit(main())
