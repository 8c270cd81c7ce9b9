"""The `omnistage` command line: serve a pipeline, run one stage replica, run the operator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_stage(sub: Any) -> None:
    from omnistage.worker.config import add_arguments

    s = sub.add_parser("stage", help="run one replica of one stage (what every stage pod runs)")
    add_arguments(s)


def _run_stage(args: argparse.Namespace) -> int:
    from omnistage.spec import SpecError
    from omnistage.worker.config import config_from_args
    from omnistage.worker.server import StageWorker

    try:
        cfg = config_from_args(args)
    except SpecError as exc:
        print(f"error: invalid stage:\n{exc}", file=sys.stderr)
        return 2
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
                   help="serves /metrics (API write counts) and /healthz")
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
