"""Failover (failover.Failover.retry) against in-process fake replicas: the rig of test_engine.py.

A lost replica's task goes to another replica of its stage, from what the orchestrator kept;
the bounds (maxRetries, the deadline, an abort, a suspect) make it fail as before. The same
with real worker processes and kill -9: tests/integration/test_failover.py.
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from omnistage import protocol as p
from omnistage.orchestrator.requests import AudioChunk, Delta, Outcome
from omnistage.spec import SpecError, parse_pipeline
from tests.harness.metrics import sample
from tests.unit import test_engine
from tests.unit.test_engine import ONE, TWO, Make, ar, events, outcome
from tests.unit.test_engine import echo as echo_stage

pytestmark = pytest.mark.timeout(30)
make = test_engine.make  # the rig's fixture

NO_RETRY = {"failover": {"maxRetries": 0}}


def metric(rig, name: str, **labels: str) -> float | None:
    return sample(generate_latest(rig.orch.registry).decode(), name, pipeline="pl", **labels)


async def test_a_lost_replica_s_task_runs_on_another_one_invisibly(make: Make) -> None:
    """The lost task goes, with the upstream output kept, to the other replica of its stage
    under a new wire id; the client sees one ok outcome; retries are counted per stage."""
    rig = await make(TWO, {"a": 1, "b": 2})
    h = rig.submit("hello", request_id="r1")
    rig.answer(h, "a", text="from-a")
    first = rig.task(h, "b").replica.name
    other = "b-1" if first == "b-0" else "b-0"
    rig.net.link(first).on_disconnect()  # kill -9: the socket closes
    assert events(h) == []  # nothing reached the client
    [sub] = rig.net.link(other).of(p.Submit)
    assert sub.id == "r1/0/b~1" and sub.params["prompt"] == "from-a"
    rig.answer(h, "b", text="done")
    out = outcome(h)
    assert out.status == "ok" and out.children[0].outputs["b"].replica == other
    assert rig.orch.failovers == {"retries": {"b": 1}, "resumes": {}}
    assert metric(rig, "omnistage_orchestrator_retries_total", stage="b") == 1
    rig.clean()


async def test_with_max_retries_0_the_lost_task_fails(make: Make) -> None:
    """The proof the bound is read: maxRetries 0 is today's behaviour, replica_lost."""
    rig = await make(ONE, {"a": 2}, orch=NO_RETRY)
    h = rig.submit("x")
    rig.net.link(rig.task(h, "a").replica.name).on_disconnect()
    out = outcome(h)
    assert (out.status, out.error.code) == ("fatal", "replica_lost")
    assert rig.orch.failovers == {"retries": {}, "resumes": {}}
    rig.clean()


async def test_two_losses_at_one_stage_make_a_suspect(make: Make, caplog) -> None:
    """A request that loses a second replica of the same stage fails once with replica_lost
    and is logged as a suspect, though retries were left (maxRetries 5)."""
    caplog.set_level(logging.WARNING, logger="omnistage.orchestrator")
    rig = await make(ONE, {"a": 3}, orch={"failover": {"maxRetries": 5}})
    h = rig.submit("poison", request_id="bad")
    first = rig.task(h, "a").replica.name
    rig.net.link(first).on_disconnect()
    second = rig.task(h, "a").replica.name
    assert second != first
    rig.net.link(second).on_disconnect()
    got = events(h)
    assert len(got) == 1 and isinstance(got[0], Outcome)
    assert got[0].error.code == "replica_lost"
    assert "request bad is a suspect: it lost 2 replicas of stage a" in caplog.text
    assert rig.orch.counters["suspect_requests"] == 1
    assert metric(rig, "omnistage_orchestrator_suspect_requests_total") == 1
    third = ({"a-0", "a-1", "a-2"} - {first, second}).pop()
    assert rig.net.link(third).of(p.Submit) == []
    rig.clean()


async def test_an_aborted_request_is_not_retried(make: Make) -> None:
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x")
    lost = rig.task(h, "a").replica.name
    h.abort()
    rig.net.link(lost).on_disconnect()
    assert outcome(h).status == "abort"
    assert [ln.of(p.Submit) for ln in rig.net.links if ln.name != lost] == [[]]
    assert rig.orch.failovers["retries"] == {}
    rig.clean()


