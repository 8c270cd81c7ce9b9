"""What protects the API server from a big fleet's ramp: the write token bucket
(`kubeapi.WriteLimit`) and the controller's reconcile concurrency (`--workers`), both set by the
chart (charts/omnistage/README.md, "Concurrency and write limits")."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omni_operator import command
from omni_operator.controller import Controller
from omnistage.kubeapi import KubeApi, KubeConfig, WriteLimit, path
from tests.unit.test_kubeapi import Server


class FakeClock:
    """Time that moves only when a test (or a write's wait) moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_burst_goes_at_once_then_writes_are_spaced_by_one_over_qps() -> None:
    clock = FakeClock()
    limit = WriteLimit(qps=10, burst=3, clock=clock)
    # Reservations at one instant: three free, then each waits one more slot (1/10 s).
    delays = [limit.reserve() for _ in range(6)]
    assert delays == pytest.approx([0, 0, 0, 0.1, 0.2, 0.3])


def test_the_bucket_refills_at_qps_and_never_above_burst() -> None:
    clock = FakeClock()
    limit = WriteLimit(qps=5, burst=2, clock=clock)
    assert [limit.reserve(), limit.reserve()] == [0, 0]
    clock.now += 0.2  # one token back
    assert limit.reserve() == 0
    assert limit.reserve() == pytest.approx(0.2)  # promised the next slot
    clock.now += 3600  # an idle hour refills to burst, not to 18,000 writes
    assert [limit.reserve() for _ in range(3)] == pytest.approx([0, 0, 0.2])


def test_a_sustained_stream_runs_at_qps() -> None:
    """1,000 writes arriving as fast as they are let through take (1000 - burst) / qps."""
    clock = FakeClock()
    limit = WriteLimit(qps=50, burst=20, clock=clock)
    start = clock.now
    for _ in range(1000):
        clock.now += limit.reserve()  # each caller waits its delay, then writes
    assert clock.now - start == pytest.approx((1000 - 20) / 50)


def test_bad_limits_name_the_value() -> None:
    with pytest.raises(ValueError, match="qps must be > 0, got 0"):
        WriteLimit(qps=0, burst=1)
    with pytest.raises(ValueError, match="burst must be >= 1, got 0"):
        WriteLimit(qps=1, burst=0)


@pytest.fixture
async def server() -> Any:
    srv = Server()
    srv.url = await srv.start()  # type: ignore[attr-defined]
    yield srv
    await srv.stop()


async def test_kube_api_waits_for_the_limit_on_writes_only(server: Server) -> None:
    """Reads (lists, the watches' GETs) are never held: only writes take tokens."""
    pods = path("Pod", "ns")
    server.routes[("POST", pods)] = (201, {"metadata": {"name": "p"}})
    server.routes[("GET", pods)] = (200, {"items": []})
    clock = FakeClock()
    limit = WriteLimit(qps=4, burst=1, clock=clock, sleep=clock.sleep)
    api = KubeApi(KubeConfig(server=server.url), write_limit=limit)  # type: ignore[attr-defined]
    try:
        for _ in range(5):
            await api.list(pods)
        assert clock.slept == [] and limit.waited == 0
        for _ in range(3):
            await api.create(pods, {"kind": "Pod"})
    finally:
        await api.close()
    assert clock.slept == pytest.approx([0.25, 0.5])  # the burst of 1, then 1/4 s apart
    assert limit.waited == pytest.approx(0.75)
    assert api.writes == 3 and len(server.requests) == 8


class InFlightApi:
    """Counts the calls in flight; each waits until the test lets them go."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.calls = 0
        self.release = asyncio.Event()
        self.reached: asyncio.Event = asyncio.Event()
        self.all_done = asyncio.Event()
        self.expect = 0

    async def patch(self, url: str, body: Any, kind: str = "merge", **_: Any) -> dict[str, Any]:
        self.in_flight += 1
        self.calls += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight >= self.expect:
            self.reached.set()
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
            if self.calls == 100 and not self.in_flight:
                self.all_done.set()
        return {}

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("workers", [1, 5, 32])
async def test_the_configured_concurrency_is_honoured(workers: int) -> None:
    """100 keys, every reconcile blocked in an API call: exactly ``workers`` are in flight,
    never more (the cap that protects the API server) and never fewer (the configured
    concurrency is what runs). Kills: start() ignoring ``workers``."""
    api = InFlightApi()
    api.expect = workers
    controller = Controller(api=api, workers=workers)  # type: ignore[arg-type]

    async def reconcile(key: Any) -> None:
        await api.patch(f"/x/{key[2]}", {})

    controller.reconcile = reconcile  # type: ignore[method-assign]
    for i in range(100):
        controller.enqueue(("StagePool", "ns", f"pool-{i}"))
    controller.start()
    try:
        await asyncio.wait_for(api.reached.wait(), 30)
        for _ in range(20):  # give any extra worker every chance to start a call
            await asyncio.sleep(0)
        assert (api.in_flight, api.peak) == (workers, workers)
        api.release.set()
        await asyncio.wait_for(api.all_done.wait(), 30)
    finally:
        await controller.stop()
    assert api.peak == workers


def _parse(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    command.register(sub)
    return parser.parse_args(["operator", *argv])


def test_flags_and_environment_set_the_limits(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse()
    assert (args.workers, args.write_qps, args.write_burst) == (
        command.WORKERS, command.WRITE_QPS, command.WRITE_BURST)
    monkeypatch.setenv(command.ENV_WORKERS, "12")
    monkeypatch.setenv(command.ENV_WRITE_QPS, "0")
    args = _parse("--write-burst=7")
    assert (args.workers, args.write_qps, args.write_burst) == (12, 0.0, 7)
    assert _parse("--workers=3").workers == 3  # the flag wins over the environment
    monkeypatch.setenv(command.ENV_WORKERS, "many")
    with pytest.raises(SystemExit):
        _parse()
    assert "--workers: must be a whole number, got 'many'" in capsys.readouterr().err
    monkeypatch.delenv(command.ENV_WORKERS)
    with pytest.raises(SystemExit):
        _parse("--write-qps=-1")
    assert "--write-qps: must be >= 0 (0: no limit), got -1" in capsys.readouterr().err


def test_kopf_frees_each_object_soon_after_its_last_event() -> None:
    """A restarted operator lists the whole fleet at once; each kopf worker keeps its last
    object until it idles out, so kopf's 5 s default held every object together (the restart's
    peak RSS, docs/benchmarks.md). And no worker_limit: kopf queues the workers over it with
    their events, which holds more. Kills: dropping the idle timeout from at_fleet_size."""
    import kopf

    from omni_operator.handlers import KOPF_IDLE_TIMEOUT, at_fleet_size, kopf_queueing

    settings = kopf.OperatorSettings()
    assert kopf_queueing(settings).idle_timeout > KOPF_IDLE_TIMEOUT  # kopf's own default is longer
    at_fleet_size(settings)
    assert kopf_queueing(settings).idle_timeout == KOPF_IDLE_TIMEOUT <= 1.0
    assert kopf_queueing(settings).worker_limit is None


def _operator_args(*values: str) -> list[str]:
    from tests.harness.helm import render

    objs = render(*values)
    [deploy] = [o for o in objs if o["kind"] == "Deployment"]
    return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


@pytest.mark.binaries
def test_chart_values_set_the_limits() -> None:
    from tests.harness.helm import helm_binary

    if helm_binary() is None:
        pytest.skip("helm is not installed (hack/build-k8s.sh helm)")
    args = _operator_args()
    assert {f"--workers={command.WORKERS}", f"--write-qps={command.WRITE_QPS:g}",
            f"--write-burst={command.WRITE_BURST}"} <= set(args)  # chart defaults = CLI's
    args = _operator_args("--set=operator.workers=64", "--set=operator.writeQPS=0",
                          "--set=operator.writeBurst=5")
    assert {"--workers=64", "--write-qps=0", "--write-burst=5"} <= set(args)
    parsed = _parse(*[a for a in args if a.startswith(("--workers", "--write-"))])
    assert (parsed.workers, parsed.write_qps, parsed.write_burst) == (64, 0.0, 5)


@pytest.mark.binaries
def test_chart_schema_refuses_bad_limits_naming_them() -> None:
    from tests.harness.helm import CHART, helm, helm_binary

    if helm_binary() is None:
        pytest.skip("helm is not installed (hack/build-k8s.sh helm)")
    for value, message in (("operator.workers=0", "at '/operator/workers': minimum"),
                           ("operator.writeQPS=-1", "at '/operator/writeQPS': minimum"),
                           ("operator.writeBurst=0", "at '/operator/writeBurst': minimum"),
                           ("operator.qps=1", "additional properties 'qps' not allowed")):
        proc = helm("template", "omnistage", str(CHART), f"--set={value}", check=False)
        assert proc.returncode != 0 and message in proc.stderr, (value, proc.stderr)


async def test_a_pool_reconciled_again_before_its_pods_are_seen_creates_them_once() -> None:
    """With many workers a pool is reconciled again (its status write, an event) before the
    watch has brought its new pods into the view; it created them all again (409s: 648 extra
    POSTs in 600 pods at 32 workers). A created pod is now expected for a while; if its event
    never comes, the create is retried after CREATE_EXPECTED_SECONDS.
    Kills: dropping the expectation check in PoolReconciler._converge_pods."""
    from omni_operator import builders
    from omni_operator.controller import CREATE_EXPECTED_SECONDS
    from omni_operator.models import API_VERSION
    from omnistage.spec import parse_pipeline
    from tests.unit.test_fleet_scale import CountingApi

    doc = {"apiVersion": API_VERSION, "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
           "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True,
                                "replicas": 3}]}}
    [pool] = [c for c in builders.pipeline_children(doc, parse_pipeline(doc))
              if c["kind"] == "StagePool"]
    pool["metadata"].update(uid="u2", generation=1, resourceVersion="3")
    clock = FakeClock()
    api = CountingApi()
    controller = Controller(api=api, clock=clock)  # type: ignore[arg-type]
    controller.view.observe("StagePool", "ADDED", pool)

    def pod_creates() -> int:
        return sum(1 for verb, url in api.calls if verb == "create" and url.endswith("/pods"))

    try:
        await controller.pool_reconciler.reconcile(pool)
        assert pod_creates() == 3
        clock.now += CREATE_EXPECTED_SECONDS / 2
        await controller.pool_reconciler.reconcile(pool)  # the pods' events have not come yet
        assert pod_creates() == 3
        clock.now += CREATE_EXPECTED_SECONDS  # they never came: look again
        await controller.pool_reconciler.reconcile(pool)
        assert pod_creates() == 6
        for o in range(3):  # the events arrive; a pod deleted later is created again at once
            pod = builders.pool_pod(pool, o)
            pod["metadata"].update(uid=f"pod-{o}", resourceVersion="5")
            controller.view.observe("Pod", "ADDED", pod)
        await controller.pool_reconciler.reconcile(pool)
        assert pod_creates() == 6
        controller.view.observe("Pod", "DELETED", pod)
        await controller.pool_reconciler.reconcile(pool)
        assert pod_creates() == 7
    finally:
        await controller.stop()
