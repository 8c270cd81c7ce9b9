"""The operator under test: CRDs applied, `omnistage operator` running as a real process."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.admin_credential import AdminCredential
from omni_operator.webhook import CONFIGURATION
from omnistage import kube as k
from tests.harness.cluster import Cluster, PodRunner
from tests.harness.local import free_port
from tests.harness.metrics import samples

REPO = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]
#: The root admin key of every operator this harness starts (--admin-key-file): one for the
#: session, so a restarted operator, or another module's, derives the same keys and digests
#: (a converged fleet sees no write) and a test can present a pipeline's key (admin_key).
ADMIN_ROOT_KEY = "omnistage-tests-admin-root-key-0123456789abcdef"


def admin_key(namespace: str, name: str, uid: str) -> str:
    """The admin key the harness's operators present at the orchestrator pods of this
    pipeline (its uid as the API server has it), for a test that calls an orchestrator's
    admin port itself (header kube.ADMIN_KEY_HEADER or Authorization: Bearer)."""
    return AdminCredential(ADMIN_ROOT_KEY.encode()).key(namespace, name, uid)


def pipeline_admin_key(cluster: Cluster, namespace: str, name: str) -> str:
    """admin_key of the pipeline `name` as the cluster has it now."""
    obj = get(cluster, namespace, "omnipipe", name)
    if obj is None:
        raise AssertionError(f"no OmniPipeline {namespace}/{name}")
    return admin_key(namespace, name, obj["metadata"]["uid"])


def admin_request(url: str, key: str | None = None, *, method: str = "GET",
                  body: Any = None, timeout: float = 10) -> tuple[int, Any]:
    """One call to an orchestrator's admin listener (`key` in kube.ADMIN_KEY_HEADER, none
    without it): (HTTP status, the JSON body or the text), error statuses included."""
    import json
    import urllib.error

    headers = {"Accept": "application/json"}
    if key is not None:
        headers[k.ADMIN_KEY_HEADER] = key
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data, headers, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def admin_load(url: str, key: str) -> Obj:
    """GET /v1/load of the orchestrator whose admin listener is at `url` (a base URL)."""
    status, doc = admin_request(url.rstrip("/") + k.LOAD_PATH, key)
    if status != 200 or not isinstance(doc, dict):
        raise AssertionError(f"GET {k.LOAD_PATH}: HTTP {status}: {str(doc)[:300]}")
    return doc


def admin_routable(url: str, key: str, stage: str) -> int:
    """The replicas of `stage` the orchestrator at admin `url` routes to now (its GET
    /v1/load, as tests.harness.metrics.routable reads the public port's before issue 43)."""
    return int(admin_load(url, key)["stages"][stage]["replicas"])


@dataclass
class Operator:
    cluster: Cluster
    log_path: Path
    port: int = field(default_factory=free_port)
    resync: float = 3.0
    proc: subprocess.Popen[bytes] | None = None
    #: serve the validating admission webhook on loopback (the local API server calls it there)
    webhook: bool = True
    webhook_port: int = field(default_factory=free_port)
    #: the credentials it runs with; None: the cluster's admin kubeconfig
    kubeconfig: Path | None = None
    #: added to its environment (this process's own), e.g. an HTTP proxy it must not use
    env: dict[str, str] = field(default_factory=dict)
    #: --curve-propagation: the pod runner refreshes mounted Secrets every second, so a
    #: CurveZMQ rotation need not wait a kubelet's minute here
    curve_propagation: float = 3.0

    @property
    def admin_key_file(self) -> Path:
        """Its --admin-key-file (ADMIN_ROOT_KEY), beside its log: the same at every start."""
        return self.log_path.parent / "admin-root-key"

    def admin_key(self, namespace: str, name: str, uid: str) -> str:
        return admin_key(namespace, name, uid)

    def start(self) -> None:
        key_file = self.admin_key_file
        key_file.write_text(ADMIN_ROOT_KEY + "\n")
        key_file.chmod(0o600)
        cmd = [
            sys.executable,
            "-m",
            "omnistage.cli",
            "operator",
            f"--kubeconfig={self.kubeconfig or self.cluster.kubeconfig}",
            f"--metrics-port={self.port}",
            f"--resync-seconds={self.resync}",
            f"--admin-key-file={key_file}",
            f"--curve-propagation={self.curve_propagation:g}",
        ]
        if self.webhook:
            cmd += ["--webhook", "--webhook-addr=127.0.0.1", f"--webhook-port={self.webhook_port}"]
        else:
            cmd.append("--no-webhook")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        wait_for(lambda: self._healthy(), 60, "operator /livez", self.log_tail)

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/livez", timeout=1):
                return True
        except OSError:
            return False

    @contextlib.contextmanager
    def restarted(self, *, webhook: bool) -> Iterator[Operator]:
        """Run the operator with the webhook on or off for a while, then as it was before.

        A clean stop lets kopf empty the webhook configuration, so with webhook=False the API
        server admits what only the webhook refuses (the CRD's own rules still apply).
        """
        before = self.webhook
        self.stop()
        self.webhook = webhook
        self.start()
        try:
            yield self
        finally:
            self.stop()
            self.webhook = before
            self.start()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No operator process for a while (a test drives a Controller of its own)."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> dict[str, float]:
        """The operator's unlabelled samples (its totals), by sample name."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {name: value for (name, labels), value in samples(text).items() if not labels}

    def writes(self) -> int:
        return int(self.metrics()["omnistage_operator_api_writes_total"])

    def reconciles(self) -> int:
        return int(self.metrics()["omnistage_operator_reconciles_total"])

    def after_reconciles(self, passes: int, timeout: float = 300) -> None:
        """Wait until the operator has made `passes` more reconcile passes."""
        mark = self.reconciles() + passes
        wait_for(lambda: self.reconciles() >= mark, timeout, f"{passes} reconcile passes",
                 self.log_tail)

    def objects(self) -> int:
        """Pipelines and pools in the cluster: what one resync round reconciles."""
        return len(self.cluster.kubectl("get", "omnipipelines,stagepools", "-A", "-o",
                                        "name").stdout.split())

    def after_resyncs(self, rounds: int, objects: int | None = None) -> None:
        """Wait for `rounds` resync rounds: `rounds` x `objects` more reconcile passes (a resync
        enqueues every pipeline and pool once; default: all of them in the cluster, as this
        operator watches every namespace), and at least `rounds` resync periods.

        "Resyncs change nothing" waits on this, not on a bare multiple of the resync period:
        the passes surely happened, however loaded the machine. The period is a lower bound
        (passes that events caused do not stand in for the operator's resync timer)."""
        started = time.monotonic()
        if objects is None:
            objects = self.objects()
        self.after_reconciles(rounds * max(objects, 1))
        time.sleep(max(0.0, started + rounds * self.resync - time.monotonic()))

    def settled(self, objects: int | None = None) -> int:
        """Wait until a whole resync round (every object reconciled twice: passes only, no
        lower bound in time) writes nothing; return the write count then."""
        if objects is None:
            objects = self.objects()
        quiet_at: list[int] = []

        def quiet() -> bool:
            before = self.writes()
            self.after_reconciles(2 * max(objects, 1))
            if self.writes() != before:
                return False
            quiet_at.append(before)
            return True

        wait_for(quiet, 400, "the operator to stop writing", self.log_tail, interval=0)
        return quiet_at[-1]

    def log_offset(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def write_lines(self, start: int) -> list[str]:
        """The operator's write log ("PATCH /api/...", one line per counted write) since
        `start`, a log_offset()."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        marker = " omnistage.kubeapi.writes: "
        return [line.split(marker, 1)[1] for line in text.splitlines() if marker in line]

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""


def wait_for(
    pred: Callable[[], Any],
    timeout: float,
    what: str,
    detail: Callable[[], str] | None = None,
    interval: float = 0.2,
) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    extra = f"\n{detail()}" if detail else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")


def apply_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        f"crd/omnipipelines.{k.GROUP}",
        f"crd/stagepools.{k.GROUP}",
    )


@pytest.fixture(scope="session")
def crds(kube: Cluster) -> None:
    apply_crds(kube)


# Module scope: tests/e2e runs the operator from the Helm chart instead (tests/e2e/conftest.py),
# and two operators must never reconcile the same cluster at once.
@pytest.fixture(scope="module")
def operator(
    kube: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    # The webhook listens on this machine's loopback, which only the local control plane's API
    # server can call; kind's API server runs in a container (tests/e2e installs the chart there).
    op = Operator(kube, tmp_path_factory.mktemp("operator") / "operator.log",
                  webhook=kube.is_local)
    op.start()
    yield op
    op.stop()
    # kopf created the webhook configuration; the chart (tests/e2e, same session) owns one of
    # that name and helm refuses to adopt an object it did not create.
    kube.kubectl("delete", "--ignore-not-found", "--wait=false",
                 f"validatingwebhookconfigurations.admissionregistration.k8s.io/{CONFIGURATION}")


def api_key(cluster: Cluster, namespace: str, pipeline: str) -> str:
    """The API key a user reads for a pipeline with keys on by default: the Secret its status
    names (status.apiKeySecret, the one the operator made), its first key's first line."""
    doc = json.loads(cluster.kubectl("get", "omnipipe", "-n", namespace, pipeline, "-o",
                                     "json").stdout)
    name = (doc.get("status") or {}).get("apiKeySecret")
    if not name:
        raise AssertionError(f"{namespace}/{pipeline}: no status.apiKeySecret yet")
    secret = json.loads(cluster.kubectl("get", "secret", "-n", namespace, name, "-o",
                                        "json").stdout)
    [value, *_] = sorted(secret["data"].items())
    return base64.b64decode(value[1]).decode().splitlines()[0].strip()


def pipeline_doc(name: str, stages: list[Obj], **spec: Any) -> Obj:
    """An OmniPipeline manifest. Keys are on by default (the operator makes the Secret): a
    test that calls the API reads the key (api_key) or says auth.disabled."""
    return {
        "apiVersion": k.API_VERSION,
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {**spec, "stages": stages},
    }


def apply(cluster: Cluster, namespace: str, doc: Obj) -> None:
    """Apply a manifest; pipelines run $OMNISTAGE_TEST_IMAGE when set (kind-e2e builds it)."""
    image = os.environ.get("OMNISTAGE_TEST_IMAGE")
    if image and doc.get("kind") == "OmniPipeline":
        doc = {**doc, "spec": {**doc["spec"], "image": image}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))


@contextlib.contextmanager
def pod_url(runner: PodRunner, pod: Obj, port: int) -> Iterator[str]:
    """A base URL for a pod's port: its loopback pod IP here, a port-forward on kind."""
    if runner.local:
        yield f"http://{pod['status']['podIP']}:{port}"
        return
    meta = pod["metadata"]
    proc = subprocess.Popen(
        [runner.cluster.kubectl_path(), f"--kubeconfig={runner.cluster.kubeconfig}",
         "port-forward", "-n", meta["namespace"], f"pod/{meta['name']}", f"127.0.0.1::{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        found = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not found:
            raise AssertionError(f"kubectl port-forward failed: {line}")
        yield f"http://127.0.0.1:{found.group(1)}"
    finally:
        proc.terminate()
        proc.wait(10)


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> Obj | None:
    proc = cluster.kubectl("get", "-n", namespace, kind, name, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    import json

    return json.loads(proc.stdout)

