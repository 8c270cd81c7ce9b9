"""Replica pools and replica selection: least in-flight by power-of-two choices, plus affinity.

A request task is bound to the replica that took it; follow-ups (abort) go there. A session key
pins a session to one replica per stage for as long as that replica stays routable.
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

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def routable(self) -> bool:
        """Alive, ready in the membership, and it accepted our protocol version."""
        return self.alive and self.info.routable and self.incarnation is not None


class StagePool:
    def __init__(self, stage: str, *, rng: random.Random | None = None) -> None:
        self.stage = stage
        self.replicas: dict[str, Replica] = {}
        self.sessions: dict[str, str] = {}
        self._rng = rng or random.Random()

    def routable(self, exclude: Iterable[str] = ()) -> list[Replica]:
        skip = set(exclude)
        return [r for r in self.replicas.values() if r.routable and r.name not in skip]

    def pick(self, session: str | None = None, exclude: Iterable[str] = ()) -> Replica | None:
        """Choose a replica for a new task, or None when the stage has no routable replica."""
        candidates = self.routable(exclude)
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
