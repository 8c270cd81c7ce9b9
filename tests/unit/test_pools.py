"""Replica selection and the per-request stage plan: the orchestrator's hot path.

Both were made cheaper per request (no set built when nothing is excluded, the DAG walk done
once per distinct `finals`); these tests pin the answers, which must not change. And the last
resort of a task whose revision a release leaves: a draining replica of it (issue 22).
"""

from __future__ import annotations

from pathlib import Path

from omnistage.orchestrator.engine import Orchestrator, _Request
from omnistage.orchestrator.membership import ReplicaInfo, StaticMembership
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.spec import load_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _replica(stage: str, name: str, *, ready: bool = True, shaken: bool = True) -> Replica:
    r = Replica(ReplicaInfo(stage=stage, name=name, endpoint="tcp://127.0.0.1:1",
                            state="ready" if ready else "draining"))
    r.incarnation = "i1" if shaken else None
    return r


def _pool(*replicas: Replica) -> StagePool:
    pool = StagePool("s")
    for r in replicas:
        pool.replicas[r.name] = r
    return pool


def test_routable_skips_draining_unshaken_and_excluded_replicas() -> None:
    ok, draining, unshaken = _replica("s", "r0"), _replica("s", "r1", ready=False), \
        _replica("s", "r2", shaken=False)
    pool = _pool(ok, draining, unshaken)
    assert pool.routable() == [ok]
    assert pool.routable(set()) == [ok]
    assert pool.routable({"r0"}) == []
    assert pool.has_routable()
    assert pool.pick(exclude={"r0"}) is None
    assert pool.pick() is ok


def test_has_routable_is_false_without_a_routable_replica() -> None:
    assert not _pool().has_routable()
    assert not _pool(_replica("s", "r1", ready=False), _replica("s", "r2", shaken=False)
                     ).has_routable()


def _rev(name: str, revision: str | None, order: int, *, said: str | None = None,
         state: str = "ready", incarnation: str | None = "i", refused: str = "") -> Replica:
    """A replica of stage s with a revision (membership label, or `said` in its hello)."""
    r = Replica(ReplicaInfo("s", name, "tcp://127.0.0.1:1", state, revision, order))  # type: ignore[arg-type]
    r.said_revision, r.incarnation, r.refused = said, incarnation, refused
    return r


def test_the_last_resort_is_a_draining_replica_of_the_revision_while_another_serves() -> None:
    """A task pinned to A1 with no routable A1 replica goes to the least busy draining A1
    replica, only while a replica of another revision is routable (a release is under way);
    never to a dead, refused, not handshaken, tried or other-revision replica, and never to
    a joining one (the engine holds for that)."""
    d1, d2 = _rev("d1", "A1", 1, state="draining"), _rev("d2", "A1", 1, state="draining")
    d1.inflight, d2.inflight = 2, 1
    new = _rev("n", "A2", 2)
    pool = _pool(d1, d2, new)
    assert pool.pick(revision="A1") is None and pool.routable(revision="A1") == []
    assert pool.last_resort("A1") is d2  # the least in flight
    assert pool.last_resort("A1", exclude={"d2"}) is d1  # tried: never again
    assert pool.last_resort("A1", exclude={"d1", "d2"}) is None
    assert pool.last_resort("A2") is None  # A2 is routable: no other revision serves
    d2.inflight = 5
    assert pool.last_resort("A1") is d1
    # Not a release: no routable replica of another revision (it drains too, joins, or has
    # no known revision) -> nothing, as before the rule.
    for other in (_rev("n", "A2", 2, state="draining"), _rev("n", "A2", 2,
                                                                     state="joining"),
                  _rev("n", "A2", 2, incarnation=None), _rev("n", None, 0)):
        assert _pool(d1, d2, other).last_resort("A1") is None, other
    # Never one that cannot take it: dead, refused our protocol, not handshaken, joining, or
    # of another revision.
    dead = _rev("x", "A1", 1, state="draining")
    dead.alive = False
    for bad in (dead, _rev("x", "A1", 1, state="draining", refused="version 9"),
                _rev("x", "A1", 1, state="draining", incarnation=None),
                _rev("x", "A1", 1, state="joining"),
                _rev("x", "A0", 1, state="draining"),
                _rev("x", None, 1, state="draining")):
        assert _pool(bad, new).last_resort("A1") is None, bad
    # The hello's revision counts, as for routing.
    assert _pool(_rev("x", "A0", 1, said="A1", state="draining"), new
                 ).last_resort("A1").name == "x"


def test_stage_plan_per_finals_is_reused_and_matches_the_dag() -> None:
    pipe = load_pipeline(EXAMPLES / "text-to-image.yaml")
    orch = Orchestrator(pipe, StaticMembership([]))
    topo = orch.topo
    final = orch.final_stages
    order, needed = orch.planner.stage_plan(final)
    assert list(order) == [s for s in topo if s in needed]
    assert set(final) <= needed
    assert orch.planner.stage_plan(final) is orch.planner.stage_plan(tuple(final))  # cached
    first = topo[0]
    assert orch.planner.stage_plan((first,)) == ((first,), frozenset({first}))


def test_plan_refuses_a_stage_without_routable_replica() -> None:
    pipe = load_pipeline(EXAMPLES / "echo.yaml")
    orch = Orchestrator(pipe, StaticMembership([]))
    orch.accepting = True
    orch.pools["a"].replicas["a0"] = _replica("a", "a0")
    request = _Request("r", PipelineRequest(prompt="x"), [], [], set(), 0.0)
    error = orch._plan(request)
    assert error is not None and error.code == "no_replica" and error.stage == "b"
    orch.pools["b"].replicas["b0"] = _replica("b", "b0")
    request = _Request("r", PipelineRequest(prompt="x"), [], [], set(), 0.0)
    assert orch._plan(request) is None
    assert request.order == ["a", "b"] and request.finals == ["b"]
