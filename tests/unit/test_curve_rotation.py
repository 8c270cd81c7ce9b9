"""The CurveZMQ key rotation's decisions (omni_operator.curve_rotation, pure) and the objects
they turn into (builders): add a pair, move the pods after the propagation wait, drop the old
pair once no pod holds it; never two transitions at once, never a pair used again."""

from __future__ import annotations

import base64
from typing import Any

from omni_operator import builders as b
from omni_operator import curve_rotation as cr
from omni_operator.curve_rotation import CurveKeysState, step
from omni_operator.pipeline_reconciler import curve_keys_state, curve_keys_status
from omnistage import curve_keys, kube
from omnistage.spec import parse_pipeline

ANN = kube.ANNOTATION_CURVE_GENERATION
OWNER = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
         "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1}}


def test_nothing_asked_nothing_done() -> None:
    state = CurveKeysState()
    assert step(state, 0, {0}, 100.0, 90.0) == cr.Step(state)


def test_a_rotation_adds_then_waits_then_switches_then_drops() -> None:
    start = CurveKeysState()
    added = step(start, 1, {0}, 100.0, 90.0)
    assert added.add == 1 and added.drop == () and added.again_in == 90.0
    assert added.state == CurveKeysState(0, (0, 1), 100.0)  # the pods stay on 0 for now
    assert added.event is not None and added.event[0] == "CurveKeysAdded"
    early = step(added.state, 1, {0}, 150.0, 90.0)  # not yet: the mounts may be stale
    assert early.state == added.state and early.add is None and early.again_in == 40.0
    switched = step(added.state, 1, {0}, 190.0, 90.0)
    assert switched.state == CurveKeysState(1, (0, 1), 100.0) and switched.add is None
    assert switched.drop == () and switched.event[0] == "CurveKeysSwitched"  # type: ignore[index]
    rolling = step(switched.state, 1, {0, 1}, 200.0, 90.0)  # old pods still serve
    assert rolling == cr.Step(switched.state)
    done = step(switched.state, 1, {1}, 260.0, 90.0)
    assert done.drop == (0,) and done.state == CurveKeysState(1, (1,), 100.0)
    assert done.event is not None and done.event[0] == "CurveKeysRotated"
    assert step(done.state, 1, {1}, 300.0, 90.0) == cr.Step(done.state)  # at rest


def test_a_new_request_mid_rotation_adds_beside_and_drops_both_old_pairs() -> None:
    mid = CurveKeysState(0, (0, 1), 100.0)
    again = step(mid, 2, {0}, 120.0, 90.0)
    assert again.add == 2 and again.state == CurveKeysState(0, (0, 1, 2), 120.0)
    switched = step(again.state, 2, {0}, 210.0, 90.0).state
    assert switched.generation == 2
    assert step(switched, 2, {2}, 220.0, 90.0).drop == (0, 1)


def test_the_annotation_is_read_strictly() -> None:
    state = CurveKeysState(1, (1,), None)
    assert cr.desired_generation(None, state) == (1, None)
    assert cr.desired_generation({ANN: " 2 "}, state) == (2, None)
    for bad, why in (("two", "not an integer"), ("-1", "not between"),
                     ("0", "below generation 1, already made")):
        wanted, problem = cr.desired_generation({ANN: bad}, state)
        assert wanted == 1 and problem is not None and why in problem, bad
    assert cr.pod_generation(None) == 0 and cr.pod_generation({ANN: "3"}) == 3
    assert cr.pod_generation({ANN: "x"}) == 0


def test_the_state_round_trips_through_the_status() -> None:
    assert curve_keys_state(None) == CurveKeysState()
    assert curve_keys_status(CurveKeysState()) is None  # a pipeline never rotated: no field
    state = CurveKeysState(1, (0, 1), 1796600000.0)
    status = curve_keys_status(state)
    assert status is not None
    doc = status.model_dump(by_alias=True, exclude_none=True)
    assert doc == {"generation": 1, "secret": [0, 1], "addedAt": "2026-12-06T23:33:20Z"}
    assert curve_keys_state(doc) == state


def _pipeline() -> Any:
    return parse_pipeline({"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                           "metadata": {"name": "p"}, "spec": {"stages": [
                               {"name": "a", "kind": "echo", "finalOutput": True}]}})


def _env(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in pod_spec["containers"][0]["env"]}


def test_the_generation_reaches_pools_pods_and_the_orchestrator() -> None:
    """Generation 0 is unsaid (a pipeline never rotated keeps its pods' spec); another is the
    pool's annotation, the pods' env and annotation, and the orchestrator's env."""
    for generation in (0, 2):
        children = b.pipeline_children(OWNER, _pipeline(), curve_generation=generation)
        [pool] = [c for c in children if c["kind"] == "StagePool"]
        pool["metadata"]["uid"] = "pool-uid"  # as the API server gives it
        [deployment] = [c for c in children if c["kind"] == "Deployment"]
        pod = b.pool_pod(pool, 0)
        orch_env = _env(deployment["spec"]["template"]["spec"])
        if generation == 0:
            assert ANN not in pool["metadata"]["annotations"]
            assert curve_keys.CURVE_GENERATION_ENV not in _env(pod["spec"])
            assert curve_keys.CURVE_GENERATION_ENV not in orch_env
        else:
            assert pool["metadata"]["annotations"][ANN] == "2"
            assert _env(pod["spec"])[curve_keys.CURVE_GENERATION_ENV] == "2"
            assert orch_env[curve_keys.CURVE_GENERATION_ENV] == "2"
            assert deployment["spec"]["template"]["metadata"]["annotations"][ANN] == "2"
        assert pod["metadata"]["annotations"][ANN] == str(generation)
    # A new generation is a new pod spec: the pool replaces its replicas.
    hashes = {b.pod_template(next(c for c in b.pipeline_children(OWNER, _pipeline(),
                                                                 curve_generation=g)
                                  if c["kind"] == "StagePool"))[1] for g in (0, 1)}
    assert len(hashes) == 2


def test_the_secret_patches_add_and_drop_the_generation_files(tmp_path: Any) -> None:
    """What a pod would see: the files of the patched Secret, loaded by the runtime."""
    keys = curve_keys.generate()
    add = b.curve_secret_add(1, keys)
    assert set(add["data"]) == {"public-1", "secret-1"}
    for name, value in add["data"].items():
        (tmp_path / name).write_bytes(base64.b64decode(value))
    assert curve_keys.load(tmp_path, 1) == keys
    assert b.curve_secret_drop((0, 1)) == {"data": {"public": None, "secret": None,
                                                    "public-1": None, "secret-1": None}}
