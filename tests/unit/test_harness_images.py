"""The pod runner's image rules (tests/harness/images.py) without a cluster: how a container
spec combines with an image, the kubelet errors for what cannot run, hack/test.sh's image
canary (on a tiny real image), and the pod address range of each local cluster.
tests/e2e/test_image_mode.py runs the same rules against real pods and images."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness.images import (
    CanaryCheck,
    ImageError,
    ImageInfo,
    LocalImages,
    canary,
    container_argv,
    container_user,
    summary,
)
from tests.harness.images import main as images_main
from tests.harness.podrunner import PORTS_PER_CLUSTER, PodRunner, cluster_pod_cidr
from tests.harness.sandbox import in_root


def _image(tmp_path: Path, **config: object) -> ImageInfo:
    (tmp_path / "etc").mkdir(exist_ok=True)
    (tmp_path / "etc" / "passwd").write_text(
        "root:x:0:0::/root:/bin/sh\nnonroot:x:65532:65532::/tmp:/usr/sbin/nologin\n")
    (tmp_path / "etc" / "group").write_text("root:x:0:\nnonroot:x:65532:\n")
    return ImageInfo("example/img:1", "sha256:abc", str(tmp_path), dict(config))


def test_command_and_args_follow_kubernetes_rules(tmp_path: Path) -> None:
    img = _image(tmp_path, Entrypoint=["omnistage"], Cmd=["--help"])
    assert container_argv(img, {}) == ["omnistage", "--help"]
    assert container_argv(img, {"args": ["stage", "-x"]}) == ["omnistage", "stage", "-x"]
    assert container_argv(img, {"command": ["sh"]}) == ["sh"]  # CMD is dropped
    assert container_argv(img, {"command": ["sh"], "args": ["-c", "true"]}) == ["sh", "-c", "true"]
    with pytest.raises(ImageError, match="no entrypoint and the container no command") as e:
        container_argv(_image(tmp_path), {})
    assert e.value.reason == "CreateContainerError"


def test_user_comes_from_the_pod_then_the_image(tmp_path: Path) -> None:
    img = _image(tmp_path, User="65532:65532")
    assert container_user(img, {}, {}) == (65532, 65532, [65532])
    assert container_user(img, {"runAsUser": 1000, "fsGroup": 2000}, {}) == (1000, 65532,
                                                                              [2000, 65532])
    assert container_user(img, {"runAsUser": 1000}, {"runAsUser": 7, "runAsGroup": 8}) == (
        7, 8, [8])
    named = _image(tmp_path, User="nonroot")
    assert container_user(named, {}, {}) == (65532, 65532, [65532])


def test_run_as_non_root_is_enforced(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="runAsNonRoot and image will run as root") as e:
        container_user(_image(tmp_path), {"runAsNonRoot": True}, {})
    assert e.value.reason == "CreateContainerConfigError"
    with pytest.raises(ImageError, match="non-numeric user"):
        container_user(_image(tmp_path, User="nonroot"), {}, {"runAsNonRoot": True})


def test_an_image_missing_from_the_index_is_err_image_pull(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"images": {
        "docker.io/library/python:3.11": {"id": "sha256:1", "rootfs": str(rootfs)},
        "example/gone:1": {"id": "sha256:2", "rootfs": str(tmp_path / "nowhere")},
    }}))
    images = LocalImages(index)
    assert images.lookup("python:3.11").rootfs == str(rootfs)  # docker.io's implicit prefix
    with pytest.raises(ImageError, match='failed to pull image "example/other:1"') as e:
        images.lookup("example/other:1")
    assert e.value.reason == "ErrImagePull"
    assert "hack/build-images.sh" in e.value.message
    with pytest.raises(ImageError, match=r"rootfs .* is gone"):
        images.lookup("example/gone:1")
    assert LocalImages(tmp_path / "missing.json").refs() == []


def test_mount_targets_resolve_symlinks_inside_the_image(tmp_path: Path) -> None:
    """Debian's /var/run -> /run must lead to the image's /run, never the host's."""
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to("/run")
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "lib").symlink_to("usr/lib")
    sa = in_root(tmp_path, "/var/run/secrets/kubernetes.io/serviceaccount")
    assert sa == tmp_path / "run" / "secrets" / "kubernetes.io" / "serviceaccount"
    assert in_root(tmp_path, "/lib/x") == tmp_path / "usr" / "lib" / "x"
    assert in_root(tmp_path, "/../../etc/hosts") == tmp_path / "etc" / "hosts"
    (tmp_path / "loop").symlink_to("/loop")
    with pytest.raises(OSError, match="too many symlinks"):
        in_root(tmp_path, "/loop/x")


