"""The orchestrator's links to its replicas: joining (handshake), heartbeats, probation, loss.

A replica is routed to only once it answered the hello with our protocol version. Its identity
is (name, incarnation): a process restarted at the same address is a new incarnation, and the
work bound to the old one is lost with it. A replica that misses heartbeats is lost and goes on
probation: membership still lists it, so it is pinged on a fresh channel and re-admitted (as a
new binding) once it answers. What is bound to a lost or restarted replica is the engine's to
fail or fail over (fail_bound); replies for tasks go to the engine (on_reply).

With CurveZMQ, each channel names the server key of the replica's own key generation
(ReplicaInfo.curve_generation; the keyring's public-N). A replica whose generation's public key
is not in the key directory yet (the Secret's mount not refreshed) cannot be connected to: it
goes on probation as a replica that does not answer its hello does, without counting as lost
(it never joined), and the probe connects once the key is there.

Faults and retirements are counted apart: a replica that was retiring (Replica.retiring: the
membership said draining, or its process said it drains) and then exits or leaves the
membership counts in `replicas_retired`, not in `replicas_lost` or `replica_restarts`, so a
scale-down does not read as an outage. Its bound work is failed over all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import zmq.asyncio

from omnistage import protocol as p
from omnistage.client import ChannelClosed, ReplicaChannel
from omnistage.curve_keys import CurveKeyring
from omnistage.orchestrator.membership import ReplicaInfo
from omnistage.orchestrator.pools import Replica, StagePool
from omnistage.orchestrator.tasks import Reply
from omnistage.revision import base_revision
from omnistage.shm import SegmentManager

log = logging.getLogger("omnistage.orchestrator")

_seq = itertools.count(1)


class Replicas:
    def __init__(
        self,
        pools: dict[str, StagePool],
        counters: dict[str, float],
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        on_reply: Callable[[Replica, Reply], None],
        fail_bound: Callable[[Replica, str], None],
        routable: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        connect: Callable[..., ReplicaChannel] = ReplicaChannel,
        clock: Callable[[], float] = time.monotonic,
        curve: CurveKeyring | None = None,
    ) -> None:
        """on_reply: a task's reply; fail_bound: fails the tasks bound to a lost replica;
        routable: a replica of the stage may have become routable (or stopped being);
        spawn: runs a coroutine the orchestrator's stop() cancels; connect: opens a channel;
        curve: the pipeline's keys, for workers that require them (omnistage.curve)."""
        self.pools = pools
        self.counters = counters
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.on_reply = on_reply
        self.fail_bound = fail_bound
        self.routable = routable
        self.spawn = spawn
        self.connect = connect
        self.clock = clock
        self.curve = curve
        self._keyless: set[tuple[str, int | None]] = set()  # (replica, generation) said once
        self.suspects: dict[str, ReplicaInfo] = {}  # lost to heartbeats, still in membership
        self.zctx: zmq.asyncio.Context | None = None  # set by the orchestrator's start()
        self.shm: SegmentManager | None = None
        self.heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Once the membership named the replicas: wait (bounded) for the handshakes under
        way, so the first requests find them routable, then start the heartbeats."""
        pending = [r.handshake for pool in self.pools.values() for r in pool.replicas.values()
                   if r.handshake is not None and not r.handshake.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.heartbeat_timeout)
        self.heartbeat = asyncio.create_task(self._heartbeats())

    async def stop_heartbeats(self) -> None:
        hb, self.heartbeat = self.heartbeat, None
        if hb is not None:
            hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hb

    async def close(self) -> None:
        """Close every channel and forget every replica (at stop)."""
        self.suspects.clear()
        for pool in self.pools.values():
            for replica in list(pool.replicas.values()):
                await replica.channel.close()
            pool.replicas.clear()

    # ---- membership ------------------------------------------------------------------------

    def on_member(self, info: ReplicaInfo) -> None:
        pool = self.pools.get(info.stage)
        if pool is None:
            log.warning("ignoring replica %s of unknown stage %r", info.name, info.stage)
            return
        current = pool.replicas.get(info.name)
        suspect = self.suspects.get(info.name)
        if info.state == "gone":
            self.suspects.pop(info.name, None)
            if current is not None:
                self.lose(current, "replica left the membership")
            return
        if suspect is not None:
            if suspect.endpoint == info.endpoint:
                self.suspects[info.name] = info  # still on probation: it missed heartbeats
                return
            self.suspects.pop(info.name, None)  # a new instance replaces the silent one
        if current is not None and current.info.endpoint != info.endpoint:
            self.lose(current, f"replaced by a new instance at {info.endpoint}")
            current = None
        if current is not None:
            if current.info.state != info.state:
                log.info("replica %s: %s -> %s", info.name, current.info.state, info.state)
            current.info = info
            self.routable(info.stage)
            return
        keys = self._keys_for(info)
        if keys is None:  # its generation's key is not here yet: probed until it is
            self.suspects[info.name] = info
            self.spawn(self._probe(info))
            return
        replica = Replica(info)
        replica.channel = self.connect(
            info.endpoint, name=info.name, zctx=self.zctx,
            on_message=partial(self._on_message, replica),
            on_disconnect=partial(self._on_disconnect, replica), shm=self.shm, **keys,
        )
        pool.replicas[info.name] = replica
        replica.handshake = self.spawn(self._handshake(replica))
        log.info("replica %s of stage %s joined at %s (%s); handshake sent", info.name,
                 info.stage, info.endpoint, info.state)

    async def _handshake(self, replica: Replica) -> None:
        """Route to a replica only once it answered the hello with our protocol version."""
        try:
            hello = await replica.channel.handshake(self.heartbeat_timeout)
        except p.VersionMismatch as exc:
            replica.refused = str(exc)
            log.error("not routing to replica %s: %s", replica.name, exc)
            return
        except TimeoutError:
            self.lose(replica, f"no hello reply within {self.heartbeat_timeout:.1f}s",
                      probation=True)
            return
        except ChannelClosed:
            return
        replica.last_seen = self.clock()
        replica.incarnation = hello.incarnation
        self._said_revision(replica, hello.revision)
        log.info("replica %s: handshake done (protocol %d, incarnation %s)", replica.name,
                 hello.version, hello.incarnation)
        self.routable(replica.info.stage)

    def _on_message(self, replica: Replica, msg: Reply) -> None:
        replica.last_seen = self.clock()
        h = msg.header
        if isinstance(h, p.Pong):
            return self._on_pong(replica, h)
        if isinstance(h, p.Draining):  # its process retires: its end is planned
            replica.said_draining = True
        if isinstance(h, p.HelloReply) or (isinstance(h, p.Error) and h.id is None
                                           and h.cid is None):
            return self._on_hello(replica, h)
        self.on_reply(replica, msg)

    # Three signs that the process behind a replica is gone, the first one seen wins: the
    # connection closes (at once, from the socket monitor), a pong or hello_reply names another
    # incarnation, or the worker refuses a submit meant for the old one (stale_incarnation:
    # stale()). The replica is routed to again once the new process has answered a hello.

    def _on_disconnect(self, replica: Replica) -> None:
        if replica.alive and replica.incarnation is not None:
            self.restarted(replica, f"connection closed: incarnation {replica.incarnation} "
                                    "is gone")

    def stale(self, replica: Replica, incarnation: str | None) -> None:
        """The replica refused a task sent to `incarnation` as stale: if that is still the one
        we know, the process restarted (the task's own fate is the engine's)."""
        if replica.incarnation == incarnation:
            self.restarted(replica, "refused a request for its previous incarnation")
            replica.channel.hello()

    def _on_pong(self, replica: Replica, pong: p.Pong) -> None:
        new = pong.state.incarnation
        if replica.incarnation is not None and new != replica.incarnation:
            self.restarted(replica, f"restarted: incarnation {replica.incarnation} -> {new}")
            replica.channel.hello()
        elif pong.state.draining:
            replica.said_draining = True

    def _on_hello(self, replica: Replica, hello: p.HelloReply | p.Error) -> None:
        """A handshake after a reconnect: the new process may be routed to."""
        if not replica.alive:
            return
        if isinstance(hello, p.Error) or hello.version != p.PROTOCOL_VERSION:
            why = (f"{hello.code}: {hello.message}" if isinstance(hello, p.Error)
                   else f"it speaks protocol version {hello.version}")
            replica.refused = f"replica {replica.name} refused the handshake after a restart: {why}"
            log.error("not routing to replica %s: %s", replica.name, replica.refused)
            if replica.incarnation is not None:
                self.restarted(replica, "restarted with another protocol version")
            return
        if replica.incarnation is not None and hello.incarnation != replica.incarnation:
            self.restarted(replica, f"restarted: incarnation {replica.incarnation} -> "
                                    f"{hello.incarnation}")
        if replica.incarnation is None:
            replica.incarnation = hello.incarnation
            replica.said_draining = False  # a new process: it said nothing yet
            self._said_revision(replica, hello.revision)
            replica.refused = ""
            log.info("replica %s: handshake done (incarnation %s); routable again",
                     replica.name, hello.incarnation)
            self.routable(replica.info.stage)

    def _said_revision(self, replica: Replica, revision: str | None) -> None:
        """Record the revision a replica's hello named: what it checks submits against, so
        what routing goes by. A membership label that disagrees is logged (the label lies)."""
        label = replica.info.revision
        # A worker appends the commit its hub model resolved to: not a disagreement.
        if revision is not None and label is not None and base_revision(revision) != label:
            log.warning("replica %s says it is revision %s but its membership says %s; "
                        "routing by what it says", replica.name, revision, label)
        replica.said_revision = revision

    # ---- loss ------------------------------------------------------------------------------

    def restarted(self, replica: Replica, reason: str) -> None:
        """The process behind a replica is gone: fail the work bound to it at once and route
        nothing more to the replica until the next process answers a hello. A retiring
        replica's process ending is its planned end, not a restart (its leaving the
        membership is counted, in lose())."""
        if replica.retiring:
            log.info("replica %s: %s after its drain; %d bound tasks go elsewhere",
                     replica.name, reason, len(replica.bound))
        else:
            self.counters["replica_restarts"] += 1
            log.warning("replica %s: %s; failing %d bound tasks", replica.name, reason,
                        len(replica.bound))
        replica.incarnation = None
        self.fail_bound(replica, reason)

    def lose(self, replica: Replica, reason: str, *, probation: bool = False) -> None:
        """Remove a replica from routing and fail exactly the tasks bound to it; one lost to
        missed heartbeats goes on probation (see the module's docstring)."""
        if not replica.alive:
            return
        if probation:
            self.suspects[replica.name] = replica.info
            self.spawn(self._probe(replica.info))
        replica.alive = False
        self.pools[replica.info.stage].remove(replica.name)
        if replica.retiring:
            self.counters["replicas_retired"] += 1
            log.info("replica %s retired (%s): %d bound tasks go elsewhere", replica.name,
                     reason, len(replica.bound))
        else:
            self.counters["replicas_lost"] += 1
            log.warning("replica %s lost (%s): failing %d bound tasks", replica.name, reason,
                        len(replica.bound))
        self.fail_bound(replica, reason)
        self.spawn(replica.channel.close())

    def _keys_for(self, info: ReplicaInfo) -> dict[str, Any] | None:
        """The CurveZMQ arguments of a channel to this replica: none without keys; None while
        its generation's public key is not in the key directory (said once per replica and
        generation)."""
        if self.curve is None:
            return {}
        server_key = self.curve.server_key(info.curve_generation)
        if server_key is not None:
            self._keyless.discard((info.name, info.curve_generation))
            return {"curve": self.curve.own, "server_key": server_key}
        if (info.name, info.curve_generation) not in self._keyless:
            if len(self._keyless) >= 1024:
                self._keyless.clear()
            self._keyless.add((info.name, info.curve_generation))
            log.warning("replica %s of stage %s holds CurveZMQ key generation %s, whose public "
                        "key is not in %s yet (the Secret's mount not refreshed?): connecting "
                        "once it is", info.name, info.stage, info.curve_generation,
                        self.curve.directory)
        return None

    async def _probe(self, info: ReplicaInfo) -> None:
        """Ping a suspect on a fresh channel until it answers, then re-admit it. The channel
        opens once the replica's generation's key is there (and again for a new address)."""
        target, keys = info, self._keys_for(info)
        channel = None if keys is None else self.connect(
            info.endpoint, name=f"probe-{info.name}", zctx=self.zctx, **keys)
        try:
            while (current := self.suspects.get(info.name)) is not None:
                if channel is None or (target.endpoint, target.curve_generation) != (
                        current.endpoint, current.curve_generation):
                    if channel is not None:
                        await channel.close()
                        channel = None
                    target, keys = current, self._keys_for(current)
                    if keys is None:
                        await asyncio.sleep(self.heartbeat_interval)
                        continue
                    channel = self.connect(current.endpoint, name=f"probe-{info.name}",
                                           zctx=self.zctx, **keys)
                try:
                    await channel.ping(timeout=self.heartbeat_timeout)
                except (TimeoutError, ConnectionError):
                    await asyncio.sleep(self.heartbeat_interval)
                    continue
                current = self.suspects.pop(info.name, None)
                if current is not None:
                    log.info("replica %s answers again: re-admitted", info.name)
                    self.on_member(current)
                return
        finally:
            if channel is not None:
                await channel.close()

    async def _heartbeats(self) -> None:
        """Ping every replica each interval; one silent for heartbeat_timeout is lost."""
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = self.clock()
            for pool in self.pools.values():
                for replica in list(pool.replicas.values()):
                    if replica.refused:  # never routed to; membership decides when it goes
                        continue
                    if now - replica.last_seen > self.heartbeat_timeout:
                        self.lose(replica, f"no heartbeat for {now - replica.last_seen:.1f}s",
                                  probation=True)
                        continue
                    with contextlib.suppress(Exception):
                        replica.channel.send(p.Ping(cid=f"hb-{next(_seq)}"))

    # ---- control and status ----------------------------------------------------------------

    async def control(self, op: str, stages: list[str] | None, timeout: float
                      ) -> dict[str, dict[str, Any]]:
        """Fan a control RPC out to every live replica of the chosen stages.

        Unknown ops and stage names are rejected before anything is sent; a worker exception
        is raised here (ControlError) after every replica has answered.
        """
        if op not in p.PIPELINE_CONTROL_OPS:
            raise ValueError(f"op: unknown control op {op!r}; "
                             f"expected one of {list(p.PIPELINE_CONTROL_OPS)}")
        names = list(stages) if stages else list(self.pools)
        unknown = [s for s in names if s not in self.pools]
        if unknown:
            raise ValueError(f"stages: unknown stage(s) {unknown}; pipeline has {list(self.pools)}")
        replicas = [r for s in names for r in self.pools[s].replicas.values() if r.alive]
        results = await asyncio.gather(
            *(r.channel.control(op, timeout) for r in replicas), return_exceptions=True
        )
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return {r.name: res for r, res in zip(replicas, results, strict=True)}  # type: ignore[misc]

    def status(self) -> dict[str, Any]:
        return {
            stage: [
                {"name": r.name, "endpoint": r.info.endpoint, "state": r.info.state,
                 "inflight": r.inflight, "served": r.served, "incarnation": r.incarnation,
                 "refused": r.refused}
                for r in pool.replicas.values()
            ]
            for stage, pool in self.pools.items()
        }
