"""Everything the operator writes to the API server, and what it remembers of its writes.

Children are server-side applied with one field manager; docs/architecture.md ("How the
operator writes") says what is applied, created or patched, and why. `ensure` applies only an
intent that differs from the one last applied (its digest is on the object) or from the live
object; `patch_status` writes only a status that changed, and holds back one that changed in
no milestone for a while. A write that answers 404 drops its object from the view.

An object whose spec is refused gets status InvalidSpec and one Warning event per generation
(`refuse`); `permanent` tells such a refusal (the API server's 422 for a built child) from a
failure worth retrying.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from omni_operator import builders
from omni_operator.events import EventRecorder, now_iso
from omni_operator.status import invalid_status, milestone, reported_invalid
from omni_operator.status_models import Status
from omni_operator.view import Key, Obj, ObjectView, Scheduler, meta_key
from omnistage.kubeapi import ApiError, KubeApi, path
from omnistage.spec import SpecError

log = logging.getLogger("omnistage.operator")

#: On every object the operator applies: the digest of the intent it applied last. An intent
#: that changed, a field removed included, differs from it; a restarted operator reads it back.
ANNOTATION_APPLIED = "omnistage.io/applied"
#: A pool's or pipeline's status change that is no milestone (status.milestone: counts,
#: routable figures, messages) is written at most this often per object, trailing edge: held
#: back, the latest value is written by a delayed reconcile. Every write costs on a busy API
#: server, and a ramp changed a pool's counts once per pod (docs/architecture.md).
STATUS_COALESCE_SECONDS = 2.0


#: Names an event lists of the objects it is about (the rest are counted).
EVENT_NAMES = 3


def few(names: list[str], limit: int = EVENT_NAMES) -> str:
    """Up to `limit` names, the rest counted: an event about many objects stays short."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def subset(want: Any, have: Any) -> bool:
    """Whether every field we manage already has the value we want (server defaults ignored)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(subset(w, h) for w, h in zip(want, have, strict=True))
        )
    if isinstance(want, int | float) and isinstance(have, int | float):
        return want == have
    return want == have or (
        want is not None and str(want) == str(have) and not isinstance(want, bool)
    )


def _intent_digest(desired: Obj) -> str:
    """The digest of an intent, spec.replicas aside: whether a StagePool's intent carries
    replicas follows who owns them (see PipelineReconciler.ensure_child), and their value is
    compared with the live object's anyway."""
    spec = desired.get("spec")
    if isinstance(spec, dict) and "replicas" in spec:
        desired = {**desired, "spec": {k: v for k, v in spec.items() if k != "replicas"}}
    return builders.digest(desired)


def applied_intent(desired: Obj) -> Obj:
    """What the operator server-side applies: `desired` with its digest as an annotation."""
    meta = desired["metadata"]
    annotations = {**(meta.get("annotations") or {}), ANNOTATION_APPLIED: _intent_digest(desired)}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def _compared(intent: Obj) -> Obj:
    """The fields of an intent to compare with the live object (identity and server-set
    metadata aside)."""
    out = {k: v for k, v in intent.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = intent["metadata"]
    out["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences")
                       if k in meta}
    return out


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: `new`, with a null for every
    key `old` has and `new` leaves out, at every depth. A status written as `new` alone would
    keep what it no longer says (a release's candidate revision, a revision gone from a map)
    and differ from what was computed on every reconcile."""
    if not isinstance(new, dict) or not isinstance(old, dict):
        return new
    out = {k: merge_patch(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out


def owners(obj: Obj, field: tuple[str, ...]) -> set[tuple[str, str, str]]:
    """(manager, operation, subresource) of every metadata.managedFields entry that owns
    `field`: field names, or fieldsV1 keys such as 'v:"x"' (an item of a set)."""
    keys = [f if ":" in f else f"f:{f}" for f in field]
    found = set()
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        node: Any = entry.get("fieldsV1") or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            found.add((str(entry.get("manager", "")), str(entry.get("operation", "")),
                       str(entry.get("subresource", ""))))
    return found


def owns(obj: Obj, field: tuple[str, ...]) -> bool:
    """Whether the operator's own server-side apply owns `field` of the object."""
    return (builders.FIELD_MANAGER, "Apply", "") in owners(obj, field)


def _finalizer_intent(obj: Obj, finalizers: list[str]) -> Obj:
    """The operator's whole intent for an object it does not build: its finalizers. With the
    object's uid, so the apply writes this very object: an apply to a name that is gone would
    otherwise create a new object from an intent without a spec (the API server refuses that
    with 422, which read as an invalid spec); with the uid it answers 409 instead."""
    meta = {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]}
    if obj["metadata"].get("uid"):
        meta["uid"] = obj["metadata"]["uid"]
    if finalizers:
        meta["finalizers"] = finalizers
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": meta}


