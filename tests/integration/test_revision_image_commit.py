"""What a revision covers beyond the spec, with real worker processes (issue 37, defect 12).

Two replicas of one stage whose hub model (`org/name`, no commit pinned) resolved to different
commits in their hub caches are two revisions: each says `<revision>+<commit>` in its hello,
the revision of the spec in its image ($OMNISTAGE_IMAGE) before the `+`. The orchestrator pins
a request to one of them, and every /v1 response of a request that ran the pipeline names the
pipeline revision it ran on (X-Omnistage-Revision), streams included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from omnistage.models import save_builtin
from omnistage.orchestrator.http_api import REVISION_HEADER, serve_http
from omnistage.revision import COMMIT_LENGTH, IMAGE_ENV, base_revision, stage_revision
from tests.integration.test_orchestrator import launch, pipeline  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-org/tiny-llama"
IMAGE = "registry.example/omnistage:1.2.3"
COMMITS = ("a" * 40, "b" * 40)


def _hub_cache(root: Path, commit: str, model: Path) -> Path:
    """A Hugging Face hub cache holding MODEL at `commit` (refs/main names it)."""
    repo = root / ("models--" + MODEL.replace("/", "--"))
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return root


async def test_replicas_of_two_commits_are_two_revisions_and_responses_name_theirs(
        launch: Any, tmp_path: Path) -> None:  # noqa: F811
    model = save_builtin("tiny-llama", tmp_path / "model")
    caches = [_hub_cache(tmp_path / f"hub-{i}", c, model) for i, c in enumerate(COMMITS)]
    pipe = pipeline("rev", [{"name": "a", "kind": "ar", "model": MODEL, "finalOutput": True}])
    stage = pipe.spec.stage("a")
    workers = [{"env": {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", IMAGE_ENV: IMAGE}}
               for cache in caches]
    orch, _, _ = await launch(pipe, {"a": workers})
    replicas = orch.pools["a"].replicas
    said = {r.name: r.said_revision for r in replicas.values()}
    spec_revision = stage_revision(stage, IMAGE)
    assert spec_revision != stage_revision(stage)  # the image is in it
    assert said == {f"rev-a-{i}": f"{spec_revision}+{c[:COMMIT_LENGTH]}"
                    for i, c in enumerate(COMMITS)}, said
    assert {base_revision(r) for r in said.values() if r} == {spec_revision}

    runner, url = await serve_http(orch, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            seen = set()
            for _ in range(4):
                async with s.post(url + "/v1/pipelines/rev/requests",
                                  json={"prompt": "hi", "params": {"a": {"max_tokens": 2}}}
                                  ) as resp:
                    assert resp.status == 200, await resp.text()
                    body = await resp.json()
                    header = resp.headers[REVISION_HEADER]
                assert body["status"] == "ok", body
                seen.add(header)
            # The header names the revision the requests were pinned to, and ran on.
            [only] = seen
            assert only in {f"a={r}" for r in said.values()}, only
            assert orch.admissions == {("a", only.split("=", 1)[1]): 4}
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post(url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers[REVISION_HEADER] in {f"a={r}" for r in said.values()}
            async with s.post(url + "/v1/chat/completions", json={**chat, "stream": True}
                              ) as resp:
                assert resp.status == 200
                assert resp.headers[REVISION_HEADER] in {f"a={r}" for r in said.values()}
                text = await resp.text()
                assert text.rstrip().endswith("data: [DONE]"), text
                assert all(json.loads(line[6:]) for line in text.splitlines()
                           if line.startswith("data: {"))
    finally:
        await runner.cleanup()
