"""`omnistage drain <replica>` and `omnistage status <pipeline>` (also `kubectl omnistage ...`).

drain writes the retirement onto the replica's StagePool (omni_operator.retirement) and the
operator carries it out, so an operator restart resumes it. status prints the tree
pipeline -> orchestrator and pools -> replicas with each replica's state, in-flight count and
node. Both only talk to the API server (the in-flight count comes through the API server's pod
proxy, or straight from the pod IP where that is reachable).

Registered through the `omnistage.commands` entry points; kept free of kopf imports.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from omni_operator import retirement
from omni_operator.models import desired_replicas
from omni_operator.status_models import PipelineStatus, PoolStatus
from omnistage import kube

Obj = dict[str, Any]
SAY: Callable[[str], None] = print


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace (default: the kubeconfig context's, else default)")
    add_cluster_flags(p)


def add_cluster_flags(p: argparse.ArgumentParser | Any) -> None:
    """--kubeconfig and --context, as kubectl has them (so `kubectl omnistage` takes the
    flags a kubectl user types)."""
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG's files merged, else "
                        "~/.kube/config; in a pod its service account)")
    p.add_argument("--context", default=None,
                   help="kubeconfig context to use (default: the current-context)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the libraries' INFO log lines (the API calls made)")


def _quiet_logs(args: argparse.Namespace) -> None:
    """These commands answer a person: their own lines go to stdout, and the libraries' INFO
    lines (the API client's one per write) would come before them on the terminal. The CLI
    configured logging for the servers it also runs (INFO); here only warnings and errors
    show, unless -v."""
    if not getattr(args, "verbose", False):
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))


def register_drain(sub: Any) -> None:
    d = sub.add_parser(
        "drain", help="retire one named stage replica (--replace, the default, or --retire)",
        description="Retire one named replica. --replace (default): a replacement starts under "
        "a new name and the replica stops taking work only once the replacement is Ready, so "
        "capacity never dips. --retire: the pool's replicas go down by one and the replica's "
        "ordinal stays free until a scale-up. Either way the replica drains its in-flight "
        "work first (up to the stage's drainTimeoutSeconds).")
    d.add_argument("replica", help="the replica (pod) name, e.g. chat-llm-1")
    mode = d.add_mutually_exclusive_group()
    mode.add_argument("--replace", dest="mode", action="store_const", const="replace",
                      help="replace it first, then retire it (default)")
    mode.add_argument("--retire", dest="mode", action="store_const", const="retire",
                      help="retire it for good: replicas - 1, its ordinal stays free")
    d.set_defaults(mode="replace")
    d.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True,
                   help="wait until the replica is gone (default: wait)")
    d.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait with --wait (default 900)")
    _common(d)
    d.set_defaults(handler=run_drain)


def register_status(sub: Any) -> None:
    s = sub.add_parser("status", help="a pipeline's pools and replicas: state, in-flight, node")
    s.add_argument("pipeline", help="the OmniPipeline's name")
    _common(s)
    s.set_defaults(handler=run_status)


def _api(args: argparse.Namespace) -> tuple[Any, str]:
    from omnistage.kubeapi import SyncKubeApi

    api = SyncKubeApi.load(args.kubeconfig, args.context)
    return api, args.namespace or api.config.namespace or "default"


def _api_errors() -> tuple[type[BaseException], ...]:
    """What talking to the API server raises that a person should read as one line: an error
    answer, credentials that do not work (an exec plugin failed), a server out of reach."""
    import aiohttp

    from omnistage.kubeapi import ApiError, ConfigError

    return ApiError, ConfigError, aiohttp.ClientError, OSError


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


# ---- drain -----------------------------------------------------------------------------------


def run_drain(args: argparse.Namespace) -> int:
    from omnistage.kubeapi import ApiError, ConfigError, path

    _quiet_logs(args)
    try:
        api, ns = _api(args)
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        pod = api.get(path("Pod", ns, args.replica), ignore=(404,))
        if pod is None:
            return _fail(f"replica {args.replica!r} not found in namespace {ns!r}")
        pool_name = (pod["metadata"].get("labels") or {}).get(kube.LABEL_POOL)
        if not pool_name:
            return _fail(f"pod {args.replica!r} is not a stage replica (no {kube.LABEL_POOL} "
                         "label)")
        for attempt in range(5):
            pool = api.get(path("StagePool", ns, pool_name), ignore=(404,))
            if pool is None:
                return _fail(f"StagePool {pool_name!r} of {args.replica!r} not found")
            try:
                patch = retirement.drain_patch(pool, pod, args.mode)
            except retirement.DrainRefused as exc:
                return _fail(str(exc))
            try:
                api.patch(path("StagePool", ns, pool_name), patch)
                break
            except ApiError as exc:
                if exc.status != 409 or attempt == 4:
                    raise
    except _api_errors() as exc:
        return _fail(str(exc) or type(exc).__name__)
    replicas = desired_replicas(pool)
    if args.mode == "retire":
        SAY(f"{args.replica}: retiring for good (StagePool {pool_name} replicas {replicas} -> "
            f"{replicas - 1}; the name stays free until a scale-up)")
    else:
        SAY(f"{args.replica}: replacing (a replacement starts first; {args.replica} stops "
            "taking work once it is Ready)")
    if not args.wait:
        return 0
    try:
        return _wait_gone(api, ns, pod, args.timeout)
    except _api_errors() as exc:
        return _fail(str(exc) or type(exc).__name__)


def _wait_gone(api: Any, ns: str, pod: Obj, timeout: float) -> int:
    from omnistage.kubeapi import path

    name, uid = pod["metadata"]["name"], pod["metadata"].get("uid")
    deadline = time.monotonic() + timeout
    said = ""
    while time.monotonic() < deadline:
        now = api.get(path("Pod", ns, name), ignore=(404,))
        if now is None or now["metadata"].get("uid") != uid:
            SAY(f"{name}: retired")
            return 0
        state = replica_state(now)
        if state != said:
            SAY(f"{name}: {state}")
            said = state
        time.sleep(0.5)
    return _fail(f"{name} is still there after {timeout:g}s (the retirement goes on; see "
                 f"`omnistage status` and the StagePool's events)")


# ---- status ----------------------------------------------------------------------------------


def replica_state(pod: Obj) -> str:
    """One word for where a replica stands (most telling first)."""
    from omni_operator.placement import unschedulable_message
    from omni_operator.readiness import is_draining, is_ready

    meta, status = pod["metadata"], pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    if is_draining(pod):
        return "Draining"
    if is_ready(pod):
        return "Ready"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            return "CrashLoopBackOff"
    if unschedulable_message(pod):
        return "Unschedulable"
    if status.get("phase") == "Running":
        return "Starting"
    return str(status.get("phase") or "Pending")


def _condition(status: PipelineStatus | PoolStatus, ctype: str) -> str:
    cond = status.condition(ctype)
    return "?" if cond is None else f"{cond.status} ({cond.reason or ''})"


def _node(pod: Obj) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "-")


def render_status(pipeline: Obj, pools: list[Obj], pods: list[Obj],
                  inflight: dict[str, int | None]) -> str:
    """The tree `omnistage status` prints (pure, for tests)."""
    name = pipeline["metadata"]["name"]
    st = PipelineStatus.stored(pipeline)
    lines = [f"pipeline {name}  phase={st.phase or '?'}  Ready={_condition(st, 'Ready')}"]
    orch = sorted((p for p in pods if (p["metadata"].get("labels") or {}).get(
        kube.LABEL_COMPONENT) == "orchestrator"), key=lambda p: p["metadata"]["name"])
    groups: list[tuple[str, list[str]]] = []
    groups.append((f"orchestrator  {len(orch)} pod(s)", [
        f"{p['metadata']['name']}  {replica_state(p)}  node={_node(p)}" for p in orch]))
    for pool in sorted(pools, key=lambda p: p["metadata"]["name"]):
        pname = pool["metadata"]["name"]
        ps = PoolStatus.stored(pool)
        members = sorted((p for p in pods if (p["metadata"].get("labels") or {}).get(
            kube.LABEL_POOL) == pname), key=retirement.ordinal_of)
        head = (f"pool {pname}  ready={ps.ready or '?'}  "
                f"Progressing={_condition(ps, 'Progressing')}")
        gone = sorted(retirement.retired(pool).ordinals)
        if gone:
            head += f"  retired ordinals={','.join(map(str, gone))}"
        rows = []
        for p in members:
            n = inflight.get(p["metadata"]["name"])
            rows.append(f"{p['metadata']['name']}  {replica_state(p)}  "
                        f"in-flight={'?' if n is None else n}  "
                        f"node={_node(p)}")
        groups.append((head, rows))
    for i, (head, rows) in enumerate(groups):
        last = i == len(groups) - 1
        lines.append(f"{'└─' if last else '├─'} {head}")
        for j, row in enumerate(rows):
            lines.append(f"{'   ' if last else '│  '}{'└─' if j == len(rows) - 1 else '├─'} {row}")
    return "\n".join(lines)


def _inflight(api: Any, pod: Obj) -> int | None:
    """Requests in flight (queued ones included; drain.work_left) from the worker's /state:
    through the API server's pod proxy, else straight from the pod IP (the proxy refuses
    loopback pod IPs)."""

    meta, ip = pod["metadata"], (pod.get("status") or {}).get("podIP")
    if (pod.get("status") or {}).get("phase") != "Running":
        return None
    url = (f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}:"
           f"{kube.WORKER_HTTP_PORT}/proxy{kube.WORKER_STATE_PATH}")
    try:
        return kube.work_left(json.loads(api.request("GET", url, raw=True, timeout=2.0)))
    except Exception:  # the proxy is optional: fall back to the pod IP
        return kube.read_work_left(kube.worker_state_url(ip), 1.0) if ip else None


def run_status(args: argparse.Namespace) -> int:
    from omnistage.kubeapi import ConfigError, path

    _quiet_logs(args)
    try:
        api, ns = _api(args)
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        pipeline = api.get(path("OmniPipeline", ns, args.pipeline), ignore=(404,))
        if pipeline is None:
            return _fail(f"OmniPipeline {args.pipeline!r} not found in namespace {ns!r}")
        pools = [p for p in api.list(path("StagePool", ns))
                 if (p.get("spec") or {}).get("pipeline") == args.pipeline]
        pods = api.list(path("Pod", ns), labelSelector=f"{kube.LABEL_PIPELINE}={args.pipeline}")
    except _api_errors() as exc:
        return _fail(str(exc) or type(exc).__name__)
    stage_pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(kube.LABEL_POOL)]
    inflight = {p["metadata"]["name"]: _inflight(api, p) for p in stage_pods}
    SAY(render_status(pipeline, pools, pods, inflight))
    return 0
