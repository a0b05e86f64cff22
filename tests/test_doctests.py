"""Every worked example in a kvforge docstring runs and shows what the code computes.

Docstrings carry the arithmetic next to the formula (block counts, pool sizes, slot
positions); an example that drifts from the code misleads exactly the reader it was written
for, so each module's doctests run here like any other test.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import kvforge


def _importable(name: str) -> bool:
    """The vLLM integration imports vLLM: its doctests run where vLLM is installed (CI installs
    it); elsewhere its modules are left out, the reason being that import."""
    if not name.startswith("kvforge.integrations.vllm"):
        return True
    return importlib.util.find_spec("vllm") is not None


MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(kvforge.__path__, "kvforge.", onerror=lambda _: None)
    if _importable(m.name)
)


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(module) if t.examples]


WITH_EXAMPLES = [name for name in MODULES if _examples(name)]


def test_the_docstrings_carry_worked_examples() -> None:
    # the modules whose arithmetic the guide asks to show at the formula
    for name in (
        "kvforge.kinds",
        "kvforge.scheduler.tables",
        "kvforge.core.memory_plan",
        "kvforge.core.prefix_keys",
    ):
        assert name in WITH_EXAMPLES, name


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_doctests(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in _examples(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
