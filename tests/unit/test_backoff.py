"""The one backoff (omnistage.backoff): growth, cap, jitter bounds, per-key reset, and the
callers that promise a documented schedule."""

from __future__ import annotations

import itertools

import pytest

from omnistage import backoff
from omnistage.backoff import Backoff
from omnistage.local_runtime import RestartPolicy


def test_delay_doubles_from_base_up_to_the_cap() -> None:
    assert [backoff.delay(a, 0.5, 15.0) for a in range(7)] == [0.5, 1, 2, 4, 8, 15, 15]
    assert backoff.delay(-3, 0.5, 15.0) == 0.5  # no attempt before the first
    assert backoff.delay(10**6, 0.5, 15.0) == 15.0  # a very long run does not overflow


def test_jitter_only_stretches_within_its_share() -> None:
    lo = [backoff.delay(a, 1.0, 8.0, 0.25, rand=lambda: 0.0) for a in range(5)]
    hi = [backoff.delay(a, 1.0, 8.0, 0.25, rand=lambda: 0.999999) for a in range(5)]
    assert lo == [1, 2, 4, 8, 8]
    assert all(h <= plain * 1.25 and h > plain * 1.2499 for h, plain in zip(hi, lo, strict=True))
    waits = list(itertools.islice(backoff.delays(1.0, 4.0, 0.5), 200))
    assert all(min(4.0, 2.0 ** i) <= w <= 1.5 * min(4.0, 2.0 ** i) for i, w in enumerate(waits))
    assert len(set(waits[5:])) > 1  # the capped waits are spread, not one value


def test_bad_policies_are_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match="base=2 cap=1"):
        backoff.delay(0, 2, 1)
    with pytest.raises(ValueError, match=r"jitter must be >= 0, got -0\.1"):
        Backoff(1.0, 2.0, jitter=-0.1)


def test_per_key_failures_grow_and_reset_independently() -> None:
    b = Backoff(1.0, 4.0)
    assert [b.failed("a") for _ in range(4)] == [1, 2, 4, 4]
    assert b.failed("b") == 1  # another key starts at base
    assert (b.failures("a"), b.failures("b")) == (4, 1)
    b.reset("a")
    assert (b.failures("a"), b.failed("a"), b.failed("b")) == (0, 1, 2)
    single = Backoff(0.1, 0.4)
    assert [single.failed() for _ in range(3)] == [0.1, 0.2, 0.4]


def test_callers_keep_their_documented_schedules() -> None:
    # local runtime: `base` after the first crash, doubling per crash in a row, at most `cap`
    policy = RestartPolicy(base=1.0, cap=60.0)
    assert [policy.delay(c) for c in (0, 1, 2, 3, 7, 8)] == [1, 1, 2, 4, 60, 60]
    # the shared-memory reaper sweeps after 50 ms, doubling to once a second
    assert list(itertools.islice(backoff.delays(0.05, 1.0), 7)) == [
        0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
