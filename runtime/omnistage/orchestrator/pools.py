"""Replica pools and replica selection: least in-flight by power-of-two choices, plus affinity.

A request task is bound to the replica that took it; follow-ups (abort) go there. A session key
pins a session to one replica per stage for as long as that replica stays routable. A request
pinned to a stage revision is routed only to replicas of that revision (`revision`; None: any),
and to replicas whose revision nobody knows (a worker older than revisions checks nothing, so
an upgrade of the runtime never leaves a stage without capacity). A task pinned to a revision
that has no routable replica left while another revision serves (a release or a revert moves
the stage away from it) goes, as a last resort, to a draining replica of its revision
(`last_resort`): such a replica still finishes work until SIGTERM, and the operator keeps the
last one of a leaving revision until no request is pinned to it (GET /v1/load `pinned`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omnistage.orchestrator.membership import ReplicaInfo


@dataclass(eq=False)
class Replica:
    info: ReplicaInfo
    channel: Any = None  # omnistage.client.ReplicaChannel
    inflight: int = 0
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    bound: set[Any] = field(default_factory=set)  # tasks currently on this replica
    served: int = 0
    handshake: Any = None  # the asyncio.Task awaiting the hello reply
    incarnation: str | None = None  # from the hello reply: the process that answers
    refused: str = ""  # why the handshake failed (another protocol version)
    said_revision: str | None = None  # the revision its hello reply named (None: not said)
    said_draining: bool = False  # its process said it drains (a pong, a `draining` reply)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def revision(self) -> str | None:
        """Its stage revision: what the worker said in its hello (what it checks submits
        against), else what the membership knows (the pod's label); None when neither knows."""
        return self.said_revision or self.info.revision

    @property
    def retiring(self) -> bool:
        """On its way out by plan: the membership says draining (a scale-down, a rollout, a
        drain mark, a terminating pod) or its process said it drains. Its process ending, or
        its leaving the membership, is then a retirement, not a fault (replicas.py counts them
        apart)."""
        return self.info.state == "draining" or self.said_draining

    @property
    def routable(self) -> bool:
        """Alive, ready in the membership, and it accepted our protocol version."""
        return self.alive and self.info.routable and self.incarnation is not None


def serves(replica: Replica, revision: str | None) -> bool:
    """Whether a replica may take a task pinned to `revision` (None: any): one of that
    revision, or one whose revision is unknown (it checks nothing)."""
    return revision is None or replica.revision is None or replica.revision == revision


class StagePool:
    def __init__(self, stage: str, *, rng: random.Random | None = None) -> None:
        self.stage = stage
        self.replicas: dict[str, Replica] = {}
        self.sessions: dict[str, str] = {}
        self._rng = rng or random.Random()

    def routable(self, exclude: Iterable[str] = (), revision: str | None = None
                 ) -> list[Replica]:
        """Routable replicas, less those named in exclude, of `revision` when one is given."""
        if not exclude and revision is None:  # the common case: no set to build
            return [r for r in self.replicas.values() if r.routable]
        skip = set(exclude)
        return [r for r in self.replicas.values() if r.routable and r.name not in skip
                and serves(r, revision)]

    def coming(self, revision: str) -> bool:
        """Whether a replica of `revision` that cannot take a task yet is on its way (joining,
        or ready but not handshaken): a task pinned to it waits for it instead of failing."""
        return any(r.alive and not r.refused and not r.routable and r.revision == revision
                   and r.info.state in ("joining", "ready") for r in self.replicas.values())

    def last_resort(self, revision: str, exclude: Iterable[str] = ()) -> Replica | None:
        """A draining replica of `revision` (alive, handshaken, not refused, not in exclude;
        the least in flight) for a task pinned to it when no routable replica of it is left,
        but only while the stage has a routable replica of another revision: a release or a
        revert is moving the stage off `revision`, and the operator keeps that revision's last
        replica while requests are pinned to it. Otherwise None (outside a release a draining
        replica takes no new task, as before)."""
        if not any(r.routable and r.revision is not None and r.revision != revision
                   for r in self.replicas.values()):
            return None
        skip = set(exclude)
        candidates = [r for r in self.replicas.values()
                      if r.alive and r.incarnation is not None and not r.refused
                      and r.info.state == "draining" and r.revision == revision
                      and r.name not in skip]
        return min(candidates, key=lambda r: (r.inflight, r.name), default=None)

    def has_routable(self, revision: str | None = None) -> bool:
        """Whether any replica (of `revision`, when given) can take a task (admission and
        readiness ask this)."""
        return any(r.routable and serves(r, revision) for r in self.replicas.values())

    def pick(self, session: str | None = None, exclude: Iterable[str] = (),
             revision: str | None = None) -> Replica | None:
        """Choose a replica for a new task (of `revision` when given), or None when the stage
        has no such routable replica."""
        candidates = self.routable(exclude, revision)
        if not candidates:
            return None
        if session is not None:
            pinned = self.replicas.get(self.sessions.get(session, ""))
            if pinned is not None and pinned in candidates:
                return pinned
        if len(candidates) == 1:
            choice = candidates[0]
        else:
            a, b = self._rng.sample(candidates, 2)
            choice = a if a.inflight <= b.inflight else b
        if session is not None:
            self.sessions[session] = choice.name
        return choice

    def remove(self, name: str) -> Replica | None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self.sessions = {k: v for k, v in self.sessions.items() if v != name}
        return replica
