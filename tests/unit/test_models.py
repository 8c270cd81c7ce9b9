"""Model references: the grammar, hub-cache resolution offline, the serve preflight, the pod
spec a hub model gets, and how a failed fetch or load reads in status.

Resolution runs the real huggingface_hub against a hub cache in the standard layout, built from
the tiny random-initialised models (tests/harness/hubcache.py); nothing touches the network.
The cluster path of the same pieces is tests/e2e/test_models_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_operator import builders
from omni_operator.status import model_failure, pipeline_status, pool_status, summary
from omnistage import kube
from omnistage.modelref import ModelRef, parse_model_ref, reference_error
from omnistage.models import ModelUnavailable, fetch, hub_cache, prepare, resolve
from omnistage.spec import SpecError, Stage, parse_pipeline
from tests.harness.hubcache import add_to_cache, tiny_models

NOW = "2026-11-30T00:00:00Z"


@pytest.mark.parametrize("value,ref", [
    ("Qwen/Qwen2.5-0.5B-Instruct", ModelRef("hub", "Qwen/Qwen2.5-0.5B-Instruct")),
    ("acme/tiny@v1.0", ModelRef("hub", "acme/tiny", "v1.0")),
    ("acme/tiny@refs/pr/3", ModelRef("hub", "acme/tiny", "refs/pr/3")),
    ("acme/tiny@" + "a" * 40, ModelRef("hub", "acme/tiny", "a" * 40)),
    ("tiny-llama", ModelRef("builtin", "tiny-llama")),
    ("./weights", ModelRef("path", "./weights")),
    ("/models/x", ModelRef("path", "/models/x")),
])
def test_references_parse(value: str, ref: ModelRef) -> None:
    assert parse_model_ref(value) == ref
    assert reference_error(value, "ar") is None
    assert str(ref) == value


@pytest.mark.parametrize("value", [
    "qwen", "acme/", "acme//x", "acme/x/y", "a--b/c", "a/b..c", "acme/x@", "acme/x@-bad",
    "acme/x y", "-acme/x", "acme/x.", "https://huggingface.co/acme/x", "a" * 98 + "/x",
])
def test_bad_references_are_refused_naming_the_forms(value: str) -> None:
    problem = reference_error(value, "ar")
    assert problem is not None and "org/name[@revision]" in problem and "local path" in problem
    with pytest.raises(ValueError):
        parse_model_ref(value)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache in a fresh HF_HOME, offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_hub_ids_resolve_from_the_cache_offline(cache: Path, models: dict[str, Path]) -> None:
    assert hub_cache() == cache
    commit = add_to_cache(cache, "acme/tiny-llm", models["ar"])
    add_to_cache(cache, "acme/tiny-llm", models["ar"], revision="v1")
    add_to_cache(cache, "acme/tiny-unet", models["diffusion"])
    for model in ("acme/tiny-llm", "acme/tiny-llm@v1", f"acme/tiny-llm@{commit}"):
        path = resolve(model, "ar")
        assert path == cache / "models--acme--tiny-llm" / "snapshots" / commit
        assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert (resolve("acme/tiny-unet", "diffusion") / "unet" / "config.json").is_file()


def test_a_missing_hub_model_offline_names_the_id_and_the_fix(cache: Path) -> None:
    with pytest.raises(ModelUnavailable) as err:
        resolve("acme/absent@v2", "ar")
    text = str(err.value)
    assert "model 'acme/absent@v2'" in text and "HF_HUB_OFFLINE" in text
    assert "omnistage models pull acme/absent@v2" in text and "local path" in text
    assert not cache.joinpath("models--acme--absent").exists()  # nothing half-written


def test_a_missing_revision_of_a_cached_model_is_missing(cache: Path,
                                                        models: dict[str, Path]) -> None:
    add_to_cache(cache, "acme/tiny-llm", models["ar"])
    with pytest.raises(ModelUnavailable, match="acme/tiny-llm@v9"):
        fetch(parse_model_ref("acme/tiny-llm@v9"), download=False)


def test_prepare_names_every_stage_whose_model_is_missing(cache: Path,
                                                          models: dict[str, Path]) -> None:
    add_to_cache(cache, "acme/tiny-llm", models["ar"])
    doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
           "metadata": {"name": "p"},
           "spec": {"stages": [
               {"name": "llm", "kind": "ar", "model": "acme/tiny-llm"},
               {"name": "img", "kind": "diffusion", "model": "acme/gone", "inputs": ["llm"],
                "finalOutput": True}]}}
    said: list[str] = []
    problems = prepare(parse_pipeline(doc).spec.stages, say=said.append)
    assert len(problems) == 1
    assert problems[0].startswith("stage 'img': model 'acme/gone': not in the Hugging Face cache")
    assert "omnistage models pull acme/gone" in problems[0]
    assert any("stage llm: model acme/tiny-llm at" in s for s in said)


# ---- the pod a hub model gets -------------------------------------------------------------


def _pool(model: str, cache: dict[str, object] | None) -> dict[str, object]:
    spec: dict[str, object] = {"pipeline": "p", "image": "ghcr.io/omnistage/omnistage:1.0",
                               "replicas": 1,
                               "stage": {"name": "llm", "kind": "ar", "model": model}}
    if cache is not None:
        spec["modelCache"] = cache
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "StagePool",
            "metadata": {"name": "p-llm", "namespace": "ns", "uid": "u"}, "spec": spec}


def _env(container: dict[str, object]) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}  # type: ignore[index, union-attr, attr-defined]


def test_a_hub_model_gets_a_fetching_init_container_and_an_offline_worker() -> None:
    cache = {"claimName": "models", "tokenSecret": {"name": "hf", "key": "tok"},
             "endpoint": "http://127.0.0.1:9"}
    spec, _ = builders.pod_template(_pool("acme/tiny-llm@v1", cache))
    (init,) = spec["initContainers"]
    (worker,) = spec["containers"]
    assert init["name"] == kube.MODEL_FETCH_CONTAINER
    assert init["image"] == "ghcr.io/omnistage/omnistage:1.0"  # the stage's own image
    assert init["command"] == ["omnistage", "models", "pull", "acme/tiny-llm@v1"]
    assert _env(init)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert _env(init)["HF_HOME"] == kube.MODEL_CACHE_PATH
    assert _env(init)["HF_ENDPOINT"] == "http://127.0.0.1:9"
    assert "HF_TOKEN" not in _env(worker)  # only the fetch ever sees the token
    assert _env(worker)["HF_HUB_OFFLINE"] == "1"
    assert _env(worker)["HF_HOME"] == kube.MODEL_CACHE_PATH
    for c in (init, worker):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    cache_mount = {"name": "model-cache", "mountPath": kube.MODEL_CACHE_PATH}
    assert cache_mount in init["volumeMounts"]
    assert {**cache_mount, "readOnly": True} in worker["volumeMounts"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in (
        spec["volumes"])
    # /livez answers while the model loads: liveness never fails a slow load.
    assert worker["startupProbe"]["httpGet"]["path"] == "/livez"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/livez"


@pytest.mark.parametrize("cache,volume,offline_flag", [
    (None, {"emptyDir": {}}, False),
    ({"size": "20Gi"}, {"emptyDir": {"sizeLimit": "20Gi"}}, False),
    ({"claimName": "m", "readOnly": True},
     {"persistentVolumeClaim": {"claimName": "m", "readOnly": True}}, True),
])
def test_cache_volume_forms(cache: dict[str, object] | None, volume: dict[str, object],
                            offline_flag: bool) -> None:
    spec, _ = builders.pod_template(_pool("acme/x", cache))
    assert {"name": "model-cache", **volume} in spec["volumes"]
    (init,) = spec["initContainers"]
    assert ("--offline" in init["command"]) is offline_flag
    if offline_flag:
        assert {"name": "model-cache", "mountPath": kube.MODEL_CACHE_PATH, "readOnly": True} in (
            init["volumeMounts"])


def test_builtin_and_path_models_get_no_init_container() -> None:
    for model in ("tiny-llama", "/weights/llm"):
        spec, _ = builders.pod_template(_pool(model, {"size": "1Gi"}))
        assert "initContainers" not in spec
        assert all(v["name"] != "model-cache" for v in spec["volumes"])


def test_the_pipeline_passes_its_model_cache_to_its_pools() -> None:
    doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
           "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
           "spec": {"modelCache": {"size": "5Gi"},
                    "stages": [{"name": "llm", "kind": "ar", "model": "acme/x",
                                "finalOutput": True}]}}
    pool = builders.stage_pool(doc, parse_pipeline({**doc, "metadata": {"name": "p"}}),
                               Stage.model_validate(doc["spec"]["stages"][0]))
    assert pool["spec"]["modelCache"] == {"size": "5Gi", "readOnly": False}


# ---- status ------------------------------------------------------------------------------


def _pod(init_term: dict[str, object] | None = None,
         worker_term: dict[str, object] | None = None) -> dict[str, object]:
    status: dict[str, object] = {"phase": "Pending"}
    if init_term is not None:
        status["initContainerStatuses"] = [{
            "name": "model-fetch", "ready": False, "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": init_term}}]
    if worker_term is not None:
        status["containerStatuses"] = [{
            "name": "worker", "ready": False, "restartCount": 1,
            "state": {"terminated": worker_term}}]
    return {"metadata": {"name": "p-llm-0", "labels": {kube.LABEL_STAGE: "llm"},
                         "annotations": {}},
            "status": status}


def test_model_failures_read_off_the_pod() -> None:
    fetch_failed = _pod(init_term={"exitCode": 3, "message": "Fetching...\nerror: model "
                                   "'acme/x': no such repository on the hub (or it is private)"})
    reason, message = model_failure(fetch_failed)  # type: ignore[misc]
    assert reason == "ModelFetchFailed"
    assert message == ("stage 'llm': the model could not be fetched on p-llm-0: error: model "
                       "'acme/x': no such repository on the hub (or it is private)")
    load_failed = _pod(worker_term={"exitCode": kube.MODEL_FAILED_EXIT,
                                    "message": "model load failed: stage 'llm', model 'acme/x': "
                                               "OSError: bad weights"})
    assert model_failure(load_failed)[0] == "ModelLoadFailed"  # type: ignore[index]
    # Any other crash of the worker is not blamed on the model.
    assert model_failure(_pod(worker_term={"exitCode": 1, "message": "boom"})) is None
    assert model_failure(_pod(init_term={"exitCode": 0})) is None


def test_a_failed_fetch_is_the_pool_and_pipeline_ready_reason() -> None:
    pool = _pool("acme/x", None)
    pool["metadata"]["generation"] = 1  # type: ignore[index]
    failed = _pod(init_term={"exitCode": 3, "message": "error: model 'acme/x': gone"})
    st = pool_status(pool, [failed], "h", NOW).wire()
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelFetchFailed")
    assert "stage 'llm'" in ready["message"] and "acme/x" in ready["message"]
    pipe = {"metadata": {"name": "p", "generation": 1}, "status": {}}
    ps = pipeline_status(pipe, ["llm"], {"llm": {**pool, "status": st}}, None, 1, "e", NOW)
    pready = ps.condition("Ready")
    assert pready and pready.reason == "ModelFetchFailed" and "acme/x" in (pready.message or "")
    assert summary(ps)[:2] == ("Warning", "Pending")


# ---- executors ----------------------------------------------------------------------------


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu() -> None:
    import torch

    from omnistage.models import torch_dtype

    assert torch_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert torch_dtype("auto", torch.device("cpu")) is torch.float32
    assert torch_dtype("float16", torch.device("cpu")) is torch.float16


@pytest.mark.parametrize("kind,model", [("ar", "tiny-llama"), ("diffusion", "tiny-unet")])
def test_a_model_replica_on_several_gpus_is_refused(kind: str, model: str) -> None:
    doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
           "metadata": {"name": "p"},
           "spec": {"stages": [{"name": "s", "kind": kind, "model": model, "finalOutput": True,
                                "resources": {"gpus": 2}}]}}
    with pytest.raises(SpecError) as err:
        parse_pipeline(doc)
    assert err.value.errors == [("spec.stages[0].resources.gpus",
                                 f"replicas of kind '{kind}' load their model onto one GPU (got "
                                 "2); spreading a model over several GPUs is not supported: "
                                 "request 1 and scale with replicas")]
    doc["spec"]["stages"][0]["resources"]["gpus"] = 1
    parse_pipeline(doc)


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_ar_chat_uses_the_tokenizer_template_when_it_has_one(models: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """Real tokenizer, real model: with a chat template the turns are rendered by it; without
    one, the orchestrator's fallback prompt is what the model sees."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from omnistage.executors.ar import ARExecutor
    from omnistage.executors.base import BadRequest
    from omnistage.spec import EngineOptions

    templated = tmp_path / "chat-llm"
    shutil.copytree(models["ar"], templated)
    tok = AutoTokenizer.from_pretrained(templated)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(templated)
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    params = {"messages": turns, "prompt": "<|user|>\nhi\n<|assistant|>\n"}

    ex = ARExecutor(str(templated), EngineOptions(), torch.device("cpu"))
    ex.load()
    job = ex.prepare(params, {})
    want = "[system] be brief\n[user] hi\n[assistant] "
    assert job.prompt_ids == tok(want, add_special_tokens=False).input_ids
    assert ex.tokenizer.decode(job.prompt_ids) == want

    plain = ARExecutor(str(models["ar"]), EngineOptions(), torch.device("cpu"))
    plain.load()
    assert plain.prepare(params, {}).prompt_ids == plain.tokenizer(params["prompt"]).input_ids
    with pytest.raises(BadRequest, match=r"params\.messages only with a model that has a chat"):
        plain.prepare({"messages": turns}, {})


