"""Status: phases and conditions that say what is true, computed by pure functions.

- Ready: serving at or above the minimum. A stage's minimum is `min(replicas, settled) -
  maxUnavailable`, at least one replica, where `settled` is the replica count the pool last
  reached with every replica updated and ready (status.settledReplicas). So a scale-up does not
  count the replicas it is still adding, and a rollout that retires one replica at a time within
  maxUnavailable keeps Ready True; losing replicas that were serving does not.
- Progressing: a rollout, a scale or replicas still starting.
- Degraded (phase): below the minimum after having served; Pending: not served yet.
- Waking: a pool the autoscaler took to zero (IdleAtZero) and now asked for replicas is below
  its minimum only because they are starting: its Ready is False with reason Waking from the
  moment it left zero (lastTransitionTime), and the pipeline counts the stage as serving
  (requests for it are held, not failed) until the wake has lasted the pipeline's
  requestTimeoutSeconds, past which a held request has timed out: then Degraded, as any stage
  below its minimum.
- Terminating (phase): the object is being deleted.
- Invalid (phase), Ready=False reason InvalidSpec: the spec is refused, with every field error.

lastTransitionTime only moves when a condition's status flips, so recomputing an unchanged world
yields an identical status and the reconciler writes nothing.

The functions take objects as the API server returns them (dicts) and return the typed statuses
of omni_operator.status_models; the controller writes their wire form.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from omni_operator import release
from omni_operator.models import desired_replicas
from omni_operator.placement import unschedulable_message
from omni_operator.readiness import is_draining, is_ready
from omni_operator.status_models import (
    PHASES,
    AutoscalerStatus,
    Condition,
    CurveKeysStatus,
    PipelineRevisions,
    PipelineStatus,
    PoolStatus,
    RevisionReplicas,
    StageStatus,
    Status,
    status_model,
)
from omnistage import kube
from omnistage.spec import Autoscaling

__all__ = [
    "IDLE_AT_ZERO",
    "INVALID_SPEC",
    "MODEL_FAILURES",
    "PHASES",
    "condition",
    "invalid_status",
    "milestone",
    "model_failure",
    "pipeline_status",
    "pool_status",
    "reported_invalid",
    "stage_minimum",
    "summary",
    "terminating_status",
    "transition_event",
    "waking_for",
]

Obj = dict[str, Any]

INVALID_SPEC = "InvalidSpec"
#: Ready reasons of a pool at zero that serves through the hold and the wake, and of one that
#: is coming up from there (see the module doc).
IDLE_AT_ZERO = "IdleAtZero"
WAKING = "Waking"
#: The pipeline's Ready reason when a stage's wake lasted past its bound.
WAKE_TIMEOUT = "WakeTimeout"
#: Phases after which a pipeline below its minimum is Degraded rather than still Pending.
_HAS_SERVED = ("Ready", "Progressing", "Degraded")


def condition(
    ctype: str, ok: bool, reason: str, message: str, generation: int,
    previous: list[Condition] | None, now: str,
) -> Condition:
    """The condition, keeping the previous one's lastTransitionTime while its status holds."""
    status = "True" if ok else "False"
    old = next((c for c in previous or [] if c.type == ctype), None)
    since = old.last_transition_time if old and old.status == status else now
    return Condition(type=ctype, status=status, reason=reason, message=message,
                     last_transition_time=since, observed_generation=generation)


def stage_minimum(desired: int, settled: int, max_unavailable: int) -> int:
    """Fewest ready replicas at which a stage still serves as promised (see the module doc)."""
    return max(1, min(desired, settled) - max_unavailable)


#: Ready reasons of a stage whose model cannot be fetched or loaded.
MODEL_FAILURES = ("ModelFetchFailed", "ModelLoadFailed")


def _failed_run(status: Obj) -> Obj | None:
    """The container's latest failed run (its current state, else the one before a restart)."""
    state = status.get("state") or {}
    if "running" in state and status.get("ready"):
        return None
    for term in (state.get("terminated"), (status.get("lastState") or {}).get("terminated")):
        if term is not None:
            return term if term.get("exitCode", 0) != 0 else None
    return None


