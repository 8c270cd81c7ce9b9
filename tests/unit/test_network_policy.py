"""A pipeline's NetworkPolicies (omni_operator.network_policy) against the pods the real
builders make: who may reach which port, judged by a small evaluator of the NetworkPolicy
rules (label selectors, peers, ports), so a selector that drifts from the pods' labels fails
here. No network plugin enforces anything on the test cluster: tests/cluster/
test_network_policy.py checks that the API server takes the objects and the operator keeps
them."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from omni_operator import builders
from omni_operator.command import register
from omni_operator.controller import Controller
from omni_operator.main import network_policy_settings
from omni_operator.network_policy import (
    MONITORING_NAMESPACE,
    NAMESPACE_NAME_LABEL,
    NetworkPolicySettings,
    OperatorPeer,
    pipeline_network_policies,
)
from omnistage import kube
from omnistage.kubeapi import ApiError, Applied, path
from omnistage.spec import OmniPipeline, parse_pipeline

Obj = dict[str, Any]
NS = "team-a"
OPERATOR_NS = "omnistage-system"
#: The chart's selector labels of the operator pods (charts/omnistage/templates/_helpers.tpl;
#: tests/chart/test_chart.py checks the chart passes exactly these).
OPERATOR_LABELS = {"app.kubernetes.io/name": "omnistage-operator",
                   "app.kubernetes.io/instance": "omnistage"}
OPERATOR = OperatorPeer(OPERATOR_NS, OPERATOR_LABELS)
ON = NetworkPolicySettings(enabled=True, operator=OPERATOR)
ZMQ, SIDE = kube.WORKER_ZMQ_PORT, kube.WORKER_HTTP_PORT
API, ADMIN = 8000, 8001  # spec.orchestrator.port and adminPort, by default


# ---- a NetworkPolicy evaluator (the API's documented semantics, the parts used here) --------


def _expression(expr: Obj, lbls: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return key in lbls and lbls[key] in values
    if op == "NotIn":
        return key not in lbls or lbls[key] not in values
    if op == "Exists":
        return key in lbls
    if op == "DoesNotExist":
        return key not in lbls
    raise AssertionError(f"not a label selector operator: {op}")


def selects(selector: Obj, lbls: Mapping[str, str]) -> bool:
    """metav1.LabelSelector: every matchLabels pair and every matchExpressions term (ANDed);
    an empty selector selects everything."""
    return (all(lbls.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
            and all(_expression(e, lbls) for e in selector.get("matchExpressions") or []))


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Mapping[str, str]

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {NAMESPACE_NAME_LABEL: self.namespace}  # set by the API server on every Namespace


def _peer_admits(peer: Obj, policy_ns: str, source: Pod) -> bool:
    assert "ipBlock" not in peer  # none used: peers are pods
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_ns:  # a podSelector alone: the policy's own namespace
        return False
    return selects(peer.get("podSelector") or {}, source.labels)


def _rule_admits(rule: Obj, policy_ns: str, source: Pod, port: int) -> bool:
    ports = rule.get("ports") or []
    if ports and not any(p.get("protocol", "TCP") == "TCP" and p["port"] == port
                         for p in ports):
        return False
    peers = rule.get("from") or []
    return not peers or any(_peer_admits(peer, policy_ns, source) for peer in peers)


def selecting(policies: list[Obj], target: Pod) -> list[Obj]:
    """The Ingress policies that isolate `target`."""
    return [p for p in policies if p["metadata"]["namespace"] == target.namespace
            and "Ingress" in p["spec"]["policyTypes"]
            and selects(p["spec"]["podSelector"], target.labels)]


def admitted(policies: list[Obj], source: Pod, target: Pod, port: int) -> bool:
    """Whether a TCP connection from `source` to `target`'s `port` is allowed: a pod no policy
    selects admits everything; a selected one what any of its policies' rules admit."""
    chosen = selecting(policies, target)
    return not chosen or any(_rule_admits(rule, p["metadata"]["namespace"], source, port)
                             for p in chosen for rule in p["spec"].get("ingress") or [])


