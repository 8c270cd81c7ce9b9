"""The Go controller-runtime baseline of bench_operator_scale.py: LeaderWorkerSet (LWS).

Why: issue 13 asks how the kopf operator compares with a controller users of this field run,
on the same kwok nodes, in the same run. LWS's controller (sigs.k8s.io/lws, built from its Go
module by `hack/build-k8s.sh lws`) manages the same number of stage pods: one LeaderWorkerSet
per stage pool (replicas = the pool's replicas, size 1, so every group is one leader pod). Its
pods come from StatefulSets, so kube-controller-manager does part of its work.

How it runs here, all on loopback:
  - the LWS CRD comes from the Go module's config/crd;
  - the controller's webhooks (LWS defaulting/validation and the pod mutation that labels group
    and worker indexes: the controller needs both) are served by the controller on 127.0.0.1
    with a throw-away CA made by openssl, and registered with `clientConfig.url`, since this
    control plane has no Service network; internal cert management and leader election are off;
  - the controller runs as a subprocess with the admin kubeconfig.

Writes are counted on the API server (apiserver_request_total), for both systems alike: every
write during the ramp except the ones no controller makes (the scheduler's pods/binding, kwok's
pods/status and node/lease heartbeats). That includes kube-controller-manager's writes (LWS's
StatefulSets and Omnistage's orchestrator Deployments both go through it).
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml
from write_counts import Obj, ScaleRun, apiserver_writes, controller_writes

from omnistage.kube import condition_status
from omnistage.kubeapi import ApiError, SyncKubeApi, path, resource_path

LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


def module_dir(version: str) -> Path:
    """The LWS Go module in the module cache (hack/build-k8s.sh lws downloads it)."""
    gomodcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                check=True).stdout.strip()
    return Path(gomodcache) / f"sigs.k8s.io/lws@{version}"


class LwsBaseline:
    """placement: the pods' nodeSelector and tolerations, as the Omnistage fleet's;
    pod_ready, log and free_port: the bench's own."""

    def __init__(self, bench: ScaleRun, binary: Path, version: str, *, placement: Obj,
                 pod_ready: Callable[[Obj], bool], log: Callable[[str], None],
                 free_port: Callable[[], int]) -> None:
        self.bench = bench
        self.placement = placement
        self.pod_ready = pod_ready
        self.say = log
        self.binary = binary
        self.module = module_dir(version)
        self.work = bench.work / "lws"
        self.work.mkdir(exist_ok=True)
        self.ns = bench.ns + "-lws"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.work / "lws-controller.log"
        self.webhook_port = free_port()
        self.health_port = free_port()

    # ---- setup ---------------------------------------------------------------------------

    def _certs(self) -> str:
        """A CA and a serving certificate for 127.0.0.1; returns the CA bundle (base64 PEM)."""
        d = self.work / "certs"
        d.mkdir(exist_ok=True)

        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "1", "-subj", "/CN=lws-bench-ca")
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
            "-subj", "/CN=127.0.0.1")
        (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        ssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "tls.crt", "-days", "1", "-extfile", "san.ext")
        return base64.b64encode((d / "ca.crt").read_bytes()).decode()

    def _webhooks(self, ca: str) -> list[Obj]:
        """The module's webhook manifests, pointed at the controller on loopback; the pod hooks
        only see LWS pods (the objectSelector of the module's own kustomize patch)."""
        docs = [d for d in yaml.safe_load_all(
            (self.module / "config/webhook/manifests.yaml").read_text()) if d]
        for doc in docs:
            doc["metadata"]["name"] = f"lws-bench-{doc['metadata']['name']}"
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}",
                                        "caBundle": ca}
                if any("pods" in r["resources"] for r in hook["rules"]):
                    hook["objectSelector"] = {"matchExpressions": [
                        {"key": LWS_NAME_LABEL, "operator": "Exists"}]}
        return docs

    def start(self) -> None:
        b = self.bench
        b.kctl("apply", "--server-side", "-f",
               str(self.module / "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"))
        crd = (f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
               f"{LWS_PLURAL}.{LWS_GROUP}")
        deadline = time.monotonic() + 60
        while condition_status(b.k.get(crd), "Established") != "True":
            if time.monotonic() > deadline:
                raise RuntimeError("the LeaderWorkerSet CRD is not Established after 60 s")
            time.sleep(0.5)
        ca = self._certs()
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1",
                        "certDir": str(self.work / "certs")},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "clientConnection": {"qps": 500, "burst": 500},
        }
        cfg = self.work / "config.yaml"
        cfg.write_text(yaml.safe_dump(config))
        hooks = self.work / "webhooks.yaml"
        hooks.write_text(yaml.safe_dump_all(self._webhooks(ca)))
        cmd = [str(self.binary), f"--config={cfg}", f"--kubeconfig={b.kubeconfig}"]
        self.say(f"starting the LWS controller {self.binary.name} (log: {self.log})")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lws-controller exited (rc={self.proc.returncode}):\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.health_port}/readyz", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("lws-controller not ready in 60 s:\n"
                                       + self.log_tail()) from None
                time.sleep(0.3)
        b.kctl("apply", "--server-side", "-f", str(hooks))
        time.sleep(2)  # let the API server pick the webhook configurations up

    def log_tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        b = self.bench
        try:
            b.kctl("delete", "--ignore-not-found", "mutatingwebhookconfiguration",
                   "lws-bench-mutating-webhook-configuration")
            b.kctl("delete", "--ignore-not-found", "validatingwebhookconfiguration",
                   "lws-bench-validating-webhook-configuration")
        except Exception as exc:  # cleanup is best effort; say what is left
            self.say(f"LWS webhook cleanup incomplete: {exc}")
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    # ---- the measured run ----------------------------------------------------------------

    def lws_doc(self, name: str, replicas: int) -> Obj:
        pod = {
            "metadata": {"labels": {"bench": "operator-scale-lws"}},
            "spec": {
                **self.placement,
                "containers": [{
                    "name": "stage",
                    "image": "registry.invalid/omnistage-echo:bench",  # kwok never pulls
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                }],
            },
        }
        return {
            "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": name},
            "spec": {"replicas": replicas,
                     "leaderWorkerTemplate": {"size": 1, "workerTemplate": pod}},
        }

    def lws_path(self) -> str:
        return resource_path(f"{LWS_GROUP}/{LWS_VERSION}", LWS_PLURAL, self.ns)

    def observe(self) -> tuple[int, int, int]:
        """(Available LWS, Ready pods, pods)."""
        sets = self.bench.k.list(self.lws_path())
        available = sum(1 for s in sets if condition_status(s, "Available") == "True")
        pods = self.bench.k.list(path("Pod", self.ns), labelSelector=LWS_NAME_LABEL,
                                 resourceVersion="0")
        return available, sum(1 for p in pods if self.pod_ready(p)), len(pods)

    def run(self, sets: int, replicas: int, idle_seconds: float, timeout: float) -> Obj:
        """Create `sets` LeaderWorkerSets of `replicas` one-pod groups; time apply -> every
        set Available and every pod Ready; count writes to then and in an idle window."""
        b = self.bench
        if b.k.get(path("Namespace", name=self.ns), ignore=(404,)) is None:
            b.k.create(path("Namespace"), {"metadata": {"name": self.ns}})
        want = sets * replicas
        names = [f"scale-{i:03d}" for i in range(sets)]
        w0 = apiserver_writes(b.k)
        self.say(f"LWS: creating {sets} LeaderWorkerSets x {replicas} replicas = {want} pods "
              f"in namespace {self.ns}")
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: b.k.create(self.lws_path(), self.lws_doc(n, replicas)),
                          names))
        last = 0.0
        while True:
            avail, ready, npods = self.observe()
            now = time.monotonic()
            if avail == sets and ready == want and npods == want:
                break
            if now - last >= 5:
                self.say(f"  LWS t={now - t0:6.1f}s Available {avail}/{sets}  pods Ready "
                      f"{ready}/{want} (exist {npods})")
                last = now
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"lws-controller died:\n{self.log_tail()}")
            if now - t0 > timeout:
                raise RuntimeError(f"LWS not Ready after {timeout:.0f}s: Available "
                                   f"{avail}/{sets}, pods Ready {ready}/{want}\n"
                                   + self.log_tail())
            time.sleep(1.0)
        t_ready = time.monotonic() - t0
        self.say(f"  LWS all Available and {want} pods Ready after {t_ready:.1f}s")
        time.sleep(3.0)  # trailing status writes, as the Omnistage side's settle()
        w1 = apiserver_writes(b.k)
        ramp = controller_writes(w0, w1)
        self.say(f"LWS idle: {idle_seconds:.0f}s")
        time.sleep(idle_seconds)
        idle = controller_writes(w1, apiserver_writes(b.k))
        total = sum(ramp.values())
        t1 = time.monotonic()
        delete_collection(b.k, self.lws_path(), t1 + timeout)
        while self.observe()[2] or b.k.list(self.lws_path()):
            if time.monotonic() - t1 > timeout:
                raise RuntimeError("LWS teardown did not finish")
            time.sleep(1.0)
        gone = time.monotonic() - t1
        return {
            "sets": sets,
            "pods": want,
            "apply_to_ready_s": round(t_ready, 1),
            "controller_writes_total": total,
            "controller_writes_per_pod": round(total / want, 2),
            "controller_writes_by_verb_resource": ramp,
            "idle_seconds": idle_seconds,
            "idle_controller_writes": sum(idle.values()),
            "idle_controller_writes_by_verb_resource": idle,
            "delete_to_gone_s": round(gone, 1),
            "controller_cpu_s": round(proc_cpu(self.proc.pid), 2) if self.proc else None,
            "controller_log": str(self.log),
        }


def delete_collection(k: SyncKubeApi, url: str, deadline: float) -> None:
    """Delete every object at `url`, asking again while the API server answers 504: a
    collection of 1,500 LeaderWorkerSets outlasted its 60 s request timeout (2026-12-03, on the
    2-CPU VM) and the run failed there; the delete is the same on a second asking."""
    while True:
        try:
            k.delete(url)
            return
        except ApiError as exc:
            if exc.status != 504 or time.monotonic() > deadline:
                raise


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