def removed(answer: Any) -> bool:
    """Whether a delete's (or a finalizer release's) answer says the object is gone: a
    Success status, or the object as it was, with no finalizer left to hold it. One still
    held (a pod's grace period, a finalizer) is not."""
    if not isinstance(answer, dict):
        return False
    if answer.get("kind") == "Status":
        return answer.get("status") == "Success"
    meta = answer.get("metadata") or {}
    return bool(meta) and not meta.get("finalizers") and (
        not meta.get("deletionTimestamp") or meta.get("deletionGracePeriodSeconds") in (None, 0))


class PermanentError(Exception):
    """A reconcile that cannot succeed until its object changes (the API server refuses what
    it builds). Reported on the object, as InvalidSpec, instead of retried in a loop.
    `errors` as SpecError's: (path, message)."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{where}: {what}" for where, what in self.errors))


def _causes(exc: ApiError) -> list[Obj]:
    """The field errors of an API server refusal (its Status details)."""
    details = exc.body.get("details") if isinstance(exc.body, dict) else None
    return [c for c in (details or {}).get("causes") or [] if isinstance(c, dict)]


def permanent(exc: BaseException) -> PermanentError | None:
    """A failure that retrying cannot fix: a PermanentError, or the API server's 422 Invalid
    (or 400 BadRequest) for an object the operator built from the spec."""
    if isinstance(exc, PermanentError):
        return exc
    if not isinstance(exc, ApiError) or exc.status not in (400, 422):
        return None
    details = exc.body.get("details") if isinstance(exc.body, dict) else None
    what = " ".join(str(v) for v in ((details or {}).get("kind"), (details or {}).get("name"))
                    if v) or exc.path
    errors = [(f"{what}: {c.get('field') or '?'}", str(c.get("message") or exc.reason))
              for c in _causes(exc)]
    return PermanentError(errors or [(what, f"{exc.reason or exc.status}: {exc.message}")])


@dataclass(frozen=True)
class _StatusWrite:
    """Our last status write to one object: the versions older than it that the view may still
    show (the one it was written against, earlier writes' results), and what it wrote."""

    stale: frozenset[str]
    status: Obj
    result: str
    at: float  # when (Writes.clock): coalesced changes wait STATUS_COALESCE_SECONDS from it


def _timeless(status: Obj) -> Obj:
    """A status without its conditions' transition times (a re-derived condition gets a new one)."""
    conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                  for c in status.get("conditions") or []]
    return {**status, "conditions": conditions}


