"""Prometheus text exposition without a client library: a few gauges and counters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class Family:
    name: str
    kind: str  # "gauge" | "counter" | "summary"
    help: str
    samples: list[tuple[Mapping[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append((labels, value))
        return self


def _labels(common: Mapping[str, str], extra: Mapping[str, str]) -> str:
    merged = {**common, **extra}
    if not merged:
        return ""
    body = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in merged.items()
    )
    return "{" + body + "}"


def render(families: Iterable[Family], common: Mapping[str, str] | None = None) -> str:
    """The text format Prometheus scrapes (version 0.0.4)."""
    out: list[str] = []
    for fam in families:
        out.append(f"# HELP {fam.name} {fam.help}")
        out.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            suffix = ""
            if fam.kind == "summary":
                suffix, labels = labels["_suffix"], {
                    k: v for k, v in labels.items() if k != "_suffix"
                }
            out.append(f"{fam.name}{suffix}{_labels(common or {}, labels)} {value:g}")
    return "\n".join(out) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
