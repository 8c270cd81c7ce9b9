"""The orchestrator engine (omnistage/orchestrator/engine.py) against in-process fake replicas.

Fast unit tests, the selection of `hack/mutation.sh engine`. The Orchestrator is the real one;
only its ReplicaChannel (the engine's one seam to a replica) is replaced by FakeLink, which
records what the engine sends and lets a test deliver the worker's replies (finals, deltas,
refusals, aborts, errors, a closed connection) when it chooses. The engine handles a reply
synchronously on the loop, so each test checks state right after delivering one: no sleeps, no
wall-clock windows. The engine's clock (`engine.time`) is a frozen clock the test moves by hand.

The same paths with real worker processes over real ZMQ are the integration tests in
tests/integration/test_orchestrator.py ("Twin:" in each docstring); "Kills:" names the broken
implementations (mutations) each test catches.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq.asyncio
from prometheus_client import generate_latest

from omnistage import protocol as p
from omnistage.client import ChannelClosed, ControlError
from omnistage.orchestrator import engine
from omnistage.orchestrator.engine import MAX_N, Orchestrator, RequestHandle
from omnistage.orchestrator.membership import Membership, ReplicaInfo, StaticMembership
from omnistage.orchestrator.requests import Delta, Outcome, PipelineRequest
from omnistage.spec import parse_pipeline
from tests.harness.metrics import sample

pytestmark = pytest.mark.timeout(30)

# A hang guard, far from what the tests wait for (a few loop turns once the engine has what it
# needs); it bounds only a broken engine (a mutant) that never answers.
HANG = 10.0
# The same as loop turns: `until` gives up after this many (a count, not a clock, so load does
# not matter; the waits that need real time pass, 10 ms at most, take far fewer turns).
TURNS = 50_000


# ---- the fake replicas ------------------------------------------------------------------------


class Clock:
    """engine.time: frozen until the test moves it. Whole seconds, so differences are exact;
    1000 s behind the real clock, which stamps a new Replica's last_seen (pools.py) until its
    handshake does with ours, so no test's heartbeat sees a replica still shaking hands as
    silent."""

    def __init__(self) -> None:
        self.now = float(math.floor(time.monotonic())) - 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Worker:
    """The process behind one replica address, as every link to that address sees it."""

    name: str
    stage: str
    incarnation: str = "inc-1"
    version: int = p.PROTOCOL_VERSION
    hello: str = "answer"  # answer | silent | closed | hang (past any timeout it is given)
    pings: str = "answer"  # answer | silent | refused
    control: Callable[[str], dict[str, Any]] | None = None
    on_ping: Callable[[], None] | None = None  # runs while a ping waits for its pong


class FakeShm:
    """The SegmentManager surface the engine uses: release(msg) and close()."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.released: list[p.Message[Any]] = []
        self.closed = 0

    def release(self, msg: p.Message[Any]) -> None:
        self.released.append(msg)

    def close(self) -> None:
        self.closed += 1


class Net:
    """Every FakeLink the engine opened, and the workers behind the addresses."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self.links: list[FakeLink] = []
        self.send_error: BaseException | None = None  # raised by the next submit sent
        self.borrower: str | None = None
        self.waiting = 0  # control calls held by slow_control
        self.slow_control: asyncio.Event | None = None  # when set, a-* answer control after it

    def has(self, name: str) -> bool:
        return any(ln.name == name for ln in self.links)

    def link(self, name: str) -> FakeLink:
        """The newest link the engine opened to replica `name`."""
        return [ln for ln in self.links if ln.name == name][-1]


class FakeLink:
    """ReplicaChannel's surface as the engine uses it, in memory."""

    def __init__(self, net: Net, endpoint: str, *, name: str = "", zctx: Any = None,
                 on_message: Callable[[Any], None] | None = None,
                 on_disconnect: Callable[[], None] | None = None, shm: Any = None) -> None:
        self.net, self.endpoint, self.name = net, endpoint, name or endpoint
        self.zctx, self.on_message, self.on_disconnect, self.shm = (
            zctx, on_message, on_disconnect, shm)
        self.sent: list[tuple[Any, dict[str, Any]]] = []
        self.hellos = 1  # the real channel sends one as it opens
        self.closed = False
        self.pinged = 0
        self.timeouts: list[float | None] = []  # of ping and control calls
        net.links.append(self)

    @property
    def worker(self) -> Worker:
        return self.net.workers[self.endpoint]

    @property
    def borrower(self) -> str | None:
        return self.net.borrower

    async def handshake(self, timeout: float | None = None) -> p.HelloReply:
        w = self.worker
        if w.hello == "silent":
            await asyncio.wait_for(asyncio.Event().wait(), timeout)
        if w.hello == "hang":
            await asyncio.Event().wait()
        if w.hello == "closed":
            raise ChannelClosed(f"channel to {self.name} closed")
        if w.version != p.PROTOCOL_VERSION:
            raise p.VersionMismatch(f"replica {self.name} speaks protocol version {w.version}")
        return self.hello_reply()

    def hello_reply(self, incarnation: str | None = None,
                    version: int = p.PROTOCOL_VERSION) -> p.HelloReply:
        w = self.worker
        return p.HelloReply(version=version, replica=w.name, stage=w.stage, kind="echo",
                            incarnation=incarnation or w.incarnation)

    def hello(self) -> None:
        self.hellos += 1

    def send(self, header: msgspec.Struct, tensors: dict[str, Any] | None = None) -> None:
        if self.closed:
            raise ChannelClosed(f"channel to {self.name} is closed")
        if isinstance(header, p.Submit) and self.net.send_error is not None:
            err, self.net.send_error = self.net.send_error, None
            raise err
        p.encode(header, tensors)  # as the real channel: an unencodable value raises here
        self.sent.append((header, dict(tensors or {})))

    async def close(self) -> None:
        self.closed = True

    async def control(self, op: str, timeout: float = 30.0) -> dict[str, Any]:
        assert self.worker.control is not None
        self.timeouts.append(timeout)
        slow = self.net.slow_control
        if slow is not None and self.name.startswith("a-"):
            self.net.waiting += 1
            await slow.wait()
        return self.worker.control(op)

    async def ping(self, timeout: float = 2.0) -> p.Pong:
        self.pinged += 1
        self.timeouts.append(timeout)
        if self.worker.pings == "silent":
            raise TimeoutError
        if self.worker.pings == "refused":
            raise ConnectionRefusedError("nobody listens")
        if self.worker.on_ping is not None:
            self.worker.on_ping()
        return p.Pong(cid="probe", state=state(self.worker))

    # ---- the test's side: what the worker answers ---------------------------------------------

    def reply(self, header: msgspec.Struct, tensors: dict[str, Any] | None = None) -> p.Message:
        assert self.on_message is not None
        msg = p.Message(header, dict(tensors or {}))
        self.on_message(msg)
        return msg

    def of(self, kind: type) -> list[Any]:
        return [h for h, _ in self.sent if isinstance(h, kind)]


def state(w: Worker, incarnation: str | None = None) -> p.WorkerState:
    return p.WorkerState(replica_id=w.name, stage=w.stage, kind="echo",
                         incarnation=incarnation or w.incarnation, ready=True, loaded=True,
                         draining=False, paused=False, asleep=False, in_flight=0, queued=0,
                         pid=1)


def tensor(*values: float) -> p.WireTensor:
    return p.WireTensor.from_any(np.array(values, dtype=np.float32))


# ---- the rig ------------------------------------------------------------------------------------


def pipeline(stages: list[dict[str, Any]], name: str = "pl", **orch: Any) -> Any:
    spec: dict[str, Any] = {"stages": stages}
    if orch:
        spec["orchestrator"] = orch
    return parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                           "metadata": {"name": name}, "spec": spec})


def echo(name: str, inputs: tuple[str, ...] = (), final: bool = False, **extra: Any
         ) -> dict[str, Any]:
    return {"name": name, "kind": "echo", "inputs": list(inputs), "finalOutput": final, **extra}


def ar(name: str, inputs: tuple[str, ...] = (), final: bool = False) -> dict[str, Any]:
    return {"name": name, "kind": "ar", "model": "tiny-llama", "inputs": list(inputs),
            "finalOutput": final}


def diffusion(name: str, inputs: tuple[str, ...], final: bool = True) -> dict[str, Any]:
    return {"name": name, "kind": "diffusion", "model": "tiny-unet", "inputs": list(inputs),
            "finalOutput": final}


TWO = [echo("a"), echo("b", ("a",), final=True)]
ONE = [echo("a", final=True)]
MULTI = [echo("src"), echo("f1", ("src",), final=True), echo("f2", ("src",), final=True)]
T2I = [ar("enc"), diffusion("img", ("enc",))]


def unseeded(params: dict[str, Any]) -> dict[str, Any]:
    """A submit's params without the seed every request gets at admission (test_seeds.py)."""
    return {k: v for k, v in params.items() if k != "seed"}


class Rig:
    def __init__(self, orch: Orchestrator, net: Net, clock: Clock,
                 membership: StaticMembership) -> None:
        self.orch, self.net, self.clock, self.membership = orch, net, clock, membership

    def submit(self, prompt: str = "x", **kw: Any) -> RequestHandle:
        return self.orch.submit(PipelineRequest(prompt=prompt, **kw))

    def task(self, handle: RequestHandle, stage: str, child: int = 0,
             companion: bool = False) -> Any:
        return handle._request.children[child].running[(stage, companion)]

    def link_of(self, handle: RequestHandle, stage: str, child: int = 0,
                companion: bool = False) -> FakeLink:
        return self.net.link(self.task(handle, stage, child, companion).replica.name)

    def answer(self, handle: RequestHandle, stage: str, header_type: type = p.Final,
               child: int = 0, companion: bool = False, tensors: dict[str, Any] | None = None,
               **fields: Any) -> p.Message:
        """The worker running `stage` of this child answers with a terminal reply."""
        task = self.task(handle, stage, child, companion)
        link = self.net.link(task.replica.name)
        return link.reply(header_type(id=task.wire_id, **fields), tensors)

    def replica(self, name: str) -> Any:
        for pool in self.orch.pools.values():
            if name in pool.replicas:
                return pool.replicas[name]
        raise KeyError(name)

    def clean(self) -> None:
        """Nothing of any request is left: no request, task, binding, in-flight count or pin to
        a revision (GET /v1/load `pinned`)."""
        assert self.orch.requests == {}
        assert self.orch.tasks == {}
        assert self.orch.pinned == {}
        for pool in self.orch.pools.values():
            for r in pool.replicas.values():
                assert r.inflight == 0 and r.bound == set(), r.name


def events(handle: RequestHandle) -> list[Any]:
    """The events queued for a request so far (without waiting)."""
    q, out = handle._request.queue, []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def outcome(handle: RequestHandle) -> Outcome:
    """The one event now queued, which must be the request's outcome."""
    evs = events(handle)
    assert len(evs) == 1 and isinstance(evs[0], Outcome), evs
    return evs[0]


async def until(pred: Callable[[], Any], what: str) -> None:
    """Wait for engine state, turn by turn of the loop (never a clock): polled, because the
    state lives in the engine, which signals nothing a test could await. Not
    tests/harness/waiting.until (10 ms polls, a 60 s guard): here everything is in-process, a
    loop turn is enough, and a broken engine (a mutant) fails in a second, not a minute."""
    for _ in range(TURNS):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


Make = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def make(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Make]:
    net, clock = Net(), Clock()
    monkeypatch.setattr(engine, "ReplicaChannel", lambda *a, **kw: FakeLink(net, *a, **kw))
    monkeypatch.setattr(engine, "time", SimpleNamespace(monotonic=clock.monotonic))
    shms: list[FakeShm] = []
    monkeypatch.setattr(engine, "start_segment_manager",
                        lambda cfg: shms.append(FakeShm(cfg)) or shms[-1])
    net.shms = shms  # type: ignore[attr-defined]
    orchs: list[Orchestrator] = []

    async def go(stages: list[dict[str, Any]], replicas: dict[str, int] | None = None, *,
                 workers: list[Worker] = (), start: bool = True, **kw: Any) -> Rig:
        """replicas: how many plain workers per stage (default one each); workers: more."""
        pipe = pipeline(stages, **kw.pop("orch", {}))
        infos = []
        counts = replicas if replicas is not None else {s["name"]: 1 for s in stages}
        all_workers = [Worker(f"{stage}-{i}", stage) for stage, n in counts.items()
                       for i in range(n)] + list(workers)
        for w in all_workers:
            endpoint = f"tcp://127.0.0.1:{20000 + len(net.workers)}"
            net.workers[endpoint] = w
            infos.append(ReplicaInfo(w.stage, w.name, endpoint))
        membership = StaticMembership(infos)
        kw.setdefault("heartbeat_interval", 3600)
        orch = Orchestrator(pipe, membership, **kw)
        orchs.append(orch)
        if start:
            await orch.start()
        return Rig(orch, net, clock, membership)

    yield go
    for orch in orchs:
        await orch.stop(drain_timeout=0)


