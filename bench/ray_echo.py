"""Baseline (a) for bench_pipeline.py: the 2-stage echo pipeline as composed Ray Serve deployments.

Why: Omnistage's goal is at least 2x Ray Serve's throughput on the same work, so the baseline
must do that same work: the ingress deployment echoes the request (stage a) and passes the result
to a second deployment through a DeploymentHandle (stage b), whose echo is the response.

Loopback only: Ray binds to 127.0.0.1, the dashboard and usage stats are off. Prints
"READY http://127.0.0.1:PORT/" once serving and runs until SIGTERM/SIGINT.

Needs `pip install "ray[serve]"`. Run: `python bench/ray_echo.py --port 8123`.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home
# Without this Ray "resolves" 127.0.0.1 to the machine's routable address and its processes talk
# over it; with it, the node address is loopback (the variable is read on Linux too).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

# Same budgets as examples/echo.yaml (maxRequests: 1024): no artificial queueing at 64 clients.
_OPTS: dict[str, Any] = {"num_replicas": 1, "max_ongoing_requests": 1024,
                         "ray_actor_options": {"num_cpus": 0}}


def _echo(payload: dict[str, Any]) -> dict[str, Any]:
    """The echo executor's work: return the prompt as the output text."""
    return {"text": str(payload.get("prompt", payload.get("text", ""))), "finish_reason": "stop"}


@serve.deployment(**_OPTS)
class StageB:
    """Second stage: echoes what stage a produced."""

    async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        return _echo(payload)


@serve.deployment(**_OPTS)
class Ingress:
    """HTTP ingress and stage a; composes stage b through a DeploymentHandle."""

    def __init__(self, b: DeploymentHandle) -> None:
        self.b = b

    async def __call__(self, request: Any) -> dict[str, Any]:
        body = await request.json()
        out_a = _echo(body)
        return await self.b.remote(out_a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Ingress.bind(StageB.bind()), route_prefix="/", name="echo")
    print(f"READY http://127.0.0.1:{args.port}/", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
