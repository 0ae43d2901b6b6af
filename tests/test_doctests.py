"""Every worked example in a docstring is run: a doctest that nobody runs can drift from the code it explains."""

import doctest
import importlib
import pkgutil

import pytest

import eval as eval_package
import hf_specdec


def _modules(package) -> list[str]:
    return [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


MODULES = _modules(hf_specdec) + _modules(eval_package)


def test_the_walk_finds_the_modules_with_examples():
    assert {"hf_specdec.layout", "hf_specdec.drafters.ngram_pool", "hf_specdec.round", "eval.interleave"} <= set(
        MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (run pytest " \
                               f"--doctest-modules on it to see which)"
