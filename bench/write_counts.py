"""What bench_operator_scale.py and its LeaderWorkerSet baseline (lws_baseline.py) share: the
API server's write count and the face of the run the baseline borrows.

Why its own module: both fleets are judged by the same count of controller writes, and the
baseline runs inside the scale bench's cluster and namespace. Kept here, neither bench imports
the other (tests/unit/test_import_graph.py forbids the cycle).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from omnistage.kubeapi import SyncKubeApi

Obj = dict[str, Any]

WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"}
# Writes that are not a controller's: the scheduler binds, kwok (the kubelet) reports status and
# heartbeats. Left out for both systems.
NOT_CONTROLLER = {"pods/binding", "pods/status", "nodes", "nodes/status", "leases"}
# The bench's own creates (the "apply"), one per object on either side.
USER_WRITES = {"POST omnipipelines", "POST leaderworkersets"}
REQUEST_TOTAL = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


class ScaleRun(Protocol):
    """What the baseline needs of the scale bench's run: its API client, work directory and
    namespace (the baseline works in `<ns>-lws`)."""

    @property
    def k(self) -> SyncKubeApi: ...

    work: Path
    ns: str


def apiserver_writes(k: SyncKubeApi) -> dict[str, int]:
    """Writes the API server has served, by "VERB resource[/subresource]" (since it started)."""
    text = k.request("GET", "/metrics", raw=True, timeout=20)
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = REQUEST_TOTAL.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        if labels.get("verb") not in WRITE_VERBS:
            continue
        res = labels.get("resource", "") + (
            f"/{labels['subresource']}" if labels.get("subresource") else "")
        key = f"{labels['verb']} {res}"
        out[key] = out.get(key, 0) + int(float(m.group("value")))
    return out


def write_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Every write the API server served between two counts, by whom no matter, largest
    first: on a control plane bound by its CPUs, what a pod costs it."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return dict(sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: -kv[1]))


def controller_writes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The write deltas that a controller made (see NOT_CONTROLLER), largest first."""
    return {k: v for k, v in write_delta(before, after).items()
            if k.split(" ", 1)[1] not in NOT_CONTROLLER and k not in USER_WRITES}
