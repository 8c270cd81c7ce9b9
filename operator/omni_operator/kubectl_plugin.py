"""`kubectl omnistage drain|status ...`: the kubectl plugin (installed as `kubectl-omnistage`).

kubectl runs any `kubectl-<name>` executable on PATH for `kubectl <name>`; this one offers the
same drain and status commands as `omnistage drain|status`.
"""

from __future__ import annotations

import argparse
import sys

from omni_operator.replicas_cli import register_drain, register_status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl omnistage", description="Omnistage replicas: named drain and status.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    register_drain(sub)
    register_status(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
