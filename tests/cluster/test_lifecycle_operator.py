"""The operator's half of the replica lifecycle, on the real control plane with the local pod
runner, under bounded loopback load with every request counted (tests/harness/load.py):

- a rollout of a stage's engine options: the orchestrator is not restarted; 0 refused, 0 failed;
- an orchestrator rollout: surge first, the old one leaves endpoints before it stops; 0 refused,
  0 failed;
- a replica is Ready about 1 s after its worker is (each rollout step is measured);
- `omnistage drain --replace` of a middle replica: capacity never dips, 0 failed; `--retire`:
  replicas go down by one, the name does not come back until a scale-up, 0 failed;
  `kubectl omnistage status` prints the tree;
- a drain that times out: a DrainTimeout Warning with the count, each cut request a terminal
  error;
- an unschedulable spec, then fixed: it converges (the Pending out-of-date pod is replaced
  without waiting for all replicas to be Ready);
- a single-replica stage under `kubectl drain`: what happens to admitted requests.

Requests go to orchestrator pod IPs; a Service is emulated by `Endpoints` over the orchestrator
pods that answer /readyz.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from omni_operator.retirement import ANNOTATION_RETIRED
from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.load import Endpoints, Load, longest_gap, summary
from tests.harness.operator import Operator, apply, get, pipeline_doc, wait_for

pytestmark = pytest.mark.timeout(600)

ORCH_PORT = 8000
Obj = dict[str, Any]


# ---- helpers ---------------------------------------------------------------------------------


def _live(kube: Cluster, ns: str, selector: str) -> list[Obj]:
    return [p for p in pods(kube.kube, ns, selector)
            if not p["metadata"].get("deletionTimestamp")]


def _orchestrators(kube: Cluster, ns: str, name: str) -> list[Obj]:
    return _live(kube, ns, f"{k.LABEL_PIPELINE}={name},{k.LABEL_COMPONENT}=orchestrator")


def _replicas(kube: Cluster, ns: str, name: str) -> list[Obj]:
    return _live(kube, ns, k.stage_selector(name))


def _url(pod: Obj) -> str:
    return f"http://{pod['status']['podIP']}:{ORCH_PORT}"


def _routable(pod: Obj) -> bool:
    annotations = pod["metadata"].get("annotations") or {}
    return (k.condition_status(pod, "Ready") == "True"
            and annotations.get(k.ANNOTATION_DRAINING) != "true"
            and not pod["metadata"].get("deletionTimestamp"))


def _report(name: str, results: list[Any], **extra: Any) -> dict[str, Any]:
    figures = {**summary(results), "longest_gap_s": round(longest_gap(results), 3), **extra}
    print(f"\n[{name}] {figures}")
    return figures


def _assert_nothing_lost(figures: dict[str, Any], results: list[Any]) -> None:
    bad = [r for r in results if r.kind not in ("ok",)]
    assert figures["failed"] == figures["refused"] == 0, bad[:5]
    assert figures["reset"] == figures["hung"] == figures["unreachable"] == 0, bad[:5]
    assert figures["unavailable"] == figures["aborted"] == 0, bad[:5]


def _pipeline_ready(kube: Cluster, ns: str, name: str) -> bool:
    cond = k.condition(get(kube, ns, "omnipipe", name), "Ready")
    return bool(cond and cond["status"] == "True")


def _pool_settled(kube: Cluster, ns: str, pool: str, replicas: int) -> bool:
    obj = get(kube, ns, "stagepool", pool) or {}
    st = obj.get("status") or {}
    return (st.get("observedGeneration") == obj.get("metadata", {}).get("generation")
            and st.get("replicas") == st.get("updatedReplicas") == st.get("readyReplicas")
            == replicas and k.condition_status(obj, "Progressing") == "False")


def _events(kube: Cluster, ns: str, reason: str) -> list[Obj]:
    out = kube.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    return [e for e in json.loads(out)["items"] if e.get("reason") == reason]


def _echo(name: str, **extra: Any) -> Obj:
    return {"name": name, "kind": "echo", "finalOutput": True, "drainTimeoutSeconds": 20,
            "resources": {"cpu": "100m", "memory": "64Mi"}, **extra}


def _start(kube: Cluster, ns: str, operator: Operator, name: str, stage: Obj,
           **orchestrator: Any) -> None:
    # Not about keys (test_curve_cluster checks keys on by default): the API serves without.
    apply(kube, ns, pipeline_doc(name, [stage], orchestrator={
        "api": ["generic"], "shutdownDelaySeconds": 2, "auth": {"disabled": True},
        **orchestrator}))
    wait_for(lambda: _pipeline_ready(kube, ns, name), 300, f"{name} Ready", operator.log_tail,
             interval=1)


class Watcher:
    """Samples the pool every `period` s in a thread: routable replica counts, and for each
    replica uid when it was first seen, when its worker first answered /readyz and when the
    Pod turned Ready (for the fast-Ready figures)."""

    def __init__(self, kube: Cluster, ns: str, pipeline: str, period: float = 0.1) -> None:
        self.kube, self.ns, self.pipeline, self.period = kube, ns, pipeline, period
        self.routable: list[tuple[float, int]] = []
        self.seen: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="watcher")

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                current = _replicas(self.kube, self.ns, self.pipeline)
            except Exception:  # a transient API hiccup under load: sample again
                continue
            now = time.monotonic()
            self.routable.append((now, sum(1 for p in current if _routable(p))))
            for p in current:
                uid = p["metadata"]["uid"]
                rec = self.seen.setdefault(uid, {"name": p["metadata"]["name"], "seen": now})
                ip = (p.get("status") or {}).get("podIP")
                if "worker_ready" not in rec and ip:
                    try:
                        with urllib.request.urlopen(
                                f"http://{ip}:{k.WORKER_HTTP_PORT}/readyz", timeout=0.5) as r:
                            if r.status == 200:
                                rec["worker_ready"] = now
                    except OSError:
                        pass
                if "pod_ready" not in rec and k.condition_status(p, "Ready") == "True":
                    rec["pod_ready"] = now

    def min_routable(self, since: float = 0.0) -> int:
        return min((n for t, n in self.routable if t >= since), default=-1)

    def ready_lags(self, since: float) -> list[float]:
        """Pod Ready minus worker ready, for the replicas that started after `since`."""
        return [round(r["pod_ready"] - r["worker_ready"], 3) for r in self.seen.values()
                if r["seen"] >= since and "pod_ready" in r and "worker_ready" in r]


@contextmanager
def _loaded(kube: Cluster, ns: str, name: str, clients: int = 4, warm: int = 20
            ) -> Iterator[Load]:
    def backends() -> list[str]:
        return [_url(p) for p in _orchestrators(kube, ns, name)
                if k.condition_status(p, "Ready") == "True"]

    with Endpoints(backends, period=0.1) as endpoints, \
            Load(endpoints.pick, f"/v1/pipelines/{name}/requests", {"prompt": "x"},
                 clients=clients) as load:
        load.wait_for(warm)
        yield load


def _kubectl_plugin(kube: Cluster, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl omnistage ...` exactly as a user runs it: kubectl finds `kubectl-omnistage` on
    PATH (a shim for the console script pip would install)."""
    shim = tmp / "kubectl-omnistage"
    if not shim.exists():
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m omni_operator.kubectl_plugin "
                        '"$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}",
           "KUBECONFIG": str(kube.kubeconfig)}
    return subprocess.run([kube.kubectl_path(), "omnistage", *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


# ---- rollouts --------------------------------------------------------------------------------


def test_rollouts_refuse_nothing_and_stage_changes_keep_the_orchestrator(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator) -> None:
    if not podrunner.local:
        pytest.skip("polls workers at their loopback pod IPs: needs the local pod runner")
    name = "roll"
    _start(kube, namespace, operator, name, _echo("a", replicas=2, engine={"echoDelayMs": 50}))
    [orch] = _orchestrators(kube, namespace, name)
    dep = get(kube, namespace, "deployment", f"{name}-orchestrator")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 2 + 20 + 5

    # 1. A stage's engine options: the replicas roll, the orchestrator stays.
    with Watcher(kube, namespace, name) as watch, _loaded(kube, namespace, name) as load:
        begun = time.monotonic()
        kube.kubectl("patch", "omnipipe", name, "-n", namespace, "--type=json", "-p", json.dumps(
            [{"op": "replace", "path": "/spec/stages/0/engine/echoDelayMs", "value": 60}]))
        old = {p["metadata"]["uid"] for p in _replicas(kube, namespace, name)}
        wait_for(lambda: not old & {p["metadata"]["uid"] for p in
                                    _replicas(kube, namespace, name)}
                 and _pool_settled(kube, namespace, f"{name}-a", 2), 300,
                 "the stage rolled", operator.log_tail, interval=0.2)
        rolled = time.monotonic()
        load.wait_for(load.count() + 20)
        results = load.snapshot()
        lags = watch.ready_lags(begun)
    figures = _report("rollout of a stage's engine options", results,
                      rollout_s=round(rolled - begun, 3), steps=2,
                      pod_ready_after_worker_ready_s=lags)
    _assert_nothing_lost(figures, results)
    [same] = _orchestrators(kube, namespace, name)
    assert same["metadata"]["uid"] == orch["metadata"]["uid"]  # not restarted
    after = get(kube, namespace, "deployment", f"{name}-orchestrator")
    assert after["metadata"]["generation"] == dep["metadata"]["generation"]
    # Fast Ready: each new replica was Ready about 1 s after its worker (probe period 1 s,
    # then the operator's readiness gate).
    assert len(lags) >= 2 and max(lags) <= 2.5, lags

    # 2. The orchestrator's own config: surge, then the old one leaves; nothing refused.
    with _loaded(kube, namespace, name) as load:
        begun = time.monotonic()
        kube.kubectl("patch", "omnipipe", name, "-n", namespace, "--type=merge", "-p",
                     json.dumps({"spec": {"orchestrator": {"requestTimeoutSeconds": 120}}}))

        def replaced() -> bool:
            current = _orchestrators(kube, namespace, name)
            return bool(current) and all(
                p["metadata"]["uid"] != orch["metadata"]["uid"]
                and k.condition_status(p, "Ready") == "True" for p in current)

        wait_for(replaced, 300, "a new Ready orchestrator", operator.log_tail, interval=0.2)
        new_ready = time.monotonic()
        wait_for(lambda: not [p for p in pods(kube.kube, namespace)
                              if p["metadata"]["uid"] == orch["metadata"]["uid"]], 120,
                 "the old orchestrator gone", operator.log_tail)
        gone = time.monotonic()
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    figures = _report("orchestrator rollout", results,
                      new_ready_s=round(new_ready - begun, 3),
                      old_gone_s=round(gone - begun, 3))
    _assert_nothing_lost(figures, results)
    ends = [e for e in podrunner.events() if e.get("pod") == orch["metadata"]["name"]
            and e.get("namespace") == namespace]
    assert ends and all(e["exitCode"] == 0 and e.get("sentSignal") != "SIGKILL" for e in ends)

    # 3. A deleted orchestrator pod (one orchestrator replica): nothing admitted is lost; the
    # gap is the replacement's start (its readiness probe runs every second).
    [current] = _orchestrators(kube, namespace, name)
    with _loaded(kube, namespace, name) as load:
        kube.kubectl("delete", "pod", "-n", namespace, current["metadata"]["name"],
                     "--wait=false")
        deleted = time.monotonic()

        def replacement() -> bool:
            return any(p["metadata"]["uid"] != current["metadata"]["uid"]
                       and k.condition_status(p, "Ready") == "True"
                       for p in _orchestrators(kube, namespace, name))

        wait_for(replacement, 300, "a Ready replacement orchestrator", operator.log_tail,
                 interval=0.1)
        ready_at = time.monotonic()
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    figures = _report("deleted orchestrator pod", results,
                      replacement_ready_s=round(ready_at - deleted, 3))
    assert figures["failed"] == figures["refused"] == figures["reset"] == 0, figures
    assert figures["hung"] == figures["unreachable"] == 0, figures


# ---- named retirement ------------------------------------------------------------------------


def test_named_drain_replace_and_retire_under_load(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator,
        tmp_path: Path) -> None:
    if not podrunner.local:
        pytest.skip("polls workers at their loopback pod IPs: needs the local pod runner")
    name = "named"
    pool = f"{name}-a"
    _start(kube, namespace, operator, name, _echo("a", replicas=3, engine={"echoDelayMs": 100}))

    # --replace (the default) of the middle replica: capacity never dips below 3.
    with Watcher(kube, namespace, name) as watch, _loaded(kube, namespace, name) as load:
        begun = time.monotonic()
        out = _kubectl_plugin(kube, tmp_path, "drain", f"{pool}-1", "-n", namespace)
        done = time.monotonic()
        assert out.returncode == 0, out.stderr
        assert f"{pool}-1: retired" in out.stdout, out.stdout
        load.wait_for(load.count() + 20)
        results = load.snapshot()
        dip = watch.min_routable(begun)
    names = sorted(p["metadata"]["name"] for p in _replicas(kube, namespace, name))
    figures = _report("omnistage drain --replace of a middle replica", results,
                      drain_s=round(done - begun, 3), min_routable_replicas=dip)
    _assert_nothing_lost(figures, results)
    assert names == [f"{pool}-0", f"{pool}-2", f"{pool}-3"], names
    assert dip >= 3, dip  # the replacement was Ready before the replica stopped taking work

    # --retire of the (new) middle replica: replicas 3 -> 2, and the name stays free. The
    # operator is killed right after the drain is asked for: the StagePool holds the state,
    # so the restarted operator carries it out.
    with _loaded(kube, namespace, name) as load:
        begun = time.monotonic()
        out = _kubectl_plugin(kube, tmp_path, "drain", f"{pool}-2", "--retire", "--no-wait",
                              "-n", namespace)
        assert out.returncode == 0, out.stderr
        operator.kill()
        operator.start()
        wait_for(lambda: f"{pool}-2" not in {p["metadata"]["name"] for p in
                                             pods(kube.kube, namespace)}, 120,
                 f"{pool}-2 retired by the restarted operator", operator.log_tail)
        done = time.monotonic()
        operator.after_resyncs(3)  # resyncs must not bring it back
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    figures = _report("omnistage drain --retire of a middle replica, operator killed",
                      results, drain_s=round(done - begun, 3))
    _assert_nothing_lost(figures, results)
    names = sorted(p["metadata"]["name"] for p in _replicas(kube, namespace, name))
    assert names == [f"{pool}-0", f"{pool}-3"], names
    assert get(kube, namespace, "stagepool", pool)["spec"]["replicas"] == 2
    wait_for(lambda: _pool_settled(kube, namespace, pool, 2), 60, "the pool settled at 2")
    wait_for(lambda: _pipeline_ready(kube, namespace, name), 60, "pipeline Ready")

    # Refusals say why.
    again = _kubectl_plugin(kube, tmp_path, "drain", f"{pool}-2", "-n", namespace)
    assert again.returncode == 1 and "not found" in again.stderr, again

    # The tree: pipeline -> orchestrator and pools -> replicas, with state, in-flight, node.
    status = _kubectl_plugin(kube, tmp_path, "status", name, "-n", namespace)
    assert status.returncode == 0, status.stderr
    print(f"\n[kubectl omnistage status {name}]\n{status.stdout}")
    lines = status.stdout.splitlines()
    assert lines[0].startswith(f"pipeline {name}  phase=Ready"), status.stdout
    assert f"pool {pool}  ready=2/2" in status.stdout and "retired ordinals=1,2" in status.stdout
    for replica in (f"{pool}-0", f"{pool}-3"):
        row = next(line for line in lines if f" {replica}  " in line)
        assert "Ready  in-flight=" in row and "in-flight=?" not in row and "node=local-" in row

    # A scale-up frees the retired ordinals one by one, lowest first: +1 brings back 1 and
    # keeps 2 retired; the next +1 frees 2 and the retirement record goes.
    kube.kubectl("scale", "stagepool", pool, "-n", namespace, "--replicas=3")
    wait_for(lambda: _pool_settled(kube, namespace, pool, 3), 300, "scaled to 3",
             operator.log_tail)
    names = sorted(p["metadata"]["name"] for p in _replicas(kube, namespace, name))
    assert names == [f"{pool}-0", f"{pool}-1", f"{pool}-3"], names
    wait_for(lambda: json.loads((get(kube, namespace, "stagepool", pool)["metadata"].get(
        "annotations") or {}).get(ANNOTATION_RETIRED, "{}")).get("ordinals") == [2], 60,
        "the retirement record keeps ordinal 2", operator.log_tail)
    kube.kubectl("scale", "stagepool", pool, "-n", namespace, "--replicas=4")
    wait_for(lambda: _pool_settled(kube, namespace, pool, 4), 300, "scaled to 4",
             operator.log_tail)
    names = sorted(p["metadata"]["name"] for p in _replicas(kube, namespace, name))
    assert names == [f"{pool}-{o}" for o in range(4)], names
    wait_for(lambda: ANNOTATION_RETIRED not in (get(kube, namespace, "stagepool", pool)[
        "metadata"].get("annotations") or {}), 60, "the retirement record gone", operator.log_tail)

    # Idle: a resync of the settled world writes nothing.
    before = operator.settled()
    operator.after_resyncs(2)
    assert operator.writes() == before, operator.log_tail()


def test_drain_timeout_is_reported_and_cut_requests_end(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator,
        tmp_path: Path) -> None:
    if not podrunner.local:
        pytest.skip("needs the local pod runner")
    name = "cut"
    pool = f"{name}-a"
    _start(kube, namespace, operator, name,
           _echo("a", replicas=2, engine={"echoDelayMs": 3000}, drainTimeoutSeconds=1))
    with _loaded(kube, namespace, name, clients=4, warm=2) as load:
        begun = time.monotonic()
        out = _kubectl_plugin(kube, tmp_path, "drain", f"{pool}-1", "--retire", "-n",
                              namespace)
        gone = time.monotonic()
        assert out.returncode == 0, out.stderr
        events = wait_for(lambda: _events(kube, namespace, "DrainTimeout"), 60,
                          "a DrainTimeout event")
        load.stop()  # returns once every request in flight, the cut ones too, has ended
        results = load.snapshot()
    figures = _report("drain timeout", results, drain_s=round(gone - begun, 3))
    [event] = events
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == pool
    cut = int(event["message"].split(" with ")[1].split(" ")[0])
    print(f"\n[drain timeout event] {event['message']}")
    assert cut >= 1
    # Each cut request ended terminally and says the server cut it: 503 drain_timeout, never
    # the 200 `status: abort` of a client's own abort; nothing hung, broke off or was refused.
    # No more were cut than the event counted (queued work is counted once).
    cut_off = [r for r in results if r.kind in ("aborted", "failed")]
    assert 1 <= len(cut_off) <= cut, cut_off
    assert all((r.kind, r.status, r.code) == ("failed", 503, "drain_timeout")
               for r in cut_off), cut_off
    assert figures["hung"] == figures["reset"] == figures["refused"] == 0, figures


# ---- convergence -----------------------------------------------------------------------------


def test_an_unschedulable_spec_then_fixed_converges(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator) -> None:
    name = "fix"
    pool = f"{name}-a"
    _start(kube, namespace, operator, name, _echo("a", replicas=2, engine={"echoDelayMs": 50}))
    with _loaded(kube, namespace, name) as load:
        patch = [{"op": "add", "path": "/spec/stages/0/resources/gpus", "value": 16}]
        kube.kubectl("patch", "omnipipe", name, "-n", namespace, "--type=json", "-p",
                     json.dumps(patch))

        def pending() -> bool:
            return any((p.get("status") or {}).get("phase") == "Pending"
                       and k.condition_status(p, "PodScheduled") == "False"
                       for p in _replicas(kube, namespace, name))

        wait_for(pending, 120, "an unschedulable replica", operator.log_tail)
        operator.after_resyncs(2)  # stuck: the other replica keeps serving
        fixed = time.monotonic()
        patch = [{"op": "replace", "path": "/spec/stages/0/resources/gpus", "value": 0}]
        kube.kubectl("patch", "omnipipe", name, "-n", namespace, "--type=json", "-p",
                     json.dumps(patch))
        wait_for(lambda: _pool_settled(kube, namespace, pool, 2), 300, "converged",
                 operator.log_tail, interval=0.2)
        converged = time.monotonic()
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    figures = _report("unschedulable spec, then fixed", results,
                      converged_after_fix_s=round(converged - fixed, 3))
    _assert_nothing_lost(figures, results)
    wait_for(lambda: _pipeline_ready(kube, namespace, name), 60, "pipeline Ready")


def test_a_hung_worker_leaves_ready_within_seconds(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator) -> None:
    """A SIGSTOPped worker (alive, silent) stops being Ready within a few seconds, as the
    orchestrator stops routing to it at its 3 s heartbeat timeout; once it runs again it is
    Ready again. builders.WORKER_READINESS_* say why 4 s is the bound. Kills: the former 5 s
    probe timeout (Ready for 15-16 s after the hang). The 10 s guard leaves room for a loaded
    machine: the kubelet's probes, its status write and this poll all add to the 4 s."""
    if not podrunner.local:
        pytest.skip("signals the worker process: needs the local pod runner")
    name = "hang"
    _start(kube, namespace, operator, name, _echo("a", replicas=1))
    [victim] = _replicas(kube, namespace, name)
    vname = victim["metadata"]["name"]
    pid = int(json.loads(podrunner.http_get(victim, k.WORKER_HTTP_PORT, "/state")[1])["pid"])

    def ready(want: bool) -> bool:
        pod = get(kube, namespace, "pod", vname) or {}
        return (k.condition_status(pod, "Ready") == "True") == want

    assert ready(True)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(lambda: ready(False), 60, f"{vname} not Ready after SIGSTOP", operator.log_tail,
                 interval=0.1)
        left = time.monotonic() - stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"\n[hung worker] not Ready {left:.2f}s after SIGSTOP")
    assert left < 10, f"{vname} stayed Ready {left:.1f}s after its worker hung"
    wait_for(lambda: ready(True), 60, f"{vname} Ready again after SIGCONT", operator.log_tail,
             interval=0.2)
    [same] = _replicas(kube, namespace, name)
    assert same["metadata"]["uid"] == victim["metadata"]["uid"]  # the same pod came back


def test_single_replica_stage_under_kubectl_drain(
        kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator) -> None:
    """One replica, PDB minAvailable 0 (docs/architecture.md says why): `kubectl drain` evicts
    it at once. Every admitted request completes (the worker drains on SIGTERM). Until the
    replacement is Ready the orchestrator's /readyz fails (a stage has no replica), so the
    emulated Service sends nothing ("unavailable"); what reaches it is refused with 503
    no_replica, never failed."""
    if not podrunner.local:
        pytest.skip("needs the local pod runner")
    name = "single"
    _start(kube, namespace, operator, name, _echo("a", replicas=1, engine={"echoDelayMs": 300}))
    pdb = get(kube, namespace, "pdb", f"{name}-a")
    assert pdb["spec"]["minAvailable"] == 0
    [victim] = _replicas(kube, namespace, name)
    node = victim["spec"]["nodeName"]
    with _loaded(kube, namespace, name, clients=2) as load:
        begun = time.monotonic()
        try:
            kube.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
                         "--pod-selector", k.stage_selector(name), "--timeout=120s",
                         timeout=180)

            def back() -> bool:
                return any(p["metadata"]["uid"] != victim["metadata"]["uid"] and _routable(p)
                           for p in _replicas(kube, namespace, name))

            wait_for(back, 300, "the replica back on another node", operator.log_tail)
            returned = time.monotonic()
        finally:
            kube.kubectl("uncordon", node, check=False)
        load.wait_for(load.count() + 10)
        results = load.snapshot()
    figures = _report("kubectl drain of a single-replica stage", results,
                      replica_back_s=round(returned - begun, 3))
    assert figures["ok"] >= 30
    refused = [r for r in results if r.kind == "refused"]
    assert all(r.code == "no_replica" for r in refused), refused[:3]
    assert figures["failed"] == figures["reset"] == figures["hung"] == 0, \
        [r for r in results if r.kind in ("failed", "reset", "hung")][:5]