async def test_no_retry_past_the_deadline(make: Make) -> None:
    rig = await make(ONE, {"a": 2})
    h = rig.submit("x", timeout_s=10)
    lost = rig.task(h, "a").replica.name
    rig.clock.advance(11)  # the timer has not fired yet: the clock says the deadline passed
    rig.net.link(lost).on_disconnect()
    assert outcome(h).error.code == "replica_lost"
    rig.clean()


async def test_a_streamed_ar_stage_resumes_from_the_delivered_tokens(make: Make) -> None:
    """The new replica gets the tokens and text the client has; its deltas go on after them;
    the client's stream has each token once."""
    rig = await make([ar("a", final=True)], {"a": 2})
    h = rig.submit("s", stream=True, request_id="r")
    lost = rig.task(h, "a").replica.name
    link = rig.net.link(lost)
    wid = rig.task(h, "a").wire_id
    link.reply(p.Delta(id=wid, seq=1, text="he", token_ids=[5]))
    link.reply(p.Delta(id=wid, seq=2, text="", token_ids=[6]))  # an incomplete character
    link.on_disconnect()
    task = rig.task(h, "a")
    new = rig.net.link(task.replica.name)
    [sub] = new.of(p.Submit)
    assert sub.id == "r/0/a~1"
    assert (sub.params["resume_token_ids"], sub.params["resume_text"]) == ([5, 6], "he")
    assert sub.params["stream"] is True
    new.reply(p.Delta(id=task.wire_id, seq=1, text="llo", token_ids=[7]))
    link.reply(p.Delta(id=wid, seq=3, text="late", token_ids=[9]))  # the old one: dropped
    new.reply(p.Final(id=task.wire_id, text="hello", token_ids=[5, 6, 7], finish_reason="stop"))
    got = [ev async for ev in h.events()]
    deltas = [e for e in got if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == "hello"
    assert [t for d in deltas for t in d.token_ids] == [5, 6, 7]
    assert got[-1].status == "ok"
    assert rig.orch.failovers == {"retries": {"a": 1}, "resumes": {"a": 1}}
    assert metric(rig, "omnistage_orchestrator_resumes_total", stage="a") == 1
    rig.clean()


async def test_a_stream_that_cannot_resume_fails_cleanly(make: Make) -> None:
    """An echo stage's deltas reached the client: its executor cannot resume, so the request
    fails with replica_lost rather than repeat text."""
    rig = await make(ONE, {"a": 2})
    h = rig.submit("s", stream=True)
    link = rig.net.link(rig.task(h, "a").replica.name)
    link.reply(p.Delta(id=rig.task(h, "a").wire_id, seq=1, text="s"))
    link.on_disconnect()
    got = events(h)
    assert isinstance(got[0], Delta) and got[-1].error.code == "replica_lost"
    assert not any(isinstance(e, AudioChunk) for e in got)
    rig.clean()


@pytest.mark.parametrize("value", [-1, 11, "two"])
def test_max_retries_out_of_bounds_is_refused_by_name(value: object) -> None:
    doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
           "metadata": {"name": "pl"},
           "spec": {"orchestrator": {"failover": {"maxRetries": value}},
                    "stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}}
    with pytest.raises(SpecError, match=r"spec\.orchestrator\.failover\.maxRetries"):
        parse_pipeline(doc)


def test_max_retries_bounds_accepted() -> None:
    for value in (0, 10):
        doc = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
               "metadata": {"name": "pl"},
               "spec": {"orchestrator": {"failover": {"maxRetries": value}},
                        "stages": [{"name": "a", "kind": "echo", "finalOutput": True}]}}
        assert parse_pipeline(doc).spec.orchestrator.failover.max_retries == value


async def test_losses_at_two_stages_are_retried_and_follow_ups_go_to_the_new_replica(
        make: Make) -> None:
    """One loss at a, one at b: bad luck, not a suspect; both are retried (maxRetries 2). The
    session's affinity and the abort follow the task to the replica it is bound to now
    (STAGE-INV-100); a third loss has no retry left."""
    rig = await make(TWO, {"a": 2, "b": 3})
    h = rig.submit("x", session="s", request_id="r")
    first_a = rig.task(h, "a").replica.name
    rig.net.link(first_a).on_disconnect()
    rig.answer(h, "a", text="x")
    first_b = rig.task(h, "b").replica.name
    rig.net.link(first_b).on_disconnect()
    task = rig.task(h, "b")
    assert task.replica.name != first_b and task.wire_id == "r/0/b~1"
    assert rig.orch.pools["b"].sessions["s"] == task.replica.name
    assert rig.orch.failovers["retries"] == {"a": 1, "b": 1}
    assert rig.orch.counters["suspect_requests"] == 0
    h.abort()
    [abort] = rig.net.link(task.replica.name).of(p.Abort)
    assert abort.id == "r/0/b~1"
    rig.answer(h, "b", p.Aborted)
    assert outcome(h).status == "abort"
    rig.clean()


async def test_a_third_loss_past_max_retries_fails(make: Make) -> None:
    rig = await make([echo_stage("a"), echo_stage("b", ("a",)), echo_stage("c", ("b",), True)],
                     {"a": 2, "b": 2, "c": 2})
    h = rig.submit("x")
    for stage in ("a", "b"):
        rig.net.link(rig.task(h, stage).replica.name).on_disconnect()
        rig.answer(h, stage, text="x")
    rig.net.link(rig.task(h, "c").replica.name).on_disconnect()
    out = outcome(h)
    assert (out.error.code, out.error.stage) == ("replica_lost", "c")
    assert rig.orch.failovers["retries"] == {"a": 1, "b": 1}
    rig.clean()


# ---- the AR executor's side of a resume ---------------------------------------------------------


@pytest.fixture(scope="module")
def ar_executor() -> object:
    import torch

    from omnistage.executors.ar import ARExecutor
    from omnistage.spec import EngineOptions

    ex = ARExecutor(None, EngineOptions(), torch.device("cpu"))
    ex.load()
    return ex


def run_ar(ex: object, params: dict[str, object]) -> tuple[list[dict[str, object]], object]:
    from omnistage.admission import ExecutionContext

    deltas: list[dict[str, object]] = []
    out = ex.execute(ex.prepare(params, {}), ExecutionContext(), deltas.append)  # type: ignore[attr-defined]
    return deltas, out


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_ar_resume_goes_on_exactly_where_the_stream_was_cut(
        ar_executor: object, sampling: dict[str, object]) -> None:
    """Cut after 5 deltas, resumed with what they carried: the resumed deltas complete the
    stream with nothing repeated or missing, and the final reply is the uncut one's."""
    params = {"prompt": "once upon a time", "stream": True, "ignore_eos": True,
              "max_tokens": 16, **sampling}
    full, whole = run_ar(ar_executor, params)
    cut = full[:5]
    ids = [t for d in cut for t in d["token_ids"]]
    text = "".join(d["text"] for d in cut)
    rest, resumed = run_ar(ar_executor, {**params, "resume_token_ids": ids, "resume_text": text})
    assert [t for d in cut + rest for t in d["token_ids"]] == whole.fields["token_ids"]
    assert "".join(d["text"] for d in cut + rest) == whole.fields["text"]
    assert resumed.fields == whole.fields


@pytest.mark.parametrize(("resume", "message"), [
    ([-1], r"params\.resume_token_ids\[0\] must be a token id"),
    ([1] * 17, r"params\.resume_token_ids: 17 tokens resumed, more than max_tokens \(16\)"),
])
def test_ar_refuses_a_bad_resume_by_field(ar_executor: object, resume: list[int],
                                          message: str) -> None:
    from omnistage.executors.base import BadRequest

    with pytest.raises(BadRequest, match=message):
        ar_executor.prepare({"prompt": "x", "max_tokens": 16,  # type: ignore[attr-defined]
                             "resume_token_ids": resume}, {})
