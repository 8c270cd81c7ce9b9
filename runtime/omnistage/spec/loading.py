"""From a file or a mapping to a validated object, and the one validator of both.

`validate_manifest` is the one validator: `omnistage validate`, `omnistage serve` and the
operator's admission webhook all call it. Documents are parsed strictly, the way the API server
types JSON: no string is coerced to a number or a boolean, keys are camelCase only, and unknown
keys are errors (under metadata too, except the fields the API server sets).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omnistage.spec.errors import SpecError, describe_errors, short_repr
from omnistage.spec.manifests import OmniPipeline, StagePool
from omnistage.spec.patterns import KIND, POOL_KIND

M = typing.TypeVar("M", bound=BaseModel)


def _strict(model: type[M], doc: Any) -> M:
    """Validate a document the way the API server types JSON: no coercion, camelCase keys only.

    Python code may still build the models by field name (populate_by_name); documents may not.
    """
    if not isinstance(doc, dict):
        raise SpecError([("(root)", f"expected a mapping, got {type(doc).__name__}")])
    try:
        return model.model_validate(doc, strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        problems = describe_errors(exc.errors(), wording="spec", root=model)
        raise SpecError([(p.path, p.message) for p in problems]) from None


def parse_pipeline(
    doc: dict[str, Any], *, check_paths: bool = False, base_dir: Path | None = None
) -> OmniPipeline:
    """Validate an OmniPipeline mapping; every problem becomes a field-pathed SpecError entry.

    check_paths also requires local model paths to exist (relative to base_dir, default cwd);
    the operator leaves it off because paths refer to the pod's filesystem.
    """
    pipeline = _strict(OmniPipeline, doc)
    if check_paths:
        missing = []
        for i, stage in enumerate(pipeline.spec.stages):
            path = stage.model_path(base_dir)
            if path is not None and not path.exists():
                missing.append(
                    (f"spec.stages[{i}].model", f"model path {stage.model!r} does not exist")
                )
        if missing:
            raise SpecError(missing)
    return pipeline


def parse_stagepool(doc: dict[str, Any]) -> StagePool:
    """Validate a StagePool mapping (the operator writes them; people may too)."""
    return _strict(StagePool, doc)


KIND_IMMUTABLE = "kind is immutable; create a stage with a new name instead"
PIPELINE_IMMUTABLE = "pipeline is immutable"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _update_errors(doc: dict[str, Any], old: dict[str, Any]) -> list[tuple[str, str]]:
    """What an update may not change. Both objects are read leniently (the old one may predate
    today's rules, the new one may be invalid otherwise too); the CRD's transition rules (CEL)
    say the same with the same paths."""
    spec, old_spec = _dict(doc.get("spec")), _dict(old.get("spec"))
    if doc.get("kind") == POOL_KIND:
        errors = []
        if old_spec.get("pipeline") not in (None, spec.get("pipeline")):
            errors.append(("spec.pipeline", PIPELINE_IMMUTABLE))
        old_kind = _dict(old_spec.get("stage")).get("kind")
        if old_kind not in (None, _dict(spec.get("stage")).get("kind")):
            errors.append(("spec.stage.kind", KIND_IMMUTABLE))
        return errors
    stages = [_dict(s) for s in old_spec.get("stages") or [] if isinstance(s, dict)]
    old_kinds = {s.get("name"): s.get("kind") for s in stages}
    new_stages = spec.get("stages") if isinstance(spec.get("stages"), list) else []
    return [
        (f"spec.stages[{i}].kind", KIND_IMMUTABLE)
        for i, stage in enumerate(_dict(s) for s in new_stages)
        if old_kinds.get(stage.get("name")) not in (None, stage.get("kind"))
    ]


def validate_manifest(
    doc: Any,
    *,
    old: Any = None,
    check_paths: bool = False,
    base_dir: Path | None = None,
) -> OmniPipeline | StagePool:
    """The one validator of an Omnistage object (OmniPipeline or StagePool).

    `omnistage validate`, `omnistage serve` and the operator's admission webhook call it, so
    each refuses the same documents naming the same field paths. old is the stored object of
    an update: changes to immutable fields are refused too. Raises SpecError with every problem.
    """
    if not isinstance(doc, dict):
        raise SpecError([("(root)", f"expected a mapping, got {type(doc).__name__}")])
    kind = doc.get("kind")
    if kind not in (KIND, POOL_KIND):
        problem = ("required field is missing" if kind is None
                   else f"invalid value {short_repr(kind)}")
        raise SpecError([("kind", f"{problem} (expected {KIND!r} or {POOL_KIND!r})")])
    errors = _update_errors(doc, old) if isinstance(old, dict) else []
    try:
        if kind == POOL_KIND:
            obj: OmniPipeline | StagePool = parse_stagepool(doc)
        else:
            obj = parse_pipeline(doc, check_paths=check_paths, base_dir=base_dir)
    except SpecError as exc:
        raise SpecError(errors + exc.errors) from None
    if errors:
        raise SpecError(errors)
    return obj


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML would otherwise silently drop."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_manifests(path: str | Path) -> list[Any]:
    """Every YAML document of a file (empty documents skipped); file problems raise SpecError
    naming the file."""
    file = Path(path)
    source = str(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([("(file)", "file not found")], source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([("(file)", f"cannot read file: {exc}")], source=source) from None
    try:
        return [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d is not None]
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([("(file)", f"invalid YAML{where}: {problem}")], source=source) from None


def load_pipeline(path: str | Path, *, check_paths: bool = True) -> OmniPipeline:
    """Read one OmniPipeline from a YAML file; errors name the file."""
    source = str(path)
    try:
        docs = load_manifests(path)
    except SpecError as exc:
        if exc.errors == [("(file)", "file not found")]:
            raise SpecError([("(file)", "pipeline file not found")], source=source) from None
        raise
    if not docs:
        raise SpecError([("(file)", "file is empty; expected one OmniPipeline")], source=source)
    if len(docs) > 1:
        raise SpecError(
            [("(file)", f"expected exactly one YAML document, found {len(docs)}")], source=source
        )
    base_dir = Path(path).parent.resolve()
    try:
        return parse_pipeline(docs[0], check_paths=check_paths, base_dir=base_dir)
    except SpecError as exc:
        raise SpecError(exc.errors, source=source) from None
