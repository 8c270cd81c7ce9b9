"""The operator against the REAL control plane, with kwok nodes carrying the pods."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from omnistage import kube as k
from tests.harness.cluster import Cluster, pods
from tests.harness.operator import (
    Operator,
    apply,
    get,
    pipeline_doc,
    wait_for,
)

KWOK = {
    "nodeSelector": {"omnistage.io/node-pool": "kwok-gpu"},
    "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
}


def stage(
    name: str,
    *,
    inputs: tuple[str, ...] = (),
    final: bool = False,
    replicas: int = 2,
    gpus: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "echo",
        "inputs": list(inputs),
        "finalOutput": final,
        "replicas": replicas,
        "resources": {"gpus": gpus, "cpu": "100m", "memory": "64Mi"},
        "placement": KWOK,
        **extra,
    }


def kwok_pipeline(name: str, stages: list[dict[str, Any]]) -> dict[str, Any]:
    return pipeline_doc(name, stages, orchestrator=dict(KWOK))


def stage_pods(cluster: Cluster, ns: str, pipeline: str) -> list[dict[str, Any]]:
    return pods(cluster.kube, ns, k.stage_selector(pipeline))


def ready(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    obj = get(cluster, ns, "omnipipe", name)
    cond = k.condition(obj, "Ready")
    if (
        cond
        and cond["status"] == "True"
        and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
    ):
        return obj
    return None


def wait_ready(
    cluster: Cluster, ns: str, name: str, operator: Operator, timeout: float = 90
) -> dict[str, Any]:
    return wait_for(
        lambda: ready(cluster, ns, name),
        timeout,
        f"{name} Ready",
        lambda: f"{get(cluster, ns, 'omnipipe', name)}\n{operator.log_tail()}",
    )


def events(cluster: Cluster, ns: str, reason: str) -> list[dict[str, Any]]:
    import json

    out = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    return [e for e in json.loads(out)["items"] if e.get("reason") == reason]


def test_apply_creates_pools_pods_orchestrator_and_reaches_ready(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    img_stage = stage("img", inputs=("enc",), final=True, replicas=1, gpus=2)
    doc = kwok_pipeline(
        "t2i", [stage("enc", gpus=1), {**img_stage, "placement": {**KWOK, "colocateWith": ["enc"]}}]
    )
    apply(kube, namespace, doc)
    wait_ready(kube, namespace, "t2i", operator)
    # Ready comes once every stage is at its minimum (1 of 2 with maxUnavailable 1); the phase
    # turns Ready once every replica is updated and ready.
    obj = wait_for(lambda: (o := get(kube, namespace, "omnipipe", "t2i"))
                   and o["status"].get("phase") == "Ready" and o,
                   90, "t2i phase Ready",
                   lambda: f"{get(kube, namespace, 'omnipipe', 't2i')}\n{operator.log_tail()}")
    enc = obj["status"]["stages"]["enc"]
    assert enc == {"pool": "t2i-enc", "ready": 2, "desired": 2, "revision": enc["revision"],
                   "routable": {enc["revision"]: 2}}  # one revision, both replicas routable
    assert obj["status"]["stagesReady"] == "2/2"
    assert obj["status"]["phase"] == "Ready"
    assert obj["status"]["endpoint"] == f"http://t2i-orchestrator.{namespace}.svc:8000"
    for ctype in ("Ready", "StagesReady", "OrchestratorReady"):
        cond = k.condition(obj, ctype)
        assert cond["status"] == "True"
        assert cond["observedGeneration"] == obj["metadata"]["generation"]
        assert cond["reason"] and cond["lastTransitionTime"]
    uid = obj["metadata"]["uid"]
    for kind, name in [
        ("stagepool", "t2i-enc"),
        ("stagepool", "t2i-img"),
        ("deployment", "t2i-orchestrator"),
        ("service", "t2i-orchestrator"),
        ("configmap", "t2i-pipeline"),
        ("role", "t2i-orchestrator"),
        ("rolebinding", "t2i-orchestrator"),
        ("serviceaccount", "t2i-orchestrator"),
    ]:
        child = get(kube, namespace, kind, name)
        assert child is not None, f"{kind}/{name} missing"
        [ref] = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True
    # A pool stores only the engine options its stage's kind reads (echo: its three).
    assert get(kube, namespace, "stagepool", "t2i-enc")["spec"]["stage"]["engine"] == {
        "echoDelayMs": 0, "echoChunkChars": 0, "echoChunkDelayMs": 0}
    role = get(kube, namespace, "role", "t2i-orchestrator")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}
    ]
    by_name = {p["metadata"]["name"]: p for p in stage_pods(kube, namespace, "t2i")}
    assert sorted(by_name) == ["t2i-enc-0", "t2i-enc-1", "t2i-img-0"]
    for name, gpus in [("t2i-enc-0", "1"), ("t2i-enc-1", "1"), ("t2i-img-0", "2")]:
        pod = by_name[name]
        res = pod["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == gpus == res["limits"]["nvidia.com/gpu"]
        assert pod["spec"]["nodeName"].startswith("kwok-gpu-")
        assert pod["spec"]["readinessGates"] == [{"conditionType": k.READINESS_GATE}]
        sc = pod["spec"]["containers"][0]["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        probes = pod["spec"]["containers"][0]
        assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert (
            probes["startupProbe"]["failureThreshold"] * probes["startupProbe"]["periodSeconds"]
            >= 600
        )
        env = {e["name"]: e.get("valueFrom") for e in probes["env"]}
        assert env["POD_IP"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
        assert env["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
    # maxUnavailable 1 of 2 replicas, as an integer minAvailable (no scale lookup needed)
    assert get(kube, namespace, "pdb", "t2i-enc")["spec"]["minAvailable"] == 1
    img = by_name["t2i-img-0"]
    [term] = img["spec"]["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"][k.LABEL_STAGE] == "enc"
    spread = img["spec"]["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"


def test_gpu_request_beyond_any_node_is_insufficient_capacity(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, kwok_pipeline("big", [stage("a", final=True, replicas=1, gpus=9)]))

    def capacity() -> dict[str, Any] | None:
        cond = k.condition(get(kube, namespace, "omnipipe", "big"), "Ready")
        return cond if cond and cond["reason"] == "InsufficientCapacity" else None

    cond = wait_for(capacity, 60, "InsufficientCapacity", operator.log_tail)
    assert cond["status"] == "False"
    assert "nvidia.com/gpu" in cond["message"]
    warned = wait_for(lambda: events(kube, namespace, "InsufficientCapacity"), 30, "event")
    assert warned[0]["type"] == "Warning" and "big-a-0" in warned[0]["message"]


def test_kubectl_scale_stagepool_both_ways(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, kwok_pipeline("sc", [stage("a", final=True, replicas=2)]))
    wait_ready(kube, namespace, "sc", operator)
    kube.kubectl("scale", "-n", namespace, "sp/sc-a", "--replicas=4")

    def names() -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in stage_pods(kube, namespace, "sc")
            if not p["metadata"].get("deletionTimestamp")
        )

    wait_for(lambda: names() == [f"sc-a-{i}" for i in range(4)], 60, "4 replicas", names)
    wait_for(
        lambda: get(kube, namespace, "sp", "sc-a")["status"].get("ready") == "4/4",
        60,
        "sp status 4/4",
    )
    kube.kubectl("scale", "-n", namespace, "sp/sc-a", "--replicas=1")
    wait_for(
        lambda: [p["metadata"]["name"] for p in stage_pods(kube, namespace, "sc")] == ["sc-a-0"],
        120,
        "scale down to the lowest ordinal",
        names,
    )
    # The pipeline's own replicas (2) did not fight the scale: it stays at 1.
    operator.after_resyncs(2)
    assert get(kube, namespace, "sp", "sc-a")["spec"]["replicas"] == 1
    assert [p["metadata"]["name"] for p in stage_pods(kube, namespace, "sc")] == ["sc-a-0"]
    assert events(kube, namespace, "ScalingDown")
    created = " ".join(e["message"] for e in events(kube, namespace, "ReplicasCreated"))
    assert "sc-a-2" in created and "sc-a-3" in created  # the scale-up was reported too


def test_deleted_pod_comes_back_with_same_name(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, kwok_pipeline("rp", [stage("a", final=True, replicas=2)]))
    wait_ready(kube, namespace, "rp", operator)
    old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in stage_pods(kube, namespace, "rp")}
    kube.kubectl("delete", "pod", "-n", namespace, "rp-a-1", "--wait=false")

    def replaced() -> bool:
        now = {
            p["metadata"]["name"]: p["metadata"]["uid"] for p in stage_pods(kube, namespace, "rp")
        }
        return (
            set(now) == set(old)
            and now["rp-a-1"] != old["rp-a-1"]
            and now["rp-a-0"] == old["rp-a-0"]
        )

    wait_for(replaced, 60, "rp-a-1 recreated under the same name")
    wait_for(lambda: events(kube, namespace, "ReplicaLost"), 30, "ReplicaLost event")
    wait_ready(kube, namespace, "rp", operator)


def test_an_evicted_replica_keeps_its_name_when_a_lower_one_is_free(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    """Stable replica identity (DESIGN.md) through an eviction: a pool whose ordinals have a
    gap (0 and 2, after two `--retire`s and a scale-up) has replica 2 evicted; it comes back
    as gap-a-2, never in the gap as gap-a-1, and a Normal ReplicaEvicted names it. Kills: the
    terminating replica's ordinal given away at once (the issue's node drain: gap-a-1 came
    back, no event)."""
    from omni_operator import retirement
    from omnistage.kubeapi import ApiError, path

    apply(kube, namespace, kwok_pipeline("gap", [stage("a", final=True, replicas=3,
                                                       drainTimeoutSeconds=0)]))
    wait_ready(kube, namespace, "gap", operator)

    def names() -> list[str]:
        return sorted(p["metadata"]["name"] for p in stage_pods(kube, namespace, "gap")
                      if not p["metadata"].get("deletionTimestamp"))

    for victim in ("gap-a-0", "gap-a-1"):  # what `omnistage drain --retire` writes
        wait_for(lambda v=victim: get(kube, namespace, "pod", v), 60, victim)
        pool = get(kube, namespace, "sp", "gap-a")
        kube.kube.patch(path("StagePool", namespace, "gap-a"), retirement.drain_patch(
            pool, get(kube, namespace, "pod", victim), "retire"))
        wait_for(lambda v=victim: v not in names(), 60, f"{victim} retired", names)
    kube.kubectl("scale", "-n", namespace, "sp/gap-a", "--replicas=2")
    wait_for(lambda: names() == ["gap-a-0", "gap-a-2"], 60, "a pool with a gap", names)
    wait_for(lambda: get(kube, namespace, "sp", "gap-a")["status"].get("ready") == "2/2", 60,
             "both Ready", operator.log_tail)
    old = get(kube, namespace, "pod", "gap-a-2")["metadata"]["uid"]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": "gap-a-2", "namespace": namespace}}

    def evicted() -> bool:
        try:
            kube.kube.create(path("Pod", namespace, "gap-a-2") + "/eviction", eviction)
            return True
        except ApiError as exc:  # 429 until the disruption controller has counted the pods
            if exc.status != 429:
                raise
            return False

    wait_for(evicted, 60, "the eviction allowed by the PDB")
    seen: set[str] = set()

    def back() -> bool:
        now = {p["metadata"]["name"]: p["metadata"]["uid"]
               for p in stage_pods(kube, namespace, "gap")}
        seen.update(now)
        return sorted(now) == ["gap-a-0", "gap-a-2"] and now["gap-a-2"] != old

    wait_for(back, 120, "gap-a-2 back under its name", operator.log_tail, interval=0.1)
    assert "gap-a-1" not in seen, seen
    said = wait_for(lambda: events(kube, namespace, "ReplicaEvicted"), 30, "ReplicaEvicted")
    assert [(e["type"], e["message"]) for e in said] == [
        ("Normal", "replica gap-a-2 was evicted; replacing it under the same name")], said
    assert not events(kube, namespace, "ReplicaLost")


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    stages = [
        stage("a", replicas=4),
        stage("b", inputs=("a",), replicas=4),
        stage("c", inputs=("b",), final=True, replicas=4),
    ]
    apply(kube, namespace, kwok_pipeline("kr", stages))
    wait_for(lambda: len(stage_pods(kube, namespace, "kr")) >= 2, 60, "first pods")
    operator.kill()
    operator.start()
    wait_ready(kube, namespace, "kr", operator, timeout=120)
    names = sorted(p["metadata"]["name"] for p in stage_pods(kube, namespace, "kr"))
    assert names == sorted(f"kr-{s}-{i}" for s in "abc" for i in range(4))
    assert len(get(kube, namespace, "deployment", "kr-orchestrator")["spec"]) > 0
    rs = kube.kubectl(
        "get",
        "pods",
        "-n",
        namespace,
        "-l",
        f"{k.LABEL_PIPELINE}=kr,{k.LABEL_COMPONENT}=orchestrator",
        "-o",
        "name",
    )
    assert len(rs.stdout.split()) == 1


def test_resync_of_unchanged_world_makes_no_writes(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, kwok_pipeline("idle", [stage("a", final=True, replicas=2)]))
    wait_ready(kube, namespace, "idle", operator)

    def quiet() -> bool:  # other tests' namespaces finish tearing down first
        out = kube.kubectl("get", "ns", "-o", "jsonpath={.items[*].status.phase}").stdout
        return "Terminating" not in out

    wait_for(quiet, 180, "no terminating namespaces")
    before = operator.settled()  # the last status writes have landed and echoed back
    operator.after_resyncs(2)  # it did resync, every object twice
    assert operator.writes() == before, operator.log_tail()


def test_spec_update_rolls_replicas_one_at_a_time(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    doc = kwok_pipeline("roll", [stage("a", final=True, replicas=3)])
    apply(kube, namespace, doc)
    wait_ready(kube, namespace, "roll", operator)
    old_hash = stage_pods(kube, namespace, "roll")[0]["metadata"]["annotations"][
        k.ANNOTATION_SPEC_HASH
    ]
    doc["spec"]["stages"][0]["engine"] = {"echoDelayMs": 5}
    apply(kube, namespace, doc)
    worst = 0
    end = time.monotonic() + 180
    while time.monotonic() < end:
        current = stage_pods(kube, namespace, "roll")
        unavailable = 3 - sum(
            1
            for p in current
            if not p["metadata"].get("deletionTimestamp")
            and (p["metadata"].get("annotations") or {}).get(k.ANNOTATION_DRAINING) != "true"
            and k.condition_status(p, "Ready") == "True"
        )
        worst = max(worst, unavailable)
        hashes = {p["metadata"]["annotations"][k.ANNOTATION_SPEC_HASH] for p in current}
        if len(current) == 3 and old_hash not in hashes and unavailable == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rollout did not finish:\n{operator.log_tail()}")
    assert worst <= 1  # within the PodDisruptionBudget: one replica at a time
    assert events(kube, namespace, "RollingUpdate")
    wait_ready(kube, namespace, "roll", operator)


def test_delete_is_ordered_and_children_are_not_recreated(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, kwok_pipeline("bye", [stage("a", final=True, replicas=2)]))
    wait_ready(kube, namespace, "bye", operator)
    assert (
        "omnistage.io/ordered-shutdown"
        in get(kube, namespace, "omnipipe", "bye")["metadata"]["finalizers"]
    )
    listing = kube.kube.get(f"/api/v1/namespaces/{namespace}/pods")
    before = {p["metadata"]["uid"] for p in listing["items"]
              if (p["metadata"].get("labels") or {}).get(k.LABEL_COMPONENT) == "stage"}
    assert len(before) == 2
    log: list[tuple[str, str, str, bool]] = []  # (event, component, uid, terminating)
    stop = threading.Event()

    def watch() -> None:
        events = kube.kube.watch(
            f"/api/v1/namespaces/{namespace}/pods", stop,
            resource_version=listing["metadata"]["resourceVersion"], timeout_seconds=120,
        )
        with contextlib.suppress(Exception):  # the stream may end abruptly once we stop
            for etype, pod in events:
                meta = pod.get("metadata", {})
                comp = (meta.get("labels") or {}).get(k.LABEL_COMPONENT, "")
                log.append((etype, comp, meta.get("uid", ""),
                            bool(meta.get("deletionTimestamp"))))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    kube.kubectl("delete", "omnipipe", "-n", namespace, "bye", "--wait=false")
    wait_for(lambda: get(kube, namespace, "omnipipe", "bye") is None, 120, "pipeline deleted",
             operator.log_tail)
    stop.set()
    # Ordered: every orchestrator pod was gone before any stage pod started terminating.
    first_stage = next(i for i, e in enumerate(log) if e[1] == "stage" and (e[0] == "DELETED"
                                                                           or e[3]))
    orch_deleted = [i for i, e in enumerate(log) if e[1] == "orchestrator" and e[0] == "DELETED"]
    assert orch_deleted and max(orch_deleted) < first_stage, log
    # No replica was created while the owner was being deleted.
    assert not [e for e in log if e[1] == "stage" and e[0] == "ADDED"], log
    assert {e[2] for e in log if e[1] == "stage"} <= before
    # The deletion was announced once, as Normal (docs/crds.md), however many reconciles the
    # ordered shutdown took.
    def announced() -> list[dict[str, Any]]:
        return [e for e in events(kube, namespace, "Terminating")
                if e["involvedObject"]["kind"] == "OmniPipeline"]

    def everything() -> str:
        import json

        return json.dumps([(e["reason"], e["involvedObject"]["kind"], e.get("count"))
                           for e in json.loads(kube.kubectl("get", "events", "-n", namespace,
                                                            "-o", "json").stdout)["items"]])

    said = wait_for(announced, 30, "a Terminating event", everything)
    assert [(e["type"], e.get("count", 1)) for e in said] == [("Normal", 1)], said


def test_shared_memory_opt_in_reaches_every_pod_and_can_be_turned_off(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    def mounted(spec: dict[str, Any]) -> bool:
        return any(v.get("hostPath", {}).get("path") == "/dev/shm/omnistage"
                   for v in spec.get("volumes", []))

    doc = kwok_pipeline("shm", [stage("a", final=True, replicas=1)])
    doc["metadata"]["annotations"] = {k.ANNOTATION_SHARED_MEMORY: "true"}
    apply(kube, namespace, doc)
    wait_ready(kube, namespace, "shm", operator)
    [pod] = stage_pods(kube, namespace, "shm")
    assert mounted(pod["spec"])
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["OMNISTAGE_SHM_DIR"] == "/var/run/omnistage/shm"
    deployment = get(kube, namespace, "deployment", "shm-orchestrator")
    assert mounted(deployment["spec"]["template"]["spec"])

    doc["metadata"]["annotations"] = {k.ANNOTATION_SHARED_MEMORY: "false"}
    apply(kube, namespace, doc)
    wait_for(lambda: (pods_ := stage_pods(kube, namespace, "shm")) and all(
        not mounted(p["spec"]) and not p["metadata"].get("deletionTimestamp") for p in pods_),
        120, "stage pods rolled without shared memory", operator.log_tail)
    wait_for(lambda: not mounted(
        get(kube, namespace, "deployment", "shm-orchestrator")["spec"]["template"]["spec"]),
        60, "orchestrator without shared memory", operator.log_tail)
    wait_ready(kube, namespace, "shm", operator)
