"""CurveZMQ key rotation on the cluster (issue 43): a pipeline serving under load is asked for
a new pair (the annotation omnistage.io/curve-generation); the operator adds it to the Secret,
moves the pods to it drain-style and drops the old pair. No request is lost meanwhile; after,
the Secret holds only the new pair, every pod is of the new generation, and a peer holding the
old pair is refused by a stage pod (counted there) while one with the new pair is heard.

The real control plane, the operator as a process and the local pod runner (loopback pod IPs:
the test reaches a stage pod's ZMQ port as another pod would; the runner refreshes mounted
Secrets every second, as a kubelet does within its sync period)."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from omni_operator import builders
from omnistage import kube as k
from omnistage.client import ReplicaChannel
from omnistage.curve_keys import CurveKeys
from tests.cluster.test_curve_cluster import refused
from tests.cluster.test_lifecycle_operator import (
    _assert_nothing_lost,
    _echo,
    _events,
    _loaded,
    _orchestrators,
    _replicas,
    _report,
    _start,
)
from tests.harness.cluster import Cluster, PodRunner
from tests.harness.operator import Operator, get, wait_for
from tests.harness.waiting import until

pytestmark = pytest.mark.timeout(600)

NAME = "rotor"
ANN = k.ANNOTATION_CURVE_GENERATION


def _secret(kube: Cluster, namespace: str) -> dict[str, bytes]:
    pipeline = get(kube, namespace, "omnipipe", NAME)
    name = builders.curve_secret_name(NAME, pipeline["metadata"]["uid"])
    doc = json.loads(kube.kubectl("get", "secret", "-n", namespace, name, "-o", "json").stdout)
    return {key: base64.b64decode(value) for key, value in (doc.get("data") or {}).items()}


def _generations(kube: Cluster, namespace: str) -> list[str]:
    return sorted((p["metadata"].get("annotations") or {}).get(ANN, "-")
                  for p in [*_replicas(kube, namespace, NAME),
                            *_orchestrators(kube, namespace, NAME)])


def test_a_rotation_under_load_loses_nothing_and_refuses_the_old_pair_after(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    if not podrunner.local:
        pytest.skip("knocks on a stage pod's ZMQ port: needs the local pod runner's pod IPs")
    _start(kube, namespace, operator, NAME, _echo("a", replicas=2, engine={"echoDelayMs": 50}))
    first = _secret(kube, namespace)
    assert set(first) == {"public", "secret"}
    old = CurveKeys(first["public"], first["secret"])
    assert _generations(kube, namespace) == ["-", "0", "0"]  # the orchestrator: unsaid

    with _loaded(kube, namespace, NAME) as load:
        begun = time.monotonic()
        kube.kubectl("annotate", "omnipipe", NAME, "-n", namespace, f"{ANN}=1")

        def rotated() -> bool:
            keys = (get(kube, namespace, "omnipipe", NAME).get("status") or {}).get(
                "curveKeys") or {}
            return ((keys.get("generation"), keys.get("secret")) == (1, [1])
                    and _generations(kube, namespace) == ["1", "1", "1"])

        wait_for(rotated, 400, "the pipeline rotated to pair 1", operator.log_tail, interval=0.5)
        took = time.monotonic() - begun
        load.wait_for(load.count() + 20)
        results = load.snapshot()
    figures = _report("CurveZMQ key rotation under load", results, rotation_s=round(took, 1))
    _assert_nothing_lost(figures, results)
    assert [e["reason"] for e in _events(kube, namespace, "CurveKeysRotated")] == [
        "CurveKeysRotated"]
    assert _events(kube, namespace, "CurveKeysAdded") and _events(
        kube, namespace, "CurveKeysSwitched")

    now = _secret(kube, namespace)
    assert set(now) == {"public-1", "secret-1"}  # the old pair is gone from the Secret
    new = CurveKeys(now["public-1"], now["secret-1"])
    assert new.public != old.public

    worker = _replicas(kube, namespace, NAME)[0]
    endpoint = f"tcp://{worker['status']['podIP']}:{k.WORKER_ZMQ_PORT}"
    before = refused(podrunner, worker, "key")

    async def knock() -> tuple[bool, bool]:
        stale = ReplicaChannel(endpoint, name="old-pair", curve=old, server_key=new.public)
        fresh = ReplicaChannel(endpoint, name="new-pair", curve=new)
        try:
            await until(lambda: refused(podrunner, worker, "key") > before,
                        what="the stage pod refusing the old pair", interval=0.1)
            hello = await fresh.handshake(timeout=30)
            return stale.peer is None, hello.replica == worker["metadata"]["name"]
        finally:
            await stale.close()
            await fresh.close()

    unanswered, heard = asyncio.run(knock())
    assert unanswered and heard
