"""`make lab` installs only the lab extras with pip's progress and turns JupyterLab's news off;
`make test` adds the dev extras; the licence is an SPDX string (PEP 639)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jupyterlab
import pytest
from jupyterlab_server.settings_utils import get_settings

ROOT = Path(__file__).resolve().parents[1]
NOTIFICATION = "@jupyterlab/apputils-extension:notification"


def _dry_run(target: str, venv: Path) -> str:
    if shutil.which("make") is None:
        pytest.fail("make is needed to check the Makefile (apt-get install make)")
    out = subprocess.run(["make", "-n", "-B", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_lab_installs_only_the_lab_extras_and_shows_pips_progress(tmp_path):
    commands = _dry_run("lab", tmp_path / "venv")
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert any('-e ".[lab]"' in line for line in installs), installs
    assert not any("dev" in line or "--quiet" in line or " -q" in line for line in installs), installs
    assert "jupyter lab" in commands


def test_make_test_adds_the_dev_extras(tmp_path):
    assert '-e ".[lab,dev]"' in _dry_run("test", tmp_path / "venv")


def test_make_lab_turns_jupyterlab_news_and_update_checks_off(tmp_path):
    commands = _dry_run("lab", tmp_path / "venv")
    written = re.search(r"printf '(.+?)\\n' > (\S+)", commands)
    assert written and written.group(2) == f"{tmp_path / 'venv'}/share/jupyter/lab/settings/overrides.json"
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir()
    (settings_dir / "overrides.json").write_text(written.group(1))
    schemas = str(Path(jupyterlab.__file__).parent / "schemas")
    result, _ = get_settings(str(settings_dir), schemas, str(tmp_path / "user"), schema_name=NOTIFICATION)
    properties = result["schema"]["properties"]
    assert properties["fetchNews"]["default"] == "false" and properties["checkForUpdates"]["default"] is False
    assert json.loads(written.group(1))  # valid JSON


def test_the_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in project["build-system"]["requires"])


def test_make_test_runs_the_notebooks_once(tmp_path):
    """In JupyterLab (tests/notebooks/test_run_all_in_lab.py) where Chromium is installed, else through nbmake."""
    command = [line for line in _dry_run("test", tmp_path / "venv").splitlines() if "-m pytest" in line]
    assert len(command) == 1 and " tests " in command[0], command
    assert ("--nbmake notebooks" in command[0]) != Path("/usr/bin/chromium").exists(), command
