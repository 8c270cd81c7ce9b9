"""How every bench judges its figures: one goal type, one PASS/MISS format, one --check flag.

Why one module: issue 15 asks every bench to say, in its summary line, whether each goal held,
and to exit non-zero on a miss when asked (`--check`), so a script or CI job can gate on a bench
without parsing its prose. A figure that could not be measured is a MISS, never a silent pass.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Goal:
    """One figure against its bound: value >= target (at_least) or value <= target."""

    label: str
    value: float | None  # None: not measured (an error, a peer that could not run)
    target: float
    at_least: bool = True
    unit: str = "x"
    digits: int = 2

    @property
    def met(self) -> bool:
        if self.value is None or math.isnan(self.value):
            return False
        return self.value >= self.target if self.at_least else self.value <= self.target

    def __str__(self) -> str:
        shown = "n/a" if self.value is None else f"{self.value:.{self.digits}f}{self.unit}"
        op = ">=" if self.at_least else "<="
        return f"{self.label}={shown} (goal {op} {self.target:g}{self.unit}: " \
               f"{'PASS' if self.met else 'MISS'})"


def add_check_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when any goal is missed (MISS in the summary line)")


def verdicts(goals: Iterable[Goal]) -> str:
    """The goals as they go into a summary line."""
    return "; ".join(str(g) for g in goals)


def exit_status(goals: Iterable[Goal], check: bool) -> int:
    """1 with --check when a goal is missed, else 0."""
    return 1 if check and not all(g.met for g in goals) else 0
