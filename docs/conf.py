"""Sphinx configuration of carlskit's documentation site (``make docs``; see docs/guide/development.md).

Sphinx + MyST (Markdown pages, the README's dialect) + myst-nb (the tutorial notebooks, rendered
from the executed copies ``make test`` writes to ``notebooks/executed/``, never re-run here) + furo.
Generated at build time, never written by hand: one API page per subpackage (every name in its
``__all__``, from the docstrings) and the notebook copies. A public name without a docstring is a
warning, and the build runs with warnings as errors.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import carlskit  # noqa: E402

project = "carlskit"
author = "The carlskit authors"
release = version = carlskit.__version__
copyright = "2026, The carlskit authors"  # noqa: A001 (Sphinx's name)

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # rendered from the executed copies, never re-run at build time
# Widgets have no live kernel on a static page: their HTML fallback (a PNG of the last frame) is shown.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_ipywidgets_js = {}  # so no page loads the widget manager from a CDN: the site works offline
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_use_ivar = True  # "Attributes:" of a dataclass as fields, not a second description of each
napoleon_custom_sections = [("Options", "params_style")]  # KnowledgeBank.create_table's table options
html_theme = "furo"
html_title = f"carlskit {release}"
exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints"]
suppress_warnings = ["myst.xref_missing", "mystnb.unknown_mime_type"]

SUBPACKAGES = list(carlskit._SUBPACKAGES)
NOTEBOOKS = ROOT / "notebooks"


def public_names(module_name: str) -> list[str]:
    """The names a subpackage documents: its ``__all__`` (the paradigms package: its modules)."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = sorted(path.stem for path in Path(module.__file__).parent.glob("[!_]*.py"))
    return list(names)


def _defining_module(package: str, name: str) -> str:
    """The private module of ``package`` whose source documents constant ``name`` (a ``#:`` comment
    or a docstring after it), so autodoc shows that text, not the docstring of the value's type."""
    from sphinx.pycode import ModuleAnalyzer

    for path in sorted(Path(importlib.import_module(package).__file__).parent.glob("_*.py")):
        module = f"{package}.{path.stem}"
        try:
            documented = ModuleAnalyzer.for_module(module).find_attr_docs()
        except Exception:  # noqa: BLE001 (a module the analyzer cannot read documents nothing)
            continue
        if ("", name) in documented:
            return module
    from sphinx.util import logging

    logging.getLogger(__name__).warning(f"{package}.{name}: public constant without a #: doc comment")
    return package


def _write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def write_api_pages(app) -> None:
    pages = []
    for subpackage in SUBPACKAGES:
        module_name = f"carlskit.{subpackage}"
        module = importlib.import_module(module_name)
        lines = [f"# `{module_name}`", "", "```{eval-rst}", f".. automodule:: {module_name}",
                 "   :no-members:", "```", ""]
        for name in public_names(module_name):
            target = getattr(module, name, None)
            if inspect.ismodule(target) or target is None:
                lines += [f"## `{module_name}.{name}`", "", "```{eval-rst}",
                          f".. automodule:: {module_name}.{name}", "   :members:", "```", ""]
                continue
            kind = "autoclass" if inspect.isclass(target) else "autofunction" if callable(target) else "autodata"
            where = module_name if kind != "autodata" else _defining_module(module_name, name)
            lines += [f"## `{name}`", "", "```{eval-rst}", f".. {kind}:: {where}.{name}"]
            if kind == "autodata":
                lines += ["   :no-value:"]
            if kind == "autoclass":
                lines += ["   :members:"]
            lines += ["```", ""]
        _write_if_changed(DOCS / "api" / f"{subpackage}.md", "\n".join(lines))
        pages.append(f"api/{subpackage}")
    _write_if_changed(DOCS / "api" / "index.md", "\n".join(
        ["# API reference", "", "One page per subpackage, every public name (`__all__`) from its docstring.", "",
         "```{toctree}", ":maxdepth: 1", "", *[page.split("/", 1)[1] for page in pages], "```", ""]))


def source_cells(path: Path) -> list[tuple[str, str]]:
    """A notebook's cells as (type, source): what a run of it does not change."""
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    return [(cell.get("cell_type", ""), "".join(cell.get("source", ""))) for cell in cells]


def chosen_copy(source: Path) -> Path:
    """The executed copy of ``source`` if it ran exactly these cells, else ``source`` itself.

    Compared by content, not modification time: JupyterLab's save hook writes the executed copy a
    few milliseconds *before* the stripped notebook (tools/jupyter_server_config.py), so an mtime
    rule showed every tutorial without outputs after a lab run (issue 44)."""
    executed = NOTEBOOKS / "executed" / source.name
    if executed.is_file():
        try:
            if source_cells(executed) == source_cells(source):
                return executed
        except (ValueError, OSError):  # a copy being written or broken: the source is shown
            pass
    return source


def copy_notebooks(app) -> None:
    """The executed copy of each tutorial where ``make test`` (or the lab) left one of its current
    cells, else the source itself (then the page has no outputs and the build says so)."""
    target = DOCS / "notebooks"
    target.mkdir(exist_ok=True)
    names = []
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        chosen = chosen_copy(source)
        if chosen is source:
            from sphinx.util import logging

            logging.getLogger(__name__).info(f"{source.name}: no executed copy of its current cells; "
                                             f"shown without outputs")
        destination = target / source.name
        if not destination.is_file() or destination.read_bytes() != chosen.read_bytes():
            shutil.copyfile(chosen, destination)
        names.append(source.stem)
    for stale in target.glob("*.ipynb"):
        if stale.stem not in names:
            stale.unlink()
    _write_if_changed(target / "index.md", "\n".join(
        ["# Tutorials", "", "The notebooks in `notebooks/`, as the last `make test` ran them (small sizes).", "",
         "```{toctree}", ":maxdepth: 1", "", *names, "```", ""]))


_LITERAL = re.compile(r"(``.*?``)")


def _plain_pipes(line: str) -> str:
    """carlskit's docstrings write norms as |x| (plain text, read in an editor first): outside
    ``literals`` those pipes are escaped, so reStructuredText does not take them for substitutions."""
    return "".join(part if part.startswith("``") else part.replace("|", "\\|") for part in _LITERAL.split(line))


def check_docstrings(app, what, name, obj, options, lines) -> None:
    """A public name without a docstring is a warning (and the build treats warnings as errors)."""
    if name.startswith("carlskit.") and not "".join(lines).strip() and what in ("class", "function", "module"):
        from sphinx.util import logging

        logging.getLogger(__name__).warning(f"{name}: public {what} without a docstring")
    lines[:] = [_plain_pipes(line) for line in lines]


def skip_imported(app, what, name, obj, skip, options):
    """A module's members are what it defines: names it imports (``Callable``, ...) are not documented."""
    module = getattr(obj, "__module__", None)
    if what == "module" and isinstance(module, str) and not module.startswith("carlskit"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", skip_imported)
    app.connect("builder-inited", write_api_pages)
    app.connect("builder-inited", copy_notebooks)
    app.connect("autodoc-process-docstring", check_docstrings)