def endpoint(rig: Rig, name: str) -> str:
    return next(e for e, w in rig.net.workers.items() if w.name == name)


# ---- routing across the stage DAG ---------------------------------------------------------------


async def test_a_request_walks_the_dag_one_stage_at_a_time(make: Make) -> None:
    """Twin: test_two_stage_routing_follows_the_dag. Stage a's text is b's prompt; only the final
    stage is an output, with exactly the result fields the worker set; nothing is left behind.

    Kills: b started before a answered, the upstream text not passed on, non-final stages in
    the outputs, a wrong wire id/incarnation/timeout in the submit, the bookkeeping (inflight,
    served, bound, tasks) not done or not undone."""
    rig = await make(TWO)
    h = rig.submit("hello", request_id="r1")
    assert h.id == "r1"
    a, b = rig.net.link("a-0"), rig.net.link("b-0")
    [sub] = a.of(p.Submit)
    assert sub.id == "r1/0/a" and sub.incarnation == "inc-1" and sub.shm is None
    assert sub.params == {"prompt": "hello", "stream": False}
    assert sub.timeout_s == 60.0  # the stage's default within the request's 300 s
    assert b.sent == [] and events(h) == []
    ra = rig.replica("a-0")
    assert (ra.inflight, ra.served, len(ra.bound)) == (1, 1, 1)
    assert set(rig.orch.tasks) == {"r1/0/a"}
    rig.answer(h, "a", text="from-a", finish_reason="stop")
    assert (ra.inflight, ra.bound) == (0, set())
    [sub_b] = b.of(p.Submit)
    assert sub_b.id == "r1/0/b" and sub_b.params == {"prompt": "from-a", "stream": False}
    assert set(rig.orch.tasks) == {"r1/0/b"} and rig.replica("b-0").inflight == 1
    rig.answer(h, "b", text="B", finish_reason="stop", token_ids=[1, 2], replica="b-0")
    out = outcome(h)
    assert (out.request_id, out.status, out.error, out.http_status) == ("r1", "ok", None, 200)
    [child] = out.children
    assert (child.index, child.status, child.error) == (0, "ok", None)
    assert set(child.outputs) == {"b"}
    got = child.outputs["b"]
    assert (got.stage, got.replica) == ("b", "b-0")
    assert got.fields == {"text": "B", "finish_reason": "stop", "token_ids": [1, 2]}
    assert got.tensors == {}
    rig.clean()
    assert rig.replica("b-0").served == 1
    assert rig.orch.outcomes == {"ok": 1}
    assert rig.orch.counters["late_messages"] == 0


async def test_upstream_without_text_leaves_the_prompt_and_ids_are_generated(make: Make) -> None:
    """Twin: test_two_stage_routing_follows_the_dag. An upstream result without text keeps the
    client's prompt for the next stage; a request without an id gets `req-` and 16 hex digits.

    Kills: `req.prompt if upstream is None else upstream` inverted, the generated id changed."""
    rig = await make(TWO)
    h = rig.submit("keep")
    assert re.fullmatch(r"req-[0-9a-f]{16}", h.id), h.id
    rig.answer(h, "a")
    [sub] = rig.net.link("b-0").of(p.Submit)
    assert sub.params["prompt"] == "keep" and sub.id == f"{h.id}/0/b"
    rig.answer(h, "b")
    assert outcome(h).status == "ok"


async def test_the_event_stream_ends_with_exactly_one_outcome(make: Make) -> None:
    """Twin: test_abort_goes_to_the_bound_replica_and_returns_prefix (streaming). Deltas of a
    final stage reach the caller in order, then one Outcome; events() stops after it; outcome()
    returns it; nothing more is queued for a late reply.

    Kills: deltas dropped or reordered, stream not requested for a streaming final stage,
    events() not stopping at the outcome, a second outcome, a late reply forwarded."""
    rig = await make(ONE)
    h = rig.submit("s", stream=True)
    link = rig.net.link("a-0")
    assert link.of(p.Submit)[0].params["stream"] is True
    wid = rig.task(h, "a").wire_id
    link.reply(p.Delta(id=wid, seq=1, text="he", token_ids=[1]))
    link.reply(p.Delta(id=wid, seq=2, text="llo", token_ids=[2, 3]))
    link.reply(p.Final(id=wid, text="hello", finish_reason="stop"))
    link.reply(p.Delta(id=wid, seq=3, text="late"))  # after the terminal reply: dropped
    got = [ev async for ev in h.events()]
    assert [type(e) for e in got] == [Delta, Delta, Outcome]
    assert (got[0].child, got[0].stage, got[0].text, got[0].token_ids) == (0, "a", "he", [1])
    assert (got[1].text, got[1].token_ids) == ("llo", [2, 3])
    assert got[2].status == "ok" and got[2].children[0].outputs["a"].fields["text"] == "hello"
    assert rig.orch.counters["late_messages"] == 1
    assert h._request.queue.empty()
    h2 = rig.submit("t")
    rig.answer(h2, "a", text="t")
    out = await asyncio.wait_for(h2.outcome(), HANG)
    assert out.status == "ok" and out.request_id == h2.id


async def test_a_join_waits_for_every_input_and_names_the_second_inputs_tensors(
        make: Make) -> None:
    """Twin: test_join_waits_for_all_inputs. The joining stage starts only when both inputs are
    done; the first input's text is its prompt and its tensors pass under their own names, the
    second input's as `<stage>.<name>`.

    Kills: `all(...)` of the inputs weakened to any, the first input chosen wrongly, the
    tensor prefix lost or applied to the first input."""
    rig = await make([echo("a"), echo("slow"), echo("j", ("a", "slow"), final=True)])
    h = rig.submit("x")
    assert {t[0] for t in h._request.children[0].running} == {"a", "slow"}
    ta, ts = tensor(1), tensor(2, 3)
    rig.answer(h, "a", text="A", tensors={"h": ta})
    assert rig.net.link("j-0").sent == []
    rig.answer(h, "slow", text="S", tensors={"h": ts})
    [(sub, tensors)] = rig.net.link("j-0").sent
    assert sub.params["prompt"] == "A"
    assert tensors == {"h": ta, "slow.h": ts}
    rig.answer(h, "j", text="J")
    assert outcome(h).children[0].outputs["j"].fields["text"] == "J"


async def test_finals_choose_the_stages_a_request_runs(make: Make) -> None:
    """Twin: test_generic_route_reports_failures_per_child (finals on the generic route). A
    request whose finals are an inner stage runs only that stage's part of the DAG, and the
    plan for the same finals is computed once.

    Kills: finals ignored, the needed-stage walk dropping or adding stages, the plan cache
    keyed wrongly or never filled."""
    rig = await make(TWO)
    h = rig.submit("x", finals=["a"])
    assert h._request.finals == ["a"] and h._request.order == ["a"]
    rig.answer(h, "a", text="A")
    out = outcome(h)
    assert out.status == "ok" and set(out.children[0].outputs) == {"a"}
    assert rig.net.link("b-0").sent == []
    plan = rig.orch.planner._plans[("a",)]
    assert plan == (("a",), frozenset({"a"}))
    assert rig.orch.planner.stage_plan(("a",)) is plan
    assert rig.orch.planner.stage_plan(("b",)) == (("a", "b"), frozenset({"a", "b"}))
    rig2 = await make([echo("x"), echo("y", ("x",)), echo("z", ("y",), final=True)])
    assert rig2.orch.planner.stage_plan(("z",)) == (("x", "y", "z"), frozenset({"x", "y", "z"}))


async def test_stage_params_merge_and_samples_get_their_own_seed(make: Make) -> None:
    """Twin: test_parallel_sampling_child_abort_drops_parent_when_none_remain (n samples).
    `*` params apply to every stage under the stage's own; sample i adds i to the seed (0 when
    none is given); a single sample keeps its seed as given.

    Kills: the merge order swapped, the seed offset dropped or wrong, n>1 tested wrongly."""
    rig = await make(ONE)
    rig.submit("x", n=3, params={"*": {"seed": 10, "k": 1}, "a": {"k": 2}})
    subs = rig.net.link("a-0").of(p.Submit)
    assert [s.params["seed"] for s in subs] == [10, 11, 12]
    assert all(s.params["k"] == 2 for s in subs)
    assert [s.id.split("/")[1] for s in subs] == ["0", "1", "2"]
    rig.submit("y", n=2)
    assert [s.params["seed"] for s in rig.net.link("a-0").of(p.Submit)[3:]] == [0, 1]
    rig.submit("z", params={"a": {"seed": 7}})
    assert rig.net.link("a-0").of(p.Submit)[-1].params["seed"] == 7
    rig.submit("w")
    assert "seed" not in rig.net.link("a-0").of(p.Submit)[-1].params


async def test_ar_to_diffusion_with_a_negative_prompt_companion(make: Make) -> None:
    """Twin: test_ar_to_diffusion_with_negative_prompt_companion. The AR stage feeding a
    diffusion stage runs twice (prompt and negative prompt), both asked for hidden states;
    the diffusion stage gets no prompt, the prompt's hidden states as encoder_hidden_states and
    the companion's as negative_encoder_hidden_states, and starts only when both are done.
    The companion streams nothing and is never an output.

    Kills: companions not planned, the companion's prompt, return_hidden_states not set, the
    tensor renames, the join on the companion, a companion delta forwarded, companion output."""
    rig = await make(T2I)
    h = rig.submit("a cat", negative_prompt="blurry", stream=True)
    assert h._request.companions == {"enc"}
    subs = rig.net.link("enc-0").of(p.Submit)
    assert [(s.id, unseeded(s.params)) for s in subs] == [
        (f"{h.id}/0/enc", {"prompt": "a cat", "return_hidden_states": True, "stream": False}),
        (f"{h.id}/0/enc/neg", {"prompt": "blurry", "return_hidden_states": True,
                               "stream": False}),
    ]
    pos, neg = tensor(1), tensor(2)
    rig.answer(h, "enc", text="T", tensors={"hidden_states": pos, "other": tensor(3)})
    assert rig.net.link("img-0").sent == []
    neg_task = rig.task(h, "enc", companion=True)
    rig.net.link("enc-0").reply(p.Delta(id=neg_task.wire_id, seq=1, text="n"))
    rig.net.link("enc-0").reply(p.Delta(id=neg_task.wire_id, seq=2, text="m"))
    assert events(h) == [] and rig.orch.counters["late_messages"] == 2
    rig.answer(h, "enc", companion=True, text="N", tensors={"hidden_states": neg})
    [(sub, tensors)] = rig.net.link("img-0").sent
    assert unseeded(sub.params) == {"stream": False}
    assert set(tensors) == {"encoder_hidden_states", "other", "negative_encoder_hidden_states"}
    assert tensors["encoder_hidden_states"] is pos
    assert tensors["negative_encoder_hidden_states"] is neg
    rig.answer(h, "img", height=32, width=32, steps=2, tensors={"image": tensor(4)})
    out = outcome(h)
    assert out.status == "ok" and set(out.children[0].outputs) == {"img"}
    assert out.children[0].outputs["img"].fields == {"height": 32, "width": 32, "steps": 2}
    rig.clean()


async def test_without_a_negative_prompt_nothing_runs_twice(make: Make) -> None:
    """Twin: test_ar_to_diffusion_with_negative_prompt_companion (the plain request). Only AR
    stages that feed a needed diffusion stage get a companion, only with a negative prompt; a
    companion without hidden states adds no negative tensor; a second input's hidden states
    reach diffusion under its stage's name.

    Kills: companions planned without a negative prompt, for non-AR stages or for stages not
    feeding diffusion; `"hidden_states" in neg.tensors` dropped; the second input's rename."""
    rig = await make([ar("enc"), echo("side"), diffusion("img", ("enc", "side")),
                      ar("chat", final=True)])
    h = rig.submit("p")
    assert h._request.companions == set()
    assert len(rig.net.link("enc-0").of(p.Submit)) == 1
    h2 = rig.submit("p", negative_prompt="n")
    assert h2._request.companions == {"enc"}  # not chat: it feeds no diffusion stage
    assert [s.id for s in rig.net.link("chat-0").of(p.Submit)] == [f"{h.id}/0/chat",
                                                                   f"{h2.id}/0/chat"]
    rig.answer(h2, "enc", text="E", tensors={"hidden_states": tensor(1)})
    rig.answer(h2, "enc", companion=True, text="N", tensors={"x": tensor(2)})
    rig.answer(h2, "side", text="S", tensors={"hidden_states": tensor(3)})
    [(_, tensors)] = rig.net.link("img-0").sent
    assert set(tensors) == {"encoder_hidden_states", "side.hidden_states"}
    h3 = rig.submit("c", negative_prompt="n", finals=["chat"])
    assert h3._request.companions == set()
    sub = rig.net.link("chat-0").of(p.Submit)[-1]
    assert unseeded(sub.params) == {"prompt": "c", "stream": False}  # no diffusion needs states


