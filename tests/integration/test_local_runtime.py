"""LocalStageRuntime with real worker processes: startup, membership, rollback, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnistage.local_runtime import (
    LocalStageRuntime,
    PlacementError,
    ReplicaStartupError,
    RestartPolicy,
)
from omnistage.orchestrator.membership import ReplicaInfo
from omnistage.spec import OmniPipeline, parse_pipeline
from tests.harness.local import alive
from tests.harness.waiting import until, wait

pytestmark = pytest.mark.timeout(120)


def pipeline(*stages: dict[str, Any], name: str | None = None) -> OmniPipeline:
    """A valid manifest with a unique name, so the process-table checks see only this test."""
    return parse_pipeline(
        {
            "apiVersion": "omnistage.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name or f"t{uuid.uuid4().hex[:8]}"},
            "spec": {"stages": list(stages)},
        }
    )


def echo(name: str, replicas: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": "echo", "replicas": replicas, **extra}



def processes_of(pipeline_name: str) -> list[int]:
    """Live pids whose command line names a replica of this pipeline (the process table)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--replica-id" in cmd and any(a.startswith(f"{pipeline_name}-".encode()) for a in cmd):
            if alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


@pytest.fixture
def runtimes(tmp_path: Path) -> Iterator[list[LocalStageRuntime]]:
    """Runtimes a test creates; each is shut down at teardown even if the test failed."""
    made: list[LocalStageRuntime] = []
    yield made
    for rt in made:
        rt.shutdown(grace=2)


def make(
    runtimes: list[LocalStageRuntime], p: OmniPipeline, tmp_path: Path, **kw: Any
) -> LocalStageRuntime:
    rt = LocalStageRuntime(p, base_dir=tmp_path, log_dir=tmp_path / "logs", **kw)
    runtimes.append(rt)
    return rt


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _state(http: str) -> dict[str, Any]:
    with urllib.request.urlopen(http + "/state", timeout=5) as resp:
        return json.loads(resp.read())


async def test_two_replicas_ready_publish_membership_and_gone(runtimes, tmp_path) -> None:
    p = pipeline(
        echo("a", 2, admission={"maxRequests": 7}), echo("b", inputs=["a"], finalOutput=True)
    )
    notes: list[str] = []
    rt = make(runtimes, p, tmp_path, progress=notes.append,
              restart=RestartPolicy(base=0.2, cap=1.0))
    rt.start()
    name = p.metadata.name
    infos = {r.name: r for r in rt.membership.replicas}
    assert sorted(infos) == [f"{name}-a-0", f"{name}-a-1", f"{name}-b-0"]
    # One host: membership publishes each worker's unix socket (it serves TCP as well).
    assert all(r.state == "ready" and r.endpoint.startswith("ipc://") for r in infos.values())
    assert all(rep.worker.zmq.startswith("tcp://127.0.0.1:") for rep in rt.replicas.values())
    assert len({r.endpoint for r in infos.values()}) == 3
    assert [r.stage for r in sorted(infos.values(), key=lambda r: r.name)] == ["a", "a", "b"]
    assert any(n.startswith("[3/3] ") and "ready (" in n for n in notes), notes
    # Each worker runs under its stable identity with the stage's settings, on the CPU.
    w = rt.replicas[f"{name}-a-1"].worker
    st = _state(w.http)
    assert (st["replica_id"], st["stage"], st["kind"], st["ready"]) == (
        f"{name}-a-1",
        "a",
        "echo",
        True,
    )
    assert b"CUDA_VISIBLE_DEVICES=" in _environ(w.pid)

    # The orchestrator sees every replica when it subscribes, then live changes.
    seen: list[ReplicaInfo] = []
    await rt.membership.start(seen.append)
    assert len(seen) == 3
    os.kill(w.pid, signal.SIGKILL)
    await until(lambda: any(i.name == w.name and i.state == "gone" for i in seen),
                f"{w.name} gone from membership")
    gone = [i for i in seen if i.state == "gone"]
    assert [i.name for i in gone] == [f"{name}-a-1"], seen
    assert gone[0].endpoint == infos[f"{name}-a-1"].endpoint
    # The supervisor publishes "gone", then says why (its own thread): wait for the note.
    await until(lambda: any("exited unexpectedly (code -9)" in n for n in notes),
                f"{w.name}'s exit reported")
    # Supervision starts it again under the same name, as a new process on a new address.
    await until(lambda: seen[-1].name == w.name and seen[-1].state == "ready",
                f"{w.name} back in membership")
    back = seen[-1]
    assert (back.name, back.state) == (w.name, "ready"), seen
    assert back.endpoint != gone[0].endpoint and rt.pids[w.name] != w.pid
    assert _state(rt.replicas[w.name].worker.http)["replica_id"] == w.name
    assert rt.replicas[w.name].restarts == 1 and rt.notes() == []
    assert any(f"replica {w.name} is back (restart 1" in n for n in notes), notes

    pids = list(rt.pids.values())
    rt.shutdown(grace=5)
    assert not [pid for pid in pids if alive(pid)]
    assert processes_of(name) == []
    assert rt.membership.replicas == []


