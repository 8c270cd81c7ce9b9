"""Revisions in the orchestrator: the pinning rule (orchestrator/revisions.py, pure) and the
engine routing every hop and every failover retry by the pinned revision, against the fake
replicas of tests/unit/test_engine.py. The same with real workers:
tests/integration/test_revisions.py.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest

from omnistage import kube
from omnistage import protocol as p
from omnistage.orchestrator.k8s_membership import replica_from_pod
from omnistage.orchestrator.membership import ReplicaInfo
from omnistage.orchestrator.pins import Pins
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.revisions import (
    NEWEST,
    PREVIOUS,
    RevisionCount,
    count_revisions,
    newest,
    pin,
    previous,
)
from tests.harness.metrics import sample
from tests.unit import test_engine
from tests.unit.test_engine import TWO, Make, Rig, events, outcome

pytestmark = pytest.mark.timeout(30)
make = test_engine.make  # the rig's fixture


def never() -> float:
    raise AssertionError("no choice to draw for")


# ---- the rule (pure) ----------------------------------------------------------------------------


def test_one_revision_per_stage_serves_every_request_without_a_draw() -> None:
    stages = {"a": {"A1": RevisionCount(3, 2, 2)}, "b": {"B1": RevisionCount(0, 1, 0)},
              "cold": {}}
    assert pin(stages, never) == (NEWEST, {"a": "A1", "b": "B1", "cold": None})


def test_nothing_moves_until_every_changed_stage_has_routable_new_capacity() -> None:
    """b's new revision is joining (not routable): every request stays on the previous
    pipeline revision, at a too, though a's new one is ready."""
    stages = {"a": {"A1": RevisionCount(1, 2, 2), "A2": RevisionCount(2, 1, 1)},
              "b": {"B1": RevisionCount(1, 2, 2), "B2": RevisionCount(2, 1, 0)},
              "same": {"S": RevisionCount(1, 2, 2)}}
    assert pin(stages, never) == (PREVIOUS, {"a": "A1", "b": "B1", "same": "S"})


def test_the_shift_follows_the_smallest_share_of_new_capacity() -> None:
    """a: 1 of 4 routable replicas new; b: 2 of 4. A request goes new with p = min = 1/4, and
    then new at both stages; with a seeded source, 4000 admissions give 1/4 within 3 points."""
    stages = {"a": {"A1": RevisionCount(1, 3, 3), "A2": RevisionCount(2, 1, 1)},
              "b": {"B1": RevisionCount(1, 2, 2), "B2": RevisionCount(2, 2, 2)}}
    rng = random.Random(22)
    got = [pin(stages, rng.random) for _ in range(4000)]
    assert {(t, pins["a"], pins["b"]) for t, pins in got} == {
        (NEWEST, "A2", "B2"), (PREVIOUS, "A1", "B1")}
    share = sum(t == NEWEST for t, _ in got) / len(got)
    assert abs(share - 0.25) < 0.03, share
    full = {"a": {"A1": RevisionCount(1, 1, 0), "A2": RevisionCount(2, 2, 2)}}
    assert pin(full, lambda: 0.999) == (NEWEST, {"a": "A2"})  # old draining: all new


def test_once_a_stage_s_previous_revision_only_drains_every_request_goes_new() -> None:
    """a: half its routable replicas new; b: its last previous replica drains (known, not
    routable). A request on the previous track would find no b replica of B1 (no_replica), so
    every draw pins the newest; while b's previous can still serve, the draw decides."""
    stages = {"a": {"A1": RevisionCount(1, 1, 1), "A2": RevisionCount(2, 1, 1)},
              "b": {"B1": RevisionCount(1, 1, 0), "B2": RevisionCount(2, 2, 2)}}
    assert pin(stages, lambda: 0.999) == (NEWEST, {"a": "A2", "b": "B2"})
    stages["b"]["B1"] = RevisionCount(1, 1, 1)
    assert pin(stages, lambda: 0.999) == (PREVIOUS, {"a": "A1", "b": "B1"})
    # Only the previous release can serve everywhere: it takes every request.
    stages = {"a": {"A1": RevisionCount(1, 1, 1), "A2": RevisionCount(2, 1, 0)},
              "b": {"B1": RevisionCount(1, 1, 1), "B2": RevisionCount(2, 2, 2)}}
    assert pin(stages, lambda: 0.0) == (PREVIOUS, {"a": "A1", "b": "B1"})
    # Neither can serve everywhere: the newest, which the operator is bringing up.
    stages["b"]["B1"] = RevisionCount(1, 1, 0)
    assert pin(stages, lambda: 0.0) == (NEWEST, {"a": "A2", "b": "B2"})


