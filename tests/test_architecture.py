"""Imports show the architecture: a subpackage reaches another only through its public ``__init__``.

Every module of ``carlskit`` is parsed (``ast``, nothing imported) and each import of
``carlskit.<X>._<private>`` (or ``from carlskit.<X> import _<private>``) from outside subpackage
``<X>`` is a failure. The top-level private modules (``carlskit/_checks.py``, ``_errors.py``,
``_serialization.py``...) sit below every subpackage and are shared on purpose.
"""

from __future__ import annotations

import ast
import pathlib

import carlskit

PACKAGE = pathlib.Path(carlskit.__file__).parent
SUBPACKAGES = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}


def subpackage_of(path: pathlib.Path) -> str | None:
    """The subpackage a module file belongs to (``None`` for top-level modules)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def imported_names(tree: ast.AST, path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every module or name imported, relative imports made absolute."""
    package = ["carlskit", *path.relative_to(PACKAGE).parent.parts]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            names += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def private_reaches(source: str, path: pathlib.Path) -> list[str]:
    """The imports in ``source`` (module file ``path``) of another subpackage's private module."""
    home = subpackage_of(path)
    found = []
    for line, name in imported_names(ast.parse(source), path):
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "carlskit" and parts[1] in SUBPACKAGES and parts[1] != home \
                and parts[2].startswith("_") and not parts[2].startswith("__"):
            reach = f"{path.relative_to(PACKAGE.parent)}:{line} imports {'.'.join(parts[:3])}"
            if reach not in found:  # one line per import statement and private module
                found.append(reach)
    return found


def test_no_subpackage_imports_another_subpackages_private_module():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50 and {"bank", "cluster", "lopt", "checkpoints"} <= SUBPACKAGES
    found = [reach for path in modules for reach in private_reaches(path.read_text(encoding="utf-8"), path)]
    assert found == [], "import these through the subpackage's public __init__:\n" + "\n".join(found)


def test_the_walk_catches_every_form_of_private_reach():
    maker = PACKAGE / "makers" / "_maker.py"
    bad = ("from carlskit.cluster._supervised import Backoff\n"
           "import carlskit.training._knowledge\n"
           "from carlskit.bank import _config\n"
           "def f():\n    from carlskit.summaries._writer import SummaryWriter\n")
    assert len(private_reaches(bad, maker)) == 4
    fine = ("from carlskit.cluster import Backoff\nfrom carlskit._checks import integer\n"
            "from carlskit.makers._builtin import EmbeddingMaker\nfrom . import _builtin\n")
    assert private_reaches(fine, maker) == []
    assert private_reaches("from ..cluster import _loss\n", maker) == [
        "carlskit/makers/_maker.py:1 imports carlskit.cluster._loss"]


def test_the_service_owners_stay_about_their_own_concept():
    """Issue 31: ``SummaryWriter`` and ``MetaTraining`` compose the service kit instead of carrying
    its machinery; each class stays under 350 lines (they were 626 and 525)."""
    for module, name in (("summaries/_writer.py", "SummaryWriter"), ("lopt/_meta_training.py", "MetaTraining")):
        tree = ast.parse((PACKAGE / module).read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        assert node.end_lineno - node.lineno + 1 < 350, f"{name} is {node.end_lineno - node.lineno + 1} lines"