def model_failure(pod: Obj) -> tuple[str, str] | None:
    """(reason, message) when this replica could not fetch its model (the model-fetch init
    container failed) or load it (the worker exited MODEL_FAILED_EXIT); the message names the
    stage, the model, the pod and the last line of the container's termination message."""
    status = pod.get("status") or {}
    stage = (pod["metadata"].get("labels") or {}).get(kube.LABEL_STAGE, "?")
    checks = [("ModelFetchFailed", "could not be fetched", c, None)
              for c in status.get("initContainerStatuses") or []
              if c.get("name") == kube.MODEL_FETCH_CONTAINER]
    checks += [("ModelLoadFailed", "could not be loaded", c, kube.MODEL_FAILED_EXIT)
               for c in status.get("containerStatuses") or [] if c.get("name") == "worker"]
    for reason, what, cstatus, code in checks:
        term = _failed_run(cstatus)
        if term is None or (code is not None and term.get("exitCode") != code):
            continue
        lines = [ln.strip() for ln in str(term.get("message") or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {term.get('exitCode')}"
        return reason, (f"stage {stage!r}: the model {what} on {pod['metadata']['name']}: "
                        f"{why}")
    return None


def pool_status(pool: Obj, pods: list[Obj], template_hash: str, now: str,
                autoscaler: AutoscalerStatus | None = None) -> PoolStatus:
    """The pool's status. autoscaler: the autoscaler's latest decision (None: keep the stored
    one); a pool without spec.stage.autoscaling carries none."""
    meta, spec = pool["metadata"], pool["spec"]
    desired = desired_replicas(pool)
    max_unavailable = int((spec.get("stage") or {}).get("maxUnavailable", 1))
    gen = int(meta.get("generation", 0))
    old = PoolStatus.stored(pool)
    previous = old.conditions
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    ready = sum(1 for p in pods if is_ready(p))
    draining = sum(1 for p in pods if is_draining(p))
    updated = sum(
        1 for p in live
        if (p["metadata"].get("annotations") or {}).get(kube.ANNOTATION_SPEC_HASH) == template_hash
    )
    unschedulable = [(p["metadata"]["name"], m) for p in live if (m := unschedulable_message(p))]
    target = release.pool_revision(pool)
    revisions = revision_replicas(pods)
    behind = [p for p in live if release.outdated(target, p)]
    surging = sum(1 for p in live if release.is_surge(p) and not is_draining(p))
    settled_now = len(live) == desired and updated == desired and ready >= desired
    settled = desired if settled_now else int(old.settled_replicas or 0)
    minimum = stage_minimum(desired, settled, max_unavailable)
    counts = f"{min(ready, desired)}/{desired} replicas ready"
    failures = [f for p in live if (f := model_failure(p))]
    old_ready = old.condition("Ready")
    # Up from zero, and not settled since: starting replicas are a wake, not a loss. A model
    # that cannot load is a failure all the same.
    waking = (_wakes_on_demand(spec) and not failures and old_ready is not None
              and old_ready.reason in (IDLE_AT_ZERO, WAKING))

    if desired == 0 and _wakes_on_demand(spec):
        ok, reason, message = True, IDLE_AT_ZERO, (
            "scaled to zero by the autoscaler: a request for the stage is held and wakes it")
    elif desired == 0:
        ok, reason, message = False, "ScaledToZero", "replicas is 0: the stage cannot serve"
    elif ready >= minimum:
        reason = "AllReplicasReady" if ready >= desired else "MinimumReplicasReady"
        ok, message = True, f"{counts} (minimum {minimum})"
    elif waking:
        waits = f"; {unschedulable[0][0]}: {unschedulable[0][1]}" if unschedulable else ""
        ok, reason, message = False, WAKING, (
            f"waking from zero: {counts} (minimum {minimum}); requests for the stage are "
            f"held meanwhile{waits}")
    elif unschedulable:
        name, msg = unschedulable[0]
        ok, reason, message = False, "InsufficientCapacity", f"{name}: {msg}"
    elif failures:
        ok, (reason, message) = False, failures[0]
    else:
        ok, reason, message = False, "ReplicasNotReady", f"{counts} (minimum {minimum})"

    if behind:
        new_ready = sum(r.ready or 0 for r in revisions if r.revision == target)
        moving, m_reason, m_msg = True, "Release", (
            f"revision {target}: {new_ready} ready; {len(behind)} replica(s) of "
            f"{', '.join(sorted({str(release.pod_revision(p)) for p in behind}))} left")
    elif surging and len(live) - surging <= desired:
        moving, m_reason, m_msg = True, "Release", (
            f"revision {target}: the release's extra replica leaves once all are ready")
    elif len(live) > desired:
        moving, m_reason, m_msg = True, "ScalingDown", f"retiring {len(live) - desired} replica(s)"
    elif unschedulable:
        name, msg = unschedulable[0]
        moving, m_reason, m_msg = True, "InsufficientCapacity", f"{name}: {msg}"
    elif len(live) < desired:
        moving, m_reason, m_msg = True, "ScalingUp", f"{len(live)}/{desired} replicas created"
    elif updated < desired:
        moving, m_reason, m_msg = True, "RollingUpdate", f"{updated}/{desired} replicas updated"
    elif ready < desired:
        moving, m_reason, m_msg = True, "ReplicasStarting", counts
    else:
        moving, m_reason, m_msg = False, "UpToDate", f"{desired} replicas updated and ready"
    scaler = (autoscaler or old.autoscaler) if (spec.get("stage") or {}).get("autoscaling") \
        else None
    conditions = [
        condition("Ready", ok, reason, message, gen, previous, now),
        condition("Progressing", moving, m_reason, m_msg, gen, previous, now),
    ]
    if scaler is not None:
        conditions.append(condition("Autoscaling", *_autoscaling(scaler), gen, previous, now))
    return PoolStatus(
        replicas=len(live),
        ready_replicas=ready,
        draining_replicas=draining,
        updated_replicas=updated,
        settled_replicas=settled,
        # Never more ready than desired (3/1): extra replicas are on their way out.
        ready=f"{min(ready, desired)}/{desired}",
        selector=f"{kube.LABEL_POOL}={meta['name']}",
        autoscaler=scaler,
        revision=target,
        revisions=revisions or None,
        observed_generation=gen,
        conditions=conditions,
    )


def revision_replicas(pods: list[Obj]) -> list[RevisionReplicas]:
    """Replicas per revision among those not retiring (pods without the label left out),
    newest release order first."""
    counts: dict[str, list[int]] = {}  # revision -> [order, replicas, ready]
    for pod in pods:
        revision = release.pod_revision(pod)
        if revision is None or is_draining(pod):
            continue
        entry = counts.setdefault(revision, [0, 0, 0])
        entry[0] = max(entry[0], release.pod_order(pod))
        entry[1] += 1
        entry[2] += int(is_ready(pod))
    return [RevisionReplicas(revision=rev, order=order, replicas=n, ready=ready)
            for rev, (order, n, ready) in sorted(counts.items(),
                                                  key=lambda kv: (-kv[1][0], kv[0]))]


def _wakes_on_demand(spec: Obj) -> bool:
    """A pool the autoscaler may take to zero (minReplicas 0): at zero it still serves, since
    the orchestrator holds a request for it and wakes it (docs/architecture.md)."""
    scaling = (spec.get("stage") or {}).get("autoscaling")
    if not isinstance(scaling, dict):
        return False
    return scaling.get("minReplicas", Autoscaling.model_fields["min_replicas"].default) == 0


def _autoscaling(scaler: AutoscalerStatus) -> tuple[bool, str, str]:
    """The Autoscaling condition: whether the autoscaler sizes the pool, and if not why."""
    if scaler.rule == "external":
        return False, "ExternalAutoscaler", scaler.reason or ""
    if scaler.signal == "Unavailable":
        return False, "SignalUnavailable", (f"the load cannot be read, so the pool is not "
                                            f"scaled down: {scaler.signal_message or ''}")
    return True, "Active", scaler.reason or ""


Why = tuple[str, str]  # (reason, message)


def _seconds(stamp: str) -> float:
    """An RFC 3339 time (as conditions carry it) in epoch seconds."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def waking_for(pool: Obj | None, now: str) -> float | None:
    """How long the pool has been waking from zero (seconds since its Ready turned Waking), or
    None when it is not waking."""
    ready = PoolStatus.stored(pool).condition("Ready")
    if ready is None or ready.status == "True" or ready.reason != WAKING:
        return None
    since = ready.last_transition_time
    return max(0.0, _seconds(now) - _seconds(since)) if since else 0.0


def _stage_view(pool: Obj | None, now: str, wake_bound_s: float
                ) -> tuple[bool, Why | None, Why | None]:
    """(serving, why it is not, why it is progressing) for one stage's pool.

    A pool whose status predates its spec (a rollout or scale just began) keeps its last Ready
    verdict, so a spec change alone never flips the pipeline out of Ready. A pool waking from
    zero serves (its requests are held) until the wake has lasted wake_bound_s.
    """
    status = PoolStatus.stored(pool)
    ready = status.condition("Ready")
    if pool is None or ready is None:
        pending = ("StagesPending", "pool not reconciled yet")
        return False, pending, pending
    fresh = status.observed_generation == pool["metadata"].get("generation")
    moving = status.condition("Progressing")
    why_moving: Why | None = None
    if moving and moving.status == "True":
        why_moving = (_or(moving.reason, "Progressing"), _or(moving.message, ""))
    elif not fresh:
        why_moving = ("Progressing", "applying the new spec")
    waking = waking_for(pool, now)
    if waking is not None and waking < wake_bound_s:
        return True, None, (WAKING, _or(ready.message, ""))
    if waking is not None:
        return False, (WAKE_TIMEOUT, f"still waking after {waking:.0f}s, past the pipeline's "
                       f"requestTimeoutSeconds ({wake_bound_s:g}s) that a held request waits "
                       f"at most: {_or(ready.message, '')}"), why_moving
    if ready.status != "True":
        return False, (_or(ready.reason, "ReplicasNotReady"), _or(ready.message, "")), (
            why_moving)
    return True, None, why_moving


def _or(value: str | None, default: str) -> str:
    """A condition field, or default when the stored condition left it out."""
    return default if value is None else value


#: The wake bound when the caller names none: OrchestratorOptions.requestTimeoutSeconds'
#: default.
DEFAULT_WAKE_BOUND_S = 300.0


def pipeline_status(
    pipeline: Obj, stages: list[str], pools: dict[str, Obj | None], deployment: Obj | None,
    want_orchestrators: int, endpoint: str, now: str, *,
    wake_bound_s: float = DEFAULT_WAKE_BOUND_S, api_key_secret: str | None = None,
    curve_keys: CurveKeysStatus | None = None,
) -> PipelineStatus:
    """The pipeline's status from its pools and orchestrator Deployment. wake_bound_s: how long
    a stage may wake from zero and still count as serving (the pipeline's
    requestTimeoutSeconds)."""
    gen = int(pipeline["metadata"].get("generation", 0))
    old = PipelineStatus.stored(pipeline)
    previous = old.conditions
    per_stage: dict[str, StageStatus] = {}
    down: list[tuple[str, str]] = []  # (reason, message) of stages below their minimum
    moving: list[tuple[str, str]] = []
    stable: dict[str, str] = {}
    candidate: dict[str, str] = {}
    waking: list[str] = []  # stages waking from zero within the bound: serving, held
    for name in stages:
        pool = pools.get(name)
        st = PoolStatus.stored(pool)
        desired = desired_replicas(pool) if pool else 0
        routable = {r.revision: int(r.ready or 0) for r in st.revisions or [] if r.revision}
        per_stage[name] = StageStatus(pool=kube.pool_name(pipeline["metadata"]["name"], name),
                                      ready=min(int(st.ready_replicas or 0), desired),
                                      desired=desired, revision=st.revision,
                                      routable=dict(sorted(routable.items())) or None)
        if st.revision:
            candidate[name] = st.revision
            # The stage's previous revision: the newest other one that still has replicas.
            others = [r.revision for r in st.revisions or []
                      if r.revision and r.revision != st.revision and (r.replicas or 0) > 0]
            stable[name] = others[0] if others else st.revision
        serving, why_down, why_moving = _stage_view(pool, now, wake_bound_s)
        if not serving and why_down:
            down.append((why_down[0], f"stage {name}: {why_down[1]}"))
        if serving and why_moving and why_moving[0] == WAKING:
            waking.append(name)
        if why_moving:
            moving.append((why_moving[0], f"stage {name}: {why_moving[1]}"))
    capacity = [d for d in down if d[0] == "InsufficientCapacity"]
    first_down = (capacity or down or [None])[0]
    stages_ok = first_down is None
    s_reason, s_msg = (
        ("AllStagesServing", f"{len(stages)}/{len(stages)} stages at or above their minimum")
        if first_down is None else first_down
    )

    dstatus = (deployment or {}).get("status") or {}
    o_ready = int(dstatus.get("readyReplicas", 0) or 0)
    o_msg = f"{min(o_ready, want_orchestrators)}/{want_orchestrators} orchestrator replicas ready"
    # Any ready orchestrator replica serves the whole pipeline; the rollout surges first.
    orch_ok = deployment is not None and want_orchestrators > 0 and o_ready >= 1
    o_reason = "OrchestratorAvailable" if orch_ok else (
        "NoOrchestrator" if want_orchestrators == 0 else "OrchestratorNotReady")
    orch_moving = deployment is None or (
        int(dstatus.get("observedGeneration", 0) or 0)
        < int((deployment.get("metadata") or {}).get("generation", 0) or 0)
        or int(dstatus.get("updatedReplicas", 0) or 0) != want_orchestrators
        or int(dstatus.get("replicas", 0) or 0) != want_orchestrators
        or o_ready != want_orchestrators
    )
    if orch_moving:
        moving.append(("OrchestratorRollout", o_msg))

    ok = stages_ok and orch_ok
    if ok:
        r_reason, r_msg = "Serving", "pipeline is serving" + (
            f"; waking from zero: {', '.join(waking)} (requests for it are held)"
            if waking else "")
    elif not stages_ok:
        r_reason, r_msg = s_reason, s_msg
    else:
        r_reason, r_msg = o_reason, o_msg
    p_reason, p_msg = moving[0] if moving else ("UpToDate", "every stage is updated and ready")
    if ok:
        phase = "Progressing" if moving else "Ready"
    else:
        phase = "Degraded" if old.phase in _HAS_SERVED else "Pending"
    ready_n = sum(1 for s in per_stage.values() if s.desired and (s.ready or 0) >= s.desired)
    return PipelineStatus(
        observed_generation=gen,
        phase=phase,
        endpoint=endpoint,
        api_key_secret=api_key_secret,
        stages_ready=f"{ready_n}/{len(stages)}",
        stages=per_stage,
        revisions=_revisions(stable, candidate),
        curve_keys=curve_keys,
        conditions=[
            condition("Ready", ok, r_reason, r_msg, gen, previous, now),
            condition("Progressing", bool(moving), p_reason, p_msg, gen, previous, now),
            condition("StagesReady", stages_ok, s_reason, s_msg, gen, previous, now),
            condition("OrchestratorReady", orch_ok, o_reason, o_msg, gen, previous, now),
        ],
    )


def _revisions(stable: dict[str, str], candidate: dict[str, str]) -> PipelineRevisions | None:
    """stable and candidate pipeline revisions from the stages' (candidate only while some
    stage still runs another revision); None before any pool reports one."""
    if not candidate:
        return None
    if stable == candidate:
        return PipelineRevisions(stable=release.pipeline_revision(candidate))
    return PipelineRevisions(stable=release.pipeline_revision(stable),
                             candidate=release.pipeline_revision(candidate))


def milestone(before: Obj, after: Obj) -> bool:
    """Whether going from status `before` to `after` (wire forms) is a milestone to write at
    once: a first status, a new phase or observed generation, a condition that appears, goes or
    flips its status. Anything else (counts, routable figures, messages, reasons) the controller
    may hold back and coalesce (controller.STATUS_COALESCE_SECONDS)."""
    if not before:
        return True
    if any(before.get(k) != after.get(k) for k in ("phase", "observedGeneration")):
        return True

    def flags(status: Obj) -> dict[Any, Any]:
        return {c.get("type"): c.get("status") for c in status.get("conditions") or []}

    return flags(before) != flags(after)


def invalid_status(obj: Obj, errors: list[tuple[str, str]], now: str) -> Status:
    """The status of an object whose spec is refused: every field error in the Ready condition.

    The rest of the previous status stays as it was (children of an earlier, valid generation
    keep running), so writing it twice changes nothing. A pipeline's phase says Invalid; a
    pool has no phase.
    """
    gen = int(obj["metadata"].get("generation", 0))
    old = status_model(obj.get("kind")).stored(obj)
    previous = old.conditions or []
    message = "; ".join(f"{path}: {msg}" for path, msg in errors)
    ready = condition("Ready", False, INVALID_SPEC, message, gen, previous, now)
    others = [c for c in previous if c.type != "Ready"]
    update: dict[str, Any] = {"observed_generation": gen, "conditions": [ready, *others]}
    if isinstance(old, PipelineStatus):
        update["phase"] = "Invalid"
    return old.model_copy(update=update)


def reported_invalid(obj: Obj) -> bool:
    """Whether the stored status already reports this generation as InvalidSpec."""
    ready = status_model(obj.get("kind")).stored(obj).condition("Ready")
    return bool(
        ready
        and ready.reason == INVALID_SPEC
        and ready.observed_generation == obj["metadata"].get("generation")
    )


def terminating_status(obj: Obj, step: str, now: str) -> PipelineStatus:
    """A pipeline being deleted: never 'Ready, pipeline is serving' while it goes away."""
    gen = int(obj["metadata"].get("generation", 0))
    old = PipelineStatus.stored(obj)
    previous = old.conditions or []
    ready = condition("Ready", False, "Terminating", f"pipeline is being deleted: {step}", gen,
                      previous, now)
    others = [c for c in previous if c.type != "Ready"]
    return old.model_copy(update={"observed_generation": gen, "phase": "Terminating",
                                  "conditions": [ready, *others]})


#: Stands in for a condition the status does not carry (no reason, no message).
_NO_CONDITION = Condition(type="", status="Unknown")


def summary(status: PipelineStatus) -> tuple[str, str, str]:
    """(event type, reason, message) that sums up a pipeline status for `kubectl describe`."""
    phase = status.phase or "Pending"
    ready = status.condition("Ready") or _NO_CONDITION
    progressing = status.condition("Progressing") or _NO_CONDITION
    if phase == "Invalid":
        return "Warning", INVALID_SPEC, ready.message or ""
    if phase == "Progressing":
        return "Normal", "Progressing", progressing.message or ""
    if phase == "Ready":
        return "Normal", "Ready", f"pipeline is serving ({status.stages_ready or ''} stages)"
    warn = phase == "Degraded" or ready.reason in ("InsufficientCapacity", *MODEL_FAILURES)
    return ("Warning" if warn else "Normal"), phase, ready.message or ""



def transition_event(before: PipelineStatus, after: PipelineStatus) -> tuple[str, str, str] | None:
    """The one event a written pipeline status deserves: its summary when the phase or the
    Ready reason changed (and the summary with it), else None (no event for a message alone)."""
    if summary(before) == summary(after):
        return None
    old_ready, new_ready = before.condition("Ready"), after.condition("Ready")
    if (before.phase, old_ready and old_ready.reason) == (after.phase,
                                                          new_ready and new_ready.reason):
        return None
    return summary(after)
