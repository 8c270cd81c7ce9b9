"""Drain-style retirement (operator/omni_operator/drain.py) against a real HTTP /state endpoint.

The replica's /state is served by a real HTTP server on loopback, so the wait for in-flight
work runs exactly as against a worker; the e2e suite (tests/e2e/test_drain_e2e.py) drives the
same code through the operator with a request held open on a real worker.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from omni_operator import drain
from omni_operator.readiness import gate_patch, is_draining, is_ready
from omnistage import kube
from tests.harness.fakeload import load_document, revision_load

Obj = dict[str, Any]


class _StateServer:
    """A /state endpoint whose answer the test sets (a JSON object, or raw bytes)."""

    def __init__(self) -> None:
        self.body: bytes = b"{}"
        self.hits = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                code = 200 if self.path == "/state" else 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(outer.body if code == 200 else b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, state: Obj | bytes) -> None:
        self.body = state if isinstance(state, bytes) else json.dumps(state).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> Iterator[_StateServer]:
    server = _StateServer()
    monkeypatch.setattr(kube, "WORKER_HTTP_PORT", server.port)
    yield server
    server.close()


def _stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(*, ip: str | None = "127.0.0.1", phase: str = "Running",
        since: dt.datetime | None = None) -> Obj:
    annotations = {kube.ANNOTATION_DRAINING: "true"}
    if since is not None:
        annotations[drain.ANNOTATION_DRAINING_SINCE] = _stamp(since)
    status: Obj = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": "p-a-1", "namespace": "ns", "annotations": annotations},
            "status": status}


def pool(timeout: int = 30) -> Obj:
    return {"spec": {"stage": {"name": "a", "kind": "echo", "finalOutput": True,
                               "drainTimeoutSeconds": timeout}}}


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def test_busy_replica_is_not_finished_until_its_work_reaches_zero(state) -> None:
    """Kills: `finished` returning True without asking the replica (immediate deletes), and
    ignoring in_flight."""
    state.answer({"in_flight": 1, "queued": 0})
    assert (await drain.finished(pod(since=now()), pool())).done is False
    state.answer({"in_flight": 2, "queued": 2})  # both queued: still work
    assert (await drain.finished(pod(since=now()), pool())).done is False
    state.answer({"in_flight": 0, "queued": 0})
    assert (await drain.finished(pod(since=now()), pool())).done is True
    state.answer({})  # fields it does not report count as zero
    assert (await drain.finished(pod(since=now()), pool())).done is True
    assert state.hits == 4


@pytest.mark.parametrize(("reported", "left"), [
    ({"in_flight": 1, "queued": 1}, 1),  # the case: 1 cut was reported as 2 (3 as 6)
    ({"in_flight": 3, "queued": 0}, 3),
    ({"in_flight": 6, "queued": 3}, 6),
    ({"in_flight": 2}, 2),
])
def test_queued_work_is_counted_once(reported: Obj, left: int) -> None:
    """A worker's in_flight already counts its queued requests (protocol.WorkerState; pinned
    against a real worker in tests/integration/test_worker.py), so the work left is in_flight
    alone. Kills: adding `queued` again (a DrainTimeout event said 3 when 1 was cut, and
    `omnistage status` showed 9 in flight with 6 clients)."""
    assert kube.work_left(reported) == left


@pytest.mark.parametrize("bad", [[1], "3", None, {"in_flight": "many"}, {"in_flight": None}])
def test_work_left_refuses_a_state_it_cannot_read(bad: Any) -> None:
    assert kube.work_left(bad) is None


async def test_a_timed_out_drain_reports_each_cut_request_once(state) -> None:
    """The DrainTimeout event's count (Progress.cut) for one request running and one queued
    behind it: two, and one running with nothing queued: one."""
    started = now() - dt.timedelta(seconds=100)
    state.answer({"in_flight": 2, "queued": 1})
    assert (await drain.finished(pod(since=started), pool(timeout=30))).cut == 2
    state.answer({"in_flight": 1, "queued": 1})  # queued, none running (a paused replica)
    assert (await drain.finished(pod(since=started), pool(timeout=30))).cut == 1


async def test_drain_timeout_ends_the_wait_even_while_busy(state) -> None:
    """Kills: ignoring drainTimeoutSeconds (a stuck request pins the replica for ever), the
    comparison turned round (`<`), and reading the timeout from somewhere else."""
    state.answer({"in_flight": 3})
    started = now() - dt.timedelta(seconds=100)
    progress = await drain.finished(pod(since=started), pool(timeout=30))
    assert progress.done and progress.timed_out and progress.cut == 3  # what it cuts
    assert (await drain.finished(pod(since=started), pool(timeout=3600))).done is False
    # Exactly at the timeout counts as passed (>=): a 0 s timeout deletes at once.
    assert (await drain.finished(pod(since=now() + dt.timedelta(seconds=2)), pool(0))).done is False
    assert (await drain.finished(pod(since=now()), pool(timeout=0))).done is True


async def test_without_a_since_mark_only_the_work_counts(state) -> None:
    """Kills: a missing draining-since annotation read as 'timed out'."""
    state.answer({"in_flight": 1})
    assert (await drain.finished(pod(since=None), pool(timeout=0))).done is False


@pytest.mark.parametrize("bad", [b"not json", b"{\"in_flight\": \"many\"}"])
async def test_unreadable_state_is_not_idle(state, bad: bytes) -> None:
    """Kills: treating an answer that cannot be read as zero in-flight work."""
    state.answer(bad)
    assert (await drain.finished(pod(since=now()), pool())).done is False


async def test_nothing_listening_is_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection means no process serves: nothing can be in flight.

    Kills: the ConnectionRefused branch answering None (a dead replica never retired)."""
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(kube, "WORKER_HTTP_PORT", port)
    assert (await drain.finished(pod(since=now()), pool())).done is True


