"""`omnistage validate FILE...`: every error of every document, as text or JSON; exit 0 or 2.

It calls omnistage.spec.validate_manifest, the validator the operator's admission webhook calls,
so a document it accepts is what `kubectl apply` accepts (the cluster's own checks aside, such as
whether a node can hold a replica), and each error names the same field path.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from omnistage.spec import SpecError, load_manifests, validate_manifest

EXIT_OK = 0
EXIT_INVALID = 2


@dataclass
class Report:
    """The outcome for one document (or for a file that could not be read)."""

    file: str
    document: int | None  # index in a multi-document file; None for a file error
    kind: str | None = None
    name: str | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.errors

    def as_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "document": self.document,
            "kind": self.kind,
            "name": self.name,
            "valid": self.valid,
            "errors": [{"path": p, "message": m} for p, m in self.errors],
        }


Key = tuple[Any, Any]  # (kind, metadata.name)


def _key(doc: Any) -> Key:
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    return (doc.get("kind") if isinstance(doc, dict) else None,
            meta.get("name") if isinstance(meta, dict) else None)


def load_old(files: list[str]) -> dict[Key, Any]:
    """The stored objects an update would replace, by (kind, name): `--old` files, for
    instance `kubectl get omnipipe NAME -o yaml`."""
    return {_key(doc): doc for f in files for doc in load_manifests(f)}


def check_file(path: str | Path, *, check_paths: bool = False,
               old: dict[Key, Any] | None = None) -> list[Report]:
    """One report per YAML document of the file; local model paths are checked on request
    (they name files on this machine, not in a pod). A document with an entry in old is
    checked as an update of it, so changes to immutable fields are errors too."""
    file = str(path)
    try:
        docs = load_manifests(path)
    except SpecError as exc:
        return [Report(file, None, errors=exc.errors)]
    if not docs:
        return [Report(file, None, errors=[("(file)", "no YAML document in the file")])]
    reports = []
    base_dir = Path(path).parent.resolve()
    for i, doc in enumerate(docs):
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        report = Report(
            file,
            i,
            kind=doc.get("kind") if isinstance(doc, dict) else None,
            name=meta.get("name") if isinstance(meta, dict) else None,
        )
        try:
            validate_manifest(doc, old=(old or {}).get(_key(doc)), check_paths=check_paths,
                              base_dir=base_dir)
        except SpecError as exc:
            report.errors = exc.errors
        reports.append(report)
    return reports


def _where(report: Report, multi: bool) -> str:
    if multi and report.document is not None:
        return f"{report.file} (document {report.document + 1})"
    return report.file


def render_text(reports: list[Report], out: TextIO) -> None:
    """`FILE: path: message` per error, one line per valid document, then a count."""
    multi = {r.file for r in reports if r.document and r.document > 0}
    for report in reports:
        where = _where(report, report.file in multi)
        if report.valid:
            print(f"{where}: {report.kind} {report.name} is valid", file=out)
        for path, message in report.errors:
            print(f"{where}: {path}: {message}", file=out)
    invalid = [r for r in reports if not r.valid]
    errors = sum(len(r.errors) for r in invalid)
    print(f"{len(reports)} document(s) checked: {len(reports) - len(invalid)} valid, "
          f"{len(invalid)} invalid ({errors} error(s))", file=out)


def run(files: list[str], *, output: str = "text", check_paths: bool = False,
        old_files: list[str] | None = None, out: TextIO | None = None) -> int:
    """Check every file; EXIT_OK when every document is valid, else EXIT_INVALID."""
    try:
        old = load_old(old_files or [])
    except SpecError as exc:
        return emit([Report(exc.source or "--old", None, errors=exc.errors)], output, out)
    reports = [r for f in files for r in check_file(f, check_paths=check_paths, old=old)]
    return emit(reports, output, out)


def emit(reports: list[Report], output: str = "text", out: TextIO | None = None) -> int:
    """Print the reports as text or JSON; the exit code says whether all were valid."""
    out = out or sys.stdout
    if output == "json":
        json.dump({"valid": all(r.valid for r in reports),
                   "documents": [r.as_json() for r in reports]}, out, indent=2)
        out.write("\n")
    else:
        render_text(reports, out)
    return EXIT_OK if all(r.valid for r in reports) else EXIT_INVALID
