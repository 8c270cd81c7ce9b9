"""A kubeconfig exec credential plugin for tests, as `aws eks get-token` or `kubelogin` are to
real clusters: a script that kubectl-style clients run for a token.

Each run appends a line to its call log and prints an ExecCredential with the next token of its
list (the last one once the list is used up) and an expirationTimestamp ``ttl_s`` from now.
Its settings live in a JSON file read on every run, so a test can make it fail mid-way.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_VERSION = "client.authentication.k8s.io/v1beta1"

_SCRIPT = '''#!{python}
import datetime, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "settings.json")) as f:
    settings = json.load(f)
try:
    with open(os.path.join(here, "calls")) as f:
        n = sum(1 for _ in f) + 1
except FileNotFoundError:
    n = 1
status = {{"token": settings["tokens"][min(n, len(settings["tokens"])) - 1]}}
expires = None
if settings["ttl_s"] is not None:
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
        seconds=settings["ttl_s"])
    expires = at.timestamp()
    status["expirationTimestamp"] = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
with open(os.path.join(here, "calls"), "a") as f:
    f.write(json.dumps({{"args": sys.argv[1:], "env": os.environ.get("PLUGIN_ENV"),
                        "info": os.environ.get("KUBERNETES_EXEC_INFO"),
                        "failed": bool(settings["fail"]), "expires": expires}}) + "\\n")
if settings["fail"]:
    print(settings["fail"], file=sys.stderr)
    sys.exit(1)
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": status}}))
'''


@dataclass
class ExecPluginScript:
    """The plugin in ``dir``: `user()` is the kubeconfig user stanza that runs it."""

    dir: Path
    tokens: list[str]
    ttl_s: float | None = None
    fail: str | None = None  # exit 1 with this on stderr
    command: Path = field(init=False)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.command = self.dir / "token-plugin"
        self.command.write_text(_SCRIPT.format(python=sys.executable))
        self.command.chmod(0o755)
        self.save()

    def save(self) -> None:
        """Write the settings (tokens, ttl_s, fail): the next run reads them."""
        (self.dir / "settings.json").write_text(json.dumps(
            {"tokens": self.tokens, "ttl_s": self.ttl_s, "fail": self.fail}))

    def calls(self) -> list[dict[str, Any]]:
        """One entry per run: its args, $PLUGIN_ENV, the ExecCredential it was given, whether
        it failed and when the token it handed out expires (epoch seconds)."""
        log = self.dir / "calls"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line]

    def user(self) -> dict[str, Any]:
        return {"exec": {"apiVersion": API_VERSION, "command": str(self.command),
                         "args": ["--cluster", "test"],
                         "env": [{"name": "PLUGIN_ENV", "value": "from-kubeconfig"}],
                         "interactiveMode": "Never"}}
