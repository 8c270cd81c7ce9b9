"""API keys rotated on a cluster without a restart (issue 43): a pipeline whose
spec.orchestrator.auth.apiKeySecret names a Secret serves the openai client and the generic
route only with a key from it; once the Secret is changed to hold another key, the orchestrator
refuses the old key and serves the new one within a bounded time, in the same pod, not
restarted.

The real control plane, the operator as a process and the local pod runner, which re-projects a
changed Secret into the pod's volume as a kubelet does (tests/harness/podvolumes.py); the
orchestrator re-reads the mounted directory (omnistage/orchestrator/auth.py). Only the public
routes are called: the admin ones live on a listener of their own."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from omnistage import kube as k
from omnistage.kubeapi import resource_path
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.operator import Operator, apply, get, pipeline_doc, pod_url, wait_for
from tests.harness.waiting import wait

pytestmark = pytest.mark.timeout(600)

NAME = "keyed"
SECRET = "keyed-api-keys"
ORCH_PORT = 8000
KEY_A = "sk-omnistage-a-0123456789abcdef"
KEY_B = "sk-omnistage-b-0123456789abcdef"
WRONG = "sk-omnistage-wrong-0123456789abcdef"
#: Far from both the runner's ~1 s volume sync plus the orchestrator's RELOAD_S and a key that
#: is never rotated; a real kubelet's sync period is a minute or so.
LOCAL_GUARD_S, KUBELET_GUARD_S = 30.0, 180.0


def call(url: str, path: str, key: str | None, body: dict[str, Any] | None = None
         ) -> tuple[int, Any]:
    """(status, JSON body) of a request to the public API, with `key` as the bearer token."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data, headers,
                                 method="POST" if body is not None else "GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def refused(status: int, body: Any) -> bool:
    return status == 401 and isinstance(body, dict) and \
        body.get("error", {}).get("code") == "invalid_api_key"


def models(url: str, key: str) -> list[str]:
    """The served models as the openai client lists them with `key`."""
    with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30) as client:
        return [m.id for m in client.models.list().data]


def assert_openai_refuses(url: str, key: str) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        models(url, key)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def secret_data(key: str) -> dict[str, str]:
    return {"keys": base64.b64encode(f"# the key in force\n{key}\n".encode()).decode()}


def test_a_rotated_api_key_secret_takes_effect_without_an_orchestrator_restart(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    secrets = resource_path("v1", "secrets", namespace)
    kube.kube.create(secrets, {"apiVersion": "v1", "kind": "Secret",
                               "metadata": {"name": SECRET}, "data": secret_data(KEY_A)})
    apply(kube, namespace, pipeline_doc(NAME, [
        {"name": "a", "kind": "echo"},
        {"name": "b", "kind": "echo", "inputs": ["a"], "finalOutput": True},
    ], orchestrator={"api": ["generic"], "auth": {"apiKeySecret": SECRET}}))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", NAME), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, f"{NAME} Ready", operator.log_tail, interval=1)
    selector = f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator"
    [orch] = [p for p in pods(kube.kube, namespace, selector)
              if not p["metadata"].get("deletionTimestamp")]
    assert [v["secret"]["secretName"] for v in orch["spec"]["volumes"]
            if v["name"] == "api-keys"] == [SECRET]
    route = f"/v1/pipelines/{NAME}/requests"
    guard = LOCAL_GUARD_S if podrunner.local else KUBELET_GUARD_S

    with pod_url(podrunner, orch, ORCH_PORT) as url:
        assert call(url, "/readyz", None)[0] == 200  # open without a key
        assert_openai_refuses(url, WRONG)
        assert models(url, KEY_A) == [NAME]
        assert refused(*call(url, route, None, {"prompt": "anonymous"}))
        assert refused(*call(url, route, WRONG, {"prompt": "wrong"}))
        status, body = call(url, route, KEY_A, {"prompt": "with key A"})
        assert status == 200 and body["status"] == "ok", body

        # Rotate: the Secret now holds key B only.
        kube.kube.patch(f"{secrets}/{SECRET}", {"data": secret_data(KEY_B)})
        rotated = time.monotonic()

        def rotation_done() -> bool:
            return refused(*call(url, "/v1/models", KEY_A)) and \
                call(url, "/v1/models", KEY_B)[0] == 200

        wait(rotation_done, "key A refused and key B served after the rotation", guard,
             interval=0.2)
        took = time.monotonic() - rotated
        assert_openai_refuses(url, KEY_A)
        assert models(url, KEY_B) == [NAME]
        assert refused(*call(url, route, KEY_A, {"prompt": "old key"}))
        status, body = call(url, route, KEY_B, {"prompt": "with key B"})
        assert status == 200 and body["status"] == "ok", body
    print(f"\n[api key rotation] key B in force {took:.1f}s after the Secret changed")

    # The same orchestrator process did it: same pod, never restarted.
    [now] = [p for p in pods(kube.kube, namespace, selector)
             if not p["metadata"].get("deletionTimestamp")]
    assert now["metadata"]["uid"] == orch["metadata"]["uid"]
    assert [c["restartCount"] for c in now["status"]["containerStatuses"]] == [0]