async def test_a_refusing_proxy_in_the_environment_does_not_finish_a_busy_replica(
    state, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator pod with http_proxy set (a cluster behind a proxy) whose proxy refuses: the
    replica still has a request in flight, so it is not finished. Kills: reading /state through
    the environment's proxy (its refusal read as "nothing listens", and the replica deleted with
    its request in flight)."""
    state.answer({"in_flight": 1})
    with socket.socket() as s:  # bound, not listening: connections to it are refused
        s.bind(("127.0.0.1", 0))
        for var in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{s.getsockname()[1]}")
        for var in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's cached environment
        assert (await drain.finished(pod(since=now()), pool())).done is False
    assert state.hits == 1


@pytest.mark.parametrize("kw", [{"ip": None}, {"phase": "Pending"}, {"phase": "Succeeded"}])
async def test_a_replica_that_is_not_running_is_finished(state, kw: Obj) -> None:
    """Kills: asking a pod that has no IP or no running process (a retirement that never ends)."""
    state.answer({"in_flight": 5})
    assert (await drain.finished(pod(since=now(), **kw), pool())).done is True
    assert state.hits == 0


class _RecordingApi:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Obj, tuple[int, ...]]] = []
        self.params: list[dict[str, str]] = []

    async def patch(self, url: str, body: Obj, ignore: tuple[int, ...] = (),
                    **params: str) -> Obj:
        self.calls.append((url, body, ignore))
        self.params.append(params)
        return body


async def test_begin_marks_the_pod_draining_with_a_since_stamp() -> None:
    """Kills: begin without the draining mark (the gate stays True and routing continues) or
    without the since stamp (the timeout could never run), and a 404 raised for a pod that
    went away meanwhile."""
    api = _RecordingApi()
    before = now().replace(microsecond=0)
    await drain.begin(api, pod(since=None))  # type: ignore[arg-type]
    [(url, body, ignore)] = api.calls
    assert url == "/api/v1/namespaces/ns/pods/p-a-1"
    annotations = body["metadata"]["annotations"]
    assert annotations[kube.ANNOTATION_DRAINING] == "true"
    since = dt.datetime.strptime(annotations[drain.ANNOTATION_DRAINING_SINCE],
                                 "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    assert before <= since <= now()
    assert 404 in ignore
    assert api.params == [{"fieldManager": "omnistage-operator"}]  # the operator's one manager
    # The marked pod is no longer routable, and the gate patch says Draining.
    marked = {**pod(), "metadata": {**pod()["metadata"], "annotations": annotations}}
    marked["status"]["conditions"] = [
        {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"},
        {"type": kube.READINESS_GATE, "status": "True"}]
    assert is_draining(marked) and not is_ready(marked)
    patch = gate_patch(marked, "t")
    assert patch is not None
    [cond] = patch["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "Draining")


def test_status_counts_queued_work_once() -> None:
    """`omnistage status` reads the same /state through the API server's pod proxy: one
    request running and one queued is 2 in flight, not 3. Kills: replicas_cli adding `queued`
    again, or answering a figure for a state it cannot read."""
    from omni_operator import replicas_cli

    class Proxy:  # what SyncKubeApi.request(..., raw=True) answers through the pod proxy
        def __init__(self, body: bytes) -> None:
            self.body = body

        def request(self, method: str, url: str, **_: Any) -> bytes:
            assert method == "GET" and url.endswith(f":{kube.WORKER_HTTP_PORT}/proxy/state")
            return self.body

    replica = pod()
    replica["metadata"].pop("annotations")
    got = replicas_cli._inflight(Proxy(b'{"in_flight": 2, "queued": 1}'), replica)
    assert got == 2
    assert replicas_cli._inflight(Proxy(b'{"in_flight": "many"}'), replica) is None
    assert replicas_cli._inflight(Proxy(b'[]'), replica) is None


# ---- the last replica of a leaving revision (issue 22) -------------------------------------


def replica(name: str, revision: str | None, *, draining: bool = False,
            deleted: bool = False) -> Obj:
    meta: Obj = {"name": name, "namespace": "ns", "labels": {}, "annotations": {}}
    if revision is not None:
        meta["labels"][kube.LABEL_REVISION] = revision
    if draining:
        meta["annotations"][kube.ANNOTATION_DRAINING] = "true"
    if deleted:
        meta["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    return {"metadata": meta, "status": {}}


def test_only_the_last_live_replica_of_a_leaving_revision_waits_for_pins() -> None:
    """Kills: waiting on a replica of the target revision (a scale-down held by pins), on one
    whose revision still has a live replica that is not retiring, and counting a draining or
    terminating one of its revision as 'somewhere to go'."""
    x = replica("x", "old", draining=True)
    assert drain.pinned_revision(x, [x], "new", "b") == ("b", "old")
    assert drain.pinned_revision(x, [x, replica("y", "old")], "new", "b") is None
    for gone in (replica("y", "old", draining=True), replica("y", "old", deleted=True)):
        assert drain.pinned_revision(x, [x, gone, replica("z", "new")], "new", "b") == (
            "b", "old")
    assert drain.pinned_revision(x, [x], "old", "b") is None  # the target: scale-down, --retire
    unlabelled = replica("x", None, draining=True)
    assert drain.pinned_revision(unlabelled, [unlabelled], "new", "b") is None


def test_pinned_counts_add_up_over_orchestrators_and_absent_reads_as_zero() -> None:
    docs = [load_document(revisions={"b": {"old": revision_load(pinned=2),
                                           "new": revision_load(pinned=9)}}),
            load_document(revisions={"b": {"old": revision_load(pinned=1)},
                                     "a": {"old": revision_load(pinned=5)}})]
    assert drain.pinned_in_flight(docs, "b", "old") == 3
    assert drain.pinned_in_flight(docs, "a", "old") == 5
    assert drain.pinned_in_flight([], "b", "old") == 0  # no orchestrator runs: none in flight
    # An older orchestrator (no field), a stage or revision not listed, no revisions at all.
    older = {"revisions": {"b": {"old": revision_load()}}, "without": ("pinned",)}
    assert drain.pinned_in_flight([load_document(**older)], "b", "old") == 0
    assert drain.pinned_in_flight(
        [load_document(revisions={"a": {"old": revision_load()}})], "b", "old") == 0
    assert drain.pinned_in_flight([{"stages": {}}], "b", "old") == 0


def garbled(revisions: Obj) -> Obj:
    """A document whose revisions are garbled on purpose (the typed builders refuse them)."""
    return {**load_document(), "revisions": revisions}


@pytest.mark.parametrize("bad", [
    [], "x", garbled({"b": {"old": {"pinned": "many"}}}), garbled({"b": {"old": {"pinned": -1}}}),
    garbled({"b": {"old": {"pinned": 1.5}}}), garbled({"b": {"old": {"pinned": True}}}),
    garbled({"b": {"old": [1]}}),
])
def test_a_pinned_count_that_cannot_be_read_is_unknown(bad: Any) -> None:
    """Kills: a garbled count read as 0 (the last replica deleted under pinned requests)."""
    assert drain.pinned_in_flight([garbled({}), bad], "b", "old") is None


class _Pins:
    """A pinned-count reader answering the counts it is given, one per call."""

    def __init__(self, *answers: int | None) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self) -> int | None:
        self.calls += 1
        return self.answers.pop(0)


async def test_an_idle_last_replica_waits_for_its_pins_within_the_drain_timeout(state) -> None:
    """Its own work 0: done only when the pinned count is 0; unknown (None) means wait; past
    the timeout it goes, reporting the count. Its own work first: the count is not read while
    the replica is busy. Kills: deleting with pinned > 0 or unknown, and a pin wait the
    timeout does not end."""
    state.answer({"in_flight": 0})
    for count, done in ((1, False), (None, False), (0, True)):
        pins = _Pins(count)
        assert (await drain.finished(pod(since=now()), pool(), pins)).done is done
        assert pins.calls == 1
    old = now() - dt.timedelta(seconds=100)
    progress = await drain.finished(pod(since=old), pool(timeout=30), _Pins(4))
    assert (progress.done, progress.timed_out, progress.cut, progress.pinned) == (True, True, 0, 4)
    state.answer({"in_flight": 2})
    pins = _Pins()
    assert (await drain.finished(pod(since=now()), pool(), pins)).done is False
    assert pins.calls == 0
    progress = await drain.finished(pod(since=old), pool(timeout=30), _Pins(None))
    assert (progress.done, progress.cut, progress.pinned) == (True, 2, None)


def test_the_drain_timeout_event_names_the_pinned_count() -> None:
    plain = drain.timeout_message("p-b-0", drain.Progress(True, True, 2), None)
    assert plain.startswith("p-b-0: drain timed out with 2 request(s) in flight; stopping it")
    assert "pinned" not in plain
    pinned = drain.timeout_message("p-b-0", drain.Progress(True, True, 0, 3), ("b", "old"))
    assert "with 0 request(s) in flight; 3 request(s) pinned to its revision old" in pinned
    unknown = drain.timeout_message("p-b-0", drain.Progress(True, True, None, None), ("b", "o"))
    assert "an unknown number of request(s) in flight; an unknown number of request(s) " \
           "pinned to its revision o" in unknown
