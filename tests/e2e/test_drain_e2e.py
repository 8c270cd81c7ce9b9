"""`kubectl drain` of a node running a stage replica loses no request.

The eviction honours the pool's PodDisruptionBudget; the evicted worker drains its in-flight work
on SIGTERM while the orchestrator stops routing to it (the Pod is terminating); the operator
brings the replica back under the same name on another node.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from omni_operator.drain import ANNOTATION_DRAINING_SINCE
from omnistage import kube as k
from tests.e2e.conftest import admin_key_of, admin_url
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.helm import Release
from tests.harness.metrics import sample
from tests.harness.operator import (
    Operator,
    admin_routable,
    apply,
    get,
    pipeline_doc,
    pod_url,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)


def _live(kube: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube.kube, ns, selector)
            if not p["metadata"].get("deletionTimestamp")]


def test_kubectl_drain_loses_no_request(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    doc = pipeline_doc("chat", [{
        "name": "llm", "kind": "ar", "model": "tiny-llama", "finalOutput": True, "replicas": 2,
        "engine": {"maxTokens": 8}, "drainTimeoutSeconds": 30,
    }], orchestrator={"auth": {"disabled": True}, "api": ["chat"]})
    apply(kube, namespace, doc)

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", "chat"), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, "chat Ready", operator.log_tail, interval=1)
    [orch] = _live(kube, namespace, f"{k.LABEL_PIPELINE}=chat,{k.LABEL_COMPONENT}=orchestrator")
    replicas = _live(kube, namespace, k.stage_selector("chat"))
    victim = next(p for p in replicas if p["spec"]["nodeName"] != orch["spec"]["nodeName"])
    node = victim["spec"]["nodeName"]
    with pod_url(podrunner, orch, 8000) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        _drain_under_load(kube, namespace, operator, client, victim, node)


def _drain_under_load(kube: Cluster, namespace: str, operator: Release, client: openai.OpenAI,
                      victim: dict[str, Any], node: str) -> None:
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
                results.append("ok")
                stop.wait(0.05)  # steady traffic that leaves the two cores room for probes
            except Exception as exc:  # every failure is a lost request
                results.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(results) >= 8, 60, "load running")

        def budget() -> dict[str, Any]:
            return (get(kube, namespace, "pdb", "chat-llm") or {}).get("status") or {}

        def pod_states() -> str:
            return kube.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout

        wait_for(lambda: budget().get("disruptionsAllowed") == 1, 60,
                 "the disruption budget to allow one eviction",
                 lambda: f"{budget()}\n{pod_states()}")
        kube.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
                     "--pod-selector", f"{k.LABEL_PIPELINE}=chat", "--timeout=180s",
                     timeout=240)

        def replaced() -> dict[str, Any] | None:
            for p in _live(kube, namespace, k.stage_selector("chat")):
                if p["metadata"]["name"] == victim["metadata"]["name"] and \
                        p["metadata"]["uid"] != victim["metadata"]["uid"] and \
                        k.condition_status(p, "Ready") == "True":
                    return p
            return None

        back = wait_for(replaced, 300, "the replica back under its name", operator.log_tail,
                        interval=1)
        assert back["spec"]["nodeName"] != node  # the drained node is cordoned
        during = len(results)
        wait_for(lambda: len(results) >= during + 8, 60, "load after the drain")
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        kube.kubectl("uncordon", node, check=False)
    failures = [r for r in results if r != "ok"]
    assert not failures, failures[:5]
    assert len(results) >= 16


# ---- operator-driven retirement with a request known to be in flight on the victim -----------

ECHO = "held"
ECHO_ROUTE = f"/v1/pipelines/{ECHO}/requests"


class _Held(threading.Thread):
    """One request held open on the generic route for `delay_ms` of echo work."""

    def __init__(self, url: str, delay_ms: int) -> None:
        super().__init__(daemon=True)
        self.url, self.delay_ms = url, delay_ms
        self.sent = time.time()
        self.result: tuple[int, dict[str, Any]] | None = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        # Its own deadline, well past the delay: the stage's default (60 s) equals the longest
        # hold here, so under load a held request that ran its full time missed it (a 504).
        body = json.dumps({"prompt": "held", "params": {"a": {"delay_ms": self.delay_ms}},
                           "timeout_s": self.delay_ms / 1000 + 240})
        req = urllib.request.Request(self.url + ECHO_ROUTE, body.encode(),
                                     {"Content-Type": "application/json"})
        try:
            with _opener().open(req, timeout=300) as resp:
                self.result = (resp.status, json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            self.result = (exc.code, json.loads(exc.read() or b"{}"))
        except OSError as exc:
            self.result = (0, {"error": str(exc)})
        finally:
            self.done.set()


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _admitted(podrunner: PodRunner, pod: dict[str, Any]) -> float:
    """The requests the replica has admitted so far (its /metrics)."""
    text = podrunner.http_get(pod, k.WORKER_HTTP_PORT, "/metrics")[1]
    return sample(text, "omnistage_worker_admitted_total", stage="a",
                  replica=pod["metadata"]["name"]) or 0.0


def _inflight(podrunner: PodRunner, pod: dict[str, Any]) -> int:
    state = json.loads(podrunner.http_get(pod, k.WORKER_HTTP_PORT, "/state")[1])
    return int(state["in_flight"])  # queued requests included (drain.work_left)


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def _deleted_at(pod: dict[str, Any]) -> float:
    """When the pod was deleted: the API server sets deletionTimestamp to the delete time plus
    the grace period (615 s here), so the mark alone says nothing about when the call came."""
    meta = pod["metadata"]
    return _stamp(meta["deletionTimestamp"]) - int(meta.get("deletionGracePeriodSeconds") or 0)


def _held_pipeline(kube: Cluster, namespace: str, operator: Release | Operator,
                   drain_timeout: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """An echo pipeline of two replicas; (orchestrator URL, replica 0, replica 1)."""
    apply(kube, namespace, pipeline_doc(ECHO, [{
        "name": "a", "kind": "echo", "finalOutput": True, "replicas": 2,
        "drainTimeoutSeconds": drain_timeout,
    }], orchestrator={"auth": {"disabled": True}, "api": ["generic"]}))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", ECHO), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, f"{ECHO} Ready", operator.log_tail, interval=1)
    [orch] = _live(kube, namespace, f"{k.LABEL_PIPELINE}={ECHO},{k.LABEL_COMPONENT}=orchestrator")
    url = f"http://{orch['status']['podIP']}:8000"
    # Its GET /v1/load is on the admin listener, with the operator's key for the pipeline.
    admin, key = admin_url(url), admin_key_of(kube, operator, namespace, ECHO)

    # Until the orchestrator routes to both, every request goes to the one replica it knows,
    # and the callers need one held request on each.
    wait_for(lambda: admin_routable(admin, key, "a") == 2, 60,
             "both replicas routable in the orchestrator",
             lambda: f"routable: {admin_routable(admin, key, 'a')}")
    by_name = {p["metadata"]["name"]: p for p in _live(kube, namespace, k.stage_selector(ECHO))}
    return url, by_name[f"{ECHO}-a-0"], by_name[f"{ECHO}-a-1"]


def _hold_one_on_each(podrunner: PodRunner, url: str, replicas: list[dict[str, Any]],
                      delay_ms: int) -> list[_Held]:
    """Two held requests, one on each replica (the engine's least-in-flight choice); the i-th
    is the one held on replicas[i], read from each replica's /state."""
    first = _Held(url, delay_ms)
    started = [first]

    def detail() -> str:
        return f"in flight {[_inflight(podrunner, p) for p in replicas]}; " \
               f"results {[h.result for h in started]}"

    wait_for(lambda: sum(_inflight(podrunner, p) for p in replicas) == 1, 60, "first held",
             detail)
    on_first = [_inflight(podrunner, p) for p in replicas].index(1)
    second = _Held(url, delay_ms)
    started.append(second)
    wait_for(lambda: [_inflight(podrunner, p) for p in replicas] == [1, 1], 60,
             "one held request on each replica", detail)
    return [first, second] if on_first == 0 else [second, first]


def _orchestrator_sees_draining(url: str) -> bool:
    """From the /metrics of the orchestrator whose API is at `url` (on its admin listener,
    where /metrics needs no key)."""
    with _opener().open(admin_url(url) + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return (sample(text, "omnistage_orchestrator_replicas", stage="a", state="draining")
            or 0) >= 1


def _deleted_only_after_its_request(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release | Operator,
    url: str, victim: dict[str, Any], keep: dict[str, Any], held: list[_Held], on_victim: _Held,
    delay_ms: int,
) -> None:
    """The retirement of `victim` (just asked for) waits for `on_victim`, the request held on
    it: the replica is marked draining, gets no new work (six new requests all go to `keep`),
    and is deleted only once that request has completed; every request completes ok."""
    vname, kname = victim["metadata"]["name"], keep["metadata"]["name"]

    def marked() -> dict[str, Any] | None:
        pod = get(kube, namespace, "pod", vname) or {}
        annotations = pod.get("metadata", {}).get("annotations") or {}
        return pod if annotations.get(k.ANNOTATION_DRAINING) == "true" else None

    drained = wait_for(marked, 60, f"{vname} marked draining", operator.log_tail)
    assert not drained["metadata"].get("deletionTimestamp")
    wait_for(lambda: _orchestrator_sees_draining(url), 60, "the orchestrator to see it draining")
    assert not on_victim.done.is_set(), "the held request finished before the test could check"
    admitted, kept = _admitted(podrunner, victim), _admitted(podrunner, keep)
    # Six new requests at once, counted once admitted, not once answered: on `keep` they wait
    # behind its own held request (echo runs one request at a time), which ends about when the
    # victim's does. Sent one after another, they were answered only after both held requests
    # had ended whenever the victim's was the first sent (the orchestrator's choice between two
    # idle replicas is random), and the operator could by then have rightly deleted the victim:
    # its count could not be read, the failure at 0cd80f9 (docs/testing.md).
    new = [_Held(url, 0) for _ in range(6)]

    def routed() -> str:
        return f"admitted on {kname}: {_admitted(podrunner, keep) - kept:g}; " \
               f"results {[h.result for h in new]}"

    wait_for(lambda: _admitted(podrunner, keep) - kept >= 6, 60,
             f"the six new requests admitted on {kname}", routed)
    try:
        after = _admitted(podrunner, victim)
    except OSError as exc:  # refused, reset or timed out: the replica is gone or going
        # Right only once its own request has ended (on a slow machine the waits above may
        # take most of its hold). The deletion-time checks below still apply; only the
        # new-work count cannot be read from a stopped worker.
        took = time.time() - on_victim.sent
        assert on_victim.done.wait(10), (
            f"{vname} stopped answering ({exc}) {took:.1f} s after its "
            f"{delay_ms / 1000:.0f} s request was sent, with that request still in flight")
    else:
        assert after == admitted  # no new work on the retiring replica
    # Not deleted while its request can still be running: on a loaded machine the request may
    # have ended by now, and then a deletion is right, but only one no sooner than its end.
    pod = get(kube, namespace, "pod", vname) or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        assert _deleted_at(pod) >= on_victim.sent + delay_ms / 1000 - 1.0, pod["metadata"]

    def gone_or_deleting() -> dict[str, Any] | bool:
        pod = get(kube, namespace, "pod", vname)
        if pod is None or pod["metadata"]["uid"] != victim["metadata"]["uid"]:
            return True
        return pod if pod["metadata"].get("deletionTimestamp") else False

    deleting = wait_for(gone_or_deleting, delay_ms / 1000 + 120, f"{vname} deleted",
                        operator.log_tail, interval=0.2)
    for h in [*held, *new]:
        h.done.wait(120)
        assert h.result is not None and h.result[0] == 200, h.result
        assert h.result[1]["status"] == "ok", h.result
    if isinstance(deleting, dict):  # the deletion mark came no earlier than the work allowed
        # (the stamp has one-second resolution; the request ended >= sent + delay)
        assert _deleted_at(deleting) >= on_victim.sent + delay_ms / 1000 - 1.0
    wait_for(lambda: get(kube, namespace, "pod", vname) is None, 120, f"{vname} gone")


def test_scale_down_waits_for_the_request_in_flight_on_the_retiring_replica(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    """Scale 2 -> 1 while a request is held on replica 1: it is marked draining, gets no new
    work, and is deleted only once that request has completed (which it does, ok).

    Kills: deleting the victim at once (drain.finished always True, or the wait skipped), a
    drain mark that does not stop routing, and a wait that ignores the replica's in-flight
    work (the deletion would come before the held request could have finished)."""
    if not podrunner.local:
        pytest.skip("reads worker /state on loopback pod IPs: needs the local pod runner")
    delay_ms = 45_000
    url, keep, victim = _held_pipeline(kube, namespace, operator, drain_timeout=600)
    held = _hold_one_on_each(podrunner, url, [keep, victim], delay_ms)
    kube.kubectl("scale", "-n", namespace, f"sp/{ECHO}-a", "--replicas=1")
    _deleted_only_after_its_request(kube, podrunner, namespace, operator, url, victim, keep,
                                    held, held[1], delay_ms)
    assert [p["metadata"]["name"] for p in _live(kube, namespace, k.stage_selector(ECHO))] \
        == [f"{ECHO}-a-0"]
    kube.kubectl("delete", "omnipipe", "-n", namespace, ECHO, "--wait=false")


def test_retire_waits_for_the_request_in_flight_on_the_retired_replica(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    """`omnistage drain --retire` of replica 0 (the one a scale-down would keep) while a
    request is held on it: replicas go 2 -> 1, replica 0 is marked draining, gets no new work,
    and is deleted only once that request has completed; replica 1 stays, and the command
    returns once replica 0 is gone.

    Kills: deleting the retired replica at once (drain.finished always True, or the wait
    skipped), a drain mark that does not stop routing, a wait that ignores the replica's
    in-flight work, and a retirement that takes the highest ordinal instead of the named one."""
    if not podrunner.local:
        pytest.skip("reads worker /state on loopback pod IPs: needs the local pod runner")
    delay_ms = 45_000
    url, victim, keep = _held_pipeline(kube, namespace, operator, drain_timeout=600)
    held = _hold_one_on_each(podrunner, url, [victim, keep], delay_ms)
    vname = victim["metadata"]["name"]
    cli = subprocess.Popen(
        [sys.executable, "-m", "omnistage.cli", "drain", vname, "--retire", "-n", namespace,
         "--kubeconfig", str(kube.kubeconfig), "--timeout", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _deleted_only_after_its_request(kube, podrunner, namespace, operator, url, victim,
                                        keep, held, held[0], delay_ms)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, (out, err)
    assert f"{vname}: retiring for good" in out and f"{vname}: retired" in out, out
    assert get(kube, namespace, "stagepool", f"{ECHO}-a")["spec"]["replicas"] == 1
    assert [p["metadata"]["name"] for p in _live(kube, namespace, k.stage_selector(ECHO))] \
        == [f"{ECHO}-a-1"]
    kube.kubectl("delete", "omnipipe", "-n", namespace, ECHO, "--wait=false")


def test_drain_timeout_retires_a_replica_whose_request_outlasts_it(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    """drainTimeoutSeconds bounds the wait: a request longer than it does not pin the replica.

    Kills: ignoring the drain timeout (the victim would stay until its 60 s request ends), and
    a timeout counted from something other than the drain mark (deleted too early)."""
    if not podrunner.local:
        pytest.skip("reads worker /state on loopback pod IPs: needs the local pod runner")
    timeout, delay_ms = 5, 60_000
    url, keep, victim = _held_pipeline(kube, namespace, operator, drain_timeout=timeout)
    held = _hold_one_on_each(podrunner, url, [keep, victim], delay_ms)
    vname = victim["metadata"]["name"]
    kube.kubectl("scale", "-n", namespace, f"sp/{ECHO}-a", "--replicas=1")

    def deleting() -> dict[str, Any] | None:
        pod = get(kube, namespace, "pod", vname)
        if pod is None or pod["metadata"]["uid"] != victim["metadata"]["uid"]:
            raise AssertionError(f"{vname} vanished before its deletion mark was seen")
        return pod if pod["metadata"].get("deletionTimestamp") else None

    pod = wait_for(deleting, 120, f"{vname} deleted after its drain timeout", operator.log_tail,
                   interval=0.2)
    # Deleted while its request was still running (the request needs 60 s)...
    assert not held[1].done.is_set()
    assert time.time() < held[1].sent + delay_ms / 1000
    # ... and no sooner than the drain timeout after the drain mark.
    since = _stamp(pod["metadata"]["annotations"][ANNOTATION_DRAINING_SINCE])
    assert _deleted_at(pod) >= since + timeout - 1
    wait_for(lambda: get(kube, namespace, "pod", vname) is None, 180, f"{vname} gone")
    for h in held:
        h.done.wait(120)
    assert held[0].result is not None and held[0].result[0] == 200, held[0].result
    kube.kubectl("delete", "omnipipe", "-n", namespace, ECHO, "--wait=false")