def test_newest_is_the_highest_order_and_previous_the_next_lower() -> None:
    counts = {"A1": RevisionCount(5, 1, 1), "A2": RevisionCount(4, 2, 2)}
    assert (newest(counts), previous(counts)) == ("A1", "A2")
    assert newest({}) is None and previous({}) is None
    assert previous({"A1": RevisionCount(1, 1, 1)}) == "A1"


def test_pins_are_one_releases_whatever_point_each_stage_reached() -> None:
    """A pipeline revision is a release: at each stage the revision of the highest order not
    above it. Stage a changed in release 2 and again in release 4; b only in release 3; c never.
    Whatever revisions each stage still runs, the pins are one release's, never the newest of
    one stage with the previous of another."""
    stages = {"a": {"A1": RevisionCount(1, 1, 1), "A2": RevisionCount(2, 1, 1),
                    "A4": RevisionCount(4, 1, 1)},
              "b": {"B1": RevisionCount(1, 1, 1), "B3": RevisionCount(3, 2, 2)},
              "c": {"C1": RevisionCount(1, 2, 2)}}
    assert pin(stages, lambda: 0.0) == (NEWEST, {"a": "A4", "b": "B3", "c": "C1"})
    assert pin(stages, lambda: 0.999) == (PREVIOUS, {"a": "A2", "b": "B3", "c": "C1"})
    # b has finished release 3 (no B1 left) while a is in the middle of release 4: a request
    # on the previous release runs A2 with B3, release 3's pair, never A1 with B3.
    del stages["b"]["B1"]
    assert pin(stages, lambda: 0.999)[1] == {"a": "A2", "b": "B3", "c": "C1"}
    # A revert to release 1 at a keeps A1's order: a's pins stay release-consistent.
    stages = {"a": {"A1": RevisionCount(1, 2, 2), "A2": RevisionCount(2, 1, 0)},
              "b": {"B1": RevisionCount(1, 1, 1), "B2": RevisionCount(2, 1, 1)}}
    assert pin(stages, lambda: 0.0) == (PREVIOUS, {"a": "A1", "b": "B1"})


def _replica(name: str, revision: str | None, order: int, *, said: str | None = None,
             state: str = "ready", incarnation: str | None = "i", refused: str = "") -> Replica:
    r = Replica(ReplicaInfo("a", name, "tcp://127.0.0.1:1", state, revision, order))  # type: ignore[arg-type]
    r.said_revision, r.incarnation, r.refused = said, incarnation, refused
    return r


def test_count_revisions_reads_what_each_replica_is() -> None:
    """The hello's revision wins over the membership's; a replica whose revision nobody knows,
    or that refused our protocol, is no revision; joining and draining ones count, not as
    routable; the order is the highest of a revision's replicas."""
    counts = count_revisions([
        _replica("r0", "A1", 1), _replica("r1", "A1", 2, state="draining"),
        _replica("r2", None, 0, said="A2"), _replica("r3", "A2", 3, incarnation=None),
        _replica("r4", None, 0), _replica("r5", "A9", 9, refused="version 5"),
        _replica("r6", "A1", 0, said="A3")])
    # r3 has not handshaken yet: on its way (coming), not routable; r1 drains: neither.
    assert counts == {"A1": RevisionCount(2, 2, 1), "A2": RevisionCount(3, 2, 1, coming=1),
                      "A3": RevisionCount(0, 1, 1)}


def test_pins_choose_is_pin_over_the_counts_in_every_state() -> None:
    """Pins.choose skips counting when every stage has at most one revision: across random
    states (one or several revisions per stage, unknown, refused, draining, joining,
    un-handshaken replicas) it pins exactly what revisions.pin over count_revisions does."""
    rng = random.Random(7)
    for case in range(3000):
        pools = {s: StagePool(s) for s in "abc"}
        for stage, pool in pools.items():
            for n in range(rng.randint(0, 4)):
                r = _replica(f"{stage}{n}", rng.choice([None, f"{stage}1", f"{stage}2"]),
                             rng.randint(0, 3), said=rng.choice([None, None, f"{stage}3"]),
                             state=rng.choice(["ready", "ready", "draining", "joining"]),
                             incarnation=rng.choice(["i", "i", None]),
                             refused=rng.choice(["", "", "", "version 9"]))
                pool.replicas[r.name] = r
        order = rng.sample("abc", rng.randint(1, 3))
        draws = [rng.random() for _ in range(2)]
        want = pin({s: count_revisions(pools[s].replicas.values()) for s in order},
                   iter(draws).__next__)
        request = SimpleNamespace(order=order, track=None, pins=None)
        Pins(pools, iter(draws).__next__).choose(request)  # type: ignore[arg-type]
        assert (request.track, request.pins) == want, case
        assert list(request.pins) == order, case


