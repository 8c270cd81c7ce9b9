"""Status: conditions with reasons that tell capacity problems from pods not ready from rollouts.

Pure functions. lastTransitionTime only moves when a condition's status flips, so recomputing an
unchanged world yields an identical status and the reconciler writes nothing.
"""

from __future__ import annotations

from typing import Any

from omni_operator.placement import unschedulable_message
from omni_operator.readiness import is_draining, is_ready
from omnistage import kube

Obj = dict[str, Any]


def condition(
    ctype: str, ok: bool, reason: str, message: str, generation: int, previous: list[Obj],
    now: str,
) -> Obj:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == ctype), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def pool_status(pool: Obj, pods: list[Obj], template_hash: str, now: str) -> Obj:
    meta, spec = pool["metadata"], pool["spec"]
    desired = int(spec.get("replicas", 0))
    gen = int(meta.get("generation", 0))
    previous = (pool.get("status") or {}).get("conditions", [])
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    ready = sum(1 for p in pods if is_ready(p))
    draining = sum(1 for p in pods if is_draining(p))
    updated = sum(
        1 for p in live
        if (p["metadata"].get("annotations") or {}).get(kube.ANNOTATION_SPEC_HASH) == template_hash
    )
    unschedulable = [(p["metadata"]["name"], m) for p in live if (m := unschedulable_message(p))]
    if unschedulable:
        name, msg = unschedulable[0]
        ok, reason, message = False, "InsufficientCapacity", f"{name}: {msg}"
    elif ready >= desired and len(live) == desired and updated == desired:
        ok, reason, message = True, "AllReplicasReady", f"{ready}/{desired} replicas ready"
    elif updated < min(desired, len(live)):
        ok, reason, message = False, "RollingUpdate", f"{updated}/{desired} replicas updated"
    elif len(live) > desired:
        ok, reason, message = ready >= desired, "ScalingDown", f"retiring {len(live) - desired}"
    else:
        ok, reason, message = False, "ReplicasNotReady", f"{ready}/{desired} replicas ready"
    return {
        "replicas": len(live),
        "readyReplicas": ready,
        "drainingReplicas": draining,
        "updatedReplicas": updated,
        "ready": f"{ready}/{desired}",
        "selector": f"{kube.LABEL_POOL}={meta['name']}",
        "observedGeneration": gen,
        "conditions": [condition("Ready", ok, reason, message, gen, previous, now)],
    }


def pipeline_status(
    pipeline: Obj, stages: list[str], pools: dict[str, Obj | None], deployment: Obj | None,
    want_orchestrators: int, endpoint: str, now: str,
) -> Obj:
    gen = int(pipeline["metadata"].get("generation", 0))
    previous = (pipeline.get("status") or {}).get("conditions", [])
    per_stage: dict[str, Obj] = {}
    not_ready: list[tuple[str, str, str]] = []
    for name in stages:
        pool = pools.get(name)
        st = (pool or {}).get("status") or {}
        desired = int(((pool or {}).get("spec") or {}).get("replicas", 0))
        per_stage[name] = {"pool": kube.pool_name(pipeline["metadata"]["name"], name),
                           "ready": int(st.get("readyReplicas", 0)), "desired": desired}
        cond = kube.condition(pool, "Ready")
        fresh = st.get("observedGeneration") == (pool or {}).get("metadata", {}).get("generation")
        if pool is None or cond is None or not fresh:
            not_ready.append((name, "StagesPending", f"stage {name}: pool not reconciled yet"))
        elif cond.get("status") != "True":
            not_ready.append((name, cond.get("reason", "ReplicasNotReady"),
                              f"stage {name}: {cond.get('message', '')}"))
    capacity = [n for n in not_ready if n[1] == "InsufficientCapacity"]
    first = (capacity or not_ready or [None])[0]
    stages_ok = first is None
    s_reason, s_msg = ("AllStagesReady", f"{len(stages)}/{len(stages)} stages ready") \
        if first is None else (first[1], first[2])
    dstatus = (deployment or {}).get("status") or {}
    o_ready = int(dstatus.get("readyReplicas", 0) or 0)
    orch_ok = deployment is not None and o_ready >= want_orchestrators
    o_reason = "OrchestratorAvailable" if orch_ok else "OrchestratorNotReady"
    o_msg = f"{o_ready}/{want_orchestrators} orchestrator replicas ready"
    if stages_ok and orch_ok:
        r_reason, r_msg = "Ready", "pipeline is serving"
    elif not stages_ok:
        r_reason, r_msg = s_reason, s_msg
    else:
        r_reason, r_msg = o_reason, o_msg
    ready_n = sum(1 for s in per_stage.values() if s["ready"] >= s["desired"])
    phase = "Ready" if stages_ok and orch_ok else (
        "Degraded" if any(s["ready"] for s in per_stage.values()) else "Pending")
    return {
        "observedGeneration": gen,
        "phase": phase,
        "endpoint": endpoint,
        "stagesReady": f"{ready_n}/{len(stages)}",
        "stages": per_stage,
        "conditions": [
            condition("Ready", stages_ok and orch_ok, r_reason, r_msg, gen, previous, now),
            condition("StagesReady", stages_ok, s_reason, s_msg, gen, previous, now),
            condition("OrchestratorReady", orch_ok, o_reason, o_msg, gen, previous, now),
        ],
    }