async def test_only_final_non_diffusion_stages_stream(make: Make) -> None:
    """Twin: test_abort_goes_to_the_bound_replica_and_returns_prefix. With stream=True only a
    final AR/echo stage is asked to stream: not an inner stage, not a diffusion stage.

    A non-diffusion stage fed by an AR stage with a companion gets the AR stage's tensors as
    they are, without the negative ones.

    Kills: `req.stream and final and kind != "diffusion"` with any term dropped or inverted,
    return_hidden_states asked where no diffusion stage runs, `and diffusion` dropped from the
    negative tensor's condition."""
    rig = await make([ar("enc"), diffusion("img", ("enc",)), echo("e", ("enc",), final=True)])
    h = rig.submit("x", stream=True)
    [enc] = rig.net.link("enc-0").of(p.Submit)
    assert enc.params["stream"] is False
    rig.answer(h, "enc", text="E")
    [img] = rig.net.link("img-0").of(p.Submit)
    [e] = rig.net.link("e-0").of(p.Submit)
    assert unseeded(img.params) == {"stream": False}
    assert e.params == {"prompt": "E", "stream": True}
    h2 = rig.submit("x", stream=False, finals=["e"])
    rig.answer(h2, "enc", text="E")
    assert rig.net.link("e-0").of(p.Submit)[-1].params["stream"] is False
    assert "return_hidden_states" not in rig.net.link("enc-0").of(p.Submit)[-1].params
    h3 = rig.submit("x", negative_prompt="n")  # only the diffusion stage gets the negative
    states = tensor(1)
    rig.answer(h3, "enc", text="E", tensors={"hidden_states": states})
    rig.answer(h3, "enc", companion=True, text="N", tensors={"hidden_states": tensor(2)})
    assert rig.net.link("e-0").sent[-1][1] == {"hidden_states": states}
    assert set(rig.net.link("img-0").sent[-1][1]) == {"encoder_hidden_states",
                                                      "negative_encoder_hidden_states"}


async def test_a_session_goes_to_the_replica_it_is_pinned_to(make: Make) -> None:
    """Twin: test_requests_spread_across_replicas_and_sessions_pin.

    Kills: the session not passed to the pool's pick."""
    rig = await make(ONE, {"a": 2})
    rig.orch.pools["a"].sessions["s"] = "a-1"
    for _ in range(3):
        h = rig.submit("x", session="s")
        assert rig.task(h, "a").replica.name == "a-1"
    assert rig.net.link("a-0").sent == []


# ---- refused before anything runs ---------------------------------------------------------------


async def test_bad_requests_are_refused_at_once_with_the_field_named(make: Make) -> None:
    """Twin: test_unencodable_value_is_a_request_error_and_loop_keeps_running. Each bad input
    ends the request at once with a 400 naming the field, before anything is sent, and leaves
    no request registered.

    Kills: each check of `_plan` removed or loosened (bool n, non-int n, n bounds, unknown
    finals, unknown params, `*` refused), a refused request registered or sent."""
    rig = await make(TWO)
    bad = {
        "n=0": dict(n=0), "n=True": dict(n=True), "n=1.0": dict(n=1.0), "n=65": dict(n=MAX_N + 1),
        "n='2'": dict(n="2"),
    }
    for why, kw in bad.items():
        out = outcome(rig.submit("x", **kw))
        assert (out.status, out.error.code, out.http_status) == ("request_error", "bad_request",
                                                                 400), why
        assert out.error.message == "n must be an integer in [1, 64]", why
        assert out.children == []
    refused = rig.submit("x", finals=["b", "nope"], request_id="r-9")
    out = outcome(refused)
    assert out.request_id == "r-9" == refused.id
    assert out.error.message == "finals: unknown stage(s) ['nope']"
    assert out.error.code == "bad_request"
    out = outcome(rig.submit("x", params={"*": {}, "a": {}, "zz": {}}))
    assert out.error.message == "params: unknown stage(s) ['zz']"
    assert (out.status, out.error.code) == ("request_error", "bad_request")
    assert rig.orch.outcomes == {"request_error": 7}
    assert rig.net.link("a-0").sent == [] and rig.orch.requests == {}
    h = rig.submit("x", n=MAX_N, params={"*": {"seed": 1}})
    assert len(h._request.children) == 64 and rig.orch.requests == {h.id: h._request}
    assert len(rig.net.link("a-0").of(p.Submit)) == 64


async def test_a_stage_without_a_routable_replica_is_no_replica(make: Make) -> None:
    """Twin: test_dead_downstream_stage. A needed stage without a routable replica ends the
    request at once (503, stage named); a stage the request does not need does not matter.

    Kills: the routability check skipped or applied to the wrong stages."""
    rig = await make(TWO, {"a": 1, "b": 0})
    out = outcome(rig.submit("x"))
    assert (out.status, out.error.code, out.error.stage, out.http_status) == (
        "fatal", "no_replica", "b", 503)
    assert out.error.message == "stage 'b' has no live replica"
    assert rig.net.link("a-0").sent == []
    h = rig.submit("x", finals=["a"])
    assert events(h) == [] and len(rig.net.link("a-0").of(p.Submit)) == 1


async def test_requests_are_refused_before_start_and_after_stop(make: Make) -> None:
    """Twin: test_kill_9_one_replica_fails_only_its_bound_requests (teardown). Not accepting:
    shutting_down (503), counted as a fatal outcome.

    Kills: the accepting check removed, accepting never set or never cleared."""
    rig = await make(ONE, start=False)
    out = outcome(rig.submit("x"))
    assert (out.status, out.error.code, out.http_status) == ("fatal", "shutting_down", 503)
    assert out.error.message == "orchestrator is not accepting requests"
    await rig.orch.start()
    assert rig.orch.accepting
    h = rig.submit("x")
    assert events(h) == []
    rig.answer(h, "a")
    assert outcome(h).status == "ok"
    await rig.orch.stop()
    assert not rig.orch.accepting
    assert outcome(rig.submit("x")).error.code == "shutting_down"
    assert rig.orch.outcomes == {"fatal": 2, "ok": 1}


# ---- replies that end a stage --------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "status", "code", "message", "retry_after"), [
    (p.Overloaded(id="-", retry_after=2.5, message="admission budget full"), "request_error",
     "overloaded", "stage a: admission budget full", 2.5),
    (p.Deadline(id="-", message="deadline passed in queue"), "request_error", "deadline",
     "stage a: deadline passed in queue", None),
    (p.Error(id="-", code="bad_request", message="prompt too long"), "request_error",
     "bad_request", "stage a: prompt too long", None),
    (p.Error(id="-", code="internal", message="boom"), "fatal", "stage_failed",
     "stage a: boom", None),
    (p.Error(id="-", code="malformed", message="bad frame"), "fatal", "stage_failed",
     "stage a: bad frame", None),
])
async def test_a_refusal_or_error_is_the_requests_one_outcome(
        make: Make, reply: Any, status: str, code: str, message: str,
        retry_after: float | None) -> None:
    """Twin: test_overloaded_worker_is_429_with_retry_after_through_the_real_engine and
    test_companion_failure_fails_the_parent. The error a client sees: kind, code, message,
    stage and Retry-After, exactly.

    Kills: each reply mapped to another code or kind, the stage or retry_after dropped, the
    message text changed, a refusal retried."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x")
    link = rig.link_of(h, "a")
    link.reply(msgspec.structs.replace(reply, id=rig.task(h, "a").wire_id))
    out = outcome(h)
    assert (out.status, out.error.code, out.error.message, out.error.stage,
            out.error.retry_after) == (status, code, message, "a", retry_after)
    assert out.children[0].status == status and out.children[0].error == out.error
    assert sum(len(rig.net.link(n).of(p.Submit)) for n in ("a-0", "a-1")) == 1  # no retry
    rig.clean()


@pytest.mark.parametrize("refusal", [
    p.Draining(id="-", message="replica is draining"),
    p.Error(id="-", code="not_ready", message="model is still loading"),
])
async def test_draining_or_not_ready_is_retried_on_another_replica(
        make: Make, refusal: Any) -> None:
    """Twin: test_a_draining_reply_is_retried_on_another_replica and
    test_a_not_ready_reply_is_retried_on_another_replica. The task goes to the replica that has
    not refused it, same wire id, and the request ends ok from there; the refusing replica's
    bookkeeping is undone.

    Kills: the refusal failing the child, a retry that excludes nothing (back to the refusing
    replica), the retry not sent, the refused task left bound."""
    rig = await make(ONE, {"a": 2})
    rig.orch.pools["a"].sessions["s"] = "a-0"
    h = rig.submit("x", session="s")
    wid = rig.task(h, "a").wire_id
    rig.net.link("a-0").reply(msgspec.structs.replace(refusal, id=wid))
    task = rig.task(h, "a")
    assert task.replica.name == "a-1" and task.tried == {"a-0"}
    [sub] = rig.net.link("a-1").of(p.Submit)
    assert sub.id == wid
    assert rig.replica("a-0").inflight == 0 and rig.replica("a-0").bound == set()
    assert events(h) == []
    rig.net.link("a-1").reply(p.Final(id=wid, text="done"))
    out = outcome(h)
    assert out.status == "ok" and out.children[0].outputs["a"].replica == "a-1"
    rig.clean()


async def test_when_every_replica_refuses_the_request_is_draining(make: Make) -> None:
    """Twin: test_a_draining_reply_is_retried_on_another_replica. Once every replica of the
    stage refused, the request fails with `draining` (503) naming the stage; each replica was
    tried once.

    Kills: the tried set not kept across retries, `draining if tried else no_replica` swapped."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x")
    first = rig.task(h, "a").replica.name
    rig.answer(h, "a", p.Draining, message="draining")
    second = rig.task(h, "a").replica.name
    assert second != first
    rig.answer(h, "a", p.Error, code="not_ready", message="loading")
    out = outcome(h)
    assert (out.status, out.error.code, out.error.stage, out.http_status) == (
        "fatal", "draining", "a", 503)
    assert out.error.message == "stage 'a' has no live replica"
    assert [len(rig.net.link(n).of(p.Submit)) for n in ("a-0", "a-1")] == [1, 1]
    rig.clean()


async def test_a_refusal_on_a_middle_stage_keeps_the_walk_going(make: Make) -> None:
    """Twin: test_a_draining_reply_is_retried_on_another_replica (on an inner stage). After a
    retried inner stage finishes, the next stage starts: the request is not settled early.

    Kills: `_settle` after the retry ending a child that is not complete."""
    rig = await make(TWO, {"a": 2, "b": 1})
    h = rig.submit("x")
    rig.answer(h, "a", p.Draining, message="d")
    assert events(h) == [] and len(h._request.children[0].running) == 1
    rig.answer(h, "a", text="A")
    rig.answer(h, "b", text="B")
    assert outcome(h).status == "ok"


async def test_a_final_stage_output_keeps_its_tensors_and_fields(make: Make) -> None:
    """Twin: test_ar_to_diffusion_with_negative_prompt_companion (the image output). Only result
    fields that are set appear; tensors are detached copies when they lie in shared memory.

    Kills: `_output` keeping None fields or dropping set ones, tensors not detached, the
    replica name lost."""
    rig = await make(ONE)
    h = rig.submit("x")
    lent = p.WireTensor("uint8", (2,), memoryview(b"ab"), shm=p.ShmRef("seg", 0, 7))
    plain = tensor(1)
    rig.answer(h, "a", text="", prompt_tokens=0, completion_tokens=3, tensors={
        "img": lent, "p": plain})
    out = outcome(h).children[0].outputs["a"]
    assert out.fields == {"text": "", "prompt_tokens": 0, "completion_tokens": 3}
    assert out.tensors["p"] is plain
    assert out.tensors["img"].shm is None and bytes(out.tensors["img"].buffer) == b"ab"
    assert out.replica == "a-0"


# ---- abort -------------------------------------------------------------------------------------


async def test_abort_goes_to_the_bound_replica_and_the_prefix_is_the_outcome(make: Make) -> None:
    """Twin: test_abort_goes_to_the_bound_replica_and_returns_prefix. The abort goes to the
    replica the task is bound to, naming its incarnation; the request ends only when that
    replica's `aborted` reply comes, with the generated prefix as the output.

    Kills: the abort sent to another replica or without incarnation, the abort made terminal
    before the worker answered, the prefix dropped, finish_reason lost."""
    rig = await make([ar("llm", final=True)], {"llm": 2})
    h = rig.submit("hi", stream=True)
    task = rig.task(h, "llm")
    bound, other = task.replica.name, {"llm-0": "llm-1", "llm-1": "llm-0"}[task.replica.name]
    h.abort()
    assert rig.net.link(bound).of(p.Abort) == [p.Abort(id=task.wire_id, incarnation="inc-1")]
    assert rig.net.link(other).sent == []
    assert events(h) == [] and h.id in rig.orch.requests
    rig.answer(h, "llm", p.Aborted, text="he", token_ids=[5, 6], finish_reason="abort")
    out = outcome(h)
    assert (out.status, out.error, out.http_status) == ("abort", None, 200)
    [child] = out.children
    assert child.status == "abort"
    assert child.outputs["llm"].replica == bound
    assert child.outputs["llm"].fields == {"text": "he", "token_ids": [5, 6],
                                           "finish_reason": "abort"}
    rig.clean()
    assert rig.orch.counters["late_messages"] == 0 and rig.orch.outcomes == {"abort": 1}


