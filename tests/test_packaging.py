"""pyproject.toml and environment.yml describe the same environment."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# PyPI name -> conda-forge name(s), where they differ.
PYPI_TO_CONDA = {
    "dask[distributed]": ["dask", "distributed"],
    "tensorboardx": ["tensorboardx"],
    "build": ["python-build"],
}


def _split(requirement: str) -> tuple[str, str]:
    match = re.match(r"^\s*([A-Za-z0-9_.\-]+(?:\[[^\]]+\])?)\s*(.*)$", requirement)
    assert match, requirement
    return match.group(1).lower(), match.group(2).replace(" ", "")


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    resolved: dict[str, str] = {}
    for requirement in requirements:
        name, spec = _split(requirement)
        for conda_name in PYPI_TO_CONDA.get(name, [name]):
            resolved[conda_name] = spec
    return resolved


def conda_requirements() -> dict[str, str]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert environment["channels"] == ["conda-forge"]
    resolved = {}
    for entry in environment["dependencies"]:
        assert isinstance(entry, str), f"unexpected entry {entry!r} in environment.yml"
        name, spec = _split(entry)
        if name not in ("python", "pip"):
            resolved[name] = spec
    return resolved


def test_environment_yml_matches_pyproject():
    assert conda_requirements() == pyproject_requirements()


def test_python_versions_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert project["requires-python"] == ">=3.11"
    assert "python>=3.11" in environment["dependencies"]
