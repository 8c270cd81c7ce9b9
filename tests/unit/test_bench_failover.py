"""bench/bench_failover.py's kill rounds without processes: a fake fleet whose replicas come back
only when the test says so. The rules the bench's goals rely on: kills do not pile up (a round
strikes a stage only while fewer than a quarter of its replicas, at least one, are earlier
victims not back yet, and never the last routable replica), a round waits rather than skip,
the victim is one killed the fewest times, and a victim is back only once the orchestrator's
log shows it ready and handshaken again."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.harness.benches import bench_module


@pytest.fixture(scope="module")
def bench() -> Any:
    return bench_module("bench_failover")


class FakeFleet:
    """Replicas by stage; a killed one is down until `back` is called."""

    def __init__(self, stages: dict[str, int]) -> None:
        self.replicas = {s: [f"{s}-{i}" for i in range(n)] for s, n in stages.items()}
        self.down: set[str] = set()
        self.killed: list[str] = []
        self.changed = asyncio.Event()

    async def kills(self, n: int) -> None:
        while len(self.killed) < n:
            self.changed.clear()
            await self.changed.wait()

    def state(self, stage: str) -> tuple[dict[str, int], int]:
        names = self.replicas[stage]
        return ({n: 1000 + i for i, n in enumerate(names) if n not in self.down},
                sum(n in self.down for n in names))

    def kill(self, stage: str, name: str, pid: int) -> None:
        assert name in self.replicas[stage] and name not in self.down
        self.down.add(name)
        self.killed.append(name)
        self.changed.set()

    def back(self, name: str) -> None:
        self.down.discard(name)


async def _settle(phase: Any) -> None:
    """Until the killer has held off twice more from here: it looked at the state as it is now
    and chose not to strike (a sleep would pass on a machine too slow to have looked at all)."""
    target = phase.holds + 2
    for _ in range(1000):  # a far guard (10 s) against a killer that died
        if phase.holds >= target:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the killer never held off twice (holds {phase.holds})")


@pytest.mark.parametrize(("replicas", "down", "may"), [
    (8, 0, True), (8, 1, True), (8, 2, False), (6, 1, True), (6, 2, False),
    (4, 0, True), (4, 1, False), (2, 0, True), (2, 1, False), (1, 0, True),
])
def test_a_stage_is_struck_while_fewer_than_a_quarter_at_least_one_are_down(
        bench: Any, replicas: int, down: int, may: bool) -> None:
    assert bench.may_strike(replicas, down) is may


def test_the_victim_is_one_killed_the_fewest_times(bench: Any) -> None:
    kills = Counter({"a-0": 2, "a-1": 1, "a-2": 1, "a-3": 0})
    picks = {bench.victim(["a-0", "a-1", "a-2"], kills, random.Random(seed))
             for seed in range(40)}
    assert picks == {"a-1", "a-2"}  # a-3 is down; a-0 was struck more often
    assert bench.victim(["a-0", "a-3"], kills) == "a-3"


JOINED = "replica p-llm-1 of stage llm joined at ipc:///t/1.1.sock (ready); handshake sent\n"
SHAKE = "replica p-llm-1: handshake done (protocol 3, incarnation ab)\n"
REJOINED = "replica p-llm-1: handshake done (incarnation cd); routable again\n"


def test_a_victim_is_back_once_ready_and_handshaken_again(bench: Any) -> None:
    start = JOINED + SHAKE
    at_kill = bench.ready_signs(start, "p-llm-1")
    assert at_kill == (1, 1)
    # omnistage serve: the restarted replica joins ready, then shakes hands.
    assert not bench.back(bench.ready_signs(start + JOINED, "p-llm-1"), at_kill)
    assert bench.back(bench.ready_signs(start + JOINED + SHAKE, "p-llm-1"), at_kill)
    # The cluster: the pod leaves Ready, the new process shakes hands before its model is
    # loaded, and only then the pod is Ready again.
    cluster = start + "replica p-llm-1: ready -> joining\n" + REJOINED
    assert not bench.back(bench.ready_signs(cluster, "p-llm-1"), at_kill)
    cluster += "replica p-llm-1: joining -> ready\n"
    assert bench.back(bench.ready_signs(cluster, "p-llm-1"), at_kill)
    # Another replica's lines (p-llm-10) are not this one's.
    other = start + JOINED.replace("-1 ", "-10 ") + SHAKE.replace("-1:", "-10:")
    assert not bench.back(bench.ready_signs(other, "p-llm-1"), at_kill)


def test_the_fleet_reads_its_victims_back_from_the_log(bench: Any, tmp_path: Path) -> None:
    log = tmp_path / "orchestrator.log"
    log.write_text(JOINED + SHAKE)

    class Local(bench.Fleet):  # type: ignore[name-defined,misc]
        def pids(self, stage: str) -> dict[str, int]:
            return {"p-llm-0": 10, "p-llm-1": 11}

    fleet = Local("p", log)
    fleet.out["llm"] = {"p-llm-1": bench.ready_signs(log.read_text(), "p-llm-1")}
    assert fleet.state("llm") == ({"p-llm-0": 10}, 1)  # its old process's pid is no sign
    log.write_text(JOINED + SHAKE + "replica p-llm-1: ready -> joining\n" + REJOINED)
    assert fleet.state("llm") == ({"p-llm-0": 10}, 1)
    log.write_text(log.read_text() + "replica p-llm-1: joining -> ready\n")
    assert fleet.state("llm") == ({"p-llm-0": 10, "p-llm-1": 11}, 0)


def test_kills_never_pile_up_and_a_round_waits_for_a_victim_back(bench: Any) -> None:
    async def scenario() -> tuple[list[int], list[str]]:
        fleet = FakeFleet({"a": 4, "llm": 8})
        phase = bench.Phase("plain")
        done = asyncio.Event()
        task = asyncio.ensure_future(bench.killer(phase, fleet, {"a": 4, "llm": 8}, 10, 4, done))
        counts = []

        async def then(n: int) -> None:  # wait for n kills, then see that no more come
            await asyncio.wait_for(fleet.kills(n), 5)
            await _settle(phase)
            counts.append(len(fleet.killed))

        phase.total = 10
        await then(2)  # round 1: one of each stage
        phase.total = 40  # rounds 2-4 are due, but a has its victim down (a quarter of 4)
        await _settle(phase)
        counts.append(len(fleet.killed))
        fleet.back(fleet.killed[0])
        await then(4)  # round 2: a, and llm (1 of 8 down); round 3 waits on a
        fleet.back(fleet.killed[2])
        await then(5)  # round 3: a; llm has 2 of 8 down, so it waits
        fleet.back(fleet.killed[1])
        await then(6)  # llm's first victim is back: round 3 strikes it
        fleet.back(fleet.killed[4])
        await then(7)  # round 4: a; llm waits again (rounds 2 and 3's victims)
        fleet.back(fleet.killed[3])
        await asyncio.wait_for(task, 5)
        return counts, fleet.killed

    counts, killed = asyncio.run(scenario())
    assert counts == [2, 2, 4, 5, 6, 7]
    assert [n.split("-")[0] for n in killed] == ["a", "llm"] * 4
    # Each victim is one killed the fewest times: nobody twice while another was never hit.
    assert len(set(killed[0::2])) == 4 and len(set(killed[1::2])) == 4


def test_overlap_kills_is_the_old_rule_kills_pile_up(bench: Any) -> None:
    async def scenario() -> list[str]:
        fleet = FakeFleet({"a": 4})
        phase = bench.Phase("plain")
        phase.total = 100
        done = asyncio.Event()
        task = asyncio.ensure_future(bench.killer(phase, fleet, {"a": 4}, 10, 5, done,
                                                  overlap=True))
        await asyncio.wait_for(fleet.kills(3), 5)  # nothing came back: 3 of 4 down
        await _settle(phase)
        done.set()
        await asyncio.wait_for(task, 5)
        return fleet.killed

    assert len(asyncio.run(scenario())) == 3  # never the last routable one


def test_the_phase_ending_stops_a_waiting_round(bench: Any) -> None:
    async def scenario() -> list[str]:
        fleet = FakeFleet({"a": 1})
        phase = bench.Phase("plain")
        phase.total = 100
        done = asyncio.Event()
        task = asyncio.ensure_future(bench.killer(phase, fleet, {"a": 1}, 10, 5, done))
        await _settle(phase)  # the round is due and waits for a victim
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
