"""The orchestrator's side of a key rotation (orchestrator/replicas.py): each replica's channel
names the server key of the replica's key generation; a replica whose generation's public key
is not in the key directory yet is not connected, is not counted lost, is said once, and is
connected by its probe once the key is there. The channels are fakes that record what they
were opened with; the keyring is a real one over a temporary directory with a fake clock."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from omnistage import curve_keys as ck
from omnistage import protocol as p
from omnistage.orchestrator.membership import ReplicaInfo
from omnistage.orchestrator.pools import StagePool
from omnistage.orchestrator.replicas import Replicas
from tests.harness.waiting import until


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Link:
    """What Replicas uses of a ReplicaChannel; answers its hello and pings at once."""

    def __init__(self, opened: list[Link], endpoint: str, **kw: Any) -> None:
        self.endpoint, self.kw, self.name = endpoint, kw, kw["name"]
        self.closed = False
        opened.append(self)

    async def handshake(self, timeout: float | None = None) -> p.HelloReply:
        return p.HelloReply(version=p.PROTOCOL_VERSION, replica=self.name, stage="a",
                            kind="echo", incarnation=f"inc-{self.name}")

    async def ping(self, timeout: float = 2.0) -> None:
        return None

    def send(self, *_: Any) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, ck.CurveKeys, ck.CurveKeys]:
    zero, one = ck.generate(), ck.generate()
    d = ck.write(zero, tmp_path / "curve")
    ck.write(one, d, generation=1)
    return d, zero, one


def rig(ring: ck.CurveKeyring | None) -> tuple[Replicas, list[Link], set[asyncio.Task[None]]]:
    opened: list[Link] = []
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Any) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        return task

    replicas = Replicas(
        {"a": StagePool("a")}, defaultdict(float), heartbeat_interval=0.01,
        heartbeat_timeout=1.0, on_reply=lambda *_: None, fail_bound=lambda *_: None,
        routable=lambda _stage: None, spawn=spawn,
        connect=lambda endpoint, **kw: Link(opened, endpoint, **kw), curve=ring)
    return replicas, opened, tasks


async def test_each_channel_names_its_replicas_generation(keys) -> None:
    d, zero, one = keys
    ring = ck.CurveKeyring(d, 1, clock=Clock())
    replicas, opened, tasks = rig(ring)
    replicas.on_member(ReplicaInfo("a", "a-0", "tcp://a0", curve_generation=0))
    replicas.on_member(ReplicaInfo("a", "a-1", "tcp://a1", curve_generation=1))
    replicas.on_member(ReplicaInfo("a", "a-2", "tcp://a2"))  # static: our own generation
    await asyncio.gather(*tasks)
    assert {ln.name: ln.kw["server_key"] for ln in opened} == {
        "a-0": zero.public, "a-1": one.public, "a-2": one.public}
    assert all(ln.kw["curve"] == one for ln in opened)  # our own pair, for every channel
    assert all(r.routable for r in replicas.pools["a"].replicas.values())


async def test_without_keys_a_channel_gets_no_curve_arguments() -> None:
    replicas, opened, tasks = rig(None)
    replicas.on_member(ReplicaInfo("a", "a-0", "tcp://a0", curve_generation=3))
    await asyncio.gather(*tasks)
    assert "curve" not in opened[0].kw and "server_key" not in opened[0].kw


async def test_a_generation_not_in_the_directory_yet_is_connected_once_it_is(
        keys, caplog: pytest.LogCaptureFixture) -> None:
    d, _zero, _one = keys
    clock = Clock()
    ring = ck.CurveKeyring(d, 1, clock=clock)
    replicas, opened, tasks = rig(ring)
    caplog.set_level(logging.WARNING, logger="omnistage.orchestrator")
    info = ReplicaInfo("a", "a-2", "tcp://a2", state="joining", curve_generation=2)
    try:
        replicas.on_member(info)
        assert "a-2" not in replicas.pools["a"].replicas and opened == []
        assert replicas.suspects == {"a-2": info}
        assert replicas.counters["replicas_lost"] == 0  # it never joined
        ready = ReplicaInfo("a", "a-2", "tcp://a2", curve_generation=2)
        replicas.on_member(ready)  # a later event: still waiting, now as ready
        assert replicas.suspects == {"a-2": ready}
        await asyncio.sleep(0.05)  # the probe looks (at the key directory) a few times
        assert opened == []
        said = [r for r in caplog.records if "generation 2" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        two = ck.generate()
        ck.write(two, d, generation=2)  # the kubelet refreshed the mount
        clock.now += ck.RELOAD_S
        await until(lambda: "a-2" in replicas.pools["a"].replicas, "a-2 connected", timeout=10)
        await until(lambda: replicas.pools["a"].replicas["a-2"].routable, "a-2 handshaken",
                    timeout=10)
        probe, channel = opened
        assert probe.name == "probe-a-2" and probe.kw["server_key"] == two.public
        assert channel.name == "a-2" and channel.kw["server_key"] == two.public
        await until(lambda: probe.closed, "the probe channel closed", timeout=10)
        assert replicas.suspects == {} and replicas.counters["replicas_lost"] == 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_waiting_replica_that_leaves_is_forgotten(keys) -> None:
    d, _zero, _one = keys
    ring = ck.CurveKeyring(d, 0, clock=Clock())
    replicas, opened, tasks = rig(ring)
    replicas.on_member(ReplicaInfo("a", "a-5", "tcp://a5", curve_generation=5))
    assert "a-5" in replicas.suspects
    replicas.on_member(ReplicaInfo("a", "a-5", "tcp://a5", state="gone", curve_generation=5))
    assert replicas.suspects == {}
    await asyncio.wait_for(asyncio.gather(*tasks), 10)  # the probe ends by itself
    assert opened == []
