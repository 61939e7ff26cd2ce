"""Every example in a docstring of the package runs and prints what it says (doctest), so the
examples the documentation site shows stay true."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import carlskit

MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(carlskit.__path__, "carlskit.")
                 if not name.endswith("__main__") and name != "carlskit.lopt.train_pretrained")


def test_the_package_has_docstring_examples():
    finder = doctest.DocTestFinder()
    examples = sum(len(test.examples) for name in MODULES for test in finder.find(importlib.import_module(name)))
    assert examples >= 4, "keep a few runnable examples in the docstrings"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed (see above)"