# ---- the image canary (hack/test.sh) ------------------------------------------------------------


def _shell_image(root: Path) -> Path:
    """A real, tiny image: the host's /bin/sh and the libraries it loads, plus /etc/passwd."""
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    sh = Path("/bin/sh").resolve()
    out = subprocess.run(["ldd", str(sh)], capture_output=True, text=True, check=True).stdout
    libs = [w for w in out.split() if w.startswith("/")]
    for src in [str(sh), *libs]:
        dest = root / src.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(src).resolve(), dest)
    (root / "bin").mkdir(exist_ok=True)
    if not (root / "bin" / "sh").exists():
        (root / "bin" / "sh").symlink_to(sh)
    return root


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ldd") is None,
                    reason="the canary runs containers as image mode does: root, overlay mounts")
def test_the_canary_names_the_image_the_command_and_its_stderr(tmp_path: Path) -> None:
    rootfs = _shell_image(tmp_path / "rootfs")
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"images": {"example/rt:1": {
        "name": "rt", "id": "sha256:1", "rootfs": str(rootfs),
        "config": {"Entrypoint": ["/bin/sh", "-c"], "Cmd": ["test -w /tmp && exit 0"],
                   "Env": ["PATH=/bin"]}}}}))
    checks = (
        CanaryCheck("rt"),  # the entry point, with a writable /tmp as the operator mounts
        CanaryCheck("rt", args=("echo broken on purpose >&2; exit 3",)),
        CanaryCheck("rt", command=("/bin/omnistage",)),
        CanaryCheck("rt", args=("while :; do :; done",)),
        CanaryCheck("gone"),
    )
    results = canary(index, checks, timeout=2)
    assert [(r.ok, r.rc) for r in results] == [
        (True, 0), (False, 3), (False, 128), (False, None), (False, -1)]
    text = summary(results)
    assert "FAILED (exit 3)  rt        example/rt:1  $ /bin/sh -c echo broken" in text
    assert "| broken on purpose" in text
    assert 'RunContainerError: exec: "/bin/omnistage"' in text
    assert "TIMED OUT" in text and "no 'gone' image in" in text
    # hack/test.sh's command: the default checks find no runtime/operator image here.
    assert images_main(["canary", "--index", str(index), "--timeout", "2"]) == 1
    assert images_main(["canary", "--index", str(tmp_path / "missing.json")]) == 1


# ---- pod address ranges of local clusters (hack/cluster.sh) -------------------------------------


def test_two_local_clusters_give_their_pods_disjoint_addresses(tmp_path: Path) -> None:
    """hack/cluster.sh up --podrunner on two port bases: the runners' allocations never meet
    (they were both 127.1.0.0/16), and stay on loopback, off kwok's 127.192.0.0/10 and off the
    random 127.2-126.0.0/16 of a runner started without --pod-cidr."""
    ips = []
    for base in (26440, 26446):  # adjacent clusters: six ports each
        runner = PodRunner(None, ["n"], tmp_path, pod_cidr=cluster_pod_cidr(base))  # type: ignore[arg-type]
        ips.append({runner.allocate_ip(f"uid-{i}", None) for i in range(600)})
    assert len(ips[0]) == len(ips[1]) == 600 and not ips[0] & ips[1]
    for ip in ips[0] | ips[1]:
        addr = ipaddress.ip_address(ip)
        assert addr in ipaddress.ip_network("127.128.0.0/10"), ip
    # Every pair of bases at least six ports apart, up to 1024 slots apart, gets its own range.
    bases = range(20000, 20000 + 1024 * PORTS_PER_CLUSTER, PORTS_PER_CLUSTER)
    assert len({cluster_pod_cidr(b) for b in bases}) == len(bases)
    assert cluster_pod_cidr(26440) == cluster_pod_cidr(26441)  # one cluster, one range
    with pytest.raises(ValueError, match="port base 0 is not a TCP port"):
        cluster_pod_cidr(0)
