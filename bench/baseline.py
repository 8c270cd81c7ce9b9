"""The baseline side of a same-run comparison: another checkout of Omnistage to measure this
tree against (`--baseline-tree DIR`, or `--baseline-commit REV` in a temporary git worktree).

Why one module: bench_pipeline and bench_speech both compare this tree with the commit before a
change in one run (issue 42), so a change is judged by a ratio of two systems measured side by
side, never against a figure from another day."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_baseline_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--baseline-tree", default=None,
                        help=f"also run {what} from this checkout (e.g. a git worktree of the "
                        "commit before a change)")
    parser.add_argument("--baseline-commit", default=None,
                        help="as --baseline-tree, from a temporary git worktree of this commit")


@contextlib.contextmanager
def baseline_tree(args: argparse.Namespace, parser: argparse.ArgumentParser
                  ) -> Iterator[Path | None]:
    """The baseline checkout the flags name (None when neither is given), checked to hold a
    runtime; a --baseline-commit worktree is removed afterwards."""
    if args.baseline_tree and args.baseline_commit:
        parser.error("--baseline-tree and --baseline-commit: give one")
    if args.baseline_commit:
        with _worktree(args.baseline_commit, parser) as tree:
            yield tree
        return
    if not args.baseline_tree:
        yield None
        return
    tree = Path(args.baseline_tree).resolve()
    if not (tree / "runtime" / "omnistage").is_dir():
        parser.error(f"--baseline-tree: {tree} has no runtime/omnistage")
    yield tree


@contextlib.contextmanager
def _worktree(commit: str, parser: argparse.ArgumentParser) -> Iterator[Path]:
    """A detached git worktree of commit, removed afterwards (the baseline of a comparison)."""
    tmp = Path(tempfile.mkdtemp(prefix="omnistage-baseline-"))
    path = tmp / "tree"
    made = subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT,
                          capture_output=True, text=True)
    if made.returncode != 0:
        tmp.rmdir()
        parser.error(f"--baseline-commit {commit}: {made.stderr.strip()}")
    print(f"baseline: {commit} in {path}", flush=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                       capture_output=True)
        with contextlib.suppress(OSError):
            tmp.rmdir()
