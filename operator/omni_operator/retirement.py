"""Named retirement: which ordinals a pool wants, and the StagePool patch `omnistage drain` writes.

The state lives on the StagePool (one annotation), so a restarted operator resumes a drain:

    omnistage.io/retired: {"ordinals": [1], "replace": [1], "atReplicas": 3}

- `ordinals`: retired ordinals. They stay free: the pool's replicas take the lowest ordinals NOT
  in this set, so a retired replica never comes back under its name.
- `replace`: those of them retired with `--replace`. Such a replica keeps serving until every
  wanted replica (its replacement included) is Ready, so capacity never dips.
- `atReplicas`: spec.replicas when the set was written. A scale-up past it frees retired
  ordinals one by one, lowest first: each replica added takes back one retired ordinal, and
  the rest stay retired (the controller writes the shrunk set, at the new count; the
  annotation goes once the set is empty). A scale from 2 to 3 after retiring 1 and 2 brings
  back 1 only, so a replica retired for a bad node does not return with an unrelated scale-up.

Pure functions: the CLI and the controller share them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from omni_operator.models import desired_replicas
from omnistage import kube

Obj = dict[str, Any]
ANNOTATION_RETIRED = "omnistage.io/retired"
Mode = Literal["replace", "retire"]


@dataclass(frozen=True)
class Retired:
    ordinals: frozenset[int] = frozenset()
    replace: frozenset[int] = frozenset()
    at_replicas: int = 0

    def to_annotation(self) -> str:
        return json.dumps({"ordinals": sorted(self.ordinals), "replace": sorted(self.replace),
                           "atReplicas": self.at_replicas}, sort_keys=True)


def stored(pool: Obj) -> Retired | None:
    """The annotation as written, or None when there is none (or it is unreadable)."""
    text = ((pool.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RETIRED)
    if not text:
        return None
    try:
        doc = json.loads(text)
        return Retired(frozenset(int(o) for o in doc.get("ordinals", [])),
                       frozenset(int(o) for o in doc.get("replace", [])),
                       int(doc.get("atReplicas", 0)))
    except (ValueError, TypeError, AttributeError):
        return None


def retired(pool: Obj) -> Retired:
    """The retirement in force: a scale-up past atReplicas frees as many retired ordinals as
    it adds replicas, lowest first; the rest stay retired at the new count."""
    state = stored(pool)
    if state is None:
        return Retired()
    want = desired_replicas(pool)
    added = want - state.at_replicas
    if added <= 0:
        return state
    kept = frozenset(sorted(state.ordinals)[added:])
    if not kept:
        return Retired()
    return Retired(kept, state.replace & kept, want)


def rewrite(pool: Obj) -> tuple[bool, str | None]:
    """Whether the stored annotation differs from the retirement in force, and the value to
    write (None: remove it). A scale-up that freed ordinals, or an unreadable annotation,
    needs one write; after it, none."""
    text = ((pool.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RETIRED)
    if not text:
        return False, None
    state = stored(pool)
    now = retired(pool)
    if state is not None and now == state:
        return False, text
    return True, (now.to_annotation() if now.ordinals else None)


def wanted_ordinals(pool: Obj, present: Iterable[int] = ()) -> list[int]:
    """The ordinals the pool's replicas should have: `replicas` of them, never a retired one.

    Replicas that exist keep their ordinals (lowest first when there are too many), so a
    scale-up that frees retired ordinals moves nobody; the rest are the lowest free ordinals,
    so a lost replica comes back under its name.
    """
    skip = retired(pool).ordinals
    want = desired_replicas(pool)
    out = sorted(o for o in set(present) if o not in skip)[:want]
    ordinal = 0
    while len(out) < want:
        if ordinal not in skip and ordinal not in out:
            out.append(ordinal)
        ordinal += 1
    return sorted(out)


def ordinal_of(pod: Obj) -> int:
    return int(((pod.get("metadata") or {}).get("labels") or {}).get(kube.LABEL_ORDINAL, "0"))


class DrainRefused(ValueError):
    """The named replica cannot be drained as asked; the message says why."""


def drain_patch(pool: Obj, pod: Obj, mode: Mode) -> Obj:
    """The StagePool merge patch that retires `pod` (`--replace` keeps replicas, `--retire`
    lowers them by one). It carries the pool's resourceVersion, so a concurrent change makes
    the API server answer 409 instead of losing one of the two."""
    name = pod["metadata"]["name"]
    pool_name = pool["metadata"]["name"]
    if (pod["metadata"].get("labels") or {}).get(kube.LABEL_POOL) != pool_name:
        raise DrainRefused(f"{name} is not a replica of StagePool {pool_name}")
    ordinal = ordinal_of(pod)
    state = retired(pool)
    if ordinal in state.ordinals:
        raise DrainRefused(f"{name} is already being retired")
    if kube.is_draining(pod):
        raise DrainRefused(f"{name} is already leaving the pool (scale-down, rollout or drain)")
    replicas = desired_replicas(pool)
    if mode == "retire":
        replicas -= 1
    new = Retired(state.ordinals | {ordinal},
                  state.replace | {ordinal} if mode == "replace" else state.replace,
                  replicas)
    patch: Obj = {"metadata": {
        "resourceVersion": pool["metadata"].get("resourceVersion"),
        "annotations": {ANNOTATION_RETIRED: new.to_annotation()},
    }}
    if mode == "retire":
        patch["spec"] = {"replicas": replicas}
    return patch
