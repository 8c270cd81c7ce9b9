"""Rotating a pipeline's CurveZMQ keypair without losing a request (issue 43). Pure: the
reconciler reads the state from the pipeline's status, writes the Secret patch and the status
this module decides, and builds the pods with the generation it names.

Why in steps, and why the waits: a stage worker's server key is the pair its process started
with, and it admits every public key its mounted Secret holds (omnistage.curve_keys,
CurveKeyring); an orchestrator connects to each worker with the public key of that worker's
generation (its pod annotation omnistage.io/curve-generation), read from the same mounted
Secret. So with the new pair added beside the old one, old and new pods all talk to each other:

1. `add`: the user asks for generation N (the OmniPipeline annotation
   omnistage.io/curve-generation, greater than the one in use). The operator adds pair N to the
   Secret (files public-N, secret-N; a merge patch: it never reads the Secret) and records it.
2. `switch`, once the kubelets had time to refresh every pod's mount (`propagation_s` after
   the add; the refresh is unobservable from the API): the pods are built with generation N,
   so the pools replace their replicas drain-style and the orchestrator Deployment rolls.
3. `drop`, once no pod of the pipeline is of another generation: the older pairs leave the
   Secret, and with them their public keys leave every worker's admitted set: a peer holding
   an old pair is refused from then on.

One transition per reconcile, each from the state the status recorded before it: a crash
between a Secret patch and its status write repeats the patch, which is harmless (an add's pair
is used by no pod until the status records it; a drop is idempotent).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from omnistage import kube

__all__ = ["CurveKeysState", "Step", "desired_generation", "pod_generation", "step"]

#: Generations are small integers; the bound keeps a typo from making a 20-digit file name.
MAX_GENERATION = 1_000_000


@dataclass(frozen=True)
class CurveKeysState:
    """What status.curveKeys records: the generation the pods are built with, the generations
    whose pair the Secret holds, and when the Secret last gained one (unix seconds)."""

    generation: int = 0
    secret: tuple[int, ...] = (0,)
    added_at: float | None = None


@dataclass(frozen=True)
class Step:
    """One decision: the state to record, the pair to add to the Secret (a generation), the
    pairs to drop from it, when to look again (seconds), and the event that says so."""

    state: CurveKeysState
    add: int | None = None
    drop: tuple[int, ...] = ()
    again_in: float | None = None
    event: tuple[str, str] | None = None  # (reason, message), a Normal event


def desired_generation(annotations: Mapping[str, str] | None, state: CurveKeysState
                       ) -> tuple[int, str | None]:
    """The generation the user asks for (the pipeline's annotation; absent: the one in use)
    and, when the annotation cannot be honoured, why (the one in use stays)."""
    text = (annotations or {}).get(kube.ANNOTATION_CURVE_GENERATION)
    newest = max(state.secret)
    if text is None:
        return newest, None
    try:
        wanted = int(text.strip())
    except ValueError:
        return newest, (f"annotation {kube.ANNOTATION_CURVE_GENERATION}={text!r} is not an "
                        "integer; the keys stay as they are")
    if not 0 <= wanted <= MAX_GENERATION:
        return newest, (f"annotation {kube.ANNOTATION_CURVE_GENERATION}={wanted} is not "
                        f"between 0 and {MAX_GENERATION}; the keys stay as they are")
    if wanted < newest:
        return newest, (f"annotation {kube.ANNOTATION_CURVE_GENERATION}={wanted} is below "
                        f"generation {newest}, already made: a pair is never used again")
    return wanted, None


def pod_generation(annotations: Mapping[str, str] | None) -> int:
    """A pod's (or a StagePool's pods') generation by its annotation (absent or unreadable:
    0, the first pair)."""
    try:
        return int((annotations or {}).get(kube.ANNOTATION_CURVE_GENERATION, "0"))
    except ValueError:
        return 0


def step(state: CurveKeysState, desired: int, pod_generations: Iterable[int], now: float,
         propagation_s: float) -> Step:
    """The next transition toward `desired` (see the module docstring), or none."""
    if desired > max(state.secret):
        new = CurveKeysState(state.generation, (*state.secret, desired), now)
        return Step(new, add=desired, again_in=propagation_s,
                    event=("CurveKeysAdded", f"CurveZMQ pair {desired} added beside "
                           f"{_names(state.secret)}; the pods move to it in "
                           f"{propagation_s:g}s"))
    if state.generation != desired and desired in state.secret:
        waited = now - (state.added_at if state.added_at is not None else now - propagation_s)
        if waited < propagation_s:
            return Step(state, again_in=propagation_s - waited)
        new = CurveKeysState(desired, state.secret, state.added_at)
        return Step(new, event=("CurveKeysSwitched", f"pods move to CurveZMQ pair {desired} "
                                "(drain-style; the orchestrators roll)"))
    old = tuple(g for g in state.secret if g != state.generation)
    if old and set(pod_generations) <= {state.generation}:
        new = CurveKeysState(state.generation, (state.generation,), state.added_at)
        return Step(new, drop=old, event=("CurveKeysRotated", f"CurveZMQ pair "
                    f"{state.generation} is the only one: {_names(old)} dropped, a peer "
                    "holding it is refused"))
    return Step(state)


def _names(gens: Iterable[int]) -> str:
    return ", ".join(str(g) for g in gens)