def test_the_evaluator_follows_the_selector_rules() -> None:
    """The evaluator itself: expressions, the AND of a peer's two selectors, empty `from`."""
    lbls = {"a": "1", "b": "2"}
    assert selects({}, lbls)
    assert selects({"matchLabels": {"a": "1"},
                    "matchExpressions": [{"key": "b", "operator": "In", "values": ["2", "3"]},
                                         {"key": "c", "operator": "DoesNotExist"}]}, lbls)
    assert not selects({"matchExpressions": [{"key": "a", "operator": "NotIn",
                                              "values": ["1"]}]}, lbls)
    assert not selects({"matchLabels": {"a": "1", "c": "3"}}, lbls)
    peer = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "x"}},
            "podSelector": {"matchLabels": {"a": "1"}}}
    assert _peer_admits(peer, "y", Pod("x", lbls))
    assert not _peer_admits(peer, "y", Pod("y", lbls))  # right pod, wrong namespace
    assert not _peer_admits(peer, "y", Pod("x", {"b": "2"}))  # right namespace, wrong pod
    assert _rule_admits({"ports": [{"port": 1}]}, "y", Pod("z", {}), 1)  # no `from`: anyone


# ---- the pods the real builders make ----------------------------------------------------------


def _pipeline(name: str, port: int = API, admin_port: int = ADMIN
              ) -> tuple[Obj, OmniPipeline]:
    doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
           "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
           "spec": {"orchestrator": {"port": port, "adminPort": admin_port},
                    "stages": [{"name": "enc", "kind": "echo"},
                               {"name": "img", "kind": "echo", "inputs": ["enc"],
                                "finalOutput": True}]}}
    return doc, parse_pipeline(doc)


@dataclass
class Built:
    """One pipeline as the operator builds it: its children and the pods they make."""

    children: list[Obj]
    stage_pods: list[Pod]
    orchestrator: Pod

    @property
    def policies(self) -> list[Obj]:
        return [c for c in self.children if c["kind"] == "NetworkPolicy"]


def build(name: str, settings: NetworkPolicySettings | None = ON, port: int = API,
          admin_port: int = ADMIN) -> Built:
    owner, pipeline = _pipeline(name, port, admin_port)
    children = builders.pipeline_children(owner, pipeline, network_policy=settings)
    stage_pods = []
    for pool in (c for c in children if c["kind"] == "StagePool"):
        pool = copy.deepcopy(pool)
        pool["metadata"]["uid"] = f"uid-{pool['metadata']['name']}"  # the API server's
        for ordinal in (0, 1):
            pod = builders.pool_pod(pool, ordinal)
            stage_pods.append(Pod(pod["metadata"]["namespace"], pod["metadata"]["labels"]))
    [deployment] = [c for c in children if c["kind"] == "Deployment"]
    orchestrator = Pod(deployment["metadata"]["namespace"],
                       deployment["spec"]["template"]["metadata"]["labels"])
    return Built(children, stage_pods, orchestrator)


OPERATOR_POD = Pod(OPERATOR_NS, {**OPERATOR_LABELS, "pod-template-hash": "abc"})
#: A Prometheus in the monitoring namespace (any labels: the namespace is the peer).
PROMETHEUS = Pod(MONITORING_NAMESPACE, {"app.kubernetes.io/name": "prometheus"})


