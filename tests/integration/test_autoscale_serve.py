"""`omnistage serve` honours `autoscaling` with processes: scale from zero on the first request,
back to zero when idle, and scale-down drains before it stops a process."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage.executors.echo import HOLD_FILE_ENV
from omnistage.local_runtime import LocalStageRuntime
from omnistage.orchestrator.engine import Orchestrator
from omnistage.orchestrator.requests import PipelineRequest
from omnistage.spec import parse_pipeline
from tests.harness.local import alive
from tests.harness.waiting import until, wait
from tests.integration.test_serve import Serve, post

pytestmark = pytest.mark.timeout(300)


def _load(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/load", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def _processes(pipeline_name: str) -> list[int]:
    """Live pids whose command line names a replica of this pipeline (the process table)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--replica-id" in cmd and any(a.startswith(f"{pipeline_name}-".encode())
                                          for a in cmd) and alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def served(tmp_path: Path) -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        s.stop(grace=30)


def test_serve_scales_a_stage_from_zero_and_back_when_idle(served, tmp_path: Path) -> None:
    name = f"z{uuid.uuid4().hex[:8]}"
    manifest = {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {"orchestrator": {"api": ["generic"]}, "stages": [{
            "name": "a", "kind": "echo", "finalOutput": True, "replicas": 0,
            "resources": {"gpus": 0},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "periodSeconds": 1,
                            "windowSeconds": 1, "idleSeconds": 1, "coolDownSeconds": 0},
        }]},
    }
    file = tmp_path / "zero.yaml"
    file.write_text(yaml.safe_dump(manifest))
    s = Serve(file, tmp_path / "logs", tmp_path)
    served.append(s)
    url, admin = s.url(), s.admin_url()
    assert _load(admin)["stages"]["a"]["replicas"] == 0
    assert _processes(name) == []  # at zero: no worker process at all

    status, body = post(f"{url}/v1/pipelines/{name}/requests", {"prompt": "wake"}, timeout=120)
    assert status == 200, body
    assert body["children"][0]["outputs"]["a"]["fields"]["text"] == "wake"
    assert len(_processes(name)) == 1
    assert "waking stage a" in s.output

    # Idle: after the window empties and idleSeconds pass, the stage drains back to zero.
    wait(lambda: _load(admin)["stages"]["a"]["replicas"] == 0, "stage a back at zero")
    wait(lambda: _processes(name) == [], "the worker process to exit")
    assert "scale down 1 -> 0" in s.output, s.output
    # And it wakes again.
    status, body = post(f"{url}/v1/pipelines/{name}/requests", {"prompt": "again"}, timeout=120)
    assert status == 200, body


async def test_scale_down_drains_first_no_request_lost(tmp_path: Path, monkeypatch) -> None:
    """A replica scaled away while it runs a request finishes it before its process stops."""
    name = f"d{uuid.uuid4().hex[:8]}"
    release = tmp_path / "release"
    pipe = parse_pipeline({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": name},
        "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True, "replicas": 1,
                             "resources": {"gpus": 0}, "drainTimeoutSeconds": 60,
                             "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}]},
    })
    notes: list[str] = []
    rt = LocalStageRuntime(pipe, base_dir=tmp_path, log_dir=tmp_path / "logs", ipc=False,
                           progress=notes.append, watch_interval=0.05)
    monkeypatch.setenv(HOLD_FILE_ENV, str(release))  # the workers inherit it: requests wait
    rt.start()
    orch = Orchestrator(pipe, rt.membership)
    try:
        await orch.start()
        handle = orch.submit(PipelineRequest(prompt="keep", timeout_s=120))
        await until(lambda: orch.load().stages["a"].inflight == 1, "the request in flight")
        [pid] = rt.pids.values()
        rt.scale("a", 0)
        await until(lambda: not orch.pools["a"].has_routable(), "the replica to drain")
        assert alive(pid)  # draining: it still runs the request
        release.touch()
        out = await asyncio.wait_for(handle.outcome(), 60)
        assert out.status == "ok", out
        await until(lambda: not rt.replicas and not alive(pid), "the replica to stop")
        assert any("draining replica" in n for n in notes), notes
    finally:
        await orch.stop(drain_timeout=1)
        rt.shutdown(grace=5)
