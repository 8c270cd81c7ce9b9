"""Exponential backoff, written once: the controller's per-key retries, the API client's watch
retries, the orchestrator's first Pod list, the local runtime's restarts, the shared-memory
reaper's sweeps and the operator's Lease retries all take their waits from `delay`.

Jitter only stretches a wait (never shortens it), so a caller that documents "at least `base`
seconds" keeps that promise; a jittered wait lies in [d, d * (1 + jitter)] where
d = min(cap, base * 2 ** attempt).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

#: Doubling past this many attempts cannot matter (2**64 times any base is past any cap), and
#: a float power of a very large attempt would overflow.
_MAX_DOUBLINGS = 64


def delay(attempt: int, base: float, cap: float, jitter: float = 0.0,
          rand: Callable[[], float] = random.random) -> float:
    """The wait before retry number `attempt` (0 = the first retry): `base` doubled per
    attempt, at most `cap`, then stretched by up to `jitter` of itself (`rand` in [0, 1))."""
    if base < 0 or cap < base:
        raise ValueError(f"backoff needs 0 <= base <= cap, got base={base} cap={cap}")
    if jitter < 0:
        raise ValueError(f"backoff jitter must be >= 0, got {jitter}")
    wait = min(cap, base * 2.0 ** min(max(0, attempt), _MAX_DOUBLINGS))
    return wait * (1.0 + jitter * rand()) if jitter else wait


def delays(base: float, cap: float, jitter: float = 0.0) -> Iterator[float]:
    """Successive waits for a loop that retries until it stops by itself."""
    attempt = 0
    while True:
        yield delay(attempt, base, cap, jitter)
        attempt += 1


@dataclass
class Backoff:
    """Failure counts per key (one key, None, for a single loop): each failure returns the next
    wait, a success resets the key so its next failure starts again at `base`."""

    base: float
    cap: float
    jitter: float = 0.0
    rand: Callable[[], float] = random.random
    _failures: dict[Hashable, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        delay(0, self.base, self.cap, self.jitter)  # refuse a bad policy at construction

    def failed(self, key: Hashable = None) -> float:
        """Count one more failure of `key`; the wait before its retry."""
        attempt = self._failures.get(key, 0)
        self._failures[key] = attempt + 1
        return delay(attempt, self.base, self.cap, self.jitter, self.rand)

    def failures(self, key: Hashable = None) -> int:
        """Failures of `key` in a row (0 after a success)."""
        return self._failures.get(key, 0)

    def reset(self, key: Hashable = None) -> None:
        """A success: the next failure of `key` waits `base` again."""
        self._failures.pop(key, None)