def test_stage_pods_admit_zmq_from_their_orchestrators_and_the_side_port_from_the_operator(
) -> None:
    p, q = build("p"), build("q")
    policies = p.policies + q.policies
    stranger = Pod(NS, {"app": "curious"})
    # The operator's labels in another namespace, and another namespace's "orchestrator".
    impostors = [Pod(NS, OPERATOR_LABELS), Pod("elsewhere", OPERATOR_LABELS),
                 Pod("elsewhere", dict(p.orchestrator.labels))]
    assert len(p.stage_pods) == 4
    for target in p.stage_pods:
        [stages] = selecting(policies, target)  # exactly its own pipeline's stage policy
        assert stages["metadata"]["name"] == "p-stages"
        assert admitted(policies, p.orchestrator, target, ZMQ)
        assert not admitted(policies, p.orchestrator, target, SIDE)  # it never calls it
        assert admitted(policies, OPERATOR_POD, target, SIDE)
        assert not admitted(policies, OPERATOR_POD, target, ZMQ)  # it never speaks ZMQ
        for source in (q.orchestrator, *q.stage_pods, *p.stage_pods, stranger, *impostors,
                       PROMETHEUS):
            for port in (ZMQ, SIDE, API, ADMIN, 22):
                assert not admitted(policies, source, target, port), (source, port)


def test_orchestrator_pods_admit_their_api_port_from_anywhere_and_nothing_else() -> None:
    p, q = build("p", port=9000, admin_port=9001), build("q")
    policies = p.policies + q.policies
    [front] = selecting(policies, p.orchestrator)
    assert front["metadata"]["name"] == "p-orchestrator"
    for source in (Pod("anywhere", {}), q.orchestrator, OPERATOR_POD, PROMETHEUS,
                   *p.stage_pods):
        assert admitted(policies, source, p.orchestrator, 9000)
        for port in (ZMQ, SIDE, API, ADMIN, 22):  # the defaults: not this pipeline's ports
            assert not admitted(policies, source, p.orchestrator, port), (source, port)
    # The stage policy selects no orchestrator pod, the orchestrator policy no stage pod.
    assert not any(selects(front["spec"]["podSelector"], pod.labels) for pod in p.stage_pods)
    [stages] = [x for x in p.policies if x["metadata"]["name"] == "p-stages"]
    assert not selects(stages["spec"]["podSelector"], p.orchestrator.labels)
    assert not selects(stages["spec"]["podSelector"], OPERATOR_POD.labels)


def test_the_admin_port_admits_only_the_operator_and_the_monitoring_namespace() -> None:
    """Control, /v1/load and /metrics live on the admin port (issue 43): the operator's pods
    (the autoscaler, the drain) and a Prometheus in the monitoring namespace reach it; they
    reach the API port as everyone does. Any other pod reaches the API port and not the admin
    port: a client, another pipeline's orchestrator, this pipeline's stage pods, the
    operator's labels in the wrong namespace, the operator's namespace with other labels.
    Kills: the admin port admitted from anywhere (an empty `from`), or the API port narrowed
    with it."""
    p, q = build("p", port=9000, admin_port=9100), build("q")
    policies = p.policies + q.policies
    for source in (OPERATOR_POD, PROMETHEUS,
                   Pod(MONITORING_NAMESPACE, {}), Pod(MONITORING_NAMESPACE, OPERATOR_LABELS)):
        assert admitted(policies, source, p.orchestrator, 9100), source
        assert admitted(policies, source, p.orchestrator, 9000), source
    others = [Pod("anywhere", {}), Pod(NS, {"app": "curious"}), q.orchestrator, *p.stage_pods,
              Pod(NS, OPERATOR_LABELS), Pod("elsewhere", OPERATOR_LABELS),
              Pod(OPERATOR_NS, {"app": "not-the-operator"}),
              Pod("monitoring-x", {}), Pod(NS, dict(PROMETHEUS.labels))]
    for source in others:
        assert admitted(policies, source, p.orchestrator, 9000), source
        assert not admitted(policies, source, p.orchestrator, 9100), source
    # Their own admin port each: q's default port is not p's.
    assert admitted(policies, OPERATOR_POD, q.orchestrator, ADMIN)
    assert not admitted(policies, OPERATOR_POD, p.orchestrator, ADMIN)