def test_failed_replica_rolls_back_everything(runtimes, tmp_path) -> None:
    p = pipeline(echo("a", 2), echo("b", inputs=["a"], finalOutput=True))
    # Bypass spec checks: a model on an echo stage makes that worker fail while loading.
    p.spec.stages[1].model = "./no-such-model-dir"
    rt = make(runtimes, p, tmp_path)
    with pytest.raises(ReplicaStartupError) as info:
        rt.start()
    err = info.value
    name = p.metadata.name
    assert err.replica == f"{name}-b-0"
    assert f"replica {name}-b-0 failed to start" in str(err)
    assert "echo stages take no model" in err.log_tail  # the worker's own log, not ours
    assert str(tmp_path / "no-such-model-dir") in str(err)  # resolved against base_dir
    assert rt.pids and not [pid for pid in rt.pids.values() if alive(pid)]
    assert processes_of(name) == []
    assert rt.membership.replicas == []
    rt.shutdown()  # harmless after a rollback


def test_shutdown_is_idempotent_and_leaves_no_process(runtimes, tmp_path) -> None:
    p = pipeline(echo("a", 2, finalOutput=True))
    rt = make(runtimes, p, tmp_path)
    rt.start()
    pids = list(rt.pids.values())
    assert all(alive(pid) for pid in pids)
    rt.shutdown()
    rt.shutdown()
    assert not [pid for pid in pids if alive(pid)]
    assert processes_of(p.metadata.name) == []
    # SIGTERM made them drain and exit cleanly (not SIGKILL).
    assert all(r.worker.proc.returncode == 0 for r in rt.replicas.values())
    with pytest.raises(RuntimeError):
        rt.start()


def test_gpu_placement_is_checked_before_anything_starts(runtimes, tmp_path) -> None:
    p = pipeline(echo("a", 2, resources={"gpus": 2}), echo("b", inputs=["a"], finalOutput=True))
    rt = make(runtimes, p, tmp_path, gpus=["0"])
    with pytest.raises(PlacementError, match=r"'a' asks for 2 GPU.*has 1 visible"):
        rt.start()
    assert rt.pids == {}

    plans = {pl.name: pl for pl in make(runtimes, p, tmp_path, gpus=["0", "1", "2"]).plan()}
    name = p.metadata.name
    assert plans[f"{name}-a-0"].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert plans[f"{name}-a-1"].env == {"CUDA_VISIBLE_DEVICES": "2,0"}  # shared when oversold
    assert plans[f"{name}-b-0"].env == {"CUDA_VISIBLE_DEVICES": ""}  # gpus: 0 -> the CPU


def test_replicas_get_their_stage_with_the_model_path_resolved(runtimes, tmp_path) -> None:
    llm = {
        "name": "llm",
        "kind": "ar",
        "model": "./weights",
        "replicas": 2,
        "drainTimeoutSeconds": 7,
        "engine": {"maxTokens": 5},
        "admission": {"maxRequests": 3, "maxCost": 99, "maxQueue": 11,
                      "defaultDeadlineSeconds": 2.5},
        "finalOutput": True,
    }
    p = pipeline(llm)
    plans = make(runtimes, p, tmp_path, gpus=[]).plan()
    assert [pl.name for pl in plans] == [f"{p.metadata.name}-llm-{i}" for i in range(2)]
    for pl in plans:
        assert pl.stage.model == str(tmp_path / "weights")  # against base_dir, not the cwd
        assert pl.stage.model_dump(exclude={"model"}) == p.spec.stages[0].model_dump(
            exclude={"model"})
    assert p.spec.stages[0].model == "./weights"  # the pipeline itself is left as written


async def test_stage_settings_reach_the_worker(runtimes, tmp_path) -> None:
    """The default deadline and the drain timeout come from the stage, not from flags.

    Kills: a worker that ignores the stage's default deadline (the 3 s request would finish),
    one that ignores its drain timeout (the 60 s request would outlive the 30 s hang guard),
    and one that aborts at SIGTERM without draining (the abort would come under 1 s)."""
    from omnistage import protocol as pr
    from omnistage.client import ReplicaChannel

    p = pipeline(echo("a", admission={"defaultDeadlineSeconds": 0.3}, drainTimeoutSeconds=1,
                      finalOutput=True))
    rt = make(runtimes, p, tmp_path)
    rt.start()
    w = rt.replicas[f"{p.metadata.name}-a-0"].worker
    ch = ReplicaChannel(w.zmq, name="t")
    try:
        _, late = await ch.request("slow", {"prompt": "x", "delay_ms": 3000})
        # no timeout_s: the stage's 0.3 s applies
        assert isinstance(late.header, pr.Deadline), late.header
        stuck = ch.submit("stuck", {"prompt": "y", "delay_ms": 60_000}, timeout_s=120)
        # ("slow" left the worker's books before its Deadline reply was sent)
        await asyncio.to_thread(wait, lambda: _state(w.http)["in_flight"] >= 1,
                                "the stuck request in flight")
        t0 = time.monotonic()
        os.kill(w.pid, signal.SIGTERM)
        reply = await asyncio.wait_for(stuck.get(), 30)  # hang guard: half the request's 60 s
        # cut short by the 1 s drain timeout (the server's cut, not an abort), and no sooner
        assert isinstance(reply.header, pr.Error), reply.header
        assert reply.header.code == "drain_timeout", reply.header
        assert time.monotonic() - t0 >= 1.0
        assert await asyncio.to_thread(w.proc.wait, 60) == 0
    finally:
        await ch.close()