def test_with_neither_release_serving_everywhere_the_one_on_its_way_is_pinned() -> None:
    """A revert: a's abandoned A2 only drains, b's reverted-to B1 replica is joining. Pinning
    the newest release (A2, B2) would fail at a; the previous one's missing replica at b is on
    its way, and the engine holds a task for it."""
    stages = {"a": {"A1": RevisionCount(1, 1, 1), "A2": RevisionCount(2, 1, 0)},
              "b": {"B1": RevisionCount(1, 1, 0, coming=1), "B2": RevisionCount(2, 1, 1)}}
    assert pin(stages, lambda: 0.0) == (PREVIOUS, {"a": "A1", "b": "B1"})
    stages["a"]["A2"] = RevisionCount(2, 1, 0, coming=1)  # both on their way: the newest
    assert pin(stages, lambda: 0.0) == (NEWEST, {"a": "A2", "b": "B2"})


def test_a_pod_s_label_and_annotation_are_its_revision_and_order() -> None:
    pod: dict[str, Any] = {
        "metadata": {"name": "p-a-0", "uid": "u",
                     "labels": {kube.LABEL_STAGE: "a", kube.LABEL_REVISION: "abc"},
                     "annotations": {kube.ANNOTATION_REVISION_ORDER: "7"}},
        "status": {"podIP": "127.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    info = replica_from_pod(pod)
    assert info is not None and (info.revision, info.order, info.state) == ("abc", 7, "ready")
    pod["metadata"]["annotations"][kube.ANNOTATION_REVISION_ORDER] = "soon"
    del pod["metadata"]["labels"][kube.LABEL_REVISION]
    info = replica_from_pod(pod)
    assert info is not None and (info.revision, info.order) == (None, 0)


# ---- the engine ---------------------------------------------------------------------------------


async def rig_with(make: Make, revisions: dict[str, tuple[str, int]], replicas: dict[str, int],
                   **kw: Any) -> Rig:
    """The rig with each named replica's membership carrying a revision and an order."""
    rig = await make(TWO, replicas, start=False, **kw)
    for info in rig.membership.replicas:
        if info.name in revisions:
            rev, order = revisions[info.name]
            rig.membership.publish(replace(info, revision=rev, order=order))
    await rig.orch.start()
    return rig


MIXED = {"a-0": ("A1", 1), "a-1": ("A2", 2), "b-0": ("B1", 1), "b-1": ("B2", 2)}


async def test_every_hop_goes_to_the_pinned_revision_and_says_so(make: Make) -> None:
    """40 requests with a seeded source: each runs a and b on one pipeline revision (a-1 with
    b-1, a-0 with b-0), both revisions get some; b's submit names its revision, what it expects
    of a, and the stamp a's final carried; admissions are counted per stage and revision."""
    rig = await rig_with(make, MIXED, {"a": 2, "b": 2}, revision_rng=random.Random(5))
    seen = set()
    for i in range(40):
        h = rig.submit(f"p{i}", request_id=f"r{i}")
        a_task = rig.task(h, "a")
        a_rev = rig.orch.pools["a"].replicas[a_task.replica.name].revision
        [sub_a] = [s for s in rig.net.link(a_task.replica.name).of(p.Submit)
                   if s.id == a_task.wire_id]
        assert sub_a.revision == a_rev and sub_a.upstream_revisions == {}
        rig.answer(h, "a", text="t", revision=a_rev)
        b_task = rig.task(h, "b")
        [sub_b] = [s for s in rig.net.link(b_task.replica.name).of(p.Submit)
                   if s.id == b_task.wire_id]
        pair = (a_task.replica.name, b_task.replica.name)
        assert pair in {("a-0", "b-0"), ("a-1", "b-1")}, pair
        assert sub_b.revision == MIXED[b_task.replica.name][0]
        assert sub_b.upstream_revisions == {"a": a_rev}
        assert sub_b.payload_revisions == {"a": a_rev}
        rig.answer(h, "b", text="t", revision=sub_b.revision)
        assert outcome(h).status == "ok"
        seen.add(pair)
    assert seen == {("a-0", "b-0"), ("a-1", "b-1")}
    new = rig.orch.admissions[("a", "A2")]
    assert rig.orch.admissions == {("a", "A1"): 40 - new, ("a", "A2"): new,
                                   ("b", "B1"): 40 - new, ("b", "B2"): new}
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_orchestrator_revision_admissions_total", stage="b",
                  revision="B2") == new
    assert sample(text, "omnistage_stage_revision_replicas", stage="a", revision="A2",
                  newest="true") == 1
    rig.clean()


async def test_a_stage_without_new_ready_capacity_keeps_everyone_on_the_previous_one(
        make: Make) -> None:
    """b's new replica is joining: every request runs a-0 and b-0, though a-1 is ready."""
    rig = await rig_with(make, MIXED, {"a": 2, "b": 2}, revision_rng=random.Random(5))
    info = next(i for i in rig.membership.replicas if i.name == "b-1")
    rig.membership.publish(replace(info, state="joining"))
    for i in range(10):
        h = rig.submit(f"p{i}")
        assert h._request.track == PREVIOUS
        assert rig.task(h, "a").replica.name == "a-0"
        rig.answer(h, "a", revision="A1")
        assert rig.task(h, "b").replica.name == "b-0"
        rig.answer(h, "b", revision="B1")
        assert outcome(h).status == "ok"
    assert rig.net.link("a-1").of(p.Submit) == []
    rig.clean()


async def test_a_task_whose_revision_is_on_its_way_waits_for_it(make: Make) -> None:
    """b's replica of the pinned revision is still joining while another revision's serves:
    the task waits (held) instead of failing with no_replica, goes to that replica once it is
    routable, and never to the other revision's."""
    revs = {"a-0": ("A2", 2), "b-0": ("B1", 1), "b-1": ("B2", 2)}
    rig = await rig_with(make, revs, {"a": 1, "b": 2})
    # A revert in progress: only the previous release (A1 at a) ... here a has A2 only, b has
    # B2 routable and B1 joining; the newest release is (A2, B2). Pin a request on B1 by hand,
    # as a request pinned before b's B1 replica left and came back would be.
    info = next(i for i in rig.membership.replicas if i.name == "b-0")
    rig.membership.publish(replace(info, state="joining"))
    h = rig.submit("x")
    h._request.pins["b"] = "B1"
    rig.answer(h, "a", revision="A2")
    assert events(h) == []  # not failed: held for b-0
    assert rig.orch.revision_holds == 1 and rig.net.link("b-1").of(p.Submit) == []
    rig.membership.publish(replace(info, state="ready"))
    assert rig.task(h, "b").replica.name == "b-0"
    rig.answer(h, "b", revision="B1")
    assert outcome(h).status == "ok"
    # With nothing of its revision on the way, it fails at once, as before.
    h = rig.submit("y")
    h._request.pins["b"] = "B9"
    rig.answer(h, "a", revision="A2")
    out = outcome(h)
    assert out.error is not None and out.error.code == "no_replica"
    rig.clean()


async def test_a_failover_retry_stays_on_the_pinned_revision(make: Make) -> None:
    """A request on A2 loses its replica: the retry goes to the other A2 replica, never to
    the A1 one; when no A2 replica is left it fails with replica_lost (not a mixed run)."""
    revs = {"a-0": ("A1", 1), "a-1": ("A2", 2), "a-2": ("A2", 2)}
    rig = await rig_with(make, revs, {"a": 3, "b": 1}, revision_rng=random.Random(1))
    pinned = []
    while len(pinned) < 2:
        h = rig.submit("x")
        if h._request.pins["a"] == "A2":
            pinned.append(h)
        else:
            rig.answer(h, "a", revision="A1")
            rig.answer(h, "b")
            assert outcome(h).status == "ok"
    first, second = pinned
    lost = rig.task(first, "a").replica.name
    other = "a-2" if lost == "a-1" else "a-1"
    if rig.task(second, "a").replica.name != lost:  # both on `lost`, so one loss hits both
        rig.answer(second, "a", revision="A2")
        rig.answer(second, "b")
        assert outcome(second).status == "ok"
        second = None
    rig.net.link(lost).on_disconnect()
    assert rig.task(first, "a").replica.name == other
    rig.answer(first, "a", revision="A2")
    rig.answer(first, "b")
    assert outcome(first).status == "ok"
    if second is not None:
        rig.answer(second, "a", revision="A2")
        rig.answer(second, "b")
        assert outcome(second).status == "ok"
    h = rig.submit("y")
    while h._request.pins["a"] != "A2":
        rig.answer(h, "a", revision="A1")
        rig.answer(h, "b")
        assert outcome(h).status == "ok"
        h = rig.submit("y")
    assert rig.task(h, "a").replica.name == other
    rig.net.link(other).on_disconnect()
    out = outcome(h)
    assert (out.status, out.error.code) == ("fatal", "replica_lost")
    assert [s for s in rig.net.link("a-0").of(p.Submit)
            if s.revision == "A2"] == []  # the A1 replica never got an A2 request
    rig.clean()


async def test_a_refused_hop_ends_the_request_and_loses_no_replica(make: Make) -> None:
    """A worker's revision_mismatch ends the child with that code (502, fatal), once: no
    retry on the other replica, the replica stays routable, the refusal is counted."""
    rig = await make(TWO, {"a": 2, "b": 1})
    h = rig.submit("x")
    name = rig.task(h, "a").replica.name
    rig.answer(h, "a", p.Error, code="revision_mismatch", message="revision: pinned to X")
    out = outcome(h)
    assert (out.status, out.error.code, out.error.stage) == ("fatal", "revision_mismatch", "a")
    assert out.http_status == 502 and "pinned to X" in out.error.message
    other = "a-1" if name == "a-0" else "a-0"
    assert rig.net.link(other).of(p.Submit) == []
    assert rig.replica(name).routable and rig.orch.counters["replicas_lost"] == 0
    assert rig.orch.counters["revision_refusals"] == 1
    assert rig.orch.failovers["retries"] == {}
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_orchestrator_revision_refusals_total") == 1
    rig.clean()


async def test_without_revisions_nothing_changes_on_the_wire(make: Make) -> None:
    """Replicas that say no revision (older workers, static membership): no pin, no revision
    field in any submit, any replica serves."""
    rig = await make(TWO)
    h = rig.submit("x")
    assert h._request.pins == {"a": None, "b": None}
    rig.answer(h, "a", text="t")
    [sub] = rig.net.link("b-0").of(p.Submit)
    assert (sub.revision, sub.upstream_revisions, sub.payload_revisions) == (None, {}, {})
    assert b"revision" not in p.encode(sub)[0]
    rig.answer(h, "b")
    assert outcome(h).status == "ok"
    assert rig.orch.load().revisions == {}
    rig.clean()


async def test_a_streamed_edge_feeds_each_chunk_with_its_stamp(make: Make) -> None:
    """a's chunks start b fed: b's submit names what it expects of a (and no attached stamp),
    and each feed carries the stamp its chunk came with, for b to check."""
    rig = await rig_with(make, MIXED, {"a": 2, "b": 2}, revision_rng=random.Random(5))
    h = rig.submit("abcd")
    a_task = rig.task(h, "a")
    a_rev = MIXED[a_task.replica.name][0]
    link = rig.net.link(a_task.replica.name)
    [sub_a] = link.of(p.Submit)
    assert sub_a.chunk_window is not None  # the edge streams
    link.reply(p.Chunk(id=a_task.wire_id, seq=1, text="ab", revision=a_rev))
    b_task = rig.task(h, "b")
    b_link = rig.net.link(b_task.replica.name)
    [sub_b] = b_link.of(p.Submit)
    assert sub_b.fed and sub_b.upstream_revisions == {"a": a_rev}
    assert sub_b.payload_revisions == {}
    link.reply(p.Chunk(id=a_task.wire_id, seq=2, text="cd", revision="forged"))
    assert [(f.seq, f.revision) for f in b_link.of(p.Feed)] == [(1, a_rev), (2, "forged")]
    rig.answer(h, "a", text="abcd", revision=a_rev)
    rig.answer(h, "b", text="abcd", revision=sub_b.revision)
    assert outcome(h).status == "ok"
    rig.clean()


class AlwaysNewest(random.Random):
    """A source whose every draw picks the newest revision when there is a choice."""

    def random(self) -> float:
        return 0.0


async def test_a_replica_of_unknown_revision_serves_any_pin(make: Make) -> None:
    """A worker older than revisions (no revision in its hello or membership) checks nothing:
    it keeps serving requests pinned to the stage's known revision, so an upgrade of the
    runtime never leaves the stage without capacity; a replica of another revision does not."""
    rig = await rig_with(make, {"a-0": ("A1", 1), "a-2": ("A0", 0)}, {"a": 3, "b": 1},
                         revision_rng=AlwaysNewest())
    pool = rig.orch.pools["a"]
    assert {r.name for r in pool.routable(revision="A1")} == {"a-0", "a-1"}
    h = rig.submit("x", session="s")
    assert h._request.pins["a"] == "A1"
    pool.sessions["s"] = "a-1"
    rig.answer(h, "a", p.Draining, message="retiring")  # the retry may go to a-1, never a-2
    assert rig.task(h, "a").replica.name in {"a-0", "a-1"}
    assert rig.net.link("a-2").of(p.Submit) == []
    rig.answer(h, "a")
    rig.answer(h, "b")
    assert outcome(h).status == "ok"
    rig.clean()


# ---- the wire -----------------------------------------------------------------------------------


def test_the_revision_fields_travel_and_default_to_no_check() -> None:
    """The new fields round-trip; a message without them (an older peer's) decodes with no
    revision and empty maps; a bad value is refused naming the field; the stamp on a result is
    no outcome field (it never reaches the client)."""
    sub = p.Submit(id="r", revision="abc", upstream_revisions={"a": "x"},
                   payload_revisions={"a": "x", "a/neg": "x"})
    got = p.decode_request(p.encode(sub)).header
    assert (got.revision, got.upstream_revisions, got.payload_revisions) == (
        "abc", {"a": "x"}, {"a": "x", "a/neg": "x"})
    old = p.decode_request(p.encode(p.Submit(id="r"))).header
    assert (old.revision, old.upstream_revisions, old.payload_revisions) == (None, {}, {})
    with pytest.raises(p.ProtocolError, match=r"\$\.revision"):
        p.decode_request([b"\x83\xa1t\xa6submit\xa2id\xa1r\xa8revision\xa0"])
    fin = p.decode_reply(p.encode(p.Final(id="r", text="t", revision="abc"))).header
    assert fin.revision == "abc" and "revision" not in p.RESULT_FIELDS
    feed = p.decode_request(p.encode(p.Feed(id="r", seq=1, revision="abc"))).header
    assert feed.revision == "abc"
    assert "revision_mismatch" in p.ErrorCode.__args__


# ---- requests pinned to a revision: counted while in flight (GET /v1/load `pinned`) ----------


PINNED = {"a-0": ("A1", 1), "a-1": ("A1", 1), "b-0": ("B1", 1)}


def pinned_load(rig: Rig) -> dict[tuple[str, str], int]:
    """GET /v1/load's `pinned` of every revision it lists."""
    return {(stage, rev): r.pinned for stage, revs in rig.orch.load().revisions.items()
            for rev, r in revs.items()}


def pinned_by(n: int) -> dict[tuple[str, str], int]:
    return {("a", "A1"): n, ("b", "B1"): n}


async def _lose_both_a_replicas(rig: Rig, h: Any) -> None:
    first = rig.task(h, "a").replica.name
    rig.net.link(first).on_disconnect()
    second = rig.task(h, "a").replica.name  # failed over: not terminal, still pinned
    assert second != first and rig.orch.pinned == pinned_by(2)
    rig.net.link(second).on_disconnect()  # a second loss at one stage: a suspect, not retried


async def _abort(rig: Rig, h: Any) -> None:
    rig.orch.abort(h.id)
    assert rig.orch.pinned == pinned_by(2)  # terminal once its replica says it stopped
    rig.answer(h, "a", p.Aborted)


async def _deadline(rig: Rig, h: Any) -> None:
    await asyncio.wait_for(h.outcome(), test_engine.HANG)


# path -> (submit options, how the request ends, its outcome's status and error code)
ENDINGS: dict[str, tuple[dict[str, Any], Any, tuple[str, str | None]]] = {
    "done": ({}, None, ("ok", None)),
    "stage_error": ({}, lambda rig, h: rig.answer(h, "a", p.Error, code="internal",
                                                   message="boom"), ("fatal", "stage_failed")),
    "deadline_reply": ({}, lambda rig, h: rig.answer(h, "a", p.Deadline, message="late"),
                       ("request_error", "deadline")),
    "abort": ({}, _abort, ("abort", None)),
    "request_timer": ({"timeout_s": 0.01}, _deadline, ("request_error", "deadline")),
    "replica_lost": ({}, _lose_both_a_replicas, ("fatal", "replica_lost")),
}


@pytest.mark.parametrize("path", list(ENDINGS))
async def test_a_request_is_pinned_from_admission_to_its_one_outcome(make: Make,
                                                                     path: str) -> None:
    """Each request counts once per stage revision it is pinned to, from admission until its
    one terminal outcome, whatever ends it, and /v1/load and the gauge show the count; a
    bystander request in flight keeps its 1 (a second decrement would take it), and the count
    is back to nothing once both ended (a missed one would stay)."""
    options, end, (status, code) = ENDINGS[path]
    rig = await rig_with(make, PINNED, {"a": 2, "b": 1})
    bystander = rig.submit("by")
    rig.answer(bystander, "a")  # it waits at b-0, away from what the path does to a
    assert rig.orch.pinned == pinned_by(1) and pinned_load(rig) == pinned_by(1)
    h = rig.submit("x", **options)
    assert h._request.pins == {"a": "A1", "b": "B1"}
    assert rig.orch.pinned == pinned_by(2) and pinned_load(rig) == pinned_by(2)
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_stage_revision_pinned", stage="b", revision="B1") == 2
    if end is None:
        rig.answer(h, "a")
        assert rig.orch.pinned == pinned_by(2)  # between stages: still in flight
        rig.answer(h, "b")
    else:
        result = end(rig, h)
        if asyncio.iscoroutine(result):
            await result
    out = h._request.outcome
    assert out is not None and (out.status, out.error and out.error.code) == (status, code)
    assert rig.orch.pinned == pinned_by(1) and pinned_load(rig) == pinned_by(1)
    rig.answer(bystander, "b")
    assert outcome(bystander).status == "ok"
    assert rig.orch.pinned == {} and pinned_load(rig) == pinned_by(0)
    rig.clean()


async def test_samples_and_refusals_count_a_request_once(make: Make) -> None:
    """Two samples of one request, one ok and one failed, end as one outcome: one decrement.
    A request refused at admission (bad n) was never pinned, so it takes nothing off."""
    rig = await rig_with(make, PINNED, {"a": 2, "b": 1})
    h = rig.submit("x", n=2)
    assert rig.orch.pinned == pinned_by(1)  # one request, however many samples
    rig.answer(h, "a", child=0)
    rig.answer(h, "b", child=0)
    assert rig.orch.pinned == pinned_by(1)  # a sample ended, not the request
    refused = rig.submit("bad", n=0)
    assert outcome(refused).error.code == "bad_request"
    assert rig.orch.pinned == pinned_by(1)
    rig.answer(h, "a", p.Error, child=1, code="internal", message="boom")
    assert outcome(h).status == "ok" and rig.orch.pinned == {}
    rig.clean()


async def test_a_shutdown_ends_every_pinned_request(make: Make) -> None:
    """An orchestrator that stops fails what is left with shutting_down: nothing stays pinned."""
    rig = await rig_with(make, PINNED, {"a": 2, "b": 1})
    handles = [rig.submit(f"p{i}") for i in range(3)]
    rig.answer(handles[0], "a")
    assert rig.orch.pinned == pinned_by(3)
    await rig.orch.stop(drain_timeout=0)
    assert [outcome(h).error.code for h in handles] == ["shutting_down"] * 3
    assert rig.orch.pinned == {}
    rig.clean()


# ---- the last resort: a draining replica of a revision a release leaves ------------------------


class AlwaysPrevious(random.Random):
    """A source whose every draw picks the previous revision when there is a choice."""

    def random(self) -> float:
        return 0.999


RELEASE = {"a-0": ("A1", 1), "b-0": ("B1", 1), "b-1": ("B2", 2)}


async def _pinned_to_b1_at_b(rig: Rig) -> tuple[Any, Any]:
    """A request admitted while both of b's revisions served, pinned to B1, done at a; then
    b-0 (B1's only replica) is marked draining (the operator retires it)."""
    h = rig.submit("x")
    assert h._request.pins == {"a": "A1", "b": "B1"}
    info = next(i for i in rig.membership.replicas if i.name == "b-0")
    rig.membership.publish(replace(info, state="draining"))
    return h, info


async def test_a_task_whose_revision_only_drains_goes_to_its_draining_replica(
        make: Make) -> None:
    """A release moves b from B1 to B2: b-0 (B1) drains while a request pinned to B1 is still
    at a. Its b task goes to b-0 (which still finishes work) instead of failing no_replica,
    never to b-1; the request stays pinned to B1 until it ends."""
    rig = await rig_with(make, RELEASE, {"a": 1, "b": 2}, revision_rng=AlwaysPrevious())
    h, _ = await _pinned_to_b1_at_b(rig)
    assert pinned_load(rig)[("b", "B1")] == 1
    rig.answer(h, "a", revision="A1")
    task = rig.task(h, "b")
    assert task.replica.name == "b-0"
    [sub] = rig.net.link("b-0").of(p.Submit)
    assert sub.revision == "B1"
    rig.answer(h, "b", revision="B1")
    assert outcome(h).status == "ok"
    assert rig.net.link("b-1").of(p.Submit) == []
    assert pinned_load(rig)[("b", "B1")] == 0
    rig.clean()


async def test_a_draining_replica_that_refuses_or_is_gone_ends_the_request_as_before(
        make: Make) -> None:
    """The last resort is one more try, not a new failure mode: the draining replica that got
    its SIGTERM refuses (draining), and the request fails with draining, once; with the B1
    replica gone it fails no_replica at once, once; and outside a release (no routable
    replica of another revision) a draining replica takes nothing, as before."""
    rig = await rig_with(make, RELEASE, {"a": 1, "b": 2}, revision_rng=AlwaysPrevious())
    h, info = await _pinned_to_b1_at_b(rig)
    rig.answer(h, "a", revision="A1")
    rig.answer(h, "b", p.Draining, message="replica is draining")
    out = outcome(h)
    assert (out.error.code, out.error.stage) == ("draining", "b")
    assert rig.net.link("b-1").of(p.Submit) == []

    rig.membership.publish(info)  # b-0 ready again: the next request pins B1
    h, _ = await _pinned_to_b1_at_b(rig)
    rig.membership.publish(replace(info, state="gone"))
    rig.answer(h, "a", revision="A1")
    out = outcome(h)
    assert (out.error.code, out.error.stage) == ("no_replica", "b")
    assert "of revision B1 (the request's)" in out.error.message
    assert rig.net.link("b-1").of(p.Submit) == []
    rig.clean()


async def test_outside_a_release_a_draining_replica_takes_nothing(make: Make) -> None:
    """b's only replica of another revision drains too (say, a local shutdown): the pinned
    task is not sent to a draining replica, it fails no_replica as before."""
    rig = await rig_with(make, RELEASE, {"a": 1, "b": 2}, revision_rng=AlwaysPrevious())
    h, _ = await _pinned_to_b1_at_b(rig)
    other = next(i for i in rig.membership.replicas if i.name == "b-1")
    rig.membership.publish(replace(other, state="draining"))
    rig.answer(h, "a", revision="A1")
    assert outcome(h).error.code == "no_replica"
    assert rig.net.link("b-0").of(p.Submit) == [] and rig.net.link("b-1").of(p.Submit) == []
    rig.clean()


async def test_a_failover_may_go_to_a_draining_replica_of_its_revision(make: Make) -> None:
    """A task pinned to B1 runs on B1's routable replica, which is lost while B1's other
    replica drains: the retry goes to the draining one (the same rule as a first try)."""
    revs = {**RELEASE, "b-2": ("B1", 1)}
    rig = await rig_with(make, revs, {"a": 1, "b": 3}, revision_rng=AlwaysPrevious())
    info = next(i for i in rig.membership.replicas if i.name == "b-2")
    rig.membership.publish(replace(info, state="draining"))
    h = rig.submit("x")
    assert h._request.pins["b"] == "B1"
    rig.answer(h, "a", revision="A1")
    assert rig.task(h, "b").replica.name == "b-0"  # routable first
    rig.net.link("b-0").on_disconnect()
    assert rig.task(h, "b").replica.name == "b-2"
    assert rig.orch.failovers["retries"] == {"b": 1}
    rig.answer(h, "b", revision="B1")
    assert outcome(h).status == "ok"
    assert rig.net.link("b-1").of(p.Submit) == []
    rig.clean()
