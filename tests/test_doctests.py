"""Every worked example in a docstring is run: a doctest that nobody runs can drift from the code it explains."""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import eval as eval_package
import hf_specdec


def _modules(package) -> dict[str, str]:
    """Every module under ``package``: its name -> its source text (read, not imported)."""
    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        found[info.name] = Path(info.module_finder.find_spec(info.name).origin).read_text()
    return found


SOURCES = _modules(hf_specdec) | _modules(eval_package)
WITH_EXAMPLES = sorted(name for name, source in SOURCES.items() if ">>>" in source)


def test_the_walk_finds_the_modules_with_examples():
    assert {"hf_specdec.layout", "hf_specdec.ngram_pool", "hf_specdec.round", "eval.interleave"} <= set(
        WITH_EXAMPLES)


def test_the_modules_left_out_have_no_examples():
    """A module is left out only because its source has no ``>>>``; doctest agrees that it has no examples."""
    finder = doctest.DocTestFinder()
    for name in sorted(set(SOURCES) - set(WITH_EXAMPLES)):
        assert not any(test.examples for test in finder.find(importlib.import_module(name))), name


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has '>>>' in its source but doctest found no example in it"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (run pytest " \
                               f"--doctest-modules on it to see which)"
