"""Credentials as kubectl has them, against the local control plane: an exec credential plugin
(what `aws eks get-token`, `gke-gcloud-auth-plugin` and `kubelogin` are) hands out tokens the
API server knows only from its --token-auth-file (hack/cluster.sh), with an expiry of seconds.

- the operator (its controller and kopf's watches, both logged in through the plugin) keeps
  reconciling after the token expired: the plugin ran again and new work was done;
- `kubectl omnistage status` and `omnistage drain`, with the merged $KUBECONFIG list and a
  --context from its second file: a refused (revoked) token makes the plugin run again once;
- a plugin that exits 1 is one error line naming the plugin and its stderr, for the CLI and
  the operator alike.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator import retirement
from omnistage.kubeapi import resource_path
from tests.cluster.test_operator import kwok_pipeline, stage, stage_pods
from tests.harness.cluster import Cluster
from tests.harness.execplugin import ExecPluginScript
from tests.harness.operator import Operator, apply, wait_for

USER = "omnistage-token-user"  # hack/cluster.sh's tokens.csv
BINDING = resource_path("rbac.authorization.k8s.io/v1", "clusterrolebindings",
                        name="omnistage-token-user-admin")
TTL_S = 4.0  # the plugin's tokens expire this soon: the operator outlives several


@pytest.fixture(scope="module")
def tokens(kube: Cluster) -> Iterator[list[str]]:
    """The tokens the API server accepts for USER, who may do what the commands need."""
    if kube.state_dir is None:
        pytest.skip("needs the local control plane's --token-auth-file (hack/cluster.sh)")
    known = [line.split(",")[0] for line in
             (kube.state_dir / "tokens.csv").read_text().splitlines() if line]
    kube.kube.create(resource_path("rbac.authorization.k8s.io/v1", "clusterrolebindings"), {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": BINDING.rsplit("/", 1)[1]},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cluster-admin"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }, ignore=(409,))
    try:
        yield known
    finally:
        kube.kube.delete(BINDING, ignore=(404,))


def _kubeconfig(kube: Cluster, out: Path, users: dict[str, dict[str, Any]],
                current: str | None = None, server: str | None = None) -> Path:
    """A kubeconfig with one context per user, all on the test cluster (or ``server``)."""
    cluster: dict[str, Any] = {"server": server or kube.kube.config.server}
    if kube.kube.config.ca_file:
        cluster["certificate-authority"] = kube.kube.config.ca_file
    doc: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": out.name, "cluster": cluster}],
        "users": [{"name": name, "user": user} for name, user in users.items()],
        "contexts": [{"name": name, "context": {"cluster": out.name, "user": name}}
                     for name in users],
    }
    if current:
        doc["current-context"] = current
    out.write_text(yaml.safe_dump(doc))
    return out


def _run(argv: list[str], env: dict[str, str], timeout: float = 120
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _operator_on(plugin: ExecPluginScript, kube: Cluster, namespace: str,
                 tmp_path: Path) -> Operator:
    """The operator logged in through ``plugin``, once it has reconciled a first pipeline
    ('before'); the caller stops it."""
    config = _kubeconfig(kube, tmp_path / "exec.kubeconfig", {"exec": plugin.user()}, "exec")
    op = Operator(kube, tmp_path / "operator.log", webhook=False, kubeconfig=config)
    op.start()
    try:
        apply(kube, namespace, kwok_pipeline("before", [stage("s", final=True, replicas=1)]))
        wait_for(lambda: stage_pods(kube, namespace, "before"), 90,
                 "the operator's stage pod for 'before'", op.log_tail)
    except BaseException:
        op.stop()
        raise
    return op


def _pools(kube: Cluster, ns: str, pipeline: str) -> list[dict[str, Any]]:
    pools = kube.kube.list(resource_path("omnistage.io/v1alpha1", "stagepools", ns))
    return [p for p in pools if (p.get("spec") or {}).get("pipeline") == pipeline]


def test_operator_and_commands_keep_working_through_token_renewals(
        kube: Cluster, crds: None, namespace: str, tmp_path: Path, tokens: list[str]) -> None:
    # The operator: its controller and kopf's watches log in through the plugin, whose tokens
    # expire after TTL_S; it must still reconcile a pipeline applied after that.
    plugin = ExecPluginScript(tmp_path / "operator-plugin", tokens, ttl_s=TTL_S)
    op = _operator_on(plugin, kube, namespace, tmp_path)
    try:
        ran = plugin.calls()
        assert ran and not any(c["failed"] for c in ran)
        expired = max(c["expires"] for c in ran)
        wait_for(lambda: time.time() > expired + 0.5, TTL_S + 5, "the plugin's token to expire")
        apply(kube, namespace, kwok_pipeline("p", [stage("s", final=True, replicas=2)]))
        # kopf's watch sees the new pipeline; the controller writes its children with a token
        # it had to renew.
        wait_for(lambda: len(stage_pods(kube, namespace, "p")) == 2, 90,
                 "the operator's two stage pods for 'p', made after the token expired",
                 op.log_tail)
        assert len(plugin.calls()) > len(ran), "the plugin was not run again after expiry"
        assert op.proc is not None and op.proc.poll() is None
        assert not any(c["failed"] for c in plugin.calls())
    finally:
        op.stop()

    # The commands, with two kubeconfig files in $KUBECONFIG: the first's current-context is
    # a dead end (its server does not listen), the second holds the `exec` context that
    # --context picks. The first token the plugin hands out is one the API server does not
    # know (revoked): the 401 makes it run again, once.
    plugin = ExecPluginScript(tmp_path / "cli-plugin", ["revoked-token", *tokens], ttl_s=3600)
    first = _kubeconfig(kube, tmp_path / "first", {"dead": {"token": tokens[0]}}, "dead",
                        server="https://127.0.0.1:1")
    second = _kubeconfig(kube, tmp_path / "second", {"exec": plugin.user()}, "exec")
    shim = tmp_path / "bin" / "kubectl-omnistage"  # the console script pip would install
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m omni_operator.kubectl_plugin \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "KUBECONFIG": os.pathsep.join([str(first), str(second)]),
           "PATH": f"{shim.parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    dead = _run([kube.kubectl_path(), "omnistage", "status", "p", "-n", namespace], env)
    assert dead.returncode == 1 and "127.0.0.1:1" in dead.stderr, dead  # the first file's
    assert "Traceback" not in dead.stderr, dead
    assert plugin.calls() == []

    status = _run([kube.kubectl_path(), "omnistage", "status", "p", "-n", namespace,
                   "--context", "exec"], env)
    assert status.returncode == 0, status
    assert status.stdout.startswith("pipeline p ") and "pool p-s " in status.stdout, status
    assert len(plugin.calls()) == 2  # refused, then run again once

    victim = max(stage_pods(kube, namespace, "p"), key=retirement.ordinal_of)
    name = victim["metadata"]["name"]
    drain = _run([sys.executable, "-m", "omnistage.cli", "drain", name, "--retire",
                  "--no-wait", "-n", namespace, "--context=exec"], env)
    assert drain.returncode == 0 and f"{name}: retiring for good" in drain.stdout, drain
    (pool,) = _pools(kube, namespace, "p")
    assert retirement.ordinal_of(victim) in retirement.retired(pool).ordinals
    assert pool["spec"]["replicas"] == 1
    assert len(plugin.calls()) == 3  # a new process: the plugin ran once, its token was good


def test_a_failing_plugin_is_one_error_line_naming_it(
        kube: Cluster, crds: None, tmp_path: Path, tokens: list[str]) -> None:
    """Each command picks the plugin's context with --context (the current-context's token
    would be refused with a 401 instead) and says which plugin failed and why."""
    plugin = ExecPluginScript(tmp_path / "plugin", tokens, fail="token service unreachable")
    config = _kubeconfig(kube, tmp_path / "exec.kubeconfig",
                         {"wrong": {"token": "not-a-token"}, "exec": plugin.user()}, "wrong")
    named = f"exec credential plugin `{plugin.command} --cluster test` failed"
    env = {**os.environ, "KUBECONFIG": str(config)}
    for argv in ([sys.executable, "-m", "omni_operator.kubectl_plugin", "status", "p",
                  "--context", "exec"],
                 [sys.executable, "-m", "omnistage.cli", "drain", "p-s-0", "--no-wait",
                  "--context=exec", f"--kubeconfig={config}"],
                 [sys.executable, "-m", "omnistage.cli", "operator", "--no-webhook",
                  "--metrics-port=0", "--context=exec"]):
        out = _run(argv, env)
        assert out.returncode == 1, out
        assert named in out.stderr and "token service unreachable" in out.stderr, out
        assert "Traceback" not in out.stderr, out
    assert len(plugin.calls()) == 3 and all(c["failed"] for c in plugin.calls())


def test_a_plugin_that_fails_at_run_time_is_one_line_each_time(
        kube: Cluster, crds: None, namespace: str, tmp_path: Path, tokens: list[str]) -> None:
    """The plugin worked at start-up, then fails when the operator renews its expired token:
    every failure is one log line naming the plugin and its stderr, never a traceback; once
    the plugin works again, the operator carries on."""
    plugin = ExecPluginScript(tmp_path / "plugin", tokens, ttl_s=TTL_S)
    op = _operator_on(plugin, kube, namespace, tmp_path)
    try:
        start = op.log_offset()
        plugin.fail = "token service unreachable"
        plugin.save()
        expired = max(c["expires"] for c in plugin.calls())
        wait_for(lambda: time.time() > expired + 0.5, TTL_S + 5, "the plugin's token to expire")
        # Work for the controller: its writes need a token, which the failing plugin must renew.
        apply(kube, namespace, kwok_pipeline("p", [stage("s", final=True, replicas=1)]))
        named = f"exec credential plugin `{plugin.command} --cluster test` failed"

        def failures() -> list[str]:
            with open(op.log_path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            return [line for line in text.splitlines() if "token service unreachable" in line]

        # The controller's writes (and kopf's re-login) run the failing plugin, again and again
        # as they retry.
        wait_for(lambda: len([c for c in plugin.calls() if c["failed"]]) >= 3
                 and len(failures()) >= 3, 60,
                 "three failed runs of the plugin, logged", op.log_tail)
        with open(op.log_path, "rb") as f:
            f.seek(start)
            since = f.read().decode(errors="replace")
        assert "Traceback" not in since, since[-6000:]
        assert all(named in line for line in failures()), failures()
        plugin.fail = None
        plugin.save()
        wait_for(lambda: stage_pods(kube, namespace, "p"), 90,
                 "the stage pod for 'p' once the plugin works again", op.log_tail)
        assert op.proc is not None and op.proc.poll() is None
    finally:
        op.stop()
