"""Placement hints become exact pod scheduling fields (pure functions; the cluster suite checks
that the real scheduler honours them, tests/cluster/test_scheduling.py)."""

from __future__ import annotations

from typing import Any

from omni_operator.placement import HOSTNAME, pod_scheduling, tolerations, unschedulable_message
from omnistage import kube
from omnistage.spec import Stage


def stage(**placement: Any) -> Stage:
    """Spreading is on by default; a test that wants it says so."""
    placement = {"spreadAcrossNodes": False, **placement}
    return Stage.model_validate({"name": "img", "kind": "echo", "placement": placement})


def test_replicas_spread_by_default() -> None:
    """Kills: the default of spreadAcrossNodes turned off."""
    plain = Stage.model_validate({"name": "img", "kind": "echo"})
    assert "topologySpreadConstraints" in pod_scheduling("p", plain)


def test_no_hints_no_scheduling_fields() -> None:
    """Kills: empty hints emitting empty (but present) fields."""
    assert pod_scheduling("p", stage()) == {}


def test_node_selector_is_sorted_and_copied() -> None:
    """Kills: dropping the selector, or emitting it in dict order (pod specs must be stable so
    the template hash does not change between operator runs)."""
    out = pod_scheduling("p", stage(nodeSelector={"b": "2", "a": "1"}))
    assert list(out["nodeSelector"].items()) == [("a", "1"), ("b", "2")]


def test_tolerations_keep_kubernetes_field_names_and_drop_unset() -> None:
    """Kills: snake_case names (`toleration_seconds`) or nulls reaching the pod spec."""
    out = pod_scheduling("p", stage(tolerations=[
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "t", "operator": "Equal", "value": "v", "effect": "NoExecute",
         "tolerationSeconds": 30}]))
    assert out["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "t", "operator": "Equal", "value": "v", "effect": "NoExecute",
         "tolerationSeconds": 30}]
    assert tolerations([]) == []


def test_colocation_is_a_preferred_host_affinity_per_stage() -> None:
    """Kills: a required affinity (a full node would make the stage unschedulable), a wrong
    topology key or weight, and the wrong pipeline or stage in the selector."""
    out = pod_scheduling("p", stage(colocateWith=["enc", "vae"]))
    assert set(out) == {"affinity"}
    terms = out["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [
        {"weight": 100, "podAffinityTerm": {
            "topologyKey": HOSTNAME,
            "labelSelector": {"matchLabels": {kube.LABEL_PIPELINE: "p", kube.LABEL_STAGE: other}},
        }} for other in ("enc", "vae")]
    assert HOSTNAME == "kubernetes.io/hostname"


def test_spread_is_a_soft_per_host_constraint_on_this_stage() -> None:
    """Kills: DoNotSchedule, a skew other than 1, and selecting another stage's pods."""
    out = pod_scheduling("p", stage(spreadAcrossNodes=True))
    assert out == {"topologySpreadConstraints": [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {kube.LABEL_PIPELINE: "p", kube.LABEL_STAGE: "img"}},
    }]}


def _pod(status: str, reason: str, message: str | None) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": "PodScheduled", "status": status, "reason": reason}
    if message is not None:
        cond["message"] = message
    return {"status": {"conditions": [cond]}}


def test_unschedulable_message_only_for_the_schedulers_verdict() -> None:
    """Kills: reporting any False PodScheduled (or a True one) as insufficient capacity, and
    losing the scheduler's own message."""
    msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert unschedulable_message(_pod("False", "Unschedulable", msg)) == msg
    assert unschedulable_message(_pod("False", "Unschedulable", None)) == "pod is unschedulable"
    assert unschedulable_message(_pod("False", "SchedulerError", msg)) is None
    assert unschedulable_message(_pod("True", "Unschedulable", msg)) is None
    assert unschedulable_message({"status": {}}) is None
