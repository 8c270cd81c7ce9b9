"""The `omnistage` command line: serve a pipeline, run one stage replica, run the operator."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any


def _json_obj(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_stage(sub: Any) -> None:
    s = sub.add_parser("stage", help="run one replica of one stage (what every stage pod runs)")
    s.add_argument("--stage", required=True, help="stage name")
    s.add_argument("--kind", required=True, choices=["ar", "diffusion", "echo"])
    s.add_argument("--model", default=None, help="built-in model name or local directory")
    s.add_argument("--engine", type=_json_obj, default={}, help="engine options as JSON")
    s.add_argument("--replica-id", default=os.environ.get("POD_NAME", ""))
    s.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"),
                   help="address to bind (default $POD_IP or 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="ZMQ ROUTER port (0 = any free port)")
    s.add_argument("--http-port", type=int, default=0, help="health/metrics port (0 = any)")
    s.add_argument("--max-requests", type=_positive_int, default=64)
    s.add_argument("--max-cost", type=_positive_int, default=None)
    s.add_argument("--max-queue", type=_positive_int, default=256)
    s.add_argument("--deadline", type=_positive_float, default=60.0,
                   help="default per-request deadline in seconds")
    s.add_argument("--drain-timeout", type=float, default=30.0)
    s.add_argument("--device", default=None, help="torch device (default: cuda if visible)")
    s.add_argument("--port-file", default=None, help="write bound addresses here as JSON")


def _run_stage(args: argparse.Namespace) -> int:
    from omnistage.worker.server import StageWorker, WorkerConfig

    cfg = WorkerConfig(
        stage=args.stage, kind=args.kind, model=args.model, engine=args.engine,
        replica_id=args.replica_id, host=args.host, port=args.port, http_port=args.http_port,
        max_requests=args.max_requests, max_cost=args.max_cost, max_queue=args.max_queue,
        default_deadline=args.deadline, drain_timeout=args.drain_timeout, device=args.device,
        port_file=args.port_file,
    )
    return asyncio.run(StageWorker(cfg).serve())


def _add_models(sub: Any) -> None:
    m = sub.add_parser("models", help="built-in tiny models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="list the built-in models")
    save = msub.add_parser("save", help="save_pretrained a built-in model into a directory")
    save.add_argument("name")
    save.add_argument("dest")


def _run_models(args: argparse.Namespace) -> int:
    from omnistage.models import BUILTINS, save_builtin

    if args.models_cmd == "list":
        for name, kind in sorted(BUILTINS.items()):
            print(f"{name}\t{kind}")
        return 0
    if os.path.exists(args.dest):
        print(f"error: destination {args.dest!r} already exists", file=sys.stderr)
        return 2
    save_builtin(args.name, args.dest)
    print(f"saved {args.name} to {args.dest}")
    return 0


def _add_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve a pipeline file on this machine (stages + HTTP API)")
    s.add_argument("file", help="OmniPipeline YAML file")
    s.add_argument("--host", default="127.0.0.1", help="address of the API and the replicas")
    s.add_argument("--port", type=int, default=None,
                   help="API port (default: spec.orchestrator.port; 0 = any free port)")
    s.add_argument("--log-dir", default=None, help="replica logs (default: a new temp folder)")


def _run_serve(args: argparse.Namespace) -> int:
    from omnistage.serve import run_serve

    return run_serve(args.file, host=args.host, port=args.port, log_dir=args.log_dir)


def _add_orchestrator(sub: Any) -> None:
    o = sub.add_parser("orchestrator",
                       help="run the pipeline's orchestrator alone (the orchestrator pod)")
    o.add_argument("--pipeline-file", default=None,
                   help="OmniPipeline YAML (default: JSON in $OMNISTAGE_PIPELINE)")
    o.add_argument("--membership", choices=["kubernetes", "static"], default="kubernetes",
                   help="where replicas come from: a watch of the pipeline's Pods, or --replica")
    o.add_argument("--namespace", default=None,
                   help="namespace of the stage Pods (default $POD_NAMESPACE, the service "
                        "account's namespace, or default)")
    o.add_argument("--host", default=None, help="API bind address (default $POD_IP or 127.0.0.1)")
    o.add_argument("--port", type=int, default=None,
                   help="API port (default: spec.orchestrator.port; 0 = any free port)")
    o.add_argument("--zmq-port", type=int, default=None,
                   help="stage replicas' ZMQ port (kubernetes membership; default 5555)")
    o.add_argument("--replica", action="append", default=[], metavar="STAGE=NAME@tcp://HOST:PORT",
                   help="a replica (static membership; repeatable)")


def _run_orchestrator(args: argparse.Namespace) -> int:
    from omnistage.kube import WORKER_ZMQ_PORT
    from omnistage.orchestrator.main import run_orchestrator

    return run_orchestrator(
        pipeline_file=args.pipeline_file, membership=args.membership, namespace=args.namespace,
        host=args.host, port=args.port, replicas=args.replica,
        zmq_port=WORKER_ZMQ_PORT if args.zmq_port is None else args.zmq_port,
    )


def _add_operator(sub: Any) -> None:
    o = sub.add_parser("operator", help="run the Kubernetes operator (needs the operator extra)")
    o.add_argument("--kubeconfig", default=None,
                   help="kubeconfig (default: in-cluster config, else $KUBECONFIG)")
    o.add_argument("--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; default: all namespaces)")
    o.add_argument("--metrics-host", default="127.0.0.1")
    o.add_argument("--metrics-port", type=int, default=8081,
                   help="serves /metrics (API write counts), /livez and /readyz")
    o.add_argument("--resync-seconds", type=_positive_float, default=30.0,
                   help="how often every object is re-checked (writes only on drift)")


def _run_operator(args: argparse.Namespace) -> int:
    try:
        from omni_operator.main import main as operator_main
    except ImportError as exc:
        print(f"error: the operator needs its extra: pip install 'omnistage[operator]' ({exc})",
              file=sys.stderr)
        return 2
    return operator_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("OMNISTAGE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_serve(sub)
    _add_stage(sub)
    _add_models(sub)
    _add_orchestrator(sub)
    _add_operator(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers = {"serve": _run_serve, "stage": _run_stage, "models": _run_models,
                "orchestrator": _run_orchestrator, "operator": _run_operator}
    try:
        return handlers[args.cmd](args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
