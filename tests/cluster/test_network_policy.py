"""A pipeline's NetworkPolicies on the real API server: it accepts them as built, the operator
makes them (on by default), puts them back when edited or deleted, writes nothing once they
match, and the garbage collector deletes them with their pipeline.

The local control plane's pods have no network plugin (loopback pod IPs), so nothing enforces
the policies here: which pods they select and admit is tests/unit/test_network_policy.py's,
against the pods the real builders make.
"""

from __future__ import annotations

import json
from typing import Any

from omni_operator import builders
from omni_operator.controller import Controller
from omni_operator.network_policy import NetworkPolicySettings, OperatorPeer
from omnistage.kubeapi import KubeApi, KubeConfig, path
from omnistage.spec import parse_pipeline
from tests.cluster.test_operator import kwok_pipeline, stage
from tests.harness.cluster import Cluster
from tests.harness.operator import Operator, apply, get, wait_for

Obj = dict[str, Any]


def _policies(kube: Cluster, ns: str) -> dict[str, Obj]:
    out = kube.kubectl("get", "networkpolicies", "-n", ns, "-o", "json").stdout
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


def _intents(live_pipeline: Obj, settings: NetworkPolicySettings) -> dict[str, Obj]:
    """The policies the operator builds for the pipeline as the API server has it."""
    children = builders.pipeline_children(live_pipeline, parse_pipeline(live_pipeline),
                                          network_policy=settings)
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "NetworkPolicy"}


def _as_built(intent: Obj, live: Obj | None) -> bool:
    """The live policy has the built spec, every field as built (the API server defaults none
    the intent leaves out) and the built labels."""
    return live is not None and live["spec"] == intent["spec"] and (
        intent["metadata"]["labels"].items() <= live["metadata"]["labels"].items())


def test_the_operator_makes_keeps_and_garbage_collects_them(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    apply(kube, namespace, kwok_pipeline("np", [stage("a", final=True, replicas=1)]))
    pipeline = wait_for(lambda: get(kube, namespace, "omnipipe", "np"), 30, "np created")
    # The session operator runs outside a pod: on by default, its own pods unknown (the
    # monitoring namespace alone reaches the orchestrators' admin port).
    wanted = _intents(pipeline, NetworkPolicySettings(enabled=True))
    assert wanted["np-orchestrator"]["spec"]["ingress"][1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert sorted(wanted) == ["np-orchestrator", "np-stages"]

    def made() -> dict[str, Obj] | None:
        live = _policies(kube, namespace)
        return live if all(_as_built(w, live.get(n)) for n, w in wanted.items()) else None

    live = wait_for(made, 60, "np's NetworkPolicies as built", operator.log_tail)
    for policy in live.values():
        [ref] = policy["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("OmniPipeline", "np",
                                                           pipeline["metadata"]["uid"])
        assert ref["controller"] is True and ref["blockOwnerDeletion"] is True

    # Opened up by hand: put back. Deleted by hand: made again.
    kube.kubectl("patch", "networkpolicy", "-n", namespace, "np-stages", "--type=merge",
                 "-p", json.dumps({"spec": {"ingress": [{}]}}))
    wait_for(made, 60, "np-stages put back", operator.log_tail)
    kube.kubectl("delete", "networkpolicy", "-n", namespace, "np-orchestrator")
    wait_for(made, 60, "np-orchestrator made again", operator.log_tail)

    # With the pipeline, the garbage collector deletes them (their owner reference).
    kube.kubectl("delete", "omnipipe", "-n", namespace, "np", "--wait=false")
    wait_for(lambda: not _policies(kube, namespace), 120, "np's NetworkPolicies collected",
             operator.log_tail)


async def test_the_api_server_takes_the_operator_peer_as_the_controller_builds_it(
    kube: Cluster, namespace: str, operator: Operator
) -> None:
    """With the operator's pods known (as the chart runs it): the reconciler's apply of the
    namespaceSelector + podSelector peer is valid, and kept as built, so the next pass writes
    nothing. A Controller of the test's own (the session operator paused), reconciling once."""
    settings = NetworkPolicySettings(enabled=True, operator=OperatorPeer(
        "omnistage-system", {"app.kubernetes.io/name": "omnistage-operator",
                             "app.kubernetes.io/instance": "omnistage"}))
    with operator.paused():
        api = KubeApi(KubeConfig.load(kube.kubeconfig))
        controller = Controller(KubeApi(KubeConfig.load(kube.kubeconfig)),
                                network_policy=settings)
        try:
            doc = kwok_pipeline("peer", [stage("a", final=True, replicas=0)])
            created = await api.create(path("OmniPipeline", namespace), doc)
            await controller.prime([namespace])
            await controller.pipeline_reconciler.reconcile(
                controller.view.pipelines[(namespace, "peer")])
            wanted = _intents(created, settings)
            # The next pass's check, on a client of its own (the reconcile's events are still
            # being written on the first one's).
            again, writes = Controller(api, network_policy=settings), api.writes
            for name, intent in wanted.items():
                live = await api.get(path("NetworkPolicy", namespace, name))
                assert _as_built(intent, live), live
                await again.writes.ensure(intent, live)
            assert api.writes == writes  # converged: no write
            stages = wanted["peer-stages"]["spec"]
            assert [sorted(r["from"][0]) for r in stages["ingress"]] == [
                ["podSelector"], ["namespaceSelector", "podSelector"]]
            # The orchestrators' admin port: the operator's pods and the monitoring namespace.
            front = wanted["peer-orchestrator"]["spec"]
            assert [[sorted(p) for p in r.get("from") or []] for r in front["ingress"]] == [
                [], [["namespaceSelector", "podSelector"], ["namespaceSelector"]]]
        finally:
            await controller.stop()
            await api.close()
