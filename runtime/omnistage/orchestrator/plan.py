"""A request's plan, from the spec alone: which stages run and in what order, which edges
stream, and what each stage's submit carries (params, tensors, revisions). Pure: no I/O and no
replica state, so the engine decides routing and this only describes the work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omnistage import protocol as p
from omnistage.kinds import Payload, StageKind
from omnistage.kinds import get as get_kind
from omnistage.orchestrator.pools import Replica
from omnistage.orchestrator.requests import PipelineRequest, RequestError
from omnistage.orchestrator.tasks import Child, Request, Task
from omnistage.spec import PipelineSpec

MAX_N = 64


class Planner:
    """The spec's routing tables (what each stage consumes and emits, by the kind table: never
    by name) and the plans derived from them."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        self.rows: dict[str, StageKind] = {s.name: get_kind(s.kind) for s in spec.stages}
        self.default_deadlines = {
            s.name: float(s.admission.default_deadline_seconds) for s in spec.stages}
        self.inputs = {s.name: list(s.inputs) for s in spec.stages}
        self.streaming = {s.name: s.streaming for s in spec.stages}
        self.topo = spec.topo_order()
        self.final_stages = tuple(spec.final_stages())
        self._plans: dict[tuple[str, ...], tuple[tuple[str, ...], frozenset[str]]] = {}

    # ---- admission -------------------------------------------------------------------------

    def plan(self, request: Request) -> RequestError | None:
        """Resolve a request's finals, stages, companions and streamed edges; the error when
        the request itself is bad (routing checks replicas afterwards)."""
        req = request.req
        if isinstance(req.n, bool) or not isinstance(req.n, int) or not 1 <= req.n <= MAX_N:
            return RequestError("bad_request", f"n must be an integer in [1, {MAX_N}]")
        finals = list(req.finals) if req.finals else list(self.final_stages)
        unknown = [s for s in finals if s not in self.inputs]
        if unknown:
            return RequestError("bad_request", f"finals: unknown stage(s) {unknown}")
        unknown = [s for s in req.params if s != "*" and s not in self.inputs]
        if unknown:
            return RequestError("bad_request", f"params: unknown stage(s) {unknown}")
        order, needed = self.stage_plan(tuple(finals))
        request.finals = finals
        request.order = list(order)
        if req.negative_prompt is not None:
            request.companions = {
                s for s in request.order if self.feeds_hidden_states(s, needed)}
        request.streamed = self.streamed_edges(request)
        if req.stream:
            request.to_client = frozenset(
                s for s in finals if self.rows[s].chunked_output
                and Payload.AUDIO in self.rows[s].emits and self.streaming[s].enabled
                and s not in request.streamed)
        return None

    def streamed_edges(self, request: Request) -> dict[str, str]:
        """The edges of this request that stream (upstream -> downstream): the upstream's row
        emits chunks, the downstream's consumes them, neither stage turned streaming off, the
        downstream has that one input, the upstream feeds no other stage of the request, and
        no negative-prompt companion runs on either."""
        edges: dict[str, str] = {}
        for down in request.order:
            ins = self.inputs[down]
            if len(ins) != 1:
                continue
            up = ins[0]
            consumers = [d for d in request.order if up in self.inputs[d]]
            if (consumers == [down] and self.rows[up].chunked_output
                    and self.rows[down].chunked_input and self.streaming[up].enabled
                    and self.streaming[down].enabled
                    and not {up, down} & request.companions):
                edges[up] = down
        return edges

    def feeds_hidden_states(self, stage: str, among: Sequence[str] | frozenset[str]) -> bool:
        """Whether stage emits hidden states that a stage among `among` consumes: it must then
        return them, and run the negative prompt too when there is one."""
        return Payload.HIDDEN_STATES in self.rows[stage].emits and any(
            Payload.HIDDEN_STATES in self.rows[d].consumes and stage in self.inputs[d]
            for d in among)

    def stage_plan(self, finals: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset[str]]:
        """The stages that finals need, in topological order, and as a set. Computed once
        per distinct finals (a pipeline has few), not on every request."""
        plan = self._plans.get(finals)
        if plan is None:
            needed = tuple(self.spec.needed_by(finals))
            plan = needed, frozenset(needed)
            self._plans[finals] = plan
        return plan

    def ready(self, child: Child, stage: str) -> bool:
        """Whether a stage's inputs are complete for a child (and its companions' too)."""
        ins = self.inputs[stage]
        return all(i in child.done for i in ins) and all(
            i in child.companion_done for i in ins if i in child.request.companions)

    # ---- what a task's submit carries ------------------------------------------------------

    def submit(self, task: Task, replica: Replica, remaining: float) -> p.Submit:
        """The task's submit to `replica`, within `remaining` seconds of its request's
        deadline (and its stage's default deadline when the client set none)."""
        child, request = task.child, task.child.request
        if request.req.timeout_s is None:
            # No deadline of the client's own: the stage's default applies to this stage, within
            # the orchestrator's bound on the whole request.
            remaining = min(remaining, self.default_deadlines[task.stage])
        out = None if task.companion else child.streams.get(task.stage)
        window = out.window if out is not None else None
        if not task.companion and task.stage in request.to_client:
            window = self.streaming[task.stage].window
        params = self.params(task)
        if task.fed is not None:
            params.pop("prompt", None)  # the fed chunks bring the input
        return p.Submit(id=task.wire_id, params=params, timeout_s=remaining,
                        incarnation=replica.incarnation, shm=replica.channel.borrower,
                        chunk_window=window, fed=task.fed is not None,
                        revision=request.pins.get(task.stage), **self.revision_fields(task))

    def revision_fields(self, task: Task) -> dict[str, dict[str, str]]:
        """Submit's upstream_revisions (what the request's pins expect of each producer whose
        payload the task brings) and payload_revisions (the stamps of the results attached; a
        fed task's chunks carry theirs in each feed). A companion brings no payload."""
        if task.companion:
            return {}
        child, pins = task.child, task.child.request.pins
        ins = self.inputs[task.stage]
        expected = {up: rev for up in ins if (rev := pins.get(up)) is not None}
        stamps: dict[str, str] = {}
        if task.fed is None:
            for up in ins:
                done, neg = child.done.get(up), child.companion_done.get(up)
                if done is not None and done.header.revision is not None:
                    stamps[up] = done.header.revision
                if neg is not None and neg.header.revision is not None:
                    stamps[f"{up}/neg"] = neg.header.revision
        return {"upstream_revisions": expected, "payload_revisions": stamps}

    def params(self, task: Task) -> dict[str, Any]:
        request, child = task.child.request, task.child
        req: PipelineRequest = request.req
        params = req.stage_params(task.stage)
        if req.n > 1:
            params["seed"] = int(params.get("seed", 0)) + child.index
        row = self.rows[task.stage]
        ins = self.inputs[task.stage]
        takes_text = Payload.TEXT in row.consumes
        if task.companion:
            params["prompt"] = req.negative_prompt
        elif ins and takes_text:
            upstream = child.done[ins[0]].header.text if ins[0] in child.done else None
            params["prompt"] = req.prompt if upstream is None else upstream
        elif takes_text:
            params["prompt"] = req.prompt
        if self.feeds_hidden_states(task.stage, request.order):
            params["return_hidden_states"] = True  # a stage of this request conditions on them
        final = task.stage in request.finals and not task.companion
        # Streamed deltas are text: only a stage that emits text streams.
        params["stream"] = req.stream and final and Payload.TEXT in row.emits
        shown = None if task.companion else child.shown.get(task.stage)
        if shown is not None and (shown.token_ids or shown.text):
            # A failover of a stream the client already saw part of: go on from there.
            params["resume_token_ids"] = list(shown.token_ids)
            params["resume_text"] = shown.text
        return params

    def tensors(self, task: Task) -> dict[str, Any]:
        """Upstream outputs become inputs: the first input's tensors as they are, others by name."""
        child = task.child
        if task.companion:
            return {}
        ins = self.inputs[task.stage]
        row = self.rows[task.stage]
        # A stage that consumes hidden states gets them as its conditioning.
        conditioned = Payload.HIDDEN_STATES in row.consumes
        tensors: dict[str, Any] = {}
        if not ins:  # an entry stage gets the request's media of the payloads it consumes
            media = {f"input_{pl.value}." for pl in (Payload.IMAGE, Payload.AUDIO)
                     if pl in row.consumes}
            tensors.update({name: t for name, t in child.request.req.tensors.items()
                            if name[:name.find(".") + 1] in media})
        for i, upstream in enumerate(ins):
            for name, wt in child.done[upstream].tensors.items():
                if conditioned and name == "hidden_states":
                    name = "encoder_hidden_states" if i == 0 else f"{upstream}.{name}"
                elif i:
                    name = f"{upstream}.{name}"
                tensors[name] = wt
            neg = child.companion_done.get(upstream)
            if neg is not None and "hidden_states" in neg.tensors and conditioned:
                tensors["negative_encoder_hidden_states"] = neg.tensors["hidden_states"]
        return tensors
