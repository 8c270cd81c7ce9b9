"""`kubectl apply -f examples/omni-speech.yaml` → thinker, talker and vocoder pods run in the
runtime image → the openai client gets a spoken answer from the orchestrator pod.

The operator is installed by the Helm chart (tests/e2e/conftest.py) and every pod runs in its
image under the pod runner, as in test_pipeline_e2e.py. The tiny built-in models are the real
Qwen3-Omni classes with random weights: the audio is noise, but every stage really ran.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import soundfile
import yaml

from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.helm import Release
from tests.harness.operator import api_key, apply, get, pod_url, wait_for

pytestmark = pytest.mark.timeout(600)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "omni-speech.yaml"
NAME = "omni-speech"


def _ready(kube: Cluster, ns: str) -> dict[str, Any] | None:
    obj = get(kube, ns, "omnipipe", NAME)
    cond = k.condition(obj, "Ready")
    return obj if cond and cond["status"] == "True" else None


def _diagnose(kube: Cluster, runner: PodRunner, ns: str, operator: Release) -> str:
    out = [json.dumps((get(kube, ns, "omnipipe", NAME) or {}).get("status"), indent=1)]
    for pod in pods(kube.kube, ns):
        name = pod["metadata"]["name"]
        out.append(f"--- {name} {pod.get('status', {}).get('phase')}\n"
                   f"{runner.log_tail(ns, name, lines=15)}")
    out.append(operator.log_tail(20))
    return "\n".join(out)


def _wav(data: bytes) -> tuple[int, int]:
    """(samples, sample rate) of a WAV file, read by soundfile."""
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return len(samples), int(rate)


def test_the_speech_pipeline_answers_with_audio_on_the_cluster(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Release
) -> None:
    apply(kube, namespace, yaml.safe_load(EXAMPLE.read_text()))
    wait_for(lambda: _ready(kube, namespace), 300, f"{NAME} Ready",
             lambda: _diagnose(kube, podrunner, namespace, operator), interval=1)
    stage_pods = [p for p in pods(kube.kube, namespace, k.stage_selector(NAME))
                  if not p["metadata"].get("deletionTimestamp")]
    assert sorted(p["metadata"]["name"] for p in stage_pods) == [
        f"{NAME}-talker-0", f"{NAME}-thinker-0", f"{NAME}-vocoder-0"]
    [vocoder] = [p for p in stage_pods if p["metadata"]["name"] == f"{NAME}-vocoder-0"]
    [orch] = [p for p in pods(kube.kube, namespace,
                              f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator")
              if not p["metadata"].get("deletionTimestamp")]
    with pod_url(podrunner, orch, 8000) as base:
        # Keys on by default: the key a user reads from the Secret status.apiKeySecret names.
        client = openai.OpenAI(base_url=base + "/v1", api_key=api_key(kube, namespace, NAME),
                               max_retries=0,
                               timeout=120)
        [model] = client.models.list().data
        assert (model.model_extra or {}).get("voices") == ["default"]
        chat = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            modalities=["text", "audio"], audio={"voice": "default", "format": "wav"})
        audio = chat.choices[0].message.audio
        assert audio is not None and isinstance(audio.transcript, str)
        samples, rate = _wav(base64.b64decode(audio.data))
        assert samples > 0 and rate > 0  # WAV keeps the vocoder's own sample rate
        speech = client.audio.speech.create(model=NAME, input="hello", voice="default",
                                            response_format="wav")
        assert _wav(speech.content)[0] > 0 and _wav(speech.content)[1] == rate
    # The vocoder pod did the decoding: its worker admitted both requests.
    status, body = podrunner.http_get(vocoder, k.WORKER_HTTP_PORT, "/metrics")
    admitted = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                if line.startswith("omnistage_worker_admitted_total")]
    assert status == 200 and admitted and sum(admitted) >= 2, body[:500]
    kube.kubectl("delete", "omnipipe", "-n", namespace, NAME, "--wait=false")
