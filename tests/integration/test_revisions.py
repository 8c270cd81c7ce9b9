"""Revisions with real worker processes over real ZMQ (docs/architecture.md, "Revisions").

A worker stamps its stage revision on what it emits and refuses, with error/revision_mismatch
and its refusal counter, a submit pinned to another revision and a payload or fed chunk stamped
with a revision other than the request expects. An orchestrator whose stages each run two
revisions at once pins every request to one pipeline revision: under concurrent load, plain and
streamed, no hop crosses revisions (the workers' refusal counters stay 0, and every request
succeeds), and both revisions serve. A request pinned to a revision a release leaves finishes on
its draining replica (issue 22). The same rules with fake replicas:
tests/unit/test_revisions.py.
"""

from __future__ import annotations

import asyncio
import random
import signal
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

from omnistage import protocol as p
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.procs import WorkerProcess
from omnistage.revision import stage_revision
from omnistage.spec import Stage
from tests.harness.metrics import sample
from tests.integration.test_orchestrator import _until, echo, held, pipeline
from tests.integration.test_shm import worker_state
from tests.unit.test_revisions import AlwaysNewest, AlwaysPrevious

pytestmark = pytest.mark.timeout(300)

WRONG = "0000000000"


def refusals(w: WorkerProcess) -> float | None:
    """The worker's omnistage_worker_revision_refusals_total, read from its /metrics."""
    with urllib.request.urlopen(w.http + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sample(text, "omnistage_worker_revision_refusals_total")


async def test_a_forced_mix_is_refused_and_counted(start_worker, channels) -> None:
    """The worker says its revision in its hello and stamps it on chunks and finals; a submit
    for another revision, a payload stamped with another revision than expected, and a fed
    chunk of another revision each end their request with revision_mismatch (nothing runs),
    counted in /metrics and /state; the worker keeps serving, and absent fields are unchecked."""
    stage = Stage.model_validate({"name": "b", "kind": "echo"})
    mine = stage_revision(stage)
    w = start_worker(stage, name="rev-b-0")
    ch = channels(w)
    hello = await ch.handshake(10)
    assert hello.revision == mine
    assert refusals(w) == 0

    async def next_reply() -> p.Message[Any]:
        return await asyncio.wait_for(ch.unsolicited.get(), 10)

    ch.send(p.Submit(id="ok", params={"prompt": "abcd", "chunk_chars": 2}, chunk_window=8,
                     revision=mine, upstream_revisions={"a": "aaaa"},
                     payload_revisions={"a": "aaaa", "a/neg": "aaaa"}))
    got = [await next_reply() for _ in range(3)]
    assert [type(m.header) for m in got] == [p.Chunk, p.Chunk, p.Final]
    assert {m.header.revision for m in got} == {mine}  # stamped
    assert got[-1].header.text == "abcd"

    ch.send(p.Submit(id="pinned-elsewhere", params={"prompt": "x"}, revision=WRONG))
    err = await next_reply()
    assert isinstance(err.header, p.Error) and err.header.id == "pinned-elsewhere"
    assert err.header.code == "revision_mismatch"
    assert f"pinned to revision {WRONG} of stage b" in err.header.message
    assert f"replica rev-b-0 is revision {mine}" in err.header.message

    ch.send(p.Submit(id="mixed", params={"prompt": "x"}, revision=mine,
                     upstream_revisions={"a": "aaaa"},
                     payload_revisions={"a": "aaaa", "a/neg": "bbbb"}))
    err = await next_reply()
    assert (err.header.id, err.header.code) == ("mixed", "revision_mismatch")
    assert "payload_revisions.a/neg" in err.header.message and "bbbb" in err.header.message

    ch.send(p.Submit(id="fed", fed=True, revision=mine, upstream_revisions={"a": "aaaa"}))
    ch.send(p.Feed(id="fed", seq=1, text="ok", revision="aaaa"))
    credit = await next_reply()
    assert isinstance(credit.header, p.Credit) and credit.header.seq == 1
    ch.send(p.Feed(id="fed", seq=2, text="mix", revision="bbbb"))
    err = await next_reply()
    assert (err.header.id, err.header.code) == ("fed", "revision_mismatch")
    assert "feed 2" in err.header.message

    await _until(lambda: refusals(w) == 3, "three refusals counted")
    state = worker_state(w)
    assert state["revision"] == mine and state["revision_refusals"] == 3
    assert state["in_flight"] == 0
    # An old client (no revision fields) is served as before.
    _, final = await ch.request("old", {"prompt": "plain"}, timeout_s=10)
    assert isinstance(final.header, p.Final) and final.header.text == "plain"
    assert refusals(w) == 3 and ch.unsolicited.empty()


Launch = Callable[..., Any]


@pytest.fixture
async def launch_revisions(start_worker) -> AsyncIterator[Launch]:
    """An Orchestrator over workers where each replica runs its own variant of its stage
    (another revision) and carries a release order in the membership, as the operator's pods
    do on Kubernetes. A variant is (engine options, order) or (engine options, order,
    start_worker options)."""
    orchs: list[Orchestrator] = []

    async def go(pipe: Any, replicas: dict[str, list[tuple[Any, ...]]],
                 **kw: Any) -> tuple[Orchestrator, dict[str, list[WorkerProcess]]]:
        procs: dict[str, list[WorkerProcess]] = {}
        infos = []
        for stage_name, variants in replicas.items():
            for i, (engine, order, *options) in enumerate(variants):
                stage = variant(pipe, stage_name, engine)
                name = f"{pipe.metadata.name}-{stage_name}-{i}"
                w = start_worker(stage, name=name, **(options[0] if options else {}))
                procs.setdefault(stage_name, []).append(w)
                infos.append(replace(ReplicaInfo(stage_name, name, w.zmq),
                                     revision=stage_revision(stage), order=order))
        orch = Orchestrator(pipe, StaticMembership(infos), **kw)
        await orch.start()
        orchs.append(orch)
        return orch, procs

    yield go
    for orch in orchs:
        await orch.stop(drain_timeout=1)


def variant(pipe: Any, stage: str, engine: dict[str, Any]) -> Stage:
    """The pipeline's stage with these engine options (python names) changed."""
    base = pipe.spec.stage(stage)
    return base.model_copy(update={"engine": base.engine.model_copy(update=engine)})


OLD, NEW = {"echo_chunk_chars": 5}, {"echo_chunk_chars": 6}  # an echo option in the revision


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_two_revisions_of_two_stages_never_mix_under_load(
        launch_revisions, streamed: bool) -> None:
    """Stages a and b each run an old and a new revision (two replicas each, the new one of the
    higher order): 48 concurrent requests are each pinned to one pipeline revision, so none is
    refused and every one succeeds; the refusal counters of all eight workers stay 0; both
    revisions serve (the shift is in proportion to capacity: half and half here); streamed, a's
    chunks go to b as feeds stamped with a's revision, and b checks each."""
    a_engine = {"echoChunkChars": 3} if streamed else {}
    pipe = pipeline(f"mix{int(streamed)}", [{**echo("a"), "engine": a_engine},
                                            echo("b", ("a",), final=True)])
    variants = [({**OLD}, 1), ({**OLD}, 1), ({**NEW}, 2), ({**NEW}, 2)]
    orch, procs = await launch_revisions(pipe, {"a": variants, "b": variants},
                                         revision_rng=random.Random(22))
    for s in ("a", "b"):  # GET /v1/load's view: two revisions, two routable replicas each
        assert {rev: (r.order, r.routable, r.newest)
                for rev, r in orch.load().revisions[s].items()} == {
            stage_revision(variant(pipe, s, OLD)): (1, 2, False),
            stage_revision(variant(pipe, s, NEW)): (2, 2, True)}

    texts = [f"request number {i} " * 3 for i in range(48)]
    handles = [orch.submit(PipelineRequest(prompt=t, params={"*": {"delay_ms": 20}}))
               for t in texts]
    pinned = [h._request.pins for h in handles]
    outcomes = await asyncio.wait_for(asyncio.gather(*(h.outcome() for h in handles)), 120)
    assert [o.status for o in outcomes] == ["ok"] * 48, [o.error for o in outcomes]
    for text, o in zip(texts, outcomes, strict=True):
        assert o.children[0].outputs["b"].fields["text"] == text
    for w in procs["a"] + procs["b"]:
        assert refusals(w) == 0, w.name
    assert orch.counters["revision_refusals"] == 0
    new = {s: stage_revision(variant(pipe, s, NEW)) for s in ("a", "b")}
    tracks = {(pins["a"] == new["a"], pins["b"] == new["b"]) for pins in pinned}
    assert tracks == {(True, True), (False, False)}  # both pipeline revisions, never a mix
    served = {r.name: r.served for s in ("a", "b") for r in orch.pools[s].replicas.values()}
    assert all(n > 0 for n in served.values()), served  # every replica of both revisions served
    admitted = orch.admissions
    assert sum(n for (s, _), n in admitted.items() if s == "a") == 48
    if streamed:
        assert all(worker_state(w)["chunks"]["fed"] > 0 for w in procs["b"])


async def test_a_kill_9_fails_over_within_the_pinned_revision(launch_revisions, tmp_path) -> None:
    """Stage a has one old replica and two new ones (held); 8 requests pinned to the new
    revision sit on them; one new replica is killed with -9: every request it held runs again
    on the other new one, never on the old one (which serves nothing), and all succeed with no
    refusal."""
    release = tmp_path / "release"
    pipe = pipeline("fo", [echo("a"), echo("b", ("a",), final=True)])
    hold = held(release)
    orch, procs = await launch_revisions(
        pipe, {"a": [(OLD, 1), (NEW, 2, hold), (NEW, 2, hold)], "b": [({}, 0)]},
        revision_rng=AlwaysNewest(), heartbeat_interval=0.5, heartbeat_timeout=60)
    new_a = stage_revision(variant(pipe, "a", NEW))
    handles = [orch.submit(PipelineRequest(prompt=f"p{i}")) for i in range(8)]
    assert {h._request.pins["a"] for h in handles} == {new_a}
    pool = orch.pools["a"]
    await _until(lambda: sum(r.inflight for r in pool.replicas.values()) == 8, "8 held at a")
    victim = max((pool.replicas["fo-a-1"], pool.replicas["fo-a-2"]), key=lambda r: r.inflight)
    bound = len(victim.bound)
    survivor = "fo-a-2" if victim.name == "fo-a-1" else "fo-a-1"
    next(w for w in procs["a"] if w.name == victim.name).proc.send_signal(signal.SIGKILL)
    await _until(lambda: not victim.bound and victim.incarnation is None, "the loss seen")
    release.touch()
    outcomes = await asyncio.wait_for(asyncio.gather(*(h.outcome() for h in handles)), 120)
    assert [o.status for o in outcomes] == ["ok"] * 8, [o.error for o in outcomes]
    assert orch.failovers["retries"] == {"a": bound}
    assert pool.replicas["fo-a-0"].served == 0
    assert pool.replicas[survivor].served == 8 - victim.served + bound
    for w in procs["a"] + procs["b"]:
        if w.name != victim.name:
            assert refusals(w) == 0, w.name


async def test_a_request_pinned_to_a_leaving_revision_finishes_on_its_draining_replica(
        launch_revisions, tmp_path) -> None:
    """Issue 22: a release moves stage b from OLD to NEW while a request pinned to OLD is still
    at a (held). b's only OLD replica is marked draining (the operator retires it): the request
    still completes, on that draining replica (a worker refuses nothing before its SIGTERM),
    never on NEW's, and /v1/load shows it pinned to OLD until its outcome. With the OLD replica
    gone, the next such request fails cleanly with no_replica: one outcome, nothing left."""
    release = tmp_path / "release"
    pipe = pipeline("leave", [echo("a"), echo("b", ("a",), final=True)])
    orch, procs = await launch_revisions(
        pipe, {"a": [({}, 1, held(release))], "b": [(OLD, 1), (NEW, 2)]},
        revision_rng=AlwaysPrevious())
    old_b, new_b = (stage_revision(variant(pipe, "b", e)) for e in (OLD, NEW))
    old_info = next(i for i in orch.membership.replicas if i.name == "leave-b-0")
    assert old_info.revision == old_b
    pinned = {rev: lambda rev=rev: orch.load().revisions["b"][rev].pinned
              for rev in (old_b, new_b)}

    h = orch.submit(PipelineRequest(prompt="pinned to the old release"))
    assert h._request.pins["b"] == old_b  # both served at admission; the draw chose OLD
    await _until(lambda: orch.pools["a"].replicas["leave-a-0"].inflight == 1, "held at a")
    orch.membership.publish(replace(old_info, state="draining"))
    await _until(lambda: not orch.pools["b"].replicas["leave-b-0"].routable, "b-0 draining")
    assert (pinned[old_b](), pinned[new_b]()) == (1, 0)
    release.touch()
    out = await asyncio.wait_for(h.outcome(), 60)
    assert out.status == "ok", out.error
    assert out.children[0].outputs["b"].replica == "leave-b-0"
    assert out.children[0].outputs["b"].fields["text"] == "pinned to the old release"
    assert orch.pools["b"].replicas["leave-b-1"].served == 0
    assert (pinned[old_b](), pinned[new_b]()) == (0, 0)

    release.unlink()  # a holds again
    orch.membership.publish(old_info)  # OLD serves again, so the next request pins it
    await _until(lambda: orch.pools["b"].replicas["leave-b-0"].routable, "b-0 ready")
    h = orch.submit(PipelineRequest(prompt="too late"))
    assert h._request.pins["b"] == old_b
    await _until(lambda: orch.pools["a"].replicas["leave-a-0"].inflight == 1, "held at a")
    orch.membership.publish(replace(old_info, state="gone"))  # retired: deleted
    await _until(lambda: "leave-b-0" not in orch.pools["b"].replicas, "b-0 gone")
    before = dict(orch.outcomes)
    release.touch()
    events = [e async for e in h.events()]
    assert len(events) == 1, events  # the outcome, once
    [out] = events
    assert (out.status, out.error.code, out.error.stage) == ("fatal", "no_replica", "b")
    assert f"of revision {old_b} (the request's)" in out.error.message
    assert orch.outcomes == {**before, "fatal": before.get("fatal", 0) + 1}
    assert orch.pools["b"].replicas["leave-b-1"].served == 0
    assert orch.pinned == {} and orch.requests == {} and orch.tasks == {}
    for w in procs["a"] + procs["b"]:
        assert refusals(w) == 0, w.name