async def test_several_final_stages_only_the_last_abort_is_terminal(make: Make) -> None:
    """Twin: test_several_final_stages_only_last_abort_is_terminal. Two final stages run; the
    first `aborted` reply does not end the request; the second does, with both prefixes.

    Kills: `_settle` ignoring `child.running` (the first final-stage abort terminal), an
    Aborted reply failing the child at once, an abort reaching only one stage."""
    rig = await make(MULTI)
    h = rig.submit("x")
    rig.answer(h, "src", text="S")
    f1, f2 = rig.task(h, "f1"), rig.task(h, "f2")
    h.abort()
    assert [a.id for a in rig.net.link("f1-0").of(p.Abort)] == [f1.wire_id]
    assert [a.id for a in rig.net.link("f2-0").of(p.Abort)] == [f2.wire_id]
    rig.answer(h, "f1", p.Aborted, text="a", finish_reason="abort")
    assert events(h) == [] and h.id in rig.orch.requests
    rig.answer(h, "f2", p.Aborted, text="b", finish_reason="abort")
    out = outcome(h)
    assert out.status == "abort"
    assert {k: v.fields["text"] for k, v in out.children[0].outputs.items()} == {
        "f1": "a", "f2": "b"}
    rig.clean()
    assert rig.orch.counters["late_messages"] == 0


async def test_an_abort_after_one_final_stage_finished_keeps_its_output(make: Make) -> None:
    """Twin: test_abort_after_one_final_stage_finished_keeps_its_output. f1 finished, f2 runs;
    the abort ends the request as `abort` once f2 answers, with f1's output beside f2's.

    Kills: an abort dropping the outputs gathered, `abort_requested` ignored when the outputs
    happen to be complete after the aborted stage answers."""
    rig = await make(MULTI)
    h = rig.submit("x")
    rig.answer(h, "src", text="S")
    rig.answer(h, "f1", text="one", finish_reason="stop")
    h.abort()
    assert rig.net.link("f1-0").of(p.Abort) == []
    rig.answer(h, "f2", p.Aborted, text="tw", finish_reason="abort")
    out = outcome(h)
    assert out.status == "abort"
    outputs = out.children[0].outputs
    assert outputs["f1"].fields == {"text": "one", "finish_reason": "stop"}
    assert outputs["f2"].fields == {"text": "tw", "finish_reason": "abort"}


async def test_an_abort_that_loses_the_race_still_ends_as_abort(make: Make) -> None:
    """Twin: test_abort_after_one_final_stage_finished_keeps_its_output. The worker finished
    before the abort reached it: the outputs are complete, but the client asked to abort, so
    the outcome is abort (only when outputs are incomplete is it forced; a finished request
    answers ok when nobody aborted).

    Kills: `child.aborted or (abort_requested and not complete)` changed, so a request whose
    last stage answered `final` after an abort is ok (and never abort)."""
    rig = await make(MULTI)
    h = rig.submit("x")
    rig.answer(h, "src", text="S")
    rig.answer(h, "f1", text="one")
    h.abort()
    rig.answer(h, "f2", text="two")  # final, not aborted: the abort came too late to the worker
    out = outcome(h)
    assert out.status == "ok" and set(out.children[0].outputs) == {"f1", "f2"}
    h2 = rig.submit("x")
    rig.answer(h2, "src", text="S")
    h2.abort()
    rig.answer(h2, "f1", text="one")
    assert events(h2) == []
    rig.answer(h2, "f2", p.Aborted, finish_reason="abort")  # diffusion-like: no prefix text
    out = outcome(h2)
    assert out.status == "abort" and set(out.children[0].outputs) == {"f1"}


async def test_an_abort_during_an_inner_stage_starts_nothing_after_it(make: Make) -> None:
    """Twin: test_several_final_stages_only_last_abort_is_terminal (abort before the finals).
    The inner stage answers `final` after the abort: the next stage is not started and the
    request ends as abort with no outputs.

    Kills: `_advance` starting stages after an abort, `abort_requested` not set."""
    rig = await make(TWO)
    h = rig.submit("x")
    h.abort()
    assert len(rig.net.link("a-0").of(p.Abort)) == 1
    rig.answer(h, "a", text="A")
    assert rig.net.link("b-0").sent == []
    out = outcome(h)
    assert (out.status, out.children[0].status, out.children[0].outputs) == ("abort", "abort", {})
    rig.clean()


async def test_an_inner_stage_aborted_reply_is_no_output(make: Make) -> None:
    """Twin: test_several_final_stages_only_last_abort_is_terminal. An `aborted` reply from a
    stage that is not final (or from a companion) is terminal for the child without an output.

    Kills: `stage in finals` / `not task.companion` dropped from the Aborted case."""
    rig = await make(TWO)
    h = rig.submit("x")
    h.abort()
    rig.answer(h, "a", p.Aborted, text="partial")
    out = outcome(h)
    assert out.status == "abort" and out.children[0].outputs == {}
    rig2 = await make(T2I)
    h2 = rig2.submit("x", negative_prompt="n")
    h2.abort()
    assert len(rig2.net.link("enc-0").of(p.Abort)) == 2  # both the prompt and the companion
    rig2.answer(h2, "enc", p.Aborted, companion=True, text="neg")
    assert events(h2) == []
    rig2.answer(h2, "enc", p.Aborted, text="pos")
    out = outcome(h2)
    assert out.status == "abort" and out.children[0].outputs == {}


async def test_aborting_one_sample_drops_the_parent_only_when_none_remain(make: Make) -> None:
    """Twin: test_parallel_sampling_child_abort_drops_parent_when_none_remain. Aborting sample 1
    ends that sample only; the parent ends as abort when every sample did; with one sample ok
    and one aborted the request is ok, each child with its own status.

    Kills: a child abort aborting its siblings, the parent ending with the first terminal
    child, the ok/abort roll-up of `_outcome`."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("p", n=3)
    h.abort(child=1)
    aborts = [a.id for n in ("a-0", "a-1") for a in rig.net.link(n).of(p.Abort)]
    assert aborts == [f"{h.id}/1/a"]
    rig.answer(h, "a", p.Aborted, child=1, finish_reason="abort")
    assert h._request.children[1].outcome.status == "abort"
    assert events(h) == [] and h.id in rig.orch.requests
    h.abort(child=0)
    h.abort(child=2)
    aborts = sorted(a.id for n in ("a-0", "a-1") for a in rig.net.link(n).of(p.Abort))
    assert aborts == [f"{h.id}/{i}/a" for i in range(3)]  # 0 and 2 are in range
    assert rig.orch.counters["late_aborts"] == 0
    rig.answer(h, "a", p.Aborted, child=0)
    assert events(h) == []
    rig.answer(h, "a", p.Aborted, child=2)
    out = outcome(h)
    assert out.status == "abort" and [c.status for c in out.children] == ["abort"] * 3
    assert [c.index for c in out.children] == [0, 1, 2]
    mixed = rig.submit("q", n=2)
    mixed.abort(child=0)
    rig.answer(mixed, "a", p.Aborted, child=0)
    rig.answer(mixed, "a", child=1, text="ok")
    out = outcome(mixed)
    assert out.status == "ok" and [c.status for c in out.children] == ["abort", "ok"]
    assert out.error is None
    rig.clean()


async def test_late_and_out_of_range_aborts_are_dropped_and_counted(make: Make) -> None:
    """Twin: test_terminal_state_is_monotonic. An abort for an unknown or finished request, a
    child index out of range (either side), or a child already terminal is dropped and counted
    as a late abort; nothing is sent and no outcome is added.

    Kills: the range check `0 <= i < len` loosened, late aborts not counted, an abort sent or
    an outcome emitted for a terminal child."""
    rig = await make(ONE)
    rig.orch.abort("nope")
    assert rig.orch.counters["late_aborts"] == 1
    h = rig.submit("x", n=2)
    for bad in (2, -1):
        h.abort(child=bad)
    assert rig.orch.counters["late_aborts"] == 3
    assert rig.net.link("a-0").of(p.Abort) == []
    rig.answer(h, "a", child=0, text="done")
    h.abort(child=0)  # that sample is terminal already
    assert rig.orch.counters["late_aborts"] == 4 and rig.net.link("a-0").of(p.Abort) == []
    h.abort()  # child 0 late, child 1 aborted
    assert rig.orch.counters["late_aborts"] == 5
    assert [a.id for a in rig.net.link("a-0").of(p.Abort)] == [f"{h.id}/1/a"]
    rig.answer(h, "a", p.Aborted, child=1)
    assert outcome(h).status == "ok"
    h.abort()
    h.abort(child=1)
    assert rig.orch.counters["late_aborts"] == 7 and events(h) == []


async def test_an_abort_that_cannot_be_sent_still_ends_the_request(make: Make) -> None:
    """Twin: test_kill_9_one_replica_fails_only_its_bound_requests. A send that raises (a closed
    channel) neither escapes abort() nor stops the abort of the other running stages.

    Kills: `contextlib.suppress` removed around the abort send."""
    rig = await make(MULTI)
    h = rig.submit("x")
    rig.answer(h, "src")
    rig.net.link("f1-0").closed = True
    h.abort()
    assert len(rig.net.link("f2-0").of(p.Abort)) == 1
    rig.answer(h, "f2", p.Aborted)
    rig.net.link("f1-0").closed = False
    rig.answer(h, "f1", p.Aborted)
    assert outcome(h).status == "abort"


# ---- terminal state is monotonic -----------------------------------------------------------------


async def test_a_failed_stage_aborts_the_others_and_their_replies_are_late(make: Make) -> None:
    """Twin: test_terminal_state_is_monotonic. f1 fails while f2 runs: the request ends at once
    with f1's error, an abort goes to f2's replica, and f2's later reply (and its deltas) are
    dropped, counted and their shared-memory blocks given back, never forwarded.

    Kills: `_fail_child` not aborting the other running tasks, the abort's send not guarded,
    the failed child's outputs dropped, late replies forwarded or not counted or not released,
    a second outcome."""
    rig = await make(MULTI, orch={}, shm=object())
    shm = rig.net.shms[0]  # type: ignore[attr-defined]
    h = rig.submit("x", stream=True)
    rig.answer(h, "src", text="S")
    f2 = rig.task(h, "f2")
    rig.answer(h, "f1", p.Error, code="bad_request", message="bad")
    out = outcome(h)
    assert (out.status, out.error.code, out.error.stage) == ("request_error", "bad_request", "f1")
    assert rig.net.link("f2-0").of(p.Abort) == [p.Abort(id=f2.wire_id, incarnation="inc-1")]
    rig.clean()
    # The outputs gathered before the failure stay on the failed child; an abort that cannot
    # be sent (closed channel) does not stop the failure.
    h2 = rig.submit("y")
    rig.answer(h2, "src", text="S")
    rig.answer(h2, "f1", text="kept")
    rig.answer(h2, "f2", p.Deadline, message="late")
    child = outcome(h2).children[0]
    assert child.status == "request_error" and set(child.outputs) == {"f1"}
    h3 = rig.submit("z")
    rig.answer(h3, "src", text="S")
    rig.net.link("f2-0").closed = True  # f2 runs; the abort for it will raise
    rig.answer(h3, "f1", p.Error, code="internal", message="boom")
    assert outcome(h3).error.code == "stage_failed"
    rig.net.link("f2-0").closed = False
    link = rig.net.link("f2-0")
    link.reply(p.Delta(id=f2.wire_id, seq=1, text="late"))
    late = link.reply(p.Aborted(id=f2.wire_id, text="x"), {"t": tensor(1)})
    assert events(h) == []
    assert rig.orch.counters["late_messages"] == 2
    assert late in shm.released


async def test_a_reply_from_another_replica_than_the_bound_one_is_dropped(make: Make) -> None:
    """Twin: test_a_restart_at_the_same_address_fails_the_old_work_at_once. A reply naming a
    task that is bound elsewhere, or an unknown id, is late: dropped and counted.

    Kills: `task.replica is not replica` check removed, unknown ids not counted."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x")
    task = rig.task(h, "a")
    other = rig.net.link({"a-0": "a-1", "a-1": "a-0"}[task.replica.name])
    other.reply(p.Final(id=task.wire_id, text="imposter"))
    other.reply(p.Final(id="unknown/0/a", text="?"))
    other.reply(p.Error(code="internal", message="no id", cid="c1"))
    assert events(h) == [] and rig.orch.counters["late_messages"] == 3
    assert rig.task(h, "a") is task
    rig.answer(h, "a", text="real")
    assert outcome(h).children[0].outputs["a"].fields["text"] == "real"


