"""House rules one level below the import graph (``tests/test_architecture.py``).

- **No module reads another module's private attributes.** ``x._name`` is allowed only where
  ``x`` is ``self`` / ``cls`` / ``super()``, or where ``_name`` is defined in the same module
  (another instance of a class of this module, as in ``__eq__``). ``from m import _name`` and
  ``getattr(x, "_name")`` across modules count too. Modules of one package are still separate
  modules: a friend reaching into ``manager._lock`` hides a seam that should be declared.
- **Functions stay short.** A function counts from its ``def`` line to its last line; above
  :data:`MAX_FUNCTION_LINES` it needs a ``# long function:`` comment with its reason on the
  line above the ``def`` (or its first decorator), and at most :data:`MAX_LONG_FUNCTIONS`
  functions may have one.
- **``ruff format`` is the layout** of ``kvforge``, ``tests``, ``examples`` and ``benchmarks``.

Each rule has a self-test on a tiny source so the checker cannot pass vacuously.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvforge

PACKAGE = Path(kvforge.__file__).parent
ROOT = PACKAGE.parent
MAX_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 5
LONG_MARK = "# long function:"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.AST) -> set[str]:
    """Every name the module itself defines or binds: functions, classes, attributes it
    assigns (``self._x = ...``), module and local names, and names it imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__slots__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return names


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return True
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def private_reads(source: str, module: str) -> list[str]:
    """Every read of another module's private name in ``source``, as ``module:line: text``."""
    tree = ast.parse(source)
    own = _defined_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not _is_self(node.value) and node.attr not in own:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            found += [
                f"{module}:{node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if _private(alias.name)
            ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
        ):
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def long_functions(source: str, module: str) -> tuple[list[str], list[str]]:
    """(functions over the limit without a reason, functions over it with one)."""
    lines = source.splitlines()
    bare: list[str] = []
    marked: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2].strip() if first >= 2 else ""
        row = f"{module}:{node.lineno}: {node.name} ({length} lines)"
        (marked if above.startswith(LONG_MARK) else bare).append(row)
    return bare, marked


def _modules() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(ROOT)), path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))
    ]


def test_no_module_reads_another_modules_private_attributes():
    found = [row for module, source in _modules() for row in private_reads(source, module)]
    assert found == []


@pytest.mark.parametrize(
    ("source", "count"),
    [
        ("def f(m):\n    return m._lock\n", 1),
        ("from kvforge.core.memory_plan import _largest\n", 1),
        ("def f(m):\n    return getattr(m, '_prefix')\n", 1),
        (
            "class A:\n    def __init__(self):\n        self._x = 1\n    def f(self, o):\n"
            "        return self._x == o._x\n",
            0,
        ),
        ("class A:\n    def f(self):\n        return super()._g()\n", 0),
    ],
)
def test_the_private_read_checker_sees_a_read(source: str, count: int):
    assert len(private_reads(source, "m")) == count


def test_functions_stay_short_with_at_most_five_stated_exceptions():
    bare: list[str] = []
    marked: list[str] = []
    for module, source in _modules():
        b, m = long_functions(source, module)
        bare += b
        marked += m
    assert bare == []
    assert len(marked) <= MAX_LONG_FUNCTIONS, marked


def test_the_length_checker_counts_from_def_to_the_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    assert long_functions(f"def f():\n{body}", "m") == ([], [])
    longer = f"def f():\n{body}    y = 0\n"
    assert long_functions(longer, "m") == ([f"m:1: f ({MAX_FUNCTION_LINES + 1} lines)"], [])
    assert long_functions(f"{LONG_MARK} a reason\n{longer}", "m")[0] == []


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    return [exe]


def test_ruff_format_is_the_layout():
    result = subprocess.run(
        [*_ruff(), "format", "--check", "kvforge", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
