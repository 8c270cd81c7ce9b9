"""CurveZMQ and API keys on by default on the cluster (issue 43): the operator makes one
keypair Secret per pipeline, owned by it, and mounts it in the orchestrator and every stage pod;
the pipeline serves, and a ZMQ peer without the key that reaches a stage pod's port gets nothing
and is counted there. A pipeline that names no API-key Secret gets one made by the operator
(status.apiKeySecret names it): its API refuses a request without that key and serves it with.

The real control plane, the operator as a process and the local pod runner (its pods have
loopback IPs, so the test can reach a stage pod's ZMQ port as another pod would)."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from omni_operator import builders
from omnistage import curve_keys
from omnistage import kube as k
from omnistage.client import ReplicaChannel
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.metrics import sample
from tests.harness.operator import Operator, apply, get, pipeline_doc, wait_for
from tests.harness.waiting import until

pytestmark = pytest.mark.timeout(600)

NAME = "curved"
ORCH_PORT = 8000


def post_json(url: str, body: dict[str, Any], key: str | None = None) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Content-Type": "application/json",
               **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with opener.open(req, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def refused(podrunner: PodRunner, pod: dict[str, Any], reason: str = "handshake") -> float:
    """The peers a stage pod refused for `reason` (its side port's /metrics)."""
    text = podrunner.http_get(pod, k.WORKER_HTTP_PORT, "/metrics")[1]
    return sample(text, "omnistage_worker_refused_peers_total", reason=reason) or 0.0


def test_a_pipeline_serves_over_curve_and_a_keyless_peer_is_refused(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    if not podrunner.local:
        pytest.skip("knocks on a stage pod's ZMQ port: needs the local pod runner's pod IPs")
    apply(kube, namespace, pipeline_doc(NAME, [
        {"name": "a", "kind": "echo"},
        {"name": "b", "kind": "echo", "inputs": ["a"], "finalOutput": True},
    ], orchestrator={"api": ["generic"]}))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", NAME), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, f"{NAME} Ready", operator.log_tail, interval=1)
    pipeline = get(kube, namespace, "omnipipe", NAME)
    secret_name = builders.curve_secret_name(NAME, pipeline["metadata"]["uid"])
    secret = json.loads(kube.kubectl("get", "secret", "-n", namespace, secret_name, "-o",
                                     "json").stdout)
    [ref] = secret["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"]) == ("OmniPipeline", pipeline["metadata"]["uid"])
    public = base64.b64decode(secret["data"]["public"])
    assert len(public) == 40 and curve_keys.z85_decode(public)

    [orch] = [p for p in pods(kube.kube, namespace,
                              f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator")
              if not p["metadata"].get("deletionTimestamp")]
    # Keys on by default: the Secret the operator made, owned by the pipeline, in status.
    key_secret = pipeline["status"]["apiKeySecret"]
    assert key_secret == builders.api_key_secret_name(NAME, pipeline["metadata"]["uid"])
    made = json.loads(kube.kubectl("get", "secret", "-n", namespace, key_secret, "-o",
                                   "json").stdout)
    assert made["metadata"]["ownerReferences"][0]["uid"] == pipeline["metadata"]["uid"]
    [api_key] = [base64.b64decode(v).decode() for v in made["data"].values()]
    url = f"http://{orch['status']['podIP']}:{ORCH_PORT}/v1/pipelines/{NAME}/requests"
    status, body = post_json(url, {"prompt": "no key"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
    status, body = post_json(url, {"prompt": "over curve"}, api_key)
    assert status == 200, body

    [worker] = pods(kube.kube, namespace, f"{k.stage_selector(NAME)},{k.LABEL_STAGE}=a")
    for pod in (orch, worker):  # both mount the pipeline's Secret, named in the environment
        spec = pod["spec"]
        assert {"name": "curve-keys", "secret": {"secretName": secret_name,
                                                 "defaultMode": 0o440}} in spec["volumes"]
    before = refused(podrunner, worker)

    async def knock() -> tuple[bool, float]:
        ch = ReplicaChannel(f"tcp://{worker['status']['podIP']}:{k.WORKER_ZMQ_PORT}",
                            name="keyless")
        try:
            await until(lambda: refused(podrunner, worker) > before,
                        what="the stage pod refusing the keyless peer", interval=0.1)
            return ch.peer is None, refused(podrunner, worker)
        finally:
            await ch.close()

    unanswered, after = asyncio.run(knock())
    assert after > before, "the stage pod never refused the keyless peer"
    assert unanswered
    status, body = post_json(url, {"prompt": "still serving"}, api_key)
    assert status == 200, body
