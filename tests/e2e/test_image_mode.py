"""Image mode has teeth: pods run what their image holds, or fail the way a kubelet says so.

The checkout has every package installed, so a runner that quietly fell back to it would pass a
broken image. Each case below would succeed on the checkout's Python and must fail here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from omnistage.kubeapi import resource_path
from omnistage.spec import DEFAULT_IMAGE
from tests.e2e.conftest import require_images
from tests.harness.cluster import HACK, PY_IMAGE, Cluster, PodRunner
from tests.harness.images import LocalImages
from tests.harness.kubeclient import wait_until

pytestmark = pytest.mark.timeout(300)
Obj = dict[str, Any]
OPERATOR_IMAGE = DEFAULT_IMAGE.replace("/omnistage:", "/omnistage-operator:")
NONROOT = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532}
LOCKED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
          "capabilities": {"drop": ["ALL"]}}
# What every stage pod runs (builders.worker_command), for a model-free echo stage.
STAGE_COMMAND = ["omnistage", "stage", "--stage-json", json.dumps({"name": "a", "kind": "echo"}),
                 "--port", "5555", "--http-port", "8081"]


def build_images_index() -> Path:
    out = subprocess.run([str(HACK / "build-images.sh"), "--print-index"], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def _pod(name: str, image: str, command: list[str], **spec: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "securityContext": NONROOT,
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "c", "image": image, "command": command,
                "securityContext": LOCKED,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": [{"name": "POD_IP",
                         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "terminationGracePeriodSeconds": 5,
            **spec,
        },
    }


def _status(kube: Cluster, ns: str, name: str) -> Obj:
    pod = kube.kube.get(resource_path("v1", "pods", ns, name))
    [st] = pod.get("status", {}).get("containerStatuses") or [{}]
    return {"phase": pod.get("status", {}).get("phase"), **st}


def _waiting(kube: Cluster, ns: str, name: str, *reasons: str) -> Obj:
    def seen() -> Obj | None:
        st = _status(kube, ns, name)
        reason = st.get("state", {}).get("waiting", {}).get("reason")
        return st if reason in reasons else None

    return dict(wait_until(seen, 120, f"{name} waiting with {reasons}",
                           on_timeout=lambda: json.dumps(_status(kube, ns, name))))


@pytest.fixture
def images(podrunner: PodRunner) -> PodRunner:
    require_images(podrunner)
    if not podrunner.local:
        pytest.skip("waiting reasons and logs of the local pod runner")
    return podrunner


def test_an_image_that_was_not_built_is_err_image_pull(
    kube: Cluster, images: PodRunner, namespace: str
) -> None:
    ref = DEFAULT_IMAGE.rsplit(":", 1)[0] + ":never-built"
    kube.kube.create(resource_path("v1", "pods", namespace),
                     _pod("unbuilt", ref, ["python3", "-c", "print('ran')"]))
    st = _waiting(kube, namespace, "unbuilt", "ErrImagePull", "ImagePullBackOff")
    assert ref in st["state"]["waiting"]["message"]
    assert "hack/build-images.sh" in st["state"]["waiting"]["message"]
    assert st["phase"] == "Pending" and st["restartCount"] == 0
    assert "ran" not in images.log_tail(namespace, "unbuilt")


def test_a_command_missing_from_the_image_is_run_container_error(
    kube: Cluster, images: PodRunner, namespace: str
) -> None:
    # The base image has python3 but not the omnistage package (the checkout's PATH has both).
    kube.kube.create(resource_path("v1", "pods", namespace),
                     _pod("no-cli", PY_IMAGE, STAGE_COMMAND))
    st = _waiting(kube, namespace, "no-cli", "RunContainerError")
    assert 'exec: "omnistage": executable file not found in $PATH' in \
        st["state"]["waiting"]["message"]
    assert st["lastState"]["terminated"]["reason"] == "StartError"


def test_an_image_without_a_needed_package_crashes_with_the_import_error(
    kube: Cluster, images: PodRunner, namespace: str
) -> None:
    # The operator image has the CLI but not the runtime extra (no torch, no pyzmq): a stage
    # worker cannot start there, and the container's termination message says why.
    kube.kube.create(resource_path("v1", "pods", namespace),
                     _pod("no-runtime", OPERATOR_IMAGE, STAGE_COMMAND))
    st = _waiting(kube, namespace, "no-runtime", "CrashLoopBackOff")
    last = st["lastState"]["terminated"]
    assert last["reason"] == "Error" and last["exitCode"] == 1
    assert "No module named" in last["message"], last


def test_the_runtime_image_runs_the_same_pod_as_the_nonroot_uid_on_a_read_only_root(
    kube: Cluster, images: PodRunner, namespace: str
) -> None:
    # The same stage command becomes Ready in the runtime image: the failure above is the image.
    pod = _pod("stage", DEFAULT_IMAGE, [
        "sh", "-c",
        "id -u; touch /probe 2>&1; touch /tmp/ok && echo tmp-writable; exec \"$@\"", "sh",
        *STAGE_COMMAND])
    pod["spec"]["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/readyz", "port": 8081}, "periodSeconds": 1}
    kube.kube.create(resource_path("v1", "pods", namespace), pod)

    def ready() -> bool:
        st = _status(kube, namespace, "stage")
        return bool(st.get("ready"))

    wait_until(ready, 180, "the echo stage Ready in the runtime image",
               on_timeout=lambda: images.log_tail(namespace, "stage"))
    out = images.log_tail(namespace, "stage")
    assert "\n65532\n" in out
    assert "Read-only file system" in out
    assert "tmp-writable" in out


@pytest.mark.parametrize("name", ["runtime", "operator"])
def test_images_are_nonroot_labelled_and_carry_no_compiler_or_pip_config(
    images: PodRunner, name: str
) -> None:
    index = LocalImages(build_images_index())
    ref = DEFAULT_IMAGE if name == "runtime" else OPERATOR_IMAGE
    image = index.lookup(ref)
    rootfs = Path(image.rootfs)
    assert image.config["User"] == "65532:65532"
    assert "nonroot:x:65532:65532:" in (rootfs / "etc" / "passwd").read_text()
    labels = image.config["Labels"]
    assert labels["org.opencontainers.image.version"] == DEFAULT_IMAGE.rsplit(":", 1)[1]
    assert labels["org.opencontainers.image.title"] == (
        "omnistage" if name == "runtime" else "omnistage-operator")
    assert labels["org.opencontainers.image.base.name"]
    compilers = [p for d in ("usr/bin", "usr/local/bin") for p in (rootfs / d).glob("*")
                 if p.name in ("gcc", "cc", "c++", "g++", "clang", "make")
                 or p.name.startswith(("x86_64-linux-gnu-gcc", "gcc-"))]
    assert not compilers, compilers
    for leak in ("etc/pip.conf", "etc/xdg/pip/pip.conf", "root/.config/pip/pip.conf",
                 "run/secrets/pipconf", "run/secrets/pipca"):
        assert not (rootfs / leak).exists(), leak
    env = image.env
    assert env["HOME"] == "/tmp" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert not any(k.startswith("PIP_") for k in env)
    has_torch = (rootfs / "opt" / "omnistage" / "lib" / "python3.11" / "site-packages"
                 / "torch").is_dir()
    assert has_torch == (name == "runtime")
