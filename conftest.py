"""Repository-wide pytest set-up, loaded for `pytest tests` and `pytest --nbmake notebooks` alike.

Notebook kernels started by nbmake inherit ``$IPYTHONDIR``: point it at a fresh folder whose startup
file installs ``tests/notebook_tables.py``'s check on every table a notebook displays.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_TESTS = Path(__file__).resolve().parent / "tests"
_IPYTHON = Path(tempfile.mkdtemp(prefix="carlskit-ipython-"))
atexit.register(shutil.rmtree, _IPYTHON, ignore_errors=True)
(_IPYTHON / "profile_default" / "startup").mkdir(parents=True)
(_IPYTHON / "profile_default" / "startup" / "00-carlskit-table-check.py").write_text(
    "import sys\n"
    f"sys.path.insert(0, {str(_TESTS)!r})\n"
    "import notebook_tables\n"
    "notebook_tables.install(get_ipython())\n"
    f"sys.path.remove({str(_TESTS)!r})\n"
)
os.environ["IPYTHONDIR"] = str(_IPYTHON)
