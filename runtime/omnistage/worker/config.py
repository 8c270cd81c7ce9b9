"""A stage worker's configuration and its one command-line form.

What a replica does is a `Stage` (omnistage.spec, already validated: kinds, models, bounds);
where it runs (replica id, address, ports, device, port file) is the only thing added here. The
stage travels as JSON of the Stage model, so no stage field is ever re-described as a flag:

    omnistage stage --stage-json '{"name":"enc","kind":"ar","model":"tiny-llama"}' --port 5555
    omnistage stage --pipeline-file pipeline.yaml --stage enc --port 5555     # for people

`worker_args` is the one function that turns a stage into that command line, for
`omnistage serve` (local_runtime/procs) and for the operator's pods (builders).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from omnistage.spec import SpecError, Stage, load_pipeline
from omnistage.spec.errors import describe_errors

# The Stage fields a worker reads. The rest (replicas, inputs, finalOutput, resources,
# placement, maxUnavailable) belong to the orchestrator and to placement; leaving them out of
# the command keeps a scale or a graph change from changing (and rolling) the replicas' pods.
WORKER_FIELDS = frozenset({"name", "kind", "model", "engine", "admission", "drain_timeout_seconds"})


@dataclass(frozen=True)
class WorkerConfig:
    """One replica: the stage it serves, and where it serves it."""

    stage: Stage
    replica_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0  # ZMQ ROUTER; 0 = any free port
    http_port: int = 0  # health/metrics side port; 0 = any free port
    device: str | None = None  # torch device; None = cuda if visible, else cpu
    port_file: str | None = None  # where the bound addresses are written as JSON
    ipc: str | None = None  # also serve ZMQ on this unix socket path (same-host clients)

    def __post_init__(self) -> None:
        if not self.replica_id:
            object.__setattr__(self, "replica_id", f"{self.stage.name}-{os.getpid()}")


def stage_json(stage: Stage) -> str:
    """The worker-relevant part of stage as compact, deterministic JSON (camelCase keys)."""
    doc = stage.model_dump(include=set(WORKER_FIELDS), by_alias=True, exclude_none=True,
                           mode="json")
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def worker_args(
    stage: Stage,
    *,
    replica_id: str | None = None,
    host: str | None = None,
    port: int | None = None,
    http_port: int | None = None,
    device: str | None = None,
    port_file: str | Path | None = None,
    ipc: str | Path | None = None,
) -> list[str]:
    """`stage --stage-json ...` plus the placement flags given (None: the worker's default).

    The caller puts the program in front: `omnistage` in a pod, `python -m omnistage.cli`
    locally. Defaults left out: replica id $POD_NAME, host $POD_IP, else 127.0.0.1.
    """
    args = ["stage", "--stage-json", stage_json(stage)]
    placement: dict[str, Any] = {"--replica-id": replica_id, "--host": host, "--port": port,
                                 "--http-port": http_port, "--device": device,
                                 "--port-file": port_file, "--ipc": ipc}
    for flag, value in placement.items():
        if value is not None:
            args += [flag, str(value)]
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `omnistage stage` flags: the stage (JSON or file + name), then placement only."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--stage-json", metavar="JSON",
                     help="the stage as JSON of the pipeline spec's stage object "
                          "(what `omnistage serve` and the operator pass)")
    src.add_argument("--pipeline-file", metavar="FILE",
                     help="an OmniPipeline YAML file; pick the stage with --stage")
    parser.add_argument("--stage", metavar="NAME", help="stage name in --pipeline-file")
    parser.add_argument("--replica-id", default=os.environ.get("POD_NAME", ""),
                        help="stable replica identity (default $POD_NAME, else <stage>-<pid>)")
    parser.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1",
                        help="address to bind (default $POD_IP or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="ZMQ ROUTER port (0 = any free port)")
    parser.add_argument("--http-port", type=int, default=0,
                        help="health/metrics port (0 = any free port)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if visible)")
    parser.add_argument("--port-file", default=None, help="write bound addresses here as JSON")
    parser.add_argument("--ipc", default=None, metavar="PATH",
                        help="also serve ZMQ on this unix socket (ipc://PATH), for clients on "
                             "this host")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The parsed flags as a WorkerConfig; SpecError names the bad field or the bad flag."""
    if args.stage_json is not None:
        if args.stage is not None:
            raise SpecError([("--stage", "only with --pipeline-file; --stage-json names the "
                                         "stage itself")])
        stage = parse_stage_json(args.stage_json)
    else:
        stage = stage_from_file(args.pipeline_file, args.stage)
    return WorkerConfig(stage=stage, replica_id=args.replica_id, host=args.host, port=args.port,
                        http_port=args.http_port, device=args.device, port_file=args.port_file,
                        ipc=args.ipc)


def parse_stage_json(text: str) -> Stage:
    """Validate a stage given as JSON with the same model the pipeline spec uses."""
    try:
        return Stage.model_validate_json(text)
    except ValidationError as exc:
        problems = describe_errors(exc.errors(), wording="pydantic", root=Stage)
        raise SpecError([(p.path, p.message) for p in problems], source="--stage-json") from None


def stage_from_file(file: str, name: str | None) -> Stage:
    """The named stage of a pipeline file; a relative model path resolves against its folder."""
    if not name:
        raise SpecError([("--stage", "required with --pipeline-file")])
    pipeline = load_pipeline(file)
    try:
        stage = pipeline.spec.stage(name)
    except KeyError as exc:
        raise SpecError([("--stage", str(exc.args[0]))], source=file) from None
    return resolve_model(stage, Path(file).resolve().parent)


def resolve_model(stage: Stage, base_dir: Path) -> Stage:
    """stage with a relative local model path made absolute against base_dir."""
    path = stage.model_path(base_dir)
    return stage if path is None else stage.model_copy(update={"model": str(path)})