@pytest.mark.parametrize(("settings", "who"), [
    (NetworkPolicySettings(enabled=True), [PROMETHEUS]),  # the operator's pods not known
    (NetworkPolicySettings(enabled=True, operator=OPERATOR, monitoring_namespace="prom"),
     [OPERATOR_POD, Pod("prom", {})]),
    (NetworkPolicySettings(enabled=True, operator=OPERATOR, monitoring_namespace=None),
     [OPERATOR_POD]),
    (NetworkPolicySettings(enabled=True, monitoring_namespace=None), []),
])
def test_who_reaches_the_admin_port_follows_the_settings(settings: NetworkPolicySettings,
                                                         who: list[Pod]) -> None:
    """Without a peer to admit, no admin rule at all (a rule with no `from` admits
    everyone): only the node's probes reach it."""
    built = build("p", settings)
    [_, front] = built.policies
    candidates = [OPERATOR_POD, PROMETHEUS, Pod("prom", {}), Pod(NS, {})]
    for source in candidates:
        assert admitted(built.policies, source, built.orchestrator, API)
        assert admitted(built.policies, source, built.orchestrator, ADMIN) == (source in who), \
            source
    assert len(front["spec"]["ingress"]) == (2 if who else 1)
    assert all(rule.get("from") for rule in front["spec"]["ingress"][1:])


def test_the_policies_exactly() -> None:
    """Ports, peers and policy types as intended; owned by the pipeline and labelled for the
    operator's view (managed-by) and for the pipeline's DELETED wake."""
    built = build("p")
    stages, front = built.policies
    owner = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "name": "p",
             "uid": "uid-p", "controller": True, "blockOwnerDeletion": True}
    for policy, component in ((stages, "stage"), (front, "orchestrator")):
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["metadata"]["namespace"] == NS
        assert policy["metadata"]["ownerReferences"] == [owner]
        assert policy["metadata"]["labels"] == {
            kube.LABEL_PIPELINE: "p", kube.LABEL_COMPONENT: component,
            kube.LABEL_MANAGED_BY: kube.MANAGED_BY}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert stages["spec"] == {
        "podSelector": {"matchLabels": {kube.LABEL_PIPELINE: "p", kube.LABEL_COMPONENT: "stage"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": {kube.LABEL_PIPELINE: "p",
                                                       kube.LABEL_COMPONENT: "orchestrator"}}}],
             "ports": [{"protocol": "TCP", "port": ZMQ}]},
            {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: OPERATOR_NS}},
                       "podSelector": {"matchLabels": OPERATOR_LABELS}}],
             "ports": [{"protocol": "TCP", "port": SIDE}]},
        ],
    }
    assert front["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": API}]},
        {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: OPERATOR_NS}},
                   "podSelector": {"matchLabels": OPERATOR_LABELS}},
                  {"namespaceSelector": {"matchLabels": {
                      NAMESPACE_NAME_LABEL: MONITORING_NAMESPACE}}}],
         "ports": [{"protocol": "TCP", "port": ADMIN}]},
    ]
    # The orchestrator policy admits the ports the orchestrator listens on (and probes).
    [deployment] = [c for c in built.children if c["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": API},
                                  {"name": kube.ADMIN_PORT_NAME, "containerPort": ADMIN}]
    assert container["readinessProbe"]["httpGet"]["port"] == API


def test_stage_probes_use_the_side_port() -> None:
    """The probes go to the side port, which the policy admits only the operator to: that holds
    because a pod's own node (the kubelet) is always admitted (network_policy's docstring)."""
    [pool] = [c for c in build("p").children if c["kind"] == "StagePool"][:1]
    pool = {**pool, "metadata": {**pool["metadata"], "uid": "u"}}
    [container] = builders.pool_pod(pool, 0)["spec"]["containers"]
    assert {probe["httpGet"]["port"] for probe in (
        container["startupProbe"], container["livenessProbe"], container["readinessProbe"])
    } == {SIDE}
    assert {p["containerPort"] for p in container["ports"]} == {ZMQ, SIDE}