def test_a_diffusers_pipeline_by_hub_id_loads_with_its_own_scheduler(
        cache: Path, models: dict[str, Path], tmp_path: Path) -> None:
    """A hub diffusion repo in diffusers' pipeline layout (model_index.json naming its
    scheduler) loads by id from the cache, and a denoising run uses that scheduler."""
    import shutil

    import torch
    from diffusers import EulerDiscreteScheduler

    from omnistage.admission import ExecutionContext
    from omnistage.executors.diffusion import DiffusionExecutor
    from omnistage.spec import EngineOptions

    repo = tmp_path / "euler-pipe"
    shutil.copytree(models["diffusion"], repo)
    shutil.rmtree(repo / "scheduler")
    EulerDiscreteScheduler(num_train_timesteps=1000).save_pretrained(repo / "scheduler")
    (repo / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}))
    add_to_cache(cache, "acme/euler-pipe", repo)

    ex = DiffusionExecutor("acme/euler-pipe", EngineOptions(), torch.device("cpu"))
    ex.load()
    assert type(ex.scheduler_template) is EulerDiscreteScheduler
    job = ex.prepare({"height": 32, "width": 32, "num_inference_steps": 2}, {})
    out = ex.execute(job, ExecutionContext(), lambda _d: None)
    assert not out.aborted and out.tensors
