"""The orchestrator's admin listener on the cluster (issue 43): control, GET /v1/load and
/metrics on their own port (spec.orchestrator.adminPort), keyed with the key the operator
derives for the pipeline, and gone from the public port.

The real control plane, the operator as a process (its root key from the harness's
--admin-key-file: tests.harness.operator.admin_key derives the same pipeline keys) and the local
pod runner running the orchestrator and a worker. What is real: the pods the operator builds
(ports, the digest in their environment), the orchestrator's two listeners and its key check,
the operator's autoscaler reading the load at the admin port with the key (its decision in the
pool's status says it read the orchestrator), and the chart's key Secret rendered against the
API server (`lookup`).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from omni_operator import builders
from omnistage import kube as k
from omnistage.kubeapi import resource_path
from omnistage.orchestrator.auth import key_digest_hex
from tests.harness.cluster import Cluster, PodRunner, pods
from tests.harness.operator import (
    Operator,
    admin_key,
    admin_request,
    apply,
    get,
    pipeline_doc,
    pod_url,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)
Obj = dict[str, Any]

NAME = "adm"
API_PORT, ADMIN_PORT = 8000, 9100  # adminPort set: not its default (port + 1)


def _orchestrator(kube: Cluster, namespace: str) -> Obj:
    def one() -> Obj | None:
        found = [p for p in pods(kube.kube, namespace,
                                 f"{k.LABEL_PIPELINE}={NAME},{k.LABEL_COMPONENT}=orchestrator")
                 if not p["metadata"].get("deletionTimestamp")
                 and k.condition_status(p, "Ready") == "True"]
        return found[0] if len(found) == 1 else None

    return wait_for(one, 120, "one Ready orchestrator pod")  # type: ignore[no-any-return]


def _autoscaler(kube: Cluster, namespace: str) -> Obj:
    pool = kube.kube.get(resource_path(k.API_VERSION, "stagepools", namespace, f"{NAME}-a"),
                         ignore=(404,)) or {}
    return dict((pool.get("status") or {}).get("autoscaler") or {})


def test_the_admin_listener_takes_the_operator_s_key_and_the_public_port_hides_it(
    kube: Cluster, podrunner: PodRunner, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, pipeline_doc(NAME, [{
        "name": "a", "kind": "echo", "finalOutput": True,
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "periodSeconds": 1,
                        "coolDownSeconds": 0}}],
        orchestrator={"api": ["generic"], "port": API_PORT, "adminPort": ADMIN_PORT}))

    def ready() -> bool:
        cond = k.condition(get(kube, namespace, "omnipipe", NAME), "Ready")
        return bool(cond and cond["status"] == "True")

    wait_for(ready, 300, f"{NAME} Ready", operator.log_tail, interval=1)
    pipeline = get(kube, namespace, "omnipipe", NAME)
    assert pipeline is not None
    key = admin_key(namespace, NAME, pipeline["metadata"]["uid"])
    orch = _orchestrator(kube, namespace)

    # What the operator built: the admin port beside the API's, the key's digest (never the
    # key) in the pod, and the admin port on the admin Service only.
    [container] = orch["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": API_PORT, k.ADMIN_PORT_NAME: ADMIN_PORT}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[k.ADMIN_KEY_DIGESTS_ENV] == key_digest_hex(key)
    assert key not in json.dumps(orch)
    public = get(kube, namespace, "service", builders.orchestrator_name(NAME))
    admin = get(kube, namespace, "service", builders.admin_service_name(NAME))
    assert public is not None and admin is not None
    assert [(p["name"], p["port"]) for p in public["spec"]["ports"]] == [("http", API_PORT)]
    assert [(p["name"], p["port"]) for p in admin["spec"]["ports"]] == [("admin", ADMIN_PORT)]
    assert admin["metadata"]["ownerReferences"][0]["uid"] == pipeline["metadata"]["uid"]

    # The operator's autoscaler reads the load there, with the key: its decision says it read
    # the one orchestrator (a refused or unreachable read would say "not read" or "no signal").
    status = wait_for(lambda: (s := _autoscaler(kube, namespace)).get("signal") == "Available"
                      and (s.get("inputs") or {}).get("orchestratorsRead") == 1 and s, 90,
                      "a decision on the orchestrator's load", operator.log_tail)
    assert f"read 1 orchestrator ({orch['metadata']['name']})" in status["reason"], status
    assert (status.get("inputs") or {}).get("orchestratorsUnread") == 0, status

    control = f"/v1/pipelines/{NAME}/control"
    with pod_url(podrunner, orch, ADMIN_PORT) as base:
        # Anonymous, or another pipeline identity's key (the same name made again): 401.
        other = admin_key(namespace, NAME, "another-uid")
        for who in (None, other, "x" * 64):
            assert admin_request(base + k.LOAD_PATH, who)[0] == 401, who
            assert admin_request(base + control, who, method="POST",
                                 body={"op": "resume"})[0] == 401, who
        # The derived key, in the operator's header or as a bearer token: 200.
        status_code, doc = admin_request(base + k.LOAD_PATH, key)
        assert status_code == 200 and "a" in doc["stages"], doc
        status_code, results = admin_request(base + control, key, method="POST",
                                             body={"op": "resume"})
        assert status_code == 200, results
        bearer = _get(base + k.LOAD_PATH, {"Authorization": f"Bearer {key}"})
        assert bearer[0] == 200, bearer
        # /metrics and the probes are open there (the network policy says who reaches it).
        assert _get(base + "/metrics")[0] == 200
        assert _get(base + "/livez")[0] == 200 and _get(base + "/readyz")[0] == 200

    with pod_url(podrunner, orch, API_PORT) as base:
        # The public port has none of them, with or without a key.
        for who in (None, key):
            assert admin_request(base + k.LOAD_PATH, who)[0] == 404, who
            assert admin_request(base + control, who, method="POST",
                                 body={"op": "resume"})[0] == 404, who
        assert _get(base + "/metrics")[0] == 404
        # It serves the pipeline's routes (behind its API keys: not the admin key's business)
        # and its probes.
        status_code, body = admin_request(base + f"/v1/pipelines/{NAME}/requests", None,
                                          method="POST", body={"prompt": "public"})
        assert status_code == 200 or (status_code == 401 and body["error"]["code"] ==
                                      "invalid_api_key"), body
        if status_code == 401:  # API keys on: the admin key is none of them
            req = urllib.request.Request(
                base + f"/v1/pipelines/{NAME}/requests", json.dumps({"prompt": "x"}).encode(),
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req,
                                                                                  timeout=10)
            assert refused.value.code == 401
        assert _get(base + "/readyz")[0] == 200


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_the_chart_keeps_the_admin_key_it_finds(kube: Cluster, namespace: str) -> None:
    """The chart's key Secret rendered against the API server (`helm template
    --dry-run=server`, the lookup `helm upgrade` runs): a Secret already there keeps its key
    (no orchestrator rolls on an upgrade); none there, a new random one."""
    from tests.harness.helm import CHART, helm, helm_binary

    if helm_binary() is None:
        pytest.skip("helm not built: run hack/build-k8s.sh helm")

    def rendered() -> str:
        out = helm("template", "omnistage", str(CHART), "-n", namespace, "--dry-run=server",
                   "--show-only=templates/admin-key-secret.yaml",
                   kubeconfig=kube.kubeconfig).stdout
        import yaml

        [secret] = [d for d in yaml.safe_load_all(out) if d]
        return base64.b64decode(secret["data"]["admin-key"]).decode()

    fresh, again = rendered(), rendered()
    assert fresh != again and len(fresh) == 48  # nothing to find: a new key each time
    kept = "k" * 40
    kube.kubectl("create", "secret", "generic", "-n", namespace, "omnistage-operator-admin-key",
                 f"--from-literal=admin-key={kept}")
    assert rendered() == rendered() == kept


def test_a_restarted_operator_derives_the_same_digest(kube: Cluster, namespace: str,
                                                      operator: Operator) -> None:
    """The same --admin-key-file after a restart: the orchestrator's Deployment is left as
    it is (its digest unchanged), so no orchestrator rolls."""
    apply(kube, namespace, pipeline_doc("same", [{"name": "a", "kind": "echo",
                                                  "finalOutput": True, "replicas": 0}],
                                        orchestrator={"replicas": 0}))

    def deployment() -> Obj | None:
        return get(kube, namespace, "deployment", builders.orchestrator_name("same"))

    before = wait_for(deployment, 60, "the orchestrator Deployment", operator.log_tail)
    operator.stop()
    operator.start()
    operator.after_reconciles(3)
    after = deployment()
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    [c] = after["spec"]["template"]["spec"]["containers"]
    digest = {e["name"]: e.get("value") for e in c["env"]}[k.ADMIN_KEY_DIGESTS_ENV]
    pipeline = get(kube, namespace, "omnipipe", "same")
    assert pipeline is not None
    assert digest == key_digest_hex(admin_key(namespace, "same", pipeline["metadata"]["uid"]))