class Writes:
    """The write layer: applies, patches, deletes, finalizers, status and events, each about one
    object of the view (a 404 drops it there)."""

    def __init__(self, api: KubeApi, view: ObjectView, scheduler: Scheduler, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.view = view
        self.scheduler = scheduler  # a held-back status write reconciles its object later
        self.clock = clock
        self.events = EventRecorder(api)
        self._spawned: set[asyncio.Future[Any]] = set()  # events in flight (a set: O(1) done)
        # The last status written per object, and the versions of it our view may still show
        # that are older than that write (read-your-writes, see patch_status).
        self._status_written: dict[Key, _StatusWrite] = {}
        self._invalid: dict[Key, tuple[str, int]] = {}  # InvalidSpec reported: (uid, generation)

    def forget(self, key: Key) -> None:
        """An object went: nothing to remember of our status writes to it."""
        self._status_written.pop(key, None)

    def cancel(self) -> list[asyncio.Future[Any]]:
        """Cancel the events in flight; the tasks, to await."""
        tasks = list(self._spawned)
        for task in tasks:
            task.cancel()
        return tasks

    # ---- events ----------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    def event(self, obj: Obj, etype: str, reason: str, message: str) -> None:
        """Record an event in the background (aggregated; see omni_operator.events)."""
        self._spawn(self.events.record(obj, etype, reason, message))

    # ---- writes ----------------------------------------------------------------------------

    async def write(self, kind: str, ns: str, name: str, call: Awaitable[Any]) -> Any:
        """A write (or read) about one object; 404 drops it from the view and returns None."""
        try:
            return await call
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.view.forget(kind, ns, name)
            return None

    async def apply_finalizers(self, obj: Obj, finalizers: list[str]) -> Obj | None:
        """Apply our finalizer intent to this pipeline (by its uid). A 409 is either a conflict
        on a live object (raised) or the object gone since our view saw it (a stale reconcile
        after its deletion): a list by name tells which (the chart grants list and watch, no
        get: a get here was refused with 403), and a gone object is dropped from the view,
        like a 404."""
        ns, name = meta_key(obj)
        url = path("OmniPipeline", ns, name)
        try:
            applied = await self.write("OmniPipeline", ns, name, self.api.apply(
                url, _finalizer_intent(obj, finalizers), field_manager=builders.FIELD_MANAGER))
            return None if applied is None else applied.object
        except ApiError as exc:
            if exc.status != 409:
                raise
            found = await self.api.get(path("OmniPipeline", ns),
                                       fieldSelector=f"metadata.name={name}")
            current = next(iter(found.get("items") or []), None)
            if current is None:
                self.view.forget("OmniPipeline", ns, name)
            elif current["metadata"].get("uid") == obj["metadata"].get("uid"):
                raise
            log.info("OmniPipeline %s/%s is gone (uid %s): nothing to apply", ns, name,
                     obj["metadata"].get("uid"))
            return None

    async def ensure(
        self,
        desired: Obj,
        current: Obj | None,
        on_create: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Server-side apply `desired`, the operator's whole intent for the object, when the
        object is missing, the intent differs from the one last applied (its digest is on the
        object), or the live object differs from it in a field the intent sets; else nothing.

        The apply removes whatever the operator applied before and the intent now leaves out,
        so no field is ever nulled by hand. Conflicts are forced: every field in an intent is
        the operator's (what another writer owns, like a `kubectl scale`d StagePool's
        replicas, is left out of the intent instead; see PipelineReconciler.ensure_child).
        """
        intent = applied_intent(desired)
        # The intent carries its digest as an annotation: a changed intent differs here too.
        if current is not None and subset(_compared(intent), current):
            return
        meta = desired["metadata"]
        kind, ns, name = desired["kind"], meta["namespace"], meta["name"]
        applied = await self.write(kind, ns, name, self.api.apply(
            path(kind, ns, name), intent, field_manager=builders.FIELD_MANAGER, force=True))
        if applied is not None and applied.created and on_create is not None:
            await on_create()

    async def create_once(self, obj: Obj) -> None:
        """Create `obj` unless it exists (409: left as it is, never read or overwritten):
        for objects made once with content only this write knows, such as generated keys."""
        meta = obj["metadata"]
        kind, ns, name = obj["kind"], meta["namespace"], meta["name"]
        await self.write(kind, ns, name, self.api.create(path(kind, ns), obj, ignore=(409,)))

    async def delete(self, kind: str, ns: str, name: str, body: Obj | None = None) -> None:
        """Delete; 404 means it is gone already (dropped from the view), 409 is a race. An
        answer that says the object is gone drops it from the view at once, as its DELETED
        event will: a step re-checked before that event came deleted it again (a 404 each)."""
        try:
            answer = await self.write(kind, ns, name, self.api.delete(path(kind, ns, name), body))
        except ApiError as exc:
            if exc.status != 409:
                raise
            return
        if kind != "Pod" and removed(answer):
            self.view.forget(kind, ns, name, deleted_by_us=True)

    # ---- status ----------------------------------------------------------------------------

    async def patch_status(self, obj: Obj, typed: Status, *, coalesce: bool = False) -> bool:
        """Write status (its wire form) if it differs from the stored one; True when it wrote.

        Read-your-writes: until the watch delivers our own write, the view still holds an older
        status, and a reconcile in that window (a 1 s re-check on a loaded machine) would write
        the same status again. Two writes in a row against one stale version (shutdown steps)
        make the first write's result stale too, when the watch delivers it. So a status equal
        to our last one is not written again while the view shows a version older than it.

        coalesce: a change that is no milestone (status.milestone) within
        STATUS_COALESCE_SECONDS of our last write to the object is held back, and the object
        reconciled again when that time is up, which writes what is true then.
        """
        status = typed.wire()
        if subset(status, obj.get("status") or {}) and subset(obj.get("status") or {}, status):
            return False
        ns, name = meta_key(obj)
        key: Key = (obj["kind"], ns, name)
        version = obj["metadata"].get("resourceVersion", "")
        last = self._status_written.get(key)
        if last is not None and version in last.stale and _timeless(last.status) == _timeless(
                status):
            return False
        if coalesce and last is not None:
            wait = last.at + STATUS_COALESCE_SECONDS - self.clock()
            shown = last.status if version in last.stale else obj.get("status") or {}
            if wait > 0 and not milestone(shown, status):
                self.scheduler.enqueue_later(key, wait)
                return False
        patched = await self.write(
            obj["kind"], ns, name,
            self.api.patch(path(obj["kind"], ns, name, "status"),
                           {"status": merge_patch(obj.get("status") or {}, status)}))
        if patched is not None:
            stale = {version}
            if last is not None and version in last.stale | {last.result}:
                stale |= last.stale | {last.result}
            result = ((patched.get("metadata") or {}).get("resourceVersion", "")
                      if isinstance(patched, dict) else "")
            self._status_written[key] = _StatusWrite(frozenset(stale), status, result,
                                                     self.clock())
        return patched is not None

    async def refuse(self, obj: Obj, exc: SpecError) -> None:
        """InvalidSpec: every field error in the status, one Warning per generation, no retry."""
        ns, name = meta_key(obj)
        key: Key = (obj["kind"], ns, name)
        generation = int(obj["metadata"].get("generation", 0))
        stamp = (obj["metadata"].get("uid", ""), generation)
        already = self._invalid.get(key) == stamp or reported_invalid(obj)
        await self.patch_status(obj, invalid_status(obj, exc.errors, now_iso()))
        if not already:
            log.warning("%s %s/%s generation %d is invalid:\n%s", obj["kind"], ns, name,
                        generation, exc)
            self.event(obj, "Warning", "InvalidSpec", str(exc).replace("\n", "; "))
        self._invalid[key] = stamp

    def accepted(self, key: Key) -> None:
        """The object's spec parses again: a later refusal is news (a Warning again)."""
        self._invalid.pop(key, None)
