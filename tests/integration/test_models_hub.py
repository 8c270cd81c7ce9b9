"""Hub model ids on one machine, with no network: real `omnistage serve` and `omnistage models
pull` processes against a hub cache in the standard layout and a fake hub on loopback, both
built from the tiny random-initialised models (tests/harness/hubcache.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage import kube
from tests.harness.hubcache import FakeHub, add_to_cache, tiny_models
from tests.harness.local import alive
from tests.integration.test_serve import READY, Serve, post, wait_dead

pytestmark = pytest.mark.timeout(600)
TOKEN = "hf_integrationsecret0123456789"


def pipeline(path: Path, encoder: str, denoiser: str) -> Path:
    doc = {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "hub-t2i"},
        "spec": {"orchestrator": {"api": ["chat", "images", "generic"]}, "stages": [
            {"name": "encoder", "kind": "ar", "model": encoder,
             "engine": {"maxTokens": 4, "returnHiddenStates": True}},
            {"name": "denoiser", "kind": "diffusion", "model": denoiser, "inputs": ["encoder"],
             "finalOutput": True,
             "engine": {"height": 32, "width": 32, "numInferenceSteps": 2}},
        ]},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def offline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HF_HOME, offline; every process the test starts inherits both."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        pids = s.worker_pids() if s.log_dir.exists() else []
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_hub_ids_serve_from_the_cache_offline(offline_home: Path, models: dict[str, Path],
                                             serving: list[Serve], tmp_path: Path) -> None:
    """An ar and a diffusion stage named by hub id load through from_pretrained from the
    standard cache, with HF_HUB_OFFLINE=1, and the pipeline serves chat and images."""
    commit = add_to_cache(offline_home / "hub", "acme/tiny-llm", models["ar"], revision="v1")
    add_to_cache(offline_home / "hub", "acme/tiny-unet", models["diffusion"])
    file = pipeline(tmp_path / "p.yaml", "acme/tiny-llm@v1", "acme/tiny-unet")
    s = Serve(file, tmp_path / "logs", tmp_path)
    serving.append(s)
    url = s.wait_for(READY, 300).group(1)
    snapshot = offline_home / "hub" / "models--acme--tiny-llm" / "snapshots" / commit
    assert f"stage encoder: model acme/tiny-llm@v1 at {snapshot}" in s.output
    status, chat = post(f"{url}/v1/chat/completions",
                        {"model": "hub-t2i", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 3})
    assert status == 200, chat
    assert chat["usage"]["completion_tokens"] > 0
    status, img = post(f"{url}/v1/images/generations",
                       {"model": "hub-t2i", "prompt": "a red square", "size": "32x32",
                        "response_format": "b64_json"}, timeout=120)
    assert status == 200, img
    assert img["data"][0]["b64_json"]
    pids = s.worker_pids()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(90) == 0, s.output
    assert wait_dead(pids) == []


def test_a_missing_model_offline_fails_before_any_worker_starts(
        offline_home: Path, models: dict[str, Path], serving: list[Serve],
        tmp_path: Path) -> None:
    add_to_cache(offline_home / "hub", "acme/tiny-llm", models["ar"])
    file = pipeline(tmp_path / "p.yaml", "acme/tiny-llm", "acme/absent")
    s = Serve(file, tmp_path / "logs", tmp_path)
    serving.append(s)
    assert s.wait(120) == 2, s.output
    assert ("stage 'denoiser': model 'acme/absent': not in the Hugging Face cache and "
            "HF_HUB_OFFLINE is set; run `omnistage models pull acme/absent`") in s.output
    assert "or use a local path" in s.output
    # No worker was started: none wrote its port file or its log.
    logs = tmp_path / "logs"
    assert not logs.exists() or not list(logs.iterdir())
    assert "replica(s)" not in s.output


def _pull(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnistage.cli", "models", "pull", *args],
                          env=env, capture_output=True, text=True, timeout=180)


def test_models_pull_downloads_with_progress_and_token(tmp_path: Path,
                                                       models: dict[str, Path]) -> None:
    env: dict[str, Any] = {k: v for k, v in os.environ.items()
                           if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env["HF_HOME"] = str(tmp_path / "hf")
    with FakeHub({"acme/tiny-llm": models["ar"], "acme/tiny-unet": models["diffusion"]},
                 token=TOKEN) as hub:
        env["HF_ENDPOINT"] = hub.url
        refused = _pull("acme/tiny-llm", env=env)  # a gated repo, no token
        assert refused.returncode == kube.MODEL_FAILED_EXIT
        assert refused.stderr.strip().splitlines()[-1] == (
            "error: model 'acme/tiny-llm': the hub refused access (a gated model); set HF_TOKEN "
            "(on a cluster: spec.modelCache.tokenSecret) to a token that was granted access")
        missing = _pull("acme/nope", env={**env, "HF_TOKEN": TOKEN})
        assert missing.returncode == kube.MODEL_FAILED_EXIT
        assert "acme/nope" in missing.stderr.splitlines()[-1]

        done = _pull("acme/tiny-llm", "acme/tiny-unet", env={**env, "HF_TOKEN": TOKEN})
        assert done.returncode == 0, done.stderr
        assert re.search(r"Fetching \d+ files: 100%", done.stderr)  # the progress bar
        assert f"2 model(s) in {tmp_path / 'hf' / 'hub'}" in done.stdout
        assert ("GET", "/api/models/acme/tiny-llm/revision/main", f"Bearer {TOKEN}") in (
            hub.requests)
        assert TOKEN not in done.stdout + done.stderr + refused.stderr
    # The hub is gone: what was pulled now resolves offline.
    check = _pull("--offline", "acme/tiny-llm", "acme/tiny-unet",
                  env={**env, "HF_HUB_OFFLINE": "1"})
    assert check.returncode == 0, check.stderr
    absent = _pull("--offline", "acme/other", env={**env, "HF_HUB_OFFLINE": "1"})
    assert absent.returncode == kube.MODEL_FAILED_EXIT


def test_a_worker_that_cannot_load_its_model_exits_3_saying_why(offline_home: Path) -> None:
    """What the operator reads as ModelLoadFailed: exit MODEL_FAILED_EXIT, and a last line
    naming the stage, the model and the cause."""
    out = subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "stage", "--stage-json",
         '{"name":"llm","kind":"ar","model":"acme/absent"}', "--http-port", "0"],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert out.returncode == kube.MODEL_FAILED_EXIT, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("model load failed: stage 'llm', model 'acme/absent': "
                           "ModelUnavailable: model 'acme/absent': not in the Hugging Face "
                           "cache and HF_HUB_OFFLINE is set"), last
