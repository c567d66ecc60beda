"""Every docstring example in the package and every code block in docs/ runs, and prints what it says."""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import lucid_fx
import lucid_fx.passes

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _walk(package) -> list:
    # passes/ is installed as lucid_fx.passes from another folder, so walk it on its own.
    found = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name != "lucid_fx.passes" and not info.name.endswith("__main__"):
            found.append(info.name)
    return found


MODULES = sorted(set(_walk(lucid_fx) + _walk(lucid_fx.passes)))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("name", MODULES)
def test_module_docstring_examples(name):
    module = importlib.import_module(name)
    import torch

    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=FLAGS, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest failure(s) in {name}"


@pytest.mark.parametrize("path", sorted(DOCS.glob("**/*.md")), ids=lambda p: p.name)
def test_docs_code_blocks(path):
    result = doctest.testfile(str(path), module_relative=False, optionflags=FLAGS, verbose=False)
    assert result.failed == 0, f"{result.failed} failing example(s) in {path.name}"
    if "```python" in path.read_text():
        assert result.attempted > 0, f"{path.name} has python blocks but no runnable examples"


def test_walk_finds_the_passes_subpackage():
    assert "lucid_fx.passes" in MODULES
    assert "lucid_fx.quantization.observers" in MODULES
