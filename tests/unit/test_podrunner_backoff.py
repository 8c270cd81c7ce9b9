"""The pod runner's restart back-off (tests/harness/podrunner.py), without a cluster.

Why: a kubelet restarts a container at once after its first exit and backs off only on a crash
loop, forgetting the loop once a run lasted long enough. A runner that waits before the first
restart makes every kill -9 cost that wait more than on a real cluster (bench/bench_failover.py
measures exactly that cost)."""

from __future__ import annotations

import time

from tests.harness.podrunner import (
    STABLE_RUN_S,
    Container,
    PodWorker,
    next_streak,
    restart_delay,
)

# A harness test: conftest.py names it in HARNESS_MODULES.


def test_the_first_restart_is_at_once_then_one_second_doubling_to_ten() -> None:
    assert [restart_delay(n) for n in range(1, 9)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_stable_run_starts_a_new_streak() -> None:
    assert next_streak(0, 0.5) == 1  # the first exit
    assert next_streak(4, STABLE_RUN_S - 0.1) == 5  # still crash-looping
    assert next_streak(4, STABLE_RUN_S) == 1  # it ran long enough: forgotten


def _wait_after(c: Container) -> float:
    """What the runner schedules for `c` after an exit, in seconds from now."""
    PodWorker._schedule_restart(None, c)  # type: ignore[arg-type]  # uses no runner state
    return c.backoff_until - time.monotonic()


def test_the_runner_restarts_at_once_backs_off_on_a_loop_and_forgets_it_after_a_long_run() -> None:
    c = Container({"name": "worker"})
    c.last_run_s = 600.0  # a kill -9 after a long run
    assert _wait_after(c) <= 0.0
    c.last_run_s = 0.2  # then it crashes at once, twice
    assert 0.9 <= _wait_after(c) <= 1.0
    assert 1.9 <= _wait_after(c) <= 2.0
    c.last_run_s = STABLE_RUN_S + 1  # a run long enough: the next exit restarts at once again
    assert _wait_after(c) <= 0.0
    assert c.restart_count == 4  # restartCount counts every restart, the streak aside