async def test_replies_release_their_blocks_when_the_request_ends(make: Make) -> None:
    """Twin: tests/integration/test_shm.py through the engine. Replies that carry tensors are
    held until the outcome and then released, all of them; replies without tensors are not
    held; the shared-memory manager is closed on stop.

    Kills: held replies not released at the outcome, `held` not cleared, replies without
    tensors held, the shm manager not passed to channels or not closed."""
    rig = await make(TWO, shm="cfg")
    shm = rig.net.shms[0]  # type: ignore[attr-defined]
    assert shm.cfg == "cfg" and rig.orch.shm is shm
    assert rig.net.link("a-0").shm is shm
    h = rig.submit("x")
    ma = rig.answer(h, "a", text="A", tensors={"h": tensor(1)})
    assert h._request.held == [ma] and shm.released == []
    mb = rig.answer(h, "b", text="B")
    assert outcome(h).status == "ok"
    assert shm.released == [ma] and mb not in shm.released
    assert h._request.held == []
    await rig.orch.stop()
    assert shm.closed == 1


async def test_the_borrower_segment_is_named_in_the_submit(make: Make) -> None:
    """Twin: tests/integration/test_shm.py. When the channel says the worker may lend to us,
    the submit names our segment.

    Kills: `shm=replica.channel.borrower` dropped."""
    rig = await make(ONE)
    rig.net.borrower = "seg-1"
    rig.submit("x")
    assert rig.net.link("a-0").of(p.Submit)[0].shm == "seg-1"


# ---- deadlines -----------------------------------------------------------------------------------


async def test_submit_timeouts_follow_the_request_deadline_and_the_stage_default(
        make: Make) -> None:
    """Twin: test_stage_default_deadline_applies_through_the_orchestrator. Without a deadline of
    the client's own, a stage gets min(what is left of the request's, the stage's default);
    with one, what is left of it; the request timer is set to the request's timeout.

    Kills: `min` -> `max`, the stage default applied to a client deadline, the remaining time
    computed wrongly, the default request timeout or the timer's delay changed."""
    stages = [echo("a", admission={"defaultDeadlineSeconds": 30}),
              echo("b", ("a",), final=True, admission={"defaultDeadlineSeconds": 120})]
    rig = await make(stages, orch={"requestTimeoutSeconds": 100})
    loop = asyncio.get_running_loop()
    before = loop.time()
    h = rig.submit("x")
    after = loop.time()
    assert h._request.deadline == rig.clock.now + 100
    assert before + 100 <= h._request.timer.when() <= after + 100
    assert rig.net.link("a-0").of(p.Submit)[0].timeout_s == 30.0
    rig.clock.advance(10)
    rig.answer(h, "a", text="A")
    assert rig.net.link("b-0").of(p.Submit)[0].timeout_s == 90.0  # 100 - 10 < 120
    h2 = rig.submit("y", timeout_s=45.0)
    assert h2._request.deadline == rig.clock.now + 45.0
    assert rig.net.link("a-0").of(p.Submit)[1].timeout_s == 45.0  # the client's, not 30
    timer = h2._request.timer
    rig.answer(h2, "a", text="A")
    rig.answer(h2, "b", text="B")
    assert outcome(h2).status == "ok" and timer.cancelled()


async def test_a_stage_started_after_the_deadline_fails_with_deadline(make: Make) -> None:
    """Twin: test_terminal_state_is_monotonic (the deadline part). When the request's time is
    used up (exactly, or more) by the time the next stage would start, it ends with deadline
    (504) naming that stage, and nothing is sent.

    Kills: `remaining <= 0` -> `< 0`, the check removed (a submit with no time left)."""
    rig = await make(TWO, orch={"requestTimeoutSeconds": 50})
    h = rig.submit("x")
    rig.clock.advance(50)
    rig.answer(h, "a", text="A")
    out = outcome(h)
    assert (out.status, out.error.code, out.error.stage, out.http_status) == (
        "request_error", "deadline", "b", 504)
    assert out.error.message == "request deadline passed"
    assert rig.net.link("b-0").sent == []
    rig.clean()


async def test_the_request_timer_fails_every_running_sample(make: Make) -> None:
    """Twin: test_terminal_state_is_monotonic. When the request's timer fires, each sample fails
    with deadline and its running stage gets an abort; one outcome for the request.

    Kills: `_on_deadline` failing only some children, the abort to running tasks dropped."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x", n=2, timeout_s=0.01)
    out = await asyncio.wait_for(h.outcome(), HANG)
    assert (out.status, out.error.code, out.error.message, out.error.stage) == (
        "request_error", "deadline", "request deadline passed", None)
    assert [c.error.code for c in out.children] == ["deadline", "deadline"]
    assert sorted(a.id for n in ("a-0", "a-1") for a in rig.net.link(n).of(p.Abort)) == [
        f"{h.id}/0/a", f"{h.id}/1/a"]
    rig.clean()


async def test_the_request_error_is_the_first_samples_when_all_failed(make: Make) -> None:
    """Twin: test_generic_route_reports_failures_per_child. Every sample failed: the request
    fails with sample 0's error (even when sample 1 failed first). A failed sample beside an
    aborted one: abort. Beside an ok one: ok, each child keeping its own error.

    Kills: errors[0] changed, the all-failed test loosened, the abort/ok roll-up swapped."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x", n=2)
    rig.answer(h, "a", p.Deadline, child=1, message="late")
    rig.answer(h, "a", p.Overloaded, child=0, message="full", retry_after=1.0)
    out = outcome(h)
    assert (out.status, out.error.code) == ("request_error", "overloaded")
    assert [c.error.code for c in out.children] == ["overloaded", "deadline"]
    assert [c.index for c in out.children] == [0, 1]
    h = rig.submit("x", n=2)
    rig.answer(h, "a", p.Error, child=0, code="internal", message="boom")
    rig.answer(h, "a", p.Error, child=1, code="bad_request", message="bad")
    out = outcome(h)
    assert (out.status, out.error.code) == ("fatal", "stage_failed")
    h = rig.submit("x", n=2)
    rig.answer(h, "a", p.Error, child=0, code="internal", message="boom")
    h.abort(child=1)
    rig.answer(h, "a", p.Aborted, child=1)
    out = outcome(h)
    assert (out.status, out.error) == ("abort", None)
    assert [c.status for c in out.children] == ["fatal", "abort"]
    h = rig.submit("x", n=2)
    rig.answer(h, "a", p.Error, child=1, code="bad_request", message="bad")
    rig.answer(h, "a", child=0, text="fine")
    out = outcome(h)
    assert (out.status, out.error) == ("ok", None)
    assert out.children[1].error.code == "bad_request"
    assert rig.orch.outcomes == {"request_error": 1, "fatal": 1, "abort": 1, "ok": 1}
    rig.clean()


# ---- sending -------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    {"prompt": "\ud800"}, {"seed": 2**70}, {"x": object()},
])
async def test_an_unencodable_request_is_a_bad_request(make: Make, params: Any) -> None:
    """Twin: test_unencodable_value_is_a_request_error_and_loop_keeps_running. A value the wire
    cannot carry (a lone surrogate, an int over 64 bits, an object) is a 400 naming the stage;
    nothing is left bound, and the next request runs.

    Kills: each exception type dropped from the encode-error tuple, the task bound before the
    send succeeded."""
    rig = await make(ONE)
    params = dict(params)  # the parametrize dict is shared by every run of this test
    prompt = params.pop("prompt", "x")
    h = rig.submit(prompt, params={"a": params})
    out = outcome(h)
    assert (out.status, out.error.code, out.error.stage, out.http_status) == (
        "request_error", "bad_request", "a", 400)
    assert out.error.message.startswith("request could not be encoded for stage a: ")
    rig.clean()
    assert rig.replica("a-0").served == 0
    h = rig.submit("fine")
    rig.answer(h, "a")
    assert outcome(h).status == "ok"


@pytest.mark.parametrize(("error", "code"), [
    (msgspec.EncodeError("cannot encode"), "bad_request"),
    (ChannelClosed("channel to a-0 is closed"), "stage_failed"),
])
async def test_a_send_that_raises_fails_the_request(
        make: Make, error: BaseException, code: str) -> None:
    """Twin: test_kill_9_one_replica_fails_only_its_bound_requests. An encoder error is a 400;
    any other failure to send is a stage failure naming the replica.

    Kills: msgspec.EncodeError dropped from the tuple, the generic handler removed or mapped to
    another code, the message."""
    rig = await make(ONE)
    rig.net.send_error = error
    out = outcome(rig.submit("x"))
    assert (out.error.code, out.error.stage) == (code, "a")
    if code == "stage_failed":
        assert out.error.message == "could not send to a-0: channel to a-0 is closed"
        assert out.status == "fatal"
    rig.clean()


# ---- replicas lost, restarted, refused ----------------------------------------------------------


async def test_a_closed_connection_fails_only_the_work_bound_to_that_replica(make: Make) -> None:
    """Twin: test_kill_9_one_replica_fails_only_its_bound_requests and
    test_a_restart_at_the_same_address_fails_the_old_work_at_once. The socket says the
    connection closed: every task bound to that replica fails at once with replica_lost (502),
    the others are untouched; the replica is not routed to until a new process answers a hello,
    then it is again.

    Kills: `_on_disconnect` ignored, the incarnation not cleared, the wrong tasks failed, the
    restart not counted, the new hello not making the replica routable."""
    rig = await make(ONE, {"a": 2}, orch={"failover": {"maxRetries": 0}})
    rig.orch.pools["a"].sessions.update({"s0": "a-0", "s1": "a-1"})
    on0 = [rig.submit(str(i), session="s0") for i in range(2)]
    on1 = rig.submit("z", session="s1")
    a0 = rig.replica("a-0")
    link = rig.net.link("a-0")
    link.on_disconnect()
    for h in on0:
        out = outcome(h)
        assert (out.status, out.error.code, out.error.stage, out.http_status) == (
            "fatal", "replica_lost", "a", 502)
        assert out.error.message == ("replica a-0 of stage a was lost: connection closed: "
                                     "incarnation inc-1 is gone")
    assert events(on1) == [] and on1.id in rig.orch.requests
    assert a0.incarnation is None and not a0.routable and a0.alive
    assert (a0.inflight, a0.bound) == (0, set())
    assert rig.orch.counters["replica_restarts"] == 1
    assert link.of(p.Abort) == []  # the process is gone: nothing is sent for its work
    link.on_disconnect()  # a second close before any hello: nothing more
    assert rig.orch.counters["replica_restarts"] == 1
    link.reply(link.hello_reply("inc-2"))
    assert a0.incarnation == "inc-2" and a0.routable and a0.refused == ""
    h = rig.submit("again", session="s0")
    assert rig.net.link("a-0").of(p.Submit)[-1].incarnation == "inc-2"
    rig.answer(h, "a")
    rig.answer(on1, "a")
    assert outcome(h).status == "ok" and outcome(on1).status == "ok"


async def test_a_pong_from_a_new_incarnation_fails_the_old_work_and_says_hello(
        make: Make) -> None:
    """Twin: test_a_new_incarnation_seen_in_a_pong_or_a_refusal_fails_the_old_work. A pong
    naming the same process changes nothing; one naming another fails the bound work with the
    restart in the message, and a new hello goes out.

    Kills: `_on_pong` comparing wrongly, not sending the hello, the message text."""
    rig = await make(ONE)
    h = rig.submit("x")
    link, w = rig.net.link("a-0"), rig.net.workers[endpoint(rig, "a-0")]
    link.reply(p.Pong(cid="hb-1", state=state(w)))
    assert events(h) == [] and link.hellos == 1
    link.reply(p.Pong(cid="hb-2", state=state(w, "inc-2")))
    out = outcome(h)
    assert out.error.message == ("replica a-0 of stage a was lost: restarted: incarnation "
                                 "inc-1 -> inc-2")
    assert link.hellos == 2 and rig.replica("a-0").incarnation is None
    link.reply(p.Pong(cid="hb-3", state=state(w, "inc-3")))  # no incarnation yet: wait
    assert link.hellos == 2 and rig.orch.counters["replica_restarts"] == 1
    link.reply(link.hello_reply("inc-2"))
    assert rig.replica("a-0").incarnation == "inc-2"


async def test_a_stale_incarnation_refusal_fails_that_request_and_restarts_once(
        make: Make) -> None:
    """Twin: test_a_new_incarnation_seen_in_a_pong_or_a_refusal_fails_the_old_work. The worker
    refuses a submit meant for its previous process: that request fails with replica_lost, the
    replica handshakes again, and the other work bound to the old process fails too; a second
    refusal for the same old process does not restart it again.

    Kills: stale_incarnation treated as a generic error, the restart skipped or repeated, the
    message."""
    rig = await make(ONE)
    h1, h2 = rig.submit("1"), rig.submit("2")
    link = rig.net.link("a-0")
    rig.answer(h1, "a", p.Error, code="stale_incarnation", message="the replica restarted")
    out = outcome(h1)
    assert (out.status, out.error.code, out.error.stage) == ("fatal", "replica_lost", "a")
    assert out.error.message == ("replica a-0 of stage a restarted: the replica restarted")
    assert outcome(h2).error.message == ("replica a-0 of stage a was lost: refused a request "
                                         "for its previous incarnation")
    assert link.hellos == 2 and rig.orch.counters["replica_restarts"] == 1
    link.reply(link.hello_reply("inc-2"))
    h3 = rig.submit("3")
    task = rig.task(h3, "a")
    assert task.incarnation == "inc-2"
    rig.replica("a-0").incarnation = "inc-3"  # already seen a newer one: no second restart
    rig.answer(h3, "a", p.Error, code="stale_incarnation", message="again")
    assert outcome(h3).error.code == "replica_lost"
    assert rig.orch.counters["replica_restarts"] == 1 and link.hellos == 2