def test_without_the_operator_pods_known_nobody_reaches_the_side_port() -> None:
    """An operator outside a pod gives no labels: no side-port rule at all (a rule with no
    `from` would admit everyone)."""
    built = build("p", NetworkPolicySettings(enabled=True))
    stages, _ = built.policies
    assert [r["ports"] for r in stages["spec"]["ingress"]] == [[{"protocol": "TCP", "port": ZMQ}]]
    target = built.stage_pods[0]
    assert admitted(built.policies, built.orchestrator, target, ZMQ)
    for source in (OPERATOR_POD, Pod(NS, {}), Pod("x", {})):
        assert not admitted(built.policies, source, target, SIDE)


@pytest.mark.parametrize("settings", [None, NetworkPolicySettings(enabled=False),
                                      NetworkPolicySettings(enabled=False, operator=OPERATOR)])
def test_off_makes_no_policy_and_changes_nothing_else(
        settings: NetworkPolicySettings | None) -> None:
    off, on = build("p", settings), build("p", ON)
    assert off.policies == []
    assert off.children == [c for c in on.children if c["kind"] != "NetworkPolicy"]


def test_policies_come_before_the_workloads() -> None:
    """The reconciler applies what is no workload first: the policies are in force when the
    first pods start."""
    kinds = [c["kind"] for c in build("p").children]
    first_workload = min(kinds.index("Deployment"), kinds.index("StagePool"))
    assert kinds.index("NetworkPolicy") < first_workload
    assert kinds.count("NetworkPolicy") == 2


def test_the_policies_are_the_pure_functions_output() -> None:
    owner, pipeline = _pipeline("p")
    assert build("p").policies == pipeline_network_policies(owner, pipeline, OPERATOR)
    assert build("p", NetworkPolicySettings(enabled=True, operator=OPERATOR,
                                            monitoring_namespace="m")).policies == \
        pipeline_network_policies(owner, pipeline, OPERATOR, "m")


# ---- the operator's flags -> the settings ----------------------------------------------------


def _args(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["operator", *argv])


def settings_from_flags(*argv: str) -> NetworkPolicySettings:
    """The settings `omnistage operator ARGV...` builds its pipelines' policies with."""
    args = _args(*argv)
    return network_policy_settings(args.network_policy, args.operator_pod_labels,
                                   args.operator_namespace, args.monitoring_namespace)


def test_flags_default_on_and_name_the_operator_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert settings_from_flags() == NetworkPolicySettings(enabled=True)  # on; no pod known
    assert settings_from_flags("--no-network-policy", "--operator-pod-labels=a=1",
                               "--operator-namespace=x") == NetworkPolicySettings(enabled=False)
    chart = ",".join(f"{k}={v}" for k, v in sorted(OPERATOR_LABELS.items()))
    assert settings_from_flags(f"--operator-pod-labels={chart}",
                               f"--operator-namespace={OPERATOR_NS}") == ON
    monkeypatch.setenv("POD_NAMESPACE", OPERATOR_NS)  # the chart's downward-API env
    assert settings_from_flags(f"--operator-pod-labels={chart}") == ON
    monkeypatch.delenv("POD_NAMESPACE")
    with pytest.raises(ValueError, match="--operator-namespace"):
        settings_from_flags("--operator-pod-labels=a=1")


def test_the_monitoring_namespace_flag() -> None:
    """Default "monitoring"; another name; "" for none (as the chart's empty value passes)."""
    assert settings_from_flags().monitoring_namespace == MONITORING_NAMESPACE == "monitoring"
    assert settings_from_flags("--monitoring-namespace=prom").monitoring_namespace == "prom"
    assert settings_from_flags("--monitoring-namespace=").monitoring_namespace is None
    chart = ",".join(f"{k}={v}" for k, v in sorted(OPERATOR_LABELS.items()))
    assert settings_from_flags(f"--operator-pod-labels={chart}",
                               f"--operator-namespace={OPERATOR_NS}",
                               "--monitoring-namespace=") == NetworkPolicySettings(
        enabled=True, operator=OPERATOR, monitoring_namespace=None)


