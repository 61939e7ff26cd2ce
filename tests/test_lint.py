"""The package, tests and benchmarks pass the lint configuration in pyproject.toml
(ruff: pyflakes, import order, line length 120)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_no_unused_or_undefined_names():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is in the dev extra: make test installs it"
    out = subprocess.run([ruff, "check", "carlskit", "tests", "benchmarks"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
