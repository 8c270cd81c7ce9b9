"""One validator on both paths: `omnistage validate` and `kubectl apply` against the real API
server with the operator's admission webhook running refuse the same manifests, naming the same
field path; then, with the webhook off, what the CRD's own rules still refuse and what the
operator reports as InvalidSpec.

Each file under invalid/ breaks one rule and says so in its header:
  # path: the field path both must name
  # layer: who refuses it when the webhook is down: schema (OpenAPI types, bounds, unknown
           fields), cel (the CRD's x-kubernetes-validations) or webhook (only the webhook)
  # base: an object to store first; the file is then an update of it
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage import kube as k
from tests.harness.cluster import Cluster
from tests.harness.operator import Operator, get, wait_for

REPO = Path(__file__).resolve().parents[2]
INVALID = Path(__file__).parent / "invalid"
CASES = sorted(INVALID.glob("*.yaml"))
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
PROBE = INVALID / "cycle.yaml"  # refused by the webhook alone
# A field path as both paths print it: spec.stages[1].inputs[0], metadata.lables, ...
PATH = re.compile(r"(?<![\w.\[])((?:metadata|spec)(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)")


def headers(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        found = re.match(r"# (path|layer|base): (.+)$", line)
        if found:
            out[found.group(1)] = found.group(2).strip()
    return out


def local_reports(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """`omnistage validate -o json` over the files (updates with --old), keyed by file name."""
    out: dict[str, dict[str, Any]] = {}
    plain = [p for p in paths if "base" not in headers(p)]
    runs = [(plain, [])] + [([p], [REPO / headers(p)["base"]]) for p in paths if p not in plain]
    for files, old in runs:
        cmd = [sys.executable, "-m", "omnistage.cli", "validate", "-o", "json",
               *map(str, files), *(f"--old={o}" for o in old)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
        assert proc.returncode in (0, 2), proc.stderr
        for doc in json.loads(proc.stdout)["documents"]:
            out[Path(doc["file"]).name] = doc
    return out


def dry_run(kube: Cluster, namespace: str, path: Path) -> subprocess.CompletedProcess[str]:
    return kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path),
                        check=False)


def server_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def wait_webhook(kube: Cluster, namespace: str, on: bool, operator: Operator) -> None:
    """Until the API server calls (on) or no longer calls (off) the webhook."""
    wait_for(lambda: (dry_run(kube, namespace, PROBE).returncode != 0) == on, 60,
             f"webhook {'on' if on else 'off'}", operator.log_tail, interval=0.5)


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    return local_reports(CASES + EXAMPLES)


@pytest.fixture(scope="module")
def webhook_ns(kube: Cluster, operator: Operator) -> Any:
    if not kube.is_local:
        pytest.skip("the webhook listens on this machine's loopback: local control plane only")
    from tests.harness.cluster import temp_namespace

    with temp_namespace(kube.kube, prefix="parity-") as ns:
        for path in CASES:
            if "base" in headers(path):
                kube.kubectl("apply", "-n", ns, "-f", str(REPO / headers(path)["base"]))
        wait_webhook(kube, ns, True, operator)
        yield ns


def test_at_least_forty_invalid_manifests_of_both_kinds() -> None:
    kinds = {yaml.safe_load(p.read_text())["kind"] for p in CASES}
    assert len(CASES) >= 40 and kinds == {"OmniPipeline", "StagePool"}
    for path in CASES:
        assert {"path", "layer"} <= set(headers(path)), path.name
        assert headers(path)["layer"] in ("schema", "cel", "webhook"), path.name


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_both_paths_refuse_naming_the_same_field(
    kube: Cluster, webhook_ns: str, reports: dict[str, dict[str, Any]], path: Path
) -> None:
    want = headers(path)["path"]
    local = reports[path.name]
    assert not local["valid"], f"omnistage validate accepted {path.name}"
    local_paths = {e["path"] for e in local["errors"]}
    assert want in local_paths, local["errors"]

    proc = dry_run(kube, webhook_ns, path)
    assert proc.returncode != 0, f"kubectl apply accepted {path.name}:\n{proc.stdout}"
    assert want in server_paths(proc.stderr), proc.stderr
    if headers(path)["layer"] != "schema":
        # CEL messageExpressions and the webhook word it as the validator does, too: one line
        # of kubectl's answer has the path and the validator's message (the API server may put
        # "Invalid value: <value>:" in between).
        message = next(e["message"] for e in local["errors"] if e["path"] == want)
        assert any(want in line and message in line for line in proc.stderr.splitlines()), (
            f"{want}: {message!r} not in:\n{proc.stderr}")
    if headers(path)["layer"] == "webhook":
        assert "admission webhook" in proc.stderr and "denied the request" in proc.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_both(
    kube: Cluster, webhook_ns: str, reports: dict[str, dict[str, Any]], path: Path
) -> None:
    assert reports[path.name]["valid"], reports[path.name]["errors"]
    proc = dry_run(kube, webhook_ns, path)
    assert proc.returncode == 0, proc.stderr


def test_metadata_only_update_of_a_stored_object_is_not_revalidated(
    kube: Cluster, webhook_ns: str
) -> None:
    """Finalizers and labels still change on an object stored before a rule was tightened."""
    base = REPO / headers(INVALID / "change-kind.yaml")["base"]
    name = yaml.safe_load(base.read_text())["metadata"]["name"]
    kube.kubectl("label", "-n", webhook_ns, f"omnipipe/{name}", "team=ml", "--overwrite")
    assert get(kube, webhook_ns, "omnipipe", name)["metadata"]["labels"]["team"] == "ml"


# ---------------------------------------------------------------------------- webhook off


@pytest.fixture(scope="module")
def without_webhook(kube: Cluster, operator: Operator, webhook_ns: str) -> Any:
    with operator.restarted(webhook=False):
        wait_webhook(kube, webhook_ns, False, operator)
        yield operator
    wait_webhook(kube, webhook_ns, True, operator)


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_without_the_webhook_the_crd_still_refuses_what_cel_can_carry(
    kube: Cluster, webhook_ns: str, without_webhook: Operator, path: Path
) -> None:
    proc = dry_run(kube, webhook_ns, path)
    if headers(path)["layer"] == "webhook":
        assert proc.returncode == 0, proc.stderr  # only the operator's InvalidSpec catches it
    else:
        assert proc.returncode != 0, f"{path.name} got through without the webhook"
        assert headers(path)["path"] in server_paths(proc.stderr), proc.stderr


def _events(kube: Cluster, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    out = kube.kubectl("get", "events", "-n", ns, "-o", "json",
                       f"--field-selector=involvedObject.name={name},reason={reason}").stdout
    return list(json.loads(out)["items"])


def test_invalid_object_gets_invalid_spec_one_event_and_no_retry(
    kube: Cluster, webhook_ns: str, without_webhook: Operator,
    reports: dict[str, dict[str, Any]],
) -> None:
    operator = without_webhook
    doc = yaml.safe_load(PROBE.read_text())
    name = doc["metadata"]["name"]
    expected = "; ".join(f"{e['path']}: {e['message']}" for e in reports[PROBE.name]["errors"])
    kube.kubectl("apply", "-n", webhook_ns, "-f", str(PROBE))

    def refused() -> dict[str, Any] | None:
        obj = get(kube, webhook_ns, "omnipipe", name)
        cond = k.condition(obj, "Ready")
        return obj if cond and cond["reason"] == "InvalidSpec" else None

    obj = wait_for(refused, 60, "InvalidSpec", operator.log_tail)
    ready = k.condition(obj, "Ready")
    assert ready["status"] == "False" and ready["message"] == expected
    assert obj["status"]["phase"] == "Invalid"
    assert ready["observedGeneration"] == obj["metadata"]["generation"] == 1
    [event] = wait_for(lambda: _events(kube, webhook_ns, name, "InvalidSpec"), 30, "event")
    assert event["type"] == "Warning" and expected in event["message"]

    # Refused once: resyncs look at it again (a retry would write a status or an event
    # each time), and write nothing.
    writes = operator.settled()
    operator.after_resyncs(3)
    assert operator.writes() == writes, "the operator retried an object it refused"
    assert [e["count"] for e in _events(kube, webhook_ns, name, "InvalidSpec")] == [1]
    assert not [p for p in kube.kube.get(f"/api/v1/namespaces/{webhook_ns}/pods")["items"]
                if (p["metadata"].get("labels") or {}).get(k.LABEL_PIPELINE) == name]

    # A new generation is looked at again: still invalid with the same error, so the same
    # event is counted once more (aggregated, not a second object) and the status moves on.
    doc["spec"]["stages"][2]["replicas"] = 2
    kube.kubectl("apply", "-n", webhook_ns, "-f", "-", input=yaml.safe_dump(doc))
    wait_for(lambda: (k.condition(get(kube, webhook_ns, "omnipipe", name), "Ready") or {})
             .get("observedGeneration") == 2, 60, "generation 2 observed")
    wait_for(lambda: [e["count"] for e in _events(kube, webhook_ns, name, "InvalidSpec")] == [2],
             30, "the InvalidSpec event counted twice")
    # Fixed: the operator takes it from there.
    doc["spec"]["stages"][1]["inputs"] = ["src"]
    kube.kubectl("apply", "-n", webhook_ns, "-f", "-", input=yaml.safe_dump(doc))
    wait_for(lambda: get(kube, webhook_ns, "omnipipe", name)["status"].get("phase")
             not in (None, "Invalid"), 60, "no longer Invalid", operator.log_tail)
