"""bench/bench_failover.py's kill rounds without processes: a fake fleet whose replicas come back
only when the test says so. The rule the bench's "kills" goal relies on: a round kills one
routable replica of each stage, never the last routable one, and waits (without skipping the
round) until a killed replica is back."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> Any:
    sys.path.insert(0, str(BENCH))  # the benches import each other by bare name
    try:
        return importlib.import_module("bench_failover")
    finally:
        sys.path.remove(str(BENCH))


class FakeFleet:
    """Replicas by stage; a killed one is down until `back` is called."""

    def __init__(self, stages: dict[str, int]) -> None:
        self.up = {s: {f"{s}-{i}" for i in range(n)} for s, n in stages.items()}
        self.killed: list[str] = []
        self.changed = asyncio.Event()

    async def kills(self, n: int) -> None:
        while len(self.killed) < n:
            self.changed.clear()
            await self.changed.wait()

    def routable(self, stage: str) -> dict[str, int]:
        return {name: 1000 + i for i, name in enumerate(sorted(self.up[stage]))}

    def kill(self, name: str, pid: int) -> None:
        self.up[name.rsplit("-", 1)[0]].discard(name)
        self.killed.append(name)
        self.changed.set()

    def back(self, name: str) -> None:
        self.up[name.rsplit("-", 1)[0]].add(name)


def test_rounds_never_kill_the_last_routable_replica_and_wait_for_one_back(bench: Any) -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        fleet = FakeFleet({"a": 3, "b": 2})
        phase = bench.Phase("plain")
        done = asyncio.Event()
        task = asyncio.ensure_future(bench.killer(phase, fleet, ["a", "b"], 10, 3, done))
        phase.total = 10
        await asyncio.wait_for(fleet.kills(2), 5)  # round 1: one of each stage
        phase.total = 30  # rounds 2 and 3 are due, but b has one replica left
        await asyncio.sleep(0.5)
        stalled = list(fleet.killed)
        fleet.back(fleet.killed[1])  # b's victim is back: round 2 goes on
        await asyncio.wait_for(fleet.kills(4), 5)
        for name in fleet.killed:
            fleet.back(name)
        await asyncio.wait_for(task, 5)
        return stalled, fleet.killed

    stalled, killed = asyncio.run(scenario())
    # Round 2 killed a's second victim, then waited on b (one routable) instead of killing it.
    assert [n[0] for n in stalled] == ["a", "b", "a"]
    assert [n[0] for n in killed] == ["a", "b"] * 3
    assert killed[0] != killed[2]  # a's first victim was still down at round 2


def test_the_phase_ending_stops_a_waiting_round(bench: Any) -> None:
    async def scenario() -> list[str]:
        fleet = FakeFleet({"a": 1})
        phase = bench.Phase("plain")
        phase.total = 100
        done = asyncio.Event()
        task = asyncio.ensure_future(bench.killer(phase, fleet, ["a"], 10, 5, done))
        await asyncio.sleep(0.3)
        done.set()
        await asyncio.wait_for(task, 5)
        return fleet.killed

    assert asyncio.run(scenario()) == []  # one replica: never killed, and the bench ends


@pytest.mark.parametrize("streamed", [False, True])
def test_the_phases_have_a_dispatch_window_unless_turned_off(bench: Any, streamed: bool) -> None:
    """Each stage's window is what its worker runs at once plus one (echo: serial; ar: its
    maxBatchSize); --no-window leaves the default (none). Both manifests are valid."""
    from omnistage.spec import parse_pipeline

    on = parse_pipeline(bench.manifest("p", streamed, 8)).spec.stages
    off = parse_pipeline(bench.manifest("p", streamed, 8, window=False)).spec.stages
    for stage in on:
        runs = stage.engine.max_batch_size if stage.kind == "ar" else 1
        assert stage.dispatch.per_replica == runs + 1
    assert [s.dispatch.per_replica for s in off] == [None] * len(off)
