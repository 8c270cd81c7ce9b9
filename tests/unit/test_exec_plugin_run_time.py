"""An exec credential plugin that fails after start-up (issue 37, defect 13): wherever the
failure surfaces it is one line that names the plugin and carries its stderr, never a
traceback. The cluster test (tests/cluster/test_exec_credentials.py) shows the operator's
reconciles; this shows kopf's login, which a run against a cluster reaches only when kopf
logs in again (at a watch's reconnect)."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
import yaml

from omnistage.kubeapi import ConfigError, KubeConfig
from tests.harness.execplugin import ExecPluginScript


def _config(tmp_path: Path, plugin: ExecPluginScript) -> KubeConfig:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443",
                                                  "insecure-skip-tls-verify": True}}],
           "users": [{"name": "u", "user": plugin.user()}],
           "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return KubeConfig.from_kubeconfig(path)


def test_a_failure_at_run_time_is_one_line_for_kopf_and_has_no_cause(tmp_path: Path) -> None:
    plugin = ExecPluginScript(tmp_path / "plugin", ["one", "two"], ttl_s=3600)
    cfg = _config(tmp_path, plugin)
    assert cfg.connection_info().token == "one"  # it worked at start-up
    plugin.fail = "token service unreachable"
    plugin.save()
    # kopf logs in again after a refusal: the plugin runs, fails, and kopf gets a TemporaryError
    # (which it logs as one line and retries), not a ConfigError (logged with its traceback).
    with pytest.raises(kopf.TemporaryError) as failed:
        cfg.connection_info()
    message = str(failed.value)
    assert f"exec credential plugin `{plugin.command} --cluster test` failed" in message
    assert "token service unreachable" in message and "\n" not in message.strip()
    assert failed.value.__cause__ is None and failed.value.__suppress_context__
    # The ConfigError itself carries no chained ExecProvider traceback either.
    with pytest.raises(ConfigError) as direct:
        cfg.renew("one")
    assert direct.value.__cause__ is None and direct.value.__suppress_context__
    plugin.fail = None
    plugin.save()
    assert cfg.connection_info().token == "two"  # and it recovers once the plugin does
