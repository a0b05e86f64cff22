"""Checks on the repository itself, as a newcomer meets it on a fresh machine.

- **No path of a developer's machine** in any tracked file (docs, benchmarks, tests, recorded
  results, skip messages): a command or a note that names ``/work/...``, ``/home/<user>/...``,
  ``/root/...``, ``/Users/...`` or a session's ``/tmp/...`` works on one machine only. Write
  paths relative to the checkout (``PYTHONPATH=.``), ``~/...`` for a user's own place, or a
  ``$(mktemp -d)``.
- **A test module that needs vLLM skips without it**: a module-level import of ``vllm``,
  ``kvforge.integrations.vllm`` (its package imports vLLM) or the vLLM harness comes after a
  module-level ``pytest.importorskip("vllm")``, so the README's test command collects on a
  machine with only the ``test`` extra.
- **The default test run is the fast one, and CI runs everything**: ``soak`` and ``slow`` are
  registered markers, ``python -m pytest`` deselects them (``addopts``), and ``.ci/run`` runs
  them too under coverage.

Each check has a self-test on a tiny input, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]

#: Top-level folders that only ever exist on some developer's (or some session's) machine.
MACHINE_ROOTS = ("work", "home", "root", "Users", "tmp", "scratch")
#: An absolute path starting at one of them, not part of a longer path (``pkg/tmp/x`` is not
#: one) nor home-relative (``~/x``).
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:" + "|".join(MACHINE_ROOTS) + r")/[\w.$-]")


def machine_paths(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` that names a machine's path."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if MACHINE_PATH.search(line)
    ]


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an installed copy): nothing tracked to scan")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name]


def test_no_tracked_file_names_a_path_of_a_developers_machine():
    found = []
    for path in tracked_files():
        if path.is_symlink() or not path.is_file() or path == Path(__file__).resolve():
            continue  # a symlink's target is scanned as itself; this file's examples are bait
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}:{n}: {line}" for n, line in machine_paths(text)]
    assert not found, "paths of a developer's machine:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("PYTHONPATH=/work/main python x.py", True),
        ("vLLM runs in ``/work/.venv-vllm``", True),
        ("see /home/alice/kvforge/README.md", True),
        ('"machine": "VM (/root/.cache/x)"', True),
        ("cd /tmp/kvf2 && ls", True),
        ("--json /tmp/tb/run1.json", True),
        ("open /Users/bob/x", True),
        ("PYTHONPATH=. ~/.venv-vllm/bin/python benchmarks/bench_step.py", False),
        ('snap=$(mktemp -d) && cd "$snap"', False),
        ("site-packages/tmp/x and vllm/work/y", False),
        ("apt-get install redis-server (/usr/bin/redis-server)", False),
        ("a ratio 3/4 of /proc/meminfo", False),
    ],
)
def test_the_path_checker_sees_a_machine_path(line: str, named: bool):
    assert bool(machine_paths(f"first line\n{line}\n")) is named
    if named:
        assert machine_paths(f"first line\n{line}\n")[0][0] == 2


def _pytest_options() -> dict:
    if tomllib is None:  # pragma: no cover - Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


#: Module-level imports that need vLLM installed: vLLM itself, kvforge's integration (its
#: package imports the connector, which imports vLLM) and the harness around vLLM's Scheduler.
NEEDS_VLLM = ("vllm", "kvforge.integrations.vllm", "vllm_harness")


def _needs_vllm(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return False
    return any(n == root or n.startswith(root + ".") for n in names for root in NEEDS_VLLM)


def _skips_without_vllm(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, (ast.Expr, ast.Assign)) else None
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "importorskip"
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == "vllm"
    )


def unguarded_vllm_imports(source: str) -> list[int]:
    """Line numbers of the module-level imports that need vLLM and come before any
    module-level ``pytest.importorskip("vllm")``: a machine without vLLM fails to collect
    the module instead of skipping it."""
    lines = []
    for node in ast.parse(source).body:
        if _skips_without_vllm(node):
            break
        if _needs_vllm(node):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("from kvforge.integrations.vllm.config import parse_options\n", [1]),
        ("import vllm\nimport pytest\n", [1]),
        ("from vllm_harness import build\n", [1]),
        ('import pytest\npytest.importorskip("vllm")\nfrom vllm.config import X\n', []),
        ('import pytest\nvllm = pytest.importorskip("vllm", reason="r")\nimport vllm.v1\n', []),
        ('import pytest\npytest.importorskip("redis")\nfrom vllm import Y\n', [3]),
        ("from kvforge.integrations import vllm_like\nfrom vllm_baseline import v\n", []),
    ],
)
def test_the_vllm_import_checker(source: str, lines: list[int]):
    assert unguarded_vllm_imports(source) == lines


def test_every_test_module_that_needs_vllm_skips_without_it():
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (lines := unguarded_vllm_imports(path.read_text()))
    }
    assert offenders == {}, (
        "these modules import vLLM (or kvforge.integrations.vllm) before "
        f'pytest.importorskip("vllm"): {offenders}'
    )


@pytest.mark.parametrize("marker", ["soak", "slow"])
def test_the_long_markers_are_registered_and_deselected_by_default(marker: str):
    options = _pytest_options()
    assert any(m.split(":")[0].strip() == marker for m in options["markers"])
    assert '-m "not soak and not slow"' in options["addopts"]
    assert "--strict-markers" in options["addopts"]


def test_ci_runs_the_soaks_too_under_coverage():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [line for line in lines if line.startswith("coverage run") and "pytest" in line]
    assert runs, "CI runs no pytest under coverage"
    # `-m ""` replaces the default `-m "not soak"`: every test, the soaks included
    assert all('-m ""' in line for line in runs), runs


def test_the_readme_names_both_test_commands():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest\n" in readme
    assert 'python -m pytest -m ""' in readme


# (hidden: what this machine lacks, the reason's fragment): the optional remote-tier tests
# skip with it on a fresh machine (tests/_optional.py), instead of failing there
MISSING = [
    ({"module:mooncake"}, "the mooncake client is not installed"),
    ({"library:ibverbs"}, "Mooncake's client needs libibverbs"),
    ({"binary:mooncake_master"}, "mooncake_master is not installed"),
    ({"module:mooncake", "library:ibverbs"}, "the mooncake client is not installed"),
    (set(), None),
]


@pytest.mark.parametrize(("hidden", "fragment"), MISSING)
def test_the_mooncake_tests_skip_naming_what_is_missing(monkeypatch, hidden, fragment):
    import ctypes.util
    import importlib.machinery
    import importlib.util

    import _optional

    def find_spec(name, package=None):
        if f"module:{name}" in hidden:
            return None
        return importlib.machinery.ModuleSpec(name, None)  # installed, whatever this machine has

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(
        ctypes.util, "find_library", lambda n: None if f"library:{n}" in hidden else f"lib{n}.so"
    )
    monkeypatch.setattr(
        shutil, "which", lambda n: None if f"binary:{n}" in hidden else f"/usr/bin/{n}"
    )
    why = _optional.mooncake_missing()
    if fragment is None:
        assert why is None
    else:
        assert fragment in why


@pytest.mark.parametrize(
    ("hidden", "fragment"),
    [("module:redis", "the redis client is not installed"), ("binary:redis-server", "redis-server is not installed"), ("", None)],
)  # fmt: skip
def test_the_redis_tests_skip_naming_what_is_missing(monkeypatch, hidden, fragment):
    import importlib.machinery
    import importlib.util

    import _optional

    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, p=None: (
            None if f"module:{n}" == hidden else importlib.machinery.ModuleSpec(n, None)
        ),
    )
    monkeypatch.setattr(shutil, "which", lambda n: None if f"binary:{n}" == hidden else f"/x/{n}")
    why = _optional.redis_missing()
    assert (why is None) if fragment is None else (fragment in why)
