"""The `omnistage` command line: serve a pipeline, run one stage replica, run the orchestrator.

Other packages add subcommands through the `omnistage.commands` entry-point group: each entry
is a function that takes the subparsers object and adds its parser, with
`set_defaults(handler=...)`. The operator's `omnistage operator` comes that way, so the runtime
never imports (or names) the operator package.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from omnistage import eventloop

COMMANDS_GROUP = "omnistage.commands"
DESCRIPTION = "Serve multi-stage omni-modal model pipelines locally or on Kubernetes."


def _add_stage(sub: Any) -> None:
    from omnistage.worker.config import add_arguments

    s = sub.add_parser("stage", help="run one replica of one stage (what every stage pod runs)")
    add_arguments(s)
    s.set_defaults(handler=_run_stage)


def _run_stage(args: argparse.Namespace) -> int:
    from omnistage.curve_keys import CurveKeyError
    from omnistage.spec import SpecError
    from omnistage.worker.config import config_from_args
    from omnistage.worker.server import StageWorker

    try:
        cfg = config_from_args(args)
        worker = StageWorker(cfg)  # reads the CurveZMQ keys ($OMNISTAGE_CURVE_KEYS)
    except SpecError as exc:
        print(f"error: invalid stage:\n{exc}", file=sys.stderr)
        return 2
    except CurveKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return eventloop.run(worker.serve())


def _add_models(sub: Any) -> None:
    m = sub.add_parser("models", help="built-in models and the Hugging Face model cache")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="list the built-in models")
    save = msub.add_parser("save", help="save_pretrained a built-in model into a directory")
    save.add_argument("name")
    save.add_argument("dest")
    pull = msub.add_parser(
        "pull", help="fetch hub models (org/name[@revision]) into the Hugging Face cache "
                     "($HF_HOME), with progress; what a stage pod's init container runs")
    pull.add_argument("models", nargs="+", metavar="ID", help="hub id or built-in name")
    pull.add_argument("--offline", action="store_true",
                      help="only check that the cache already holds them")
    m.set_defaults(handler=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    from omnistage.kinds import builtin_models
    from omnistage.models import ModelUnavailable, pull, save_builtin

    if args.models_cmd == "list":
        for name, kind in sorted(builtin_models().items()):
            print(f"{name}\t{kind}")
        return 0
    if args.models_cmd == "pull":
        from omnistage import kube

        try:
            cache = pull(args.models, offline_only=args.offline)
        except (ModelUnavailable, ValueError) as exc:
            # One last line, the pod's termination message when this is an init container.
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return kube.MODEL_FAILED_EXIT
        print(f"{len(args.models)} model(s) in {cache}")
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
    s.add_argument("--admin-host", default="127.0.0.1",
                   help="address of the admin listener (default loopback, whatever --host)")
    s.add_argument("--port", type=int, default=None,
                   help="API port (default: spec.orchestrator.port; 0 = any free port)")
    s.add_argument("--log-dir", default=None, help="replica logs (default: a new temp folder)")
    s.add_argument("--shutdown-delay", type=_seconds, default=0.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, fail /readyz but keep serving this long before "
                        "draining (default 0: nothing routes to a local server by its "
                        "readiness; set it when a load balancer does)")
    s.add_argument("--dry-run", action="store_true",
                   help="only check the file and the GPU plan, as serve would; exit 0 or 2")
    _add_auth(s, "off by default only when --host is loopback")
    s.add_argument("--no-curve", action="store_true",
                   help="plain ZMQ between the orchestrator and its stage workers (default: "
                        "CurveZMQ with a keypair made for this run, so no other process that "
                        "reaches a worker's port is heard)")
    _add_output(s)
    s.set_defaults(handler=_run_serve)


def _add_auth(parser: Any, default: str) -> None:
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="API keys for the OpenAI and pipeline routes: a file (one key a "
                             "line) or a directory such as a mounted Secret (every file in it), "
                             "read again when it changes; or set $OMNISTAGE_API_KEY. Never a "
                             f"key on the command line ({default})")
    parser.add_argument("--admin-port", type=int, default=None,
                        help="admin listener port: control, GET /v1/load, /metrics (default: "
                             "spec.orchestrator.adminPort; any free port when --port is 0)")
    parser.add_argument("--admin-key-file", default=None, metavar="PATH",
                        help="admin keys for the admin listener's control and load routes, "
                             "as --api-key-file takes them; or set $OMNISTAGE_ADMIN_KEY. "
                             "Needed unless the admin listener is on loopback")
    parser.add_argument("--no-auth", action="store_true",
                        help="serve the API and the admin listener without keys, on any "
                             "address")


def seconds_between(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds from low to high (the commands' durations)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number of seconds, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be between {low:g} and {high:g} seconds, got {text}")
        return value
    return parse


_seconds = seconds_between(0, 300)


def _run_serve(args: argparse.Namespace) -> int:
    from omnistage.serve import dry_run, run_serve

    if args.dry_run:
        return dry_run(args.file, output=args.output)
    return run_serve(args.file, host=args.host, port=args.port, log_dir=args.log_dir,
                     shutdown_delay=args.shutdown_delay, api_key_file=args.api_key_file,
                     no_auth=args.no_auth, curve=not args.no_curve,
                     admin_host=args.admin_host, admin_port=args.admin_port,
                     admin_key_file=args.admin_key_file)


def _add_output(parser: Any) -> None:
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text",
                        help="report format (json: one object per document, with its errors)")


def _add_validate(sub: Any) -> None:
    v = sub.add_parser("validate",
                       help="check OmniPipeline/StagePool files as kubectl apply does; exit 0/2")
    v.add_argument("files", nargs="+", metavar="FILE", help="YAML files (several documents each)")
    v.add_argument("--check-paths", action="store_true",
                   help="also require local model paths to exist (as serve does)")
    v.add_argument("--old", action="append", default=[], metavar="FILE",
                   help="the stored objects (same kind and name) the files would update: "
                        "immutable fields are checked too (repeatable)")
    _add_output(v)
    v.set_defaults(handler=_run_validate)


def _run_validate(args: argparse.Namespace) -> int:
    from omnistage.validate import run

    return run(args.files, output=args.output, check_paths=args.check_paths,
               old_files=args.old)


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
    o.add_argument("--shutdown-delay", type=_seconds, default=None, metavar="SECONDS",
                   help="on SIGTERM, fail /readyz but keep serving this long before draining "
                        "(default: spec.orchestrator.shutdownDelaySeconds)")
    _add_auth(o, "needed unless the API is on loopback or the pipeline sets "
                 "spec.orchestrator.auth.disabled")
    o.set_defaults(handler=_run_orchestrator)


def _run_orchestrator(args: argparse.Namespace) -> int:
    from omnistage.kube import WORKER_ZMQ_PORT
    from omnistage.orchestrator.main import run_orchestrator

    return run_orchestrator(
        pipeline_file=args.pipeline_file, membership=args.membership, namespace=args.namespace,
        host=args.host, port=args.port, replicas=args.replica,
        zmq_port=WORKER_ZMQ_PORT if args.zmq_port is None else args.zmq_port,
        shutdown_delay=args.shutdown_delay, api_key_file=args.api_key_file,
        no_auth=args.no_auth, admin_port=args.admin_port, admin_key_file=args.admin_key_file,
    )


def _add_plugins(sub: Any, plugins: list[EntryPoint]) -> None:
    """Subcommands other installed packages register; one that fails to load still shows up,
    and running it says why (instead of every other command failing)."""
    for ep in plugins:
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not take the CLI down
            reason = f"{type(exc).__name__}: {exc}"
            broken = sub.add_parser(ep.name, help=f"(failed to load: {reason})")
            broken.set_defaults(handler=lambda _args, r=reason, n=ep.name: _plugin_failed(n, r))


def _plugin_failed(name: str, reason: str) -> int:
    print(f"error: the {name!r} command failed to load ({reason})", file=sys.stderr)
    return 2


def build_parser(plugins: list[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The parser; plugins default to the installed `omnistage.commands` entry points."""
    parser = argparse.ArgumentParser(prog="omnistage", description=DESCRIPTION)
    parser.add_argument("--log-level", default=os.environ.get("OMNISTAGE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_serve(sub)
    _add_validate(sub)
    _add_stage(sub)
    _add_models(sub)
    _add_orchestrator(sub)
    _add_plugins(sub, list(entry_points(group=COMMANDS_GROUP)) if plugins is None else plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        eventloop.loop_factory()  # a bad OMNISTAGE_EVENT_LOOP: one line, before any work
    except eventloop.EventLoopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
