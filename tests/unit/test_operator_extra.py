"""The operator image installs only the `operator` extra (no numpy, zmq, msgspec, torch...).

Kills: the operator importing a runtime module with a heavy dependency (builders reaching
`omnistage.shm` for its env names, or `orchestrator.main` for the termination grace), which
crash-looped the operator pod with "No module named 'numpy'" while every process-mode test passed.
"""

from __future__ import annotations

import subprocess
import sys

RUNTIME_ONLY = ["numpy", "zmq", "msgspec", "torch", "transformers", "diffusers", "safetensors",
                "PIL"]
OPERATOR_MODULES = ["omni_operator.main", "omni_operator.command", "omni_operator.webhook",
                    "omni_operator.replicas_cli", "omni_operator.kubectl_plugin"]


def test_operator_imports_without_the_runtime_extra() -> None:
    code = (
        "import sys\n"
        f"for name in {RUNTIME_ONLY!r}:\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        f"for module in {OPERATOR_MODULES!r}:\n"
        "    __import__(module)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