@pytest.mark.parametrize("bad", ["a", "=1", "a=1,b"])
def test_bad_pod_labels_are_refused_by_the_parser(bad: str) -> None:
    with pytest.raises(SystemExit):
        _args(f"--operator-pod-labels={bad}")


@pytest.mark.parametrize("bad", ["Monitoring", "a_b", "-x", "x" * 64])
def test_a_bad_monitoring_namespace_is_refused_by_the_parser(bad: str) -> None:
    with pytest.raises(SystemExit):
        _args(f"--monitoring-namespace={bad}")


# ---- the reconciler applies them, once --------------------------------------------------------


class Api:
    """Records applies and answers them as the API server would (the object, created once);
    lists find nothing."""

    def __init__(self) -> None:
        self.applies: list[tuple[str, Obj]] = []
        self.live: dict[str, Obj] = {}

    async def apply(self, url: str, obj: Obj, **_: Any) -> Applied:
        self.applies.append((url, obj))
        created = url not in self.live
        self.live[url] = {**copy.deepcopy(obj), "metadata": {
            **copy.deepcopy(obj["metadata"]), "uid": f"uid-{len(self.live)}",
            "resourceVersion": "1"}}
        return Applied(self.live[url], created=created)

    async def patch(self, url: str, body: Obj, kind: str = "merge", **_: Any) -> Obj:
        return body

    async def create(self, url: str, obj: Obj, **_: Any) -> Obj:
        return obj

    async def get(self, url: str, **_: Any) -> Obj:
        raise ApiError(404, {"kind": "Status", "reason": "NotFound"}, "GET", url)

    async def close(self) -> None:
        pass


async def test_the_reconciler_applies_them_in_the_first_wave_and_not_again() -> None:
    api = Api()
    c = Controller(api=api, network_policy=ON)  # type: ignore[arg-type]
    c.writes.event = lambda *a, **k: None  # type: ignore[method-assign,assignment]
    owner, _ = _pipeline("p")
    c.view.observe("OmniPipeline", "ADDED", owner)
    await c.pipeline_reconciler.reconcile(owner)
    urls = [url for url, _ in api.applies]
    policy_urls = [path("NetworkPolicy", NS, "p-stages"), path("NetworkPolicy", NS,
                                                               "p-orchestrator")]
    assert policy_urls[0] == "/apis/networking.k8s.io/v1/namespaces/team-a/networkpolicies/p-stages"
    assert set(policy_urls) <= set(urls)
    workloads = [i for i, u in enumerate(urls) if "/deployments/" in u or "/stagepools/" in u]
    assert max(urls.index(u) for u in policy_urls) < min(workloads)
    # The view sees what was applied (as the watch would): the next pass writes no policy.
    for url in policy_urls:
        c.view.observe("NetworkPolicy", "ADDED", api.live[url])
    api.applies.clear()
    await c.pipeline_reconciler.reconcile(owner)
    assert not [u for u, _ in api.applies if "/networkpolicies/" in u]
    # A policy edited by hand is put back.
    drifted = copy.deepcopy(api.live[policy_urls[0]])
    drifted["spec"]["ingress"] = []
    c.view.observe("NetworkPolicy", "MODIFIED", drifted)
    await c.pipeline_reconciler.reconcile(owner)
    assert [u for u, _ in api.applies if "/networkpolicies/" in u] == [policy_urls[0]]


async def test_a_controller_without_the_setting_applies_none() -> None:
    api = Api()
    c = Controller(api=api)  # type: ignore[arg-type]
    c.writes.event = lambda *a, **k: None  # type: ignore[method-assign,assignment]
    owner, _ = _pipeline("p")
    c.view.observe("OmniPipeline", "ADDED", owner)
    await c.pipeline_reconciler.reconcile(owner)
    assert api.applies and not [u for u, _ in api.applies if "/networkpolicies/" in u]