async def test_a_hello_after_a_reconnect_that_refuses_is_not_routed_to(make: Make) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version. After a reconnect,
    a hello refused (an error without id) or of another version leaves the replica unroutable
    with the reason in status(), and fails its old work; the same incarnation answering again
    changes nothing; a lost replica's hello is ignored.

    Kills: `_on_hello` accepting another version, the refused reason text, the restart on a
    refused hello, a same-incarnation hello treated as a restart."""
    rig = await make(ONE, {"a": 2}, orch={"failover": {"maxRetries": 0}})
    link0, link1 = rig.net.link("a-0"), rig.net.link("a-1")
    a0 = rig.replica("a-0")
    link0.reply(link0.hello_reply("inc-1"))  # the same process again
    assert a0.incarnation == "inc-1" and rig.orch.counters["replica_restarts"] == 0
    rig.orch.pools["a"].sessions["s"] = "a-0"
    h = rig.submit("x", session="s")
    link0.reply(p.Error(code="version_mismatch", message="speaks 9"))
    assert outcome(h).error.message == ("replica a-0 of stage a was lost: restarted with "
                                        "another protocol version")
    assert a0.refused == ("replica a-0 refused the handshake after a restart: "
                          "version_mismatch: speaks 9")
    assert not a0.routable and rig.orch.counters["replica_restarts"] == 1
    link0.reply(p.Error(code="version_mismatch", message="speaks 9"))  # no incarnation now
    assert rig.orch.counters["replica_restarts"] == 1
    link1.reply(link1.hello_reply("inc-1", version=p.PROTOCOL_VERSION + 1))
    a1 = rig.replica("a-1")
    assert a1.refused == (f"replica a-1 refused the handshake after a restart: it speaks "
                          f"protocol version {p.PROTOCOL_VERSION + 1}")
    assert a1.incarnation is None and rig.orch.counters["replica_restarts"] == 2
    assert outcome(rig.submit("y")).error.code == "no_replica"
    status = {r["name"]: r for r in rig.orch.status()["a"]}
    assert status["a-0"]["refused"] == a0.refused and status["a-0"]["incarnation"] is None
    link0.reply(link0.hello_reply("inc-5"))
    assert a0.incarnation == "inc-5" and a0.refused == "" and a0.routable
    rig.membership.publish(ReplicaInfo("a", "a-0", endpoint(rig, "a-0"), "gone"))
    link0.reply(link0.hello_reply("inc-6"))  # a lost replica: ignored
    assert a0.incarnation == "inc-5"


async def test_a_new_incarnation_in_a_hello_fails_the_old_work(make: Make) -> None:
    """Twin: test_a_restart_at_the_same_address_fails_the_old_work_at_once. A hello naming a new
    process, when no closed connection was seen, fails the work bound to the old one and makes
    the replica routable with the new incarnation.

    Kills: the incarnation comparison in `_on_hello`, the new incarnation not taken."""
    rig = await make(ONE)
    h = rig.submit("x")
    link = rig.net.link("a-0")
    link.reply(link.hello_reply("inc-2"))
    out = outcome(h)
    assert out.error.message == ("replica a-0 of stage a was lost: restarted: incarnation "
                                 "inc-1 -> inc-2")
    assert rig.replica("a-0").incarnation == "inc-2"
    assert rig.orch.counters["replica_restarts"] == 1


async def test_a_replica_of_another_protocol_version_is_never_routed_to(make: Make) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version. The handshake at
    start says another version: the replica is refused (reason kept), never sent work, and
    skipped by the heartbeat.

    Kills: VersionMismatch not recorded, a refused replica routed to or declared lost."""
    rig = await make(ONE, {"a": 0}, workers=[Worker("old", "a", version=p.PROTOCOL_VERSION - 1),
                                             Worker("a-0", "a")],
                     heartbeat_interval=0, heartbeat_timeout=5)
    assert list(rig.orch.pools["a"].replicas) == ["old", "a-0"]  # the refused one first
    old = rig.replica("old")
    assert old.refused == f"replica old speaks protocol version {p.PROTOCOL_VERSION - 1}"
    assert old.incarnation is None and not old.routable
    for _ in range(4):
        h = rig.submit("x")
        assert rig.task(h, "a").replica.name == "a-0"
    a0_link = rig.net.link("a-0")
    await until(lambda: len(a0_link.of(p.Ping)) >= 2, "heartbeats running")
    rig.net.workers[endpoint(rig, "a-0")].pings = "silent"
    rig.clock.advance(60)
    await until(lambda: "a-0" in rig.orch.suspects, "a-0 lost to missed heartbeats")
    assert "old" in rig.orch.pools["a"].replicas and old.alive
    assert rig.net.link("old").of(p.Ping) == []
    await until(lambda: a0_link.closed, "a-0's channel closed")


async def test_a_handshake_closed_before_a_reply_leaves_the_replica_unrouted(make: Make) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version. A channel closed
    before the hello was answered: the replica stays listed, unroutable, not declared lost.

    Kills: ChannelClosed handled like a timeout (lost, probation)."""
    rig = await make(ONE, {"a": 0}, workers=[Worker("c", "a", hello="closed")])
    c = rig.replica("c")
    assert c.alive and c.incarnation is None and c.refused == ""
    assert rig.orch.suspects == {} and rig.orch.counters["replicas_lost"] == 0
    assert rig.orch.readiness() == (False, "stage 'a' has no ready replica")


async def test_start_waits_for_the_handshakes_so_the_first_request_finds_them(
        make: Make) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version. After start() the
    replicas that answered are routable, with their incarnation and last_seen set.

    Each channel shares the orchestrator's ZMQ context; without a shared-memory config there
    is no segment manager.

    Kills: start() not waiting for pending handshakes, the incarnation not recorded, no
    context made or another one passed, a segment manager started without a config."""
    rig = await make(TWO)
    for name in ("a-0", "b-0"):
        r = rig.replica(name)
        assert r.incarnation == "inc-1" and r.routable and r.last_seen == rig.clock.now
        assert r.handshake.done()
        assert rig.net.link(name).shm is None
    assert rig.orch.ready and rig.orch.readiness() == (True, "ready")
    zctx = rig.orch._zctx
    assert isinstance(zctx, zmq.asyncio.Context)
    assert all(ln.zctx is zctx for ln in rig.net.links)
    assert rig.orch.shm is None and rig.net.shms == []  # type: ignore[attr-defined]
    await rig.orch.stop()
    assert zctx.closed


async def test_a_silent_handshake_puts_the_replica_on_probation_until_it_answers(
        make: Make) -> None:
    """Twin: test_stalled_replica_is_dropped_then_readmitted. A replica that never answers its
    hello is dropped from routing and probed on a fresh channel; once a ping is answered it is
    re-admitted (a new channel and handshake) and the probe channel closes.

    Kills: the timeout not losing the replica, probation not set, the probe not re-admitting,
    the probe channel leaked, the re-admission not going through `Replicas.on_member`."""
    rig = await make(ONE, {"a": 1}, workers=[Worker("s", "a", hello="silent", pings="silent")],
                     heartbeat_interval=0, heartbeat_timeout=0.01)
    await until(lambda: "s" in rig.orch.suspects, "s on probation")
    assert "s" not in rig.orch.pools["a"].replicas
    assert set(rig.orch.suspects) == {"s"}
    assert rig.orch.counters["replicas_lost"] == 1
    await until(lambda: rig.net.has("probe-s"), "a probe channel opened")
    probe = rig.net.link("probe-s")
    assert probe.zctx is rig.orch._zctx and probe.endpoint == endpoint(rig, "s")
    await until(lambda: probe.pinged >= 2, "the probe retried a silent ping")
    w = rig.net.workers[endpoint(rig, "s")]
    w.pings = "refused"  # the address refuses: still a suspect, still probed
    n = probe.pinged
    await until(lambda: probe.pinged >= n + 2, "the probe retried a refused ping")
    assert "s" in rig.orch.suspects and not probe.closed
    assert set(probe.timeouts) == {0.01}  # each ping waits the heartbeat timeout
    w.hello, w.pings = "answer", "answer"
    await until(lambda: "s" in rig.orch.pools["a"].replicas, "s re-admitted")
    assert rig.orch.suspects == {}
    await until(lambda: probe.closed, "the probe channel closed")
    await until(lambda: rig.replica("s").routable, "s handshaken")
    assert rig.net.link("s") is not probe and rig.net.link("s").endpoint == endpoint(rig, "s")


async def test_missed_heartbeats_lose_the_replica_and_fail_its_work(make: Make) -> None:
    """Twin: test_stalled_replica_is_dropped_then_readmitted. Pings go out each interval; a
    replica silent for exactly the timeout is kept, longer is lost (on probation), its bound
    work fails with replica_lost, and it is re-admitted when a probe ping is answered.

    Kills: `>` -> `>=` on the heartbeat timeout, pings not sent, a ping that cannot be sent
    ending the heartbeat, the loss not failing the bound work, probation not set."""
    rig = await make(ONE, {"a": 0}, orch={"failover": {"maxRetries": 0}},
                     workers=[Worker("c", "a"), Worker("a-0", "a"), Worker("a-1", "a")],
                     heartbeat_interval=0, heartbeat_timeout=3.0)
    rig.net.link("c").closed = True  # its pings raise: the others are pinged all the same
    link0 = rig.net.link("a-0")
    await until(lambda: len(link0.of(p.Ping)) >= 3, "pings sent")
    assert all(ping.cid.startswith("hb-") for ping in link0.of(p.Ping))
    rig.orch.pools["a"].sessions["s"] = "a-0"
    h = rig.submit("x", session="s")
    rig.clock.advance(3.0)
    n = len(link0.of(p.Ping))
    await until(lambda: len(link0.of(p.Ping)) >= n + 3, "more pings, nothing lost")
    assert rig.orch.counters["replicas_lost"] == 0
    for name in ("a-1", "c"):  # these two answered: their last_seen moves with the clock
        rig.net.link(name).reply(p.Pong(cid="x", state=state(rig.net.workers[endpoint(
            rig, name)])))
    w0 = rig.net.workers[endpoint(rig, "a-0")]
    w0.pings = "silent"
    rig.clock.advance(0.5)
    await until(lambda: "a-0" in rig.orch.suspects, "a-0 lost")
    assert "a-1" in rig.orch.pools["a"].replicas and rig.orch.counters["replicas_lost"] == 1
    out = outcome(h)
    assert out.error.code == "replica_lost"
    assert out.error.message == ("replica a-0 of stage a was lost: no heartbeat for 3.5s")
    await until(lambda: link0.closed, "a-0's channel closed")
    w0.pings = "answer"
    await until(lambda: "a-0" in rig.orch.pools["a"].replicas, "a-0 re-admitted")
    await until(lambda: rig.replica("a-0").routable, "a-0 handshaken")


async def test_a_lost_replica_with_an_aborted_child_ends_it_as_abort(make: Make) -> None:
    """Twin: test_kill_9_one_replica_fails_only_its_bound_requests. Work whose abort was asked
    before its replica was lost ends as abort, not replica_lost; a lost replica is lost once.

    Kills: `abort_requested` ignored in `Failover.lost`, `Replicas.lose` not idempotent."""
    rig = await make(ONE)
    h = rig.submit("x")
    h.abort()
    rig.membership.publish(ReplicaInfo("a", "a-0", endpoint(rig, "a-0"), "gone"))
    out = outcome(h)
    assert (out.status, out.error) == ("abort", None)
    assert rig.orch.counters["replicas_lost"] == 1
    lost = rig.net.link("a-0")
    replica = lost.on_message.args[0]  # the Replica the channel served
    assert not replica.alive
    rig.orch.replicas.lose(replica, "again")
    assert rig.orch.counters["replicas_lost"] == 1 and rig.orch.suspects == {}


