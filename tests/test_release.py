"""A release installs: ``python -m build`` makes an sdist and a wheel from the checkout, and the wheel,
installed into a fresh virtual environment, works from there and not from the checkout.

The fresh environment has no pip packages of its own: a ``.pth`` file puts this environment's
site-packages on its path, so carlskit's dependencies (jax, dask, ...) need no download, while the
checkout's editable install is not seen (a path listed in a ``.pth`` file is added to ``sys.path``,
its own ``.pth`` files, the editable finder's among them, are not run). Run from a scratch directory
with ``HOME`` there too, so neither the checkout nor a user cache can supply what the wheel lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

import carlskit

ROOT = Path(__file__).resolve().parents[1]

INSTALLED_CHECK = r'''
import importlib, pathlib, sys
import carlskit
here = pathlib.Path(carlskit.__file__).resolve()
assert pathlib.Path(sys.prefix).resolve() in here.parents, f"carlskit imported from {here}, not the fresh venv"
for name in sys.argv[1].split(","):
    importlib.import_module(name)
from carlskit.data import load_planetoid, planetoid_path
cora = load_planetoid("cora")
assert cora.num_items == 2708 and pathlib.Path(sys.prefix).resolve() in planetoid_path("cora").resolve().parents
from carlskit.lopt import LearnedOptimizer
optimizer = LearnedOptimizer.pretrained()
print("installed ok", carlskit.__version__, type(optimizer).__name__)
'''


def _packages_on_disk() -> set[str]:
    return {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "carlskit").rglob("__init__.py")}


def test_every_package_is_listed_for_the_build():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    code = {name for name in listed if not name.startswith("carlskit._shipped_data")}
    assert code == _packages_on_disk(), "add new subpackages to pyproject.toml"
    data = {name for name in listed if name.startswith("carlskit._shipped_data.")}
    folders = {f"carlskit._shipped_data.{path.name}" for path in (ROOT / "data").iterdir() if path.is_dir()}
    assert data == folders, "every folder of data/ is a package of its own (else setuptools warns it is absent)"


def test_every_command_line_has_a_console_script_that_resolves():
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), f"{name} = {target!r}"
    programs = {path.stem for path in (ROOT / "carlskit" / "paradigms").glob("[!_]*.py")
                if 'if __name__ == "__main__"' in path.read_text(encoding="utf-8")}
    assert {f"carlskit-{program.replace('_', '-')}" for program in programs} <= set(scripts), sorted(scripts)


def test_the_changelog_names_the_version():
    entries = [line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")]
    assert entries and entries[0].startswith(f"## {carlskit.__version__} "), entries[:1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``python -m build`` of the checkout: (its output, the dist folder)."""
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return build.stdout + build.stderr, dist


def test_the_build_warns_nothing_about_packages_and_the_wheel_holds_no_raw_data(built):
    output, dist = built
    warned = [line for line in output.splitlines() if "absent from the" in line or "would be ignored" in line]
    assert not warned, warned  # setuptools' "Package 'carlskit._shipped_data.planetoid' is absent from ..."
    with zipfile.ZipFile(dist / f"carlskit-{carlskit.__version__}-py3-none-any.whl") as archive:
        raw = [name for name in archive.namelist() if "/raw/" in name]
    assert not raw, f"the raw Planetoid files stay in the sdist: {raw[:3]}"


def test_the_wheel_installs_into_a_fresh_environment_and_runs_from_there(built, tmp_path):
    _, dist = built
    version = carlskit.__version__
    wheel = dist / f"carlskit-{version}-py3-none-any.whl"
    sdist = dist / f"carlskit-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"carlskit-{version}.dist-info/METADATA").decode()
    for shipped in ("carlskit/_shipped_data/planetoid/cora.npz", "carlskit/_shipped_data/planetoid/citeseer.npz",
                    "carlskit/_shipped_data/planetoid/LICENSE", "carlskit/lopt/pretrained_mlp_lopt.npz",
                    "carlskit/py.typed"):
        assert shipped in names, shipped
    assert not any(name.startswith(("tests/", "notebooks/", "benchmarks/")) for name in names)
    assert f"Version: {version}" in metadata and "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for shipped in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "data/planetoid/cora.npz",
                    "data/planetoid/raw/ind.cora.x"):
        assert shipped in members, shipped

    fresh = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(purelib, "carlskit_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "CARLSKIT_DATA", "CARLSKIT_PLANETOID_DIR", "XDG_CACHE_HOME")}
    env["HOME"] = str(scratch)
    subpackages = ",".join(sorted(_packages_on_disk()))
    check = subprocess.run([str(python), "-c", INSTALLED_CHECK, subpackages], cwd=scratch, env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "installed ok" in check.stdout, check.stdout[-3000:] + check.stderr[-3000:]
    cli = subprocess.run([str(python), "-m", "carlskit.paradigms.graph_reg", "--help"], cwd=scratch, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "usage" in cli.stdout.lower(), cli.stdout[-2000:] + cli.stderr[-2000:]
    # the console script runs in its environment with no activation (its bin/ is not on PATH here)
    script = subprocess.run([str(fresh / "bin" / "carlskit-graph-reg"), "--help"], cwd=scratch, env=env,
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == 0 and "usage: carlskit-graph-reg" in script.stdout, script.stderr[-2000:]
