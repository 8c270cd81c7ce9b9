"""Replica selection and the per-request stage plan: the orchestrator's hot path.

Both were made cheaper per request (no set built when nothing is excluded, the DAG walk done
once per distinct `finals`); these tests pin the answers, which must not change.
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


def test_stage_plan_per_finals_is_reused_and_matches_the_dag() -> None:
    pipe = load_pipeline(EXAMPLES / "text-to-image.yaml")
    orch = Orchestrator(pipe, StaticMembership([]))
    topo = orch.topo
    final = orch.final_stages
    order, needed = orch._stage_plan(final)
    assert list(order) == [s for s in topo if s in needed]
    assert set(final) <= needed
    assert orch._stage_plan(final) is orch._stage_plan(tuple(final))  # cached
    first = topo[0]
    assert orch._stage_plan((first,)) == ((first,), frozenset({first}))


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