async def test_membership_changes_route_and_unroute_replicas(make: Make) -> None:
    """Twin: test_draining_replica_takes_no_new_work and test_kill_9_... A replica marked draining
    takes no new work but keeps its channel; one gone is removed, its channel closed and its
    work failed; one at a new address replaces the old (the old one's work fails); an unknown
    stage is ignored; a joining replica gets a channel to its endpoint.

    Kills: state changes ignored, `gone` not losing the replica, a new endpoint not replacing
    the channel, replicas of unknown stages added, the new channel's endpoint or name."""
    rig = await make(ONE, {"a": 2}, orch={"failover": {"maxRetries": 0}})
    e0, e1 = endpoint(rig, "a-0"), endpoint(rig, "a-1")
    link0 = rig.net.link("a-0")
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "draining"))
    assert rig.replica("a-0").info.state == "draining" and rig.net.link("a-0") is link0
    for _ in range(4):
        assert rig.task(rig.submit("x"), "a").replica.name == "a-1"
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "ready"))
    rig.orch.pools["a"].sessions["s"] = "a-0"
    h = rig.submit("y", session="s")
    assert rig.task(h, "a").replica.name == "a-0"
    new = "tcp://127.0.0.1:29999"
    rig.net.workers[new] = Worker("a-0", "a", incarnation="inc-9")
    rig.membership.publish(ReplicaInfo("a", "a-0", new, "ready"))
    out = outcome(h)
    assert out.error.code == "replica_lost"
    assert out.error.message.endswith(f"replaced by a new instance at {new}")
    await until(lambda: link0.closed, "the old channel closed")
    fresh = rig.net.link("a-0")
    assert fresh is not link0 and fresh.endpoint == new and fresh.zctx is rig.orch._zctx
    await until(lambda: rig.replica("a-0").incarnation == "inc-9", "new instance handshaken")
    rig.membership.publish(ReplicaInfo("zz", "z-0", "tcp://127.0.0.1:1"))
    assert "zz" not in rig.orch.pools and all(ln.name != "z-0" for ln in rig.net.links)
    rig.orch.pools["a"].sessions["s1"] = "a-1"
    on_a1 = rig.submit("z", session="s1")
    assert rig.task(on_a1, "a").replica.name == "a-1"
    rig.membership.publish(ReplicaInfo("a", "a-1", e1, "gone"))
    assert "a-1" not in rig.orch.pools["a"].replicas
    assert rig.orch.counters["replicas_lost"] == 2
    assert outcome(on_a1).error.message == ("replica a-1 of stage a was lost: replica left the "
                                            "membership")
    await until(lambda: rig.net.link("a-1").closed, "a-1 channel closed")
    rig.membership.publish(ReplicaInfo("a", "a-1", e1, "gone"))  # gone twice: nothing
    assert rig.orch.counters["replicas_lost"] == 2


async def test_membership_updates_for_a_suspect(make: Make) -> None:
    """Twin: test_stalled_replica_is_dropped_then_readmitted. While a replica is on probation, a
    membership update at the same address only refreshes what the probe re-admits; one at a new
    address replaces it at once; `gone` ends the probation.

    Kills: the suspect checks of `Replicas.on_member` (same endpoint re-added at once, new endpoint
    ignored, gone leaving the suspect)."""
    rig = await make(ONE, {"a": 0}, workers=[Worker("s", "a", hello="silent", pings="silent"),
                                             Worker("t", "a", hello="silent", pings="silent"),
                                             Worker("u", "a", hello="silent", pings="silent")],
                     heartbeat_interval=0, heartbeat_timeout=0.01)
    await until(lambda: len(rig.orch.suspects) == 3, "all three on probation")
    assert set(rig.orch.suspects) == {"s", "t", "u"}
    es = endpoint(rig, "s")
    rig.membership.publish(ReplicaInfo("a", "s", es, "draining"))
    assert "s" not in rig.orch.pools["a"].replicas
    assert rig.orch.suspects["s"].state == "draining"
    other = "tcp://127.0.0.1:29998"
    rig.net.workers[other] = Worker("t", "a")
    rig.membership.publish(ReplicaInfo("a", "t", other))
    assert "t" not in rig.orch.suspects and "t" in rig.orch.pools["a"].replicas
    rig.membership.publish(ReplicaInfo("a", "u", endpoint(rig, "u"), "gone"))
    assert "u" not in rig.orch.suspects
    await until(lambda: rig.net.has("probe-u"), "u probed")
    probe_u = rig.net.link("probe-u")
    await until(lambda: probe_u.closed, "the probe of a gone replica ends")
    rig.net.workers[es].pings = "answer"
    rig.net.workers[es].hello = "answer"
    await until(lambda: "s" in rig.orch.pools["a"].replicas, "s re-admitted")
    assert rig.replica("s").info.state == "draining"


# ---- lifecycle -----------------------------------------------------------------------------------


async def test_stop_lets_requests_in_flight_finish_then_closes_everything(make: Make) -> None:
    """Twin: every integration test's teardown (launch fixture: stop(drain_timeout=1)). stop()
    refuses new requests at once, waits for the one in flight to finish, then stops the
    heartbeat, closes every channel, empties the pools and the suspects, stops membership.

    Kills: stop not draining (the in-flight request failed), the idle event never set (stop
    waits for its whole timeout), channels not closed, pools not cleared."""
    rig = await make(ONE, {"a": 1}, workers=[Worker("s", "a", hello="silent", pings="silent")],
                     heartbeat_interval=0, heartbeat_timeout=0.01)
    stopped: list[bool] = []
    membership_stop = rig.membership.stop

    async def record_stop() -> None:
        stopped.append(True)
        await membership_stop()

    rig.membership.stop = record_stop  # type: ignore[method-assign]
    await until(lambda: "s" in rig.orch.suspects, "s on probation")
    h, h2 = rig.submit("x"), rig.submit("y")
    hb = rig.orch.replicas.heartbeat
    stopping = asyncio.ensure_future(rig.orch.stop(drain_timeout=3600))
    await until(lambda: not rig.orch.accepting, "stop began")
    assert outcome(rig.submit("late")).error.code == "shutting_down"
    rig.answer(h, "a", text="done")
    assert outcome(h).status == "ok"
    for _ in range(10):  # one request is still in flight: the drain goes on
        await asyncio.sleep(0)
    assert not stopping.done() and events(h2) == []
    rig.answer(h2, "a", text="done")
    assert outcome(h2).status == "ok"
    await asyncio.wait_for(stopping, HANG)
    assert rig.orch.replicas.heartbeat is None and hb.done() and stopped == [True]
    assert all(not pool.replicas for pool in rig.orch.pools.values())
    assert rig.orch.suspects == {} and not rig.orch._background
    assert all(ln.closed for ln in rig.net.links)
    await rig.orch.stop()  # idempotent
    assert stopped == [True]


async def test_stop_fails_what_outlasts_the_drain_with_shutting_down(make: Make) -> None:
    """Twin: test_dead_downstream_stage (teardown). Work still running when the drain timeout
    passes ends with shutting_down (503); a second stop() while the first runs waits for it.

    Kills: the remaining requests never failed (no outcome), the concurrent stop returning
    before the first finished."""
    rig = await make(ONE)
    h = rig.submit("x")
    first = asyncio.ensure_future(rig.orch.stop(drain_timeout=0))
    await until(lambda: not rig.orch.accepting, "stop began")
    second = asyncio.ensure_future(rig.orch.stop())
    await asyncio.wait_for(second, HANG)
    assert first.done()
    out = outcome(h)
    assert (out.status, out.error.code, out.error.message) == (
        "fatal", "shutting_down", "orchestrator shut down")
    assert rig.net.link("a-0").of(p.Abort) == [p.Abort(id=f"{h.id}/0/a", incarnation="inc-1")]


async def test_stop_before_start_does_nothing(make: Make) -> None:
    """Twin: none (a guard for callers' error paths).

    Kills: stop() touching state that start() never set."""
    rig = await make(ONE, start=False)
    await rig.orch.stop()
    assert rig.orch._stopped is None and rig.net.links == []


class _Failing(Membership):
    async def start(self, on_change: Any) -> None:
        raise RuntimeError("watch failed")


async def test_a_failed_start_leaves_no_shared_memory_segment(make: Make) -> None:
    """Twin: tests/integration/test_shm.py (a failed start). When membership cannot start, the
    segment manager is closed and dropped, the error reaches the caller, and a later stop()
    returns at once (it used to wait forever for a stop that never began).

    Kills: the cleanup in start()'s except branch removed, the error swallowed, the stop
    state left set."""
    rig = await make(ONE, start=False)
    orch = Orchestrator(pipeline(ONE), _Failing(), shm="cfg")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="watch failed"):
        await orch.start()
    [shm] = rig.net.shms  # type: ignore[attr-defined]
    assert shm.cfg == "cfg" and shm.closed == 1
    assert orch.shm is None and not orch.accepting
    await asyncio.wait_for(orch.stop(), HANG)  # returns: nothing was started
    assert shm.closed == 1 and orch._stopped is None


# ---- control, readiness, status, metrics --------------------------------------------------------


async def test_control_fans_out_and_raises_the_workers_exception(make: Make) -> None:
    """Twin: test_control_fan_out_and_error_propagation. Unknown ops and stages are refused
    before anything is sent; the op goes to every live replica of the chosen stages (all by
    default) and the answers come back by replica; a worker's exception is raised.

    Kills: the op or stage checks removed, the fan-out missing replicas or stages, a worker
    exception swallowed or raised before the other replicas answered (return_exceptions),
    results keyed wrongly."""
    rig = await make(TWO, {"a": 2, "b": 1})
    calls: list[tuple[str, str]] = []
    for w in rig.net.workers.values():
        w.control = (lambda name: lambda op: calls.append((name, op)) or {"who": name})(w.name)
    with pytest.raises(ValueError, match=r"^op: unknown control op 'drain'; expected one of "
                                         r"\['sleep', 'wake_up', 'pause', 'resume'\]$"):
        await rig.orch.control("drain")
    with pytest.raises(ValueError, match=r"^stages: unknown stage\(s\) \['nope'\]; pipeline "
                                         r"has \['a', 'b'\]$"):
        await rig.orch.control("pause", ["a", "nope"])
    assert calls == []
    got = await rig.orch.control("pause", ["a"])
    assert got == {"a-0": {"who": "a-0"}, "a-1": {"who": "a-1"}}
    assert rig.net.link("a-0").timeouts == [60.0]  # the default bound on a control RPC
    await rig.orch.control("pause", ["b"], timeout=5.0)
    assert rig.net.link("b-0").timeouts == [5.0]
    got = await rig.orch.control("resume")
    assert set(got) == {"a-0", "a-1", "b-0"}
    assert sorted(calls) == sorted([("a-0", "pause"), ("a-1", "pause"), ("b-0", "pause"),
                                    ("a-0", "resume"), ("a-1", "resume"), ("b-0", "resume")])

    def asleep(op: str) -> dict[str, Any]:
        raise ControlError("b-0", op, "ControlConflict", "asleep")

    rig.net.workers[endpoint(rig, "b-0")].control = asleep
    slow = asyncio.Event()
    rig.net.slow_control = slow
    call = asyncio.ensure_future(rig.orch.control("resume"))
    await until(lambda: rig.net.waiting == 2, "a-0 and a-1 hold their answers")
    for _ in range(10):  # a-0 and a-1 have not answered: the error waits for them
        await asyncio.sleep(0)
    assert not call.done()
    slow.set()
    with pytest.raises(ControlError, match="asleep"):
        await asyncio.wait_for(call, HANG)
    rig.net.slow_control = None
    rig.replica("a-1").alive = False
    assert set(await rig.orch.control("pause", ["a"])) == {"a-0"}


async def test_readiness_names_the_stage_without_a_replica_and_the_notes(make: Make) -> None:
    """Twin: test_dead_downstream_stage (readiness). Not ready before start and while a stage
    has no routable replica (named, in topological order), with the placement's notes.

    Kills: the readiness checks, the notes' join, `ready` not reading readiness()."""
    rig = await make(TWO, {"a": 0, "b": 0}, start=False, notes=lambda: ["n1", "n2"])
    assert rig.orch.readiness() == (False, "not accepting requests") and not rig.orch.ready
    await rig.orch.start()
    assert rig.orch.readiness() == (False, "stage 'a' has no ready replica; n1; n2")
    plain = await make(TWO, {"a": 1, "b": 0})
    assert plain.orch.readiness() == (False, "stage 'b' has no ready replica")
    assert not plain.orch.ready
    ready = await make(ONE, notes=lambda: ["crash-looping"])
    assert ready.orch.readiness() == (True, "ready; crash-looping") and ready.orch.ready


