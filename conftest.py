"""Repository-wide pytest set-up, loaded for `pytest tests` and `pytest --nbmake notebooks` alike.

Notebook kernels started by nbmake inherit ``$IPYTHONDIR``: point it at a fresh folder whose startup
file installs ``tests/notebook_tables.py``'s check on every table a notebook displays.

Every notebook nbmake runs is also kept with its outputs in ``notebooks/executed/`` (git-ignored, the
folder where ``make lab`` keeps the last run), written atomically: the documentation site
(``make docs``) renders the tutorials from those copies instead of running them a second time. A run
whose saved outputs a reader could not see fails: a widget view without a static frame beside it (a
PNG, HTML, or text that is more than the widget's repr), or a warning or anything else a cell
printed to stderr (``tests/notebook_checks.py``, the checks the JupyterLab run applies too).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
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

if str(_TESTS) not in sys.path:  # for `pytest --nbmake notebooks` too
    sys.path.insert(0, str(_TESTS))
from notebook_checks import saved_problems  # noqa: E402


def _keep_executed_copies() -> None:
    try:
        import nbformat
        from nbmake import nb_run
    except ImportError:  # nbmake is a dev extra: without it there is nothing to keep
        return
    if getattr(nb_run.NotebookRun.execute, "keeps_executed_copy", False):
        return
    run_notebook = nb_run.NotebookRun.execute

    def execute(self):
        result = run_notebook(self)
        source = Path(self.filename)
        target = source.parent / "executed" / source.name
        target.parent.mkdir(exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        nbformat.write(result.nb, str(temporary))
        os.replace(temporary, target)
        if result.error is None:
            problems = saved_problems(result.nb)
            assert not problems, f"{source.name}: what its saved copy shows: {problems}"
        return result

    execute.keeps_executed_copy = True
    nb_run.NotebookRun.execute = execute


_keep_executed_copies()