async def test_orchestrator_fails_only_requests_bound_to_a_dead_replica(
        runtimes, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: failing every request when one replica dies, or none (the lost one hanging)."""
    from omnistage.executors.echo import HOLD_FILE_ENV
    from omnistage.orchestrator.engine import Orchestrator
    from omnistage.orchestrator.requests import PipelineRequest

    # The replicas (they inherit the variable) hold each request until the release file
    # exists: the victim's request is surely still running when it is killed.
    release = tmp_path / "release"
    monkeypatch.setenv(HOLD_FILE_ENV, str(release))
    p = pipeline(echo("a", 2, finalOutput=True))
    p.spec.orchestrator.failover.max_retries = 0  # the no-retry path; failover: test_failover.py
    rt = make(runtimes, p, tmp_path, restart=RestartPolicy(base=60))  # stays down meanwhile
    rt.start()
    orch = Orchestrator(p, rt.membership)
    await orch.start()
    try:
        handles = [orch.submit(PipelineRequest(prompt=f"r{i}")) for i in range(2)]
        busy = {r["name"]: r["inflight"] for r in orch.status()["a"]}
        assert sorted(busy.values()) == [1, 1], busy  # least in-flight spread them out
        victim = sorted(busy)[0]
        os.kill(rt.pids[victim], signal.SIGKILL)
        waits = [asyncio.ensure_future(h.outcome()) for h in handles]
        done, held = await asyncio.wait(waits, timeout=90, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == len(held) == 1  # the other is still held on the live replica
        release.touch()
        outcomes = await asyncio.wait_for(asyncio.gather(*waits), 90)
        statuses = sorted((o.status, o.error.code if o.error else None) for o in outcomes)
        assert statuses == [("fatal", "replica_lost"), ("ok", None)]
        await until(lambda: [r["name"] for r in orch.status()["a"]]
                    == [n for n in busy if n != victim], "the dead replica's membership gone")
    finally:
        await orch.stop(5)


def test_a_crash_loop_backs_off_and_shows_and_no_restart_leaks(runtimes, tmp_path) -> None:
    from omnistage.metrics import exposition, new_registry
    from tests.harness.metrics import sample

    p = pipeline(echo("a", 1, finalOutput=True))
    notes: list[str] = []
    policy = RestartPolicy(base=0.3, cap=5.0, stable=60.0)
    rt = make(runtimes, p, tmp_path, progress=notes.append, restart=policy)
    rt.start()
    name = f"{p.metadata.name}-a-0"
    rep = rt.replicas[name]
    for crash in (1, 2):
        pid = rt.pids[name]
        os.kill(pid, signal.SIGKILL)
        wait(lambda: rep.restarts >= crash and rep.state == "ready",  # noqa: B023
             f"restart {crash} ready ({notes[-3:]})")
        assert rt.pids[name] != pid
    # Two crashes in a row: crash-looping, with the backoff doubled (0.3 s, then 0.6 s).
    first, second = [n for n in notes if "restarting in" in n]
    assert "exited unexpectedly (code -9); restarting in 0.3s; log tail" in first, first
    assert "restarting in 0.6s; crash-looping (2 crashes in a row)" in second, second
    assert rep.crash_looping
    text = exposition(new_registry(rt.collector))[0].decode()
    labels = {"pipeline": p.metadata.name, "stage": "a", "replica": name}
    assert sample(text, "omnistage_runtime_replica_restarts_total", **labels) == 2
    assert sample(text, "omnistage_runtime_replica_crash_looping", **labels) == 1
    assert sample(text, "omnistage_runtime_replica_up", **labels) == 1
    # While it waits out its backoff, the notes (/readyz under `omnistage serve`) say so.
    os.kill(rt.pids[name], signal.SIGKILL)
    wait(rt.notes, "the crash loop in the notes")
    assert "crash-looping: 3 crash(es) in a row, last exit code -9" in rt.notes()[0]
    text = exposition(new_registry(rt.collector))[0].decode()
    assert sample(text, "omnistage_runtime_replica_up", **labels) == 0
    rt.shutdown(grace=5)
    assert processes_of(p.metadata.name) == []  # no restart outlives the runtime