async def test_status_lists_every_replica(make: Make) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version (status()).

    Kills: any field of status() dropped or taken from the wrong place."""
    rig = await make(TWO)
    h = rig.submit("x")
    assert rig.orch.status() == {
        "a": [{"name": "a-0", "endpoint": endpoint(rig, "a-0"), "state": "ready", "inflight": 1,
               "served": 1, "incarnation": "inc-1", "refused": ""}],
        "b": [{"name": "b-0", "endpoint": endpoint(rig, "b-0"), "state": "ready", "inflight": 0,
               "served": 0, "incarnation": "inc-1", "refused": ""}],
    }
    rig.answer(h, "a")


async def test_metrics_follow_outcomes_counters_and_latency(make: Make) -> None:
    """Twin: tests/integration/test_metrics.py. The registry reads the engine's own state: the
    pipeline label, outcomes by status, late messages, and latency (the engine's clock from
    admission to outcome, summed).

    Kills: the collector given other containers, the counters' initial values or keys, the
    latency sum's arithmetic."""
    rig = await make(ONE)
    assert rig.orch.counters == {"late_messages": 0, "late_aborts": 0, "replicas_lost": 0,
                                 "replica_restarts": 0, "replicas_retired": 0,
                                 "latency_sum": 0.0,
                                 "suspect_requests": 0, "revision_refusals": 0}
    assert rig.orch.name == "pl" and rig.orch.heartbeat_timeout == 3.0
    assert rig.orch.pipeline.metadata.name == "pl" and rig.orch.pools["a"].stage == "a"
    h = rig.submit("x")
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_orchestrator_inflight_requests", pipeline="pl") == 1
    rig.clock.advance(100)
    rig.answer(h, "a")
    first = rig.clock.now - h._request.started
    h2 = rig.submit("y")
    rig.clock.advance(50)
    rig.answer(h2, "a")
    second = rig.clock.now - h2._request.started
    assert rig.orch.counters["latency_sum"] == pytest.approx(first + second)
    rig.orch.abort("gone")
    text = generate_latest(rig.orch.registry).decode()
    assert sample(text, "omnistage_orchestrator_requests_total", pipeline="pl",
                  status="ok") == 2
    assert sample(text, "omnistage_orchestrator_late_aborts_total", pipeline="pl") == 1
    assert sample(text, "omnistage_orchestrator_inflight_requests", pipeline="pl") == 0
    assert sample(text, "omnistage_orchestrator_replica_inflight", pipeline="pl", stage="a",
                  replica="a-0") == 0


async def test_default_heartbeat_settings(make: Make) -> None:
    """Twin: the launch fixture (default heartbeats). Defaults: a ping each second, a replica
    lost after 3 s of silence (docs/architecture.md).

    Kills: the defaults changed."""
    orch = Orchestrator(pipeline(ONE), StaticMembership())
    assert (orch.heartbeat_interval, orch.heartbeat_timeout) == (1.0, 3.0)
    assert list(orch.notes()) == [] and orch.final_stages == ("a",)


async def test_a_second_stop_during_the_drain_waits_for_the_first(make: Make) -> None:
    """Twin: none with processes (main.py stops once; a second stop comes from a caller's error
    path). A stop() called while another drains waits for that one; it must not start a drain
    of its own, which replaced the idle event the first waits on (the first then waited its
    whole drain timeout after the last request had ended).

    Kills: the idempotency check of stop() letting a concurrent call through."""
    rig = await make(ONE)
    h = rig.submit("x")
    first = asyncio.ensure_future(rig.orch.stop(drain_timeout=3600))
    await until(lambda: not rig.orch.accepting, "stop began")
    second = asyncio.ensure_future(rig.orch.stop(drain_timeout=3600))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not first.done() and not second.done()
    rig.answer(h, "a", text="done")
    assert outcome(h).status == "ok"
    await asyncio.wait_for(asyncio.gather(first, second), HANG)
    assert rig.orch._stopped.is_set()


async def test_a_stage_whose_replicas_went_meanwhile_is_no_replica(make: Make) -> None:
    """Twin: test_dead_downstream_stage. Stage b was routable at admission but its replica left
    before a finished: b cannot start, and the request fails with no_replica (not draining:
    nothing refused it) naming b.

    Kills: `"draining" if task.tried else "no_replica"` inverted."""
    rig = await make(TWO)
    h = rig.submit("x")
    rig.membership.publish(ReplicaInfo("b", "b-0", endpoint(rig, "b-0"), "gone"))
    rig.answer(h, "a", text="A")
    out = outcome(h)
    assert (out.status, out.error.code, out.error.stage) == ("fatal", "no_replica", "b")
    assert out.error.message == "stage 'b' has no live replica"
    rig.clean()


async def test_in_flight_and_served_count_every_task_on_a_replica(make: Make) -> None:
    """Twin: test_requests_spread_across_replicas_and_sessions_pin (least in-flight). Each task
    sent adds one to its replica's in-flight and served counts; each that ends takes one off
    in-flight only.

    Kills: `+= 1` -> `= 1` or `-= 1`, the in-flight decrement off by one."""
    rig = await make(ONE)
    a0 = rig.replica("a-0")
    hs = [rig.submit(str(i)) for i in range(3)]
    assert (a0.inflight, a0.served, len(a0.bound)) == (3, 3, 3)
    rig.answer(hs[0], "a")
    assert (a0.inflight, a0.served, len(a0.bound)) == (2, 3, 2)
    rig.answer(hs[1], "a", p.Error, code="internal", message="x")
    assert a0.inflight == 1
    rig.answer(hs[2], "a")
    rig.clean()
    assert a0.served == 3


async def test_an_aborted_reply_nobody_asked_for_stops_the_walk(make: Make) -> None:
    """Twin: test_several_final_stages_only_last_abort_is_terminal. A worker that answers
    `aborted` by itself (no abort from the client) ends that sample as abort: a stage still
    running may finish, but nothing after it starts.

    Kills: the Aborted case not marking the abort as requested (b's successor would start)."""
    rig = await make([echo("a", final=True), echo("b"), echo("c", ("b",), final=True)])
    h = rig.submit("x")
    rig.answer(h, "a", p.Aborted, text="pre", finish_reason="abort")
    assert events(h) == []
    rig.answer(h, "b", text="B")
    assert rig.net.link("c-0").sent == []
    out = outcome(h)
    assert out.status == "abort" and set(out.children[0].outputs) == {"a"}
    rig.clean()


async def test_losing_a_replica_with_both_halves_of_a_companion_fails_the_sample_once(
        make: Make) -> None:
    """Twin: test_kill_9_one_replica_fails_only_its_bound_requests. The prompt and its negative
    companion both run on the AR replica that is lost: the sample fails once, and the other
    sample's work elsewhere is untouched; nothing stays bound.

    Kills: `Failover.lost` failing a child twice or stopping at the first terminal child, the
    detach of an already detached task raising."""
    rig = await make(T2I, {"enc": 2, "img": 1})
    rig.orch.pools["enc"].sessions["s"] = "enc-0"
    hs = [rig.submit(str(i), negative_prompt="n", session="s") for i in range(8)]
    rig.orch.pools["enc"].sessions["t"] = "enc-1"
    other = rig.submit("o", negative_prompt="n", session="t")
    assert len(rig.replica("enc-0").bound) == 16
    rig.net.link("enc-0").on_disconnect()
    for h in hs:
        out = outcome(h)
        assert out.error.code == "replica_lost" and len(out.children) == 1
    assert events(other) == [] and len(rig.replica("enc-1").bound) == 2
    assert rig.replica("enc-0").bound == set() and rig.replica("enc-0").inflight == 0
    assert set(rig.orch.tasks) == {f"{other.id}/0/enc", f"{other.id}/0/enc/neg"}


async def test_the_log_says_what_happened_to_each_replica(
        make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version and
    test_a_restart_at_the_same_address_fails_the_old_work_at_once (their log assertions). The
    lines an operator reads, exactly: joins, handshakes, refusals, state changes, restarts,
    losses, re-admissions, unknown stages, shutdown.

    Kills: each log line's text or arguments changed, the state-change line's condition."""
    import logging

    caplog.set_level(logging.INFO, logger="omnistage.orchestrator")
    rig = await make(ONE, {"a": 1}, workers=[
        Worker("old", "a", version=p.PROTOCOL_VERSION + 1),
        Worker("s", "a", hello="silent", pings="silent")],
        heartbeat_interval=0, heartbeat_timeout=0.01)
    await until(lambda: "s" in rig.orch.suspects, "s on probation")
    e0, es = endpoint(rig, "a-0"), endpoint(rig, "s")
    link = rig.net.link("a-0")
    h = rig.submit("x")
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "ready"))  # no change: no line
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "draining"))
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "ready"))  # back: its end is a fault
    rig.membership.publish(ReplicaInfo("zz", "z-0", "tcp://127.0.0.1:1"))
    link.on_disconnect()
    link.reply(p.Error(code="version_mismatch", message="no"))
    link.reply(link.hello_reply("inc-2"))
    rig.net.workers[es].pings = rig.net.workers[es].hello = "answer"
    await until(lambda: "s" in rig.orch.pools["a"].replicas, "s re-admitted")
    await until(lambda: rig.replica("s").routable, "s handshaken")
    rig.membership.publish(ReplicaInfo("a", "a-0", e0, "gone"))
    assert outcome(h).error.code == "replica_lost"
    await rig.orch.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "omnistage.orchestrator"]
    v = p.PROTOCOL_VERSION
    assert lines == [
        f"replica a-0 of stage a joined at {e0} (ready); handshake sent",
        f"replica old of stage a joined at {endpoint(rig, 'old')} (ready); handshake sent",
        f"replica s of stage a joined at {es} (ready); handshake sent",
        f"replica a-0: handshake done (protocol {v}, incarnation inc-1)",
        f"not routing to replica old: replica old speaks protocol version {v + 1}",
        "replica s lost (no hello reply within 0.0s): failing 0 bound tasks",
        "replica a-0: ready -> draining",
        "replica a-0: draining -> ready",
        "ignoring replica z-0 of unknown stage 'zz'",
        "replica a-0: connection closed: incarnation inc-1 is gone; failing 1 bound tasks",
        "not routing to replica a-0: replica a-0 refused the handshake after a restart: "
        "version_mismatch: no",
        "replica a-0: handshake done (incarnation inc-2); routable again",
        "replica s answers again: re-admitted",
        f"replica s of stage a joined at {es} (ready); handshake sent",
        f"replica s: handshake done (protocol {v}, incarnation inc-1)",
        "replica a-0 lost (replica left the membership): failing 0 bound tasks",
        "orchestrator stopping: 0 requests in flight",
    ], lines
    assert v == 4


async def test_a_replica_gone_while_its_probe_pings_is_not_readmitted(make: Make) -> None:
    """Twin: test_stalled_replica_is_dropped_then_readmitted. Membership says `gone` while the
    probe's ping is on the wire: the pong that follows re-admits nothing, and the probe ends
    cleanly (its channel closed, no exception).

    Kills: the probe's `suspects.pop(name, None)` without its default (a KeyError in the probe
    once the suspect went meanwhile), re-admitting a replica that left."""
    rig = await make(ONE, {"a": 1}, workers=[Worker("s", "a", hello="silent", pings="silent")],
                     heartbeat_interval=0, heartbeat_timeout=0.01)
    await until(lambda: "s" in rig.orch.suspects and rig.net.has("probe-s"), "s probed")
    probe = rig.net.link("probe-s")
    tasks = set(rig.orch._background)
    w = rig.net.workers[endpoint(rig, "s")]
    w.on_ping = lambda: rig.membership.publish(ReplicaInfo("a", "s", probe.endpoint, "gone"))
    w.pings = "answer"
    await until(lambda: probe.closed, "the probe ended")
    await until(lambda: all(t.done() for t in tasks), "the probe task finished")
    assert [t.exception() for t in tasks if not t.cancelled()] == [None] * len(
        [t for t in tasks if not t.cancelled()])
    assert "s" not in rig.orch.pools["a"].replicas and rig.orch.suspects == {}


async def test_one_heartbeat_round_loses_every_silent_replica(make: Make) -> None:
    """Twin: test_stalled_replica_is_dropped_then_readmitted. Two replicas silent past the
    timeout are both lost in the same round of the heartbeat, not one per round.

    Kills: `continue` -> `break` after a loss in the heartbeat loop."""
    rig = await make(ONE, {"a": 2}, heartbeat_interval=0, heartbeat_timeout=3.0)
    for name in ("a-0", "a-1"):
        rig.net.workers[endpoint(rig, name)].pings = "silent"
    rig.clock.advance(5)
    await until(lambda: rig.orch.suspects, "a replica lost")
    assert set(rig.orch.suspects) == {"a-0", "a-1"}  # checked in the same turn as the first
    assert rig.orch.pools["a"].replicas == {}


async def test_start_waits_for_handshakes_only_up_to_the_heartbeat_timeout(make: Make) -> None:
    """Twin: test_replicas_are_routed_only_after_a_handshake_of_our_version. A handshake that
    never ends (whatever its own timeout) does not hold start() past the heartbeat timeout;
    the replica is not routed to; stop() cancels that handshake and waits until it is gone.

    Kills: start()'s wait without its bound, stop() not waiting for the cancelled background
    tasks."""
    rig = await make(ONE, {"a": 1}, workers=[Worker("h", "a", hello="hang")], start=False,
                     heartbeat_timeout=0.01)
    await asyncio.wait_for(rig.orch.start(), HANG)
    assert rig.orch.accepting and not rig.replica("h").routable
    handshake = rig.replica("h").handshake
    assert not handshake.done() and handshake in rig.orch._background
    await rig.orch.stop()  # awaited in this task: no loop turn between its end and the check
    assert handshake.cancelled() and not rig.orch._background
