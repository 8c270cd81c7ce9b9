"""A pipeline's NetworkPolicies (issue 43): who may open a connection to its pods.

Pure, like omni_operator.builders (which includes these in pipeline_children). Two policies,
Ingress only (what the pods may reach is not restricted):

- `<pipeline>-stages` selects the pipeline's stage pods (every pool's). The worker ZMQ port
  admits only this pipeline's orchestrator pods, the one client of the data path: stage
  workers never connect to each other, the orchestrator routes every hop. The worker side
  port (/livez, /readyz, /metrics, /state: read-only) admits only the operator's pods: the
  drain reads /state there, and no orchestrator calls it. Nothing else reaches either port.
- `<pipeline>-orchestrator` selects its orchestrator pods. Their API port
  (spec.orchestrator.port) admits everyone: it is the public API (clients, gateways). Their
  admin port (spec.orchestrator.adminPort: control, GET /v1/load, /metrics) admits only the
  operator's pods (the autoscaler and the drain read /v1/load there, with the pipeline's admin
  key) and the pods of the monitoring namespace (`--monitoring-namespace`, default
  "monitoring": a Prometheus scraping /metrics, which needs no key; "" admits none). The key
  is what guards control and /v1/load; the policy narrows who may even try.

Probes: the kubelet probes the side port (startup, liveness, readiness: builders.pod_template)
and the orchestrator's API port, from the pod's own node, and traffic from a pod's own node is
always admitted (the NetworkPolicy API's rule, which CNIs implement), so admitting only the
operator on the side port fails no probe. What is NOT admitted to the side port: the API
server's pod proxy from another node (the in-flight column of `omnistage status` then reads
`?`) and a Prometheus scraping the workers. Nor to the admin port: the API server's service
proxy from another node (the autoscaler's fallback when it cannot reach a pod straight).
Policies add up: a policy of your own that admits more (a Prometheus elsewhere, say) goes
beside these, never into them (the operator puts these back as it builds them).

Peers are matched by labels: whoever may create pods labelled as this pipeline's orchestrator
in its namespace passes the stage policy, and whoever may create pods in the monitoring
namespace reaches the admin port (not the keyed routes behind it). The operator's pods are
matched by namespace and pod labels together (`--operator-namespace`, `--operator-pod-labels`;
the chart passes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_operator.metadata import component_selector, labels, object_meta, orchestrator_name
from omnistage import kube
from omnistage.spec import OmniPipeline

Obj = dict[str, Any]

API_VERSION = "networking.k8s.io/v1"
#: The label the API server puts on every Namespace (its name), so a peer can name one.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: Whose pods reach the orchestrators' admin port besides the operator's, by default
#: (`--monitoring-namespace`; the chart's networkPolicy.monitoringNamespace).
MONITORING_NAMESPACE = "monitoring"


@dataclass(frozen=True)
class OperatorPeer:
    """The operator's own pods, as a NetworkPolicy peer: their namespace and pod labels."""

    namespace: str
    pod_labels: Mapping[str, str]


@dataclass(frozen=True)
class NetworkPolicySettings:
    """The operator-wide setting: `--network-policy` (on unless --no-network-policy; chart
    value networkPolicy.enabled). operator: its pods, admitted to the stage pods' side port
    and the orchestrator pods' admin port; None when they are not known (an operator run
    outside a pod): no pod is admitted there for it. monitoring_namespace: every pod of it is
    admitted to the orchestrators' admin port (/metrics); "" or None: none."""

    enabled: bool = False
    operator: OperatorPeer | None = None
    monitoring_namespace: str | None = MONITORING_NAMESPACE


def stages_policy_name(pipeline: str) -> str:
    return f"{pipeline}-stages"


def _ports(*ports: int) -> list[Obj]:
    # The protocol spelled out: the API server defaults it to TCP, and the operator compares
    # its intent with the live object field by field.
    return [{"protocol": "TCP", "port": p} for p in ports]


def operator_peer(peer: OperatorPeer) -> Obj:
    """The operator's pods in their namespace: one peer, so both selectors must match."""
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: peer.namespace}},
            "podSelector": {"matchLabels": dict(sorted(peer.pod_labels.items()))}}


def namespace_peer(namespace: str) -> Obj:
    """Every pod of one namespace, as a NetworkPolicy peer."""
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}


def pipeline_network_policies(owner: Obj, pipeline: OmniPipeline,
                              operator: OperatorPeer | None,
                              monitoring_namespace: str | None = MONITORING_NAMESPACE
                              ) -> list[Obj]:
    """The pipeline's two NetworkPolicies (see the module's docstring), owned by `owner`, the
    OmniPipeline as the API server has it (namespace and uid)."""
    name, ns = pipeline.metadata.name, owner["metadata"]["namespace"]
    # A peer without a namespaceSelector is a pod of the policy's own namespace.
    orchestrators = {"podSelector": {"matchLabels": component_selector(name, "orchestrator")}}
    ingress: list[Obj] = [{"from": [orchestrators], "ports": _ports(kube.WORKER_ZMQ_PORT)}]
    if operator is not None:
        ingress.append({"from": [operator_peer(operator)],
                        "ports": _ports(kube.WORKER_HTTP_PORT)})
    # Without the operator's pods known, no rule for the side port: a rule with no `from`
    # would admit everyone, and an empty list of rules admits no one but the node (probes).
    stages = {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": object_meta(stages_policy_name(name), ns, labels(name, "stage"), owner),
        "spec": {
            "podSelector": {"matchLabels": component_selector(name, "stage")},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
    orch = pipeline.spec.orchestrator
    # No `from`: every source. The public API (see the module's docstring).
    front_ingress: list[Obj] = [{"ports": _ports(orch.port)}]
    admin_peers = [operator_peer(operator)] if operator is not None else []
    if monitoring_namespace:
        admin_peers.append(namespace_peer(monitoring_namespace))
    # None to admit: no rule at all (as for the side port: an empty `from` is everyone).
    if admin_peers:
        front_ingress.append({"from": admin_peers, "ports": _ports(orch.admin_listen_port)})
    front = {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": object_meta(orchestrator_name(name), ns, labels(name, "orchestrator"),
                                owner),
        "spec": {
            "podSelector": {"matchLabels": component_selector(name, "orchestrator")},
            "policyTypes": ["Ingress"],
            "ingress": front_ingress,
        },
    }
    return [stages, front]


def policies_for(owner: Obj, pipeline: OmniPipeline,
                 settings: NetworkPolicySettings | None) -> list[Obj]:
    """What pipeline_children adds: the policies when the setting is on, else none."""
    if settings is None or not settings.enabled:
        return []
    return pipeline_network_policies(owner, pipeline, settings.operator,
                                     settings.monitoring_namespace)
