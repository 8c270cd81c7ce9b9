"""One version source: the package version is the image tag, the chart's appVersion and the
default image of a pipeline; the image repositories agree between the build, the chart and the
spec."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

import omnistage
from omnistage.spec import DEFAULT_IMAGE, IMAGE_REPOSITORY, OmniPipeline

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "omnistage"


def _built_refs() -> dict[str, str]:
    out = subprocess.run([sys.executable, str(REPO / "hack" / "build_images.py"),
                          "--print-refs"], capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.split())


def test_the_package_version_is_the_one_source() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "omnistage.__version__"}


def test_chart_images_and_spec_default_agree_with_the_package_version() -> None:
    version = omnistage.__version__
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    refs = _built_refs()
    assert chart["appVersion"] == version
    assert chart["version"] == version
    assert DEFAULT_IMAGE == f"{IMAGE_REPOSITORY}:{version}"
    assert refs["runtime"] == DEFAULT_IMAGE
    # The chart runs the operator image at appVersion when no tag is given.
    assert values["image"]["tag"] == ""
    assert refs["operator"] == f"{values['image']['repository']}:{version}"
    assert f"{IMAGE_REPOSITORY}:{{{{ .Chart.AppVersion }}}}" in (
        CHART / "templates" / "NOTES.txt").read_text()


def test_a_pipeline_without_an_image_runs_the_default_runtime_image() -> None:
    pipeline = OmniPipeline.model_validate({
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"stages": [{"name": "a", "kind": "echo", "finalOutput": True}]},
    })
    assert pipeline.spec.image == DEFAULT_IMAGE
    assert DEFAULT_IMAGE.endswith(f":{omnistage.__version__}")
