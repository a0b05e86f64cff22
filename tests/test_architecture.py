"""The module graph: layers only import downwards, there are no circles, and the scheduler
side loads no backend, worker module or kernel and allocates no tensor.

Every import counts, wherever it is written: module level, inside ``if`` / ``try`` blocks
(``TYPE_CHECKING`` too: a type-only circle is still a circle in the design), inside functions
(imports deferred to first use), and ``importlib.import_module`` / ``__import__`` calls whose
module name is a literal string. Exempt, because no literal names the module: a plugin
imported by a name the user gives (``kvforge.models.plugins``), ``kvforge._lazy`` (which
resolves the literal names of each package's ``_EXPORTS`` table: those tables are read as
imports of the package that declares them), and ``kvforge.ops`` loading its own kernel
submodules by an f-string of ``__name__``.

The layers, bottom to top (a module may import its own layer or any layer below)::

    contract     kvforge._lazy, _checks, errors, kinds, platform, specs, attn_backends, ops
    core         kvforge.core
    sides        kvforge.scheduler | kvforge.worker | kvforge.models | kvforge.store
                 (never each other)
    facade       kvforge.controller, kvforge.options, kvforge.remote_tier
    integrations kvforge.integrations (engine plug-ins: they import their engine)
    tools        kvforge.verify, kvforge.testing
    cli          kvforge.cli
    package      kvforge (its lazy exports name every layer)
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvforge

PACKAGE = Path(kvforge.__file__).parent

LAYERS = [
    (
        "contract",
        (
            "kvforge._lazy",
            "kvforge._checks",
            "kvforge.errors",
            "kvforge.kinds",
            "kvforge.platform",
            "kvforge.specs",
            "kvforge.attn_backends",
            "kvforge.ops",
        ),
    ),
    ("core", ("kvforge.core",)),
    ("sides", ("kvforge.scheduler", "kvforge.worker", "kvforge.models", "kvforge.store")),
    ("facade", ("kvforge.controller", "kvforge.options", "kvforge.remote_tier")),
    ("integrations", ("kvforge.integrations",)),
    ("tools", ("kvforge.verify", "kvforge.testing")),
    ("cli", ("kvforge.cli",)),
]
#: siblings on one floor that must not import each other
APART = ("kvforge.scheduler", "kvforge.worker", "kvforge.models", "kvforge.store")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _literal_import(node: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("x")`` / ``__import__("x")`` names."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def imports_of(path: Path) -> set[str]:
    """Every kvforge module ``path`` imports, at any depth, plus literal ``import_module``
    strings and the module names of an ``_EXPORTS`` table."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvforge"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvforge"):
            names = False  # ``from kvforge import ops`` imports the submodule, not a name
            for alias in node.names:
                base = PACKAGE.parent / node.module.replace(".", "/") / alias.name
                if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
                    found.add(f"{node.module}.{alias.name}")
                else:
                    names = True
            if names:
                found.add(node.module)
        elif isinstance(node, ast.Call):
            literal = _literal_import(node)
            if literal and literal.startswith("kvforge"):
                found.add(literal)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(getattr(t, "id", None) == "_EXPORTS" for t in targets) and isinstance(
                node.value, ast.Dict
            ):
                found.update(
                    v.value
                    for v in node.value.values
                    if isinstance(v, ast.Constant) and str(v.value).startswith("kvforge")
                )
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path) & set(modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    assert module == "kvforge", f"{module} belongs to no layer: add it to LAYERS"
    return len(LAYERS)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_imports_form_no_cycle():
    graph = import_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_import_points_down_the_layers():
    graph = import_graph()
    upward = sorted(
        (
            src,
            dst,
            LAYERS[layer_of(src)][0],
            LAYERS[layer_of(dst)][0] if dst != "kvforge" else "package",
        )
        for src, dsts in graph.items()
        for dst in dsts
        if layer_of(dst) > layer_of(src)
    )
    assert upward == []


def test_the_two_sides_and_models_never_import_each_other():
    graph = import_graph()
    crossing = sorted(
        (src, dst)
        for src, dsts in graph.items()
        for dst in dsts
        for a in APART
        for b in APART
        if a != b
        and (src == a or src.startswith(a + "."))
        and (dst == b or dst.startswith(b + "."))
    )
    assert crossing == []


def test_core_imports_neither_side_and_no_kernel():
    graph = import_graph()
    for module, dsts in graph.items():
        if module.startswith("kvforge.core"):
            assert not {
                d
                for d in dsts
                if d.startswith(("kvforge.scheduler", "kvforge.worker", "kvforge.ops"))
            }, module


def test_the_scheduler_side_names_no_tensor():
    # "allocates no tensor": no scheduler module imports torch or names it
    for path in (PACKAGE / "scheduler").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        imported = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])
        }
        assert "torch" not in names and "torch" not in imported, path.name


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("def f():\n    from kvforge.worker import storage\n", {"kvforge.worker.storage"}),
        ("from kvforge.worker import CacheStorage\n", {"kvforge.worker"}),
        ("import importlib\nimportlib.import_module('kvforge.cli.main')\n", {"kvforge.cli.main"}),
        ("__import__('kvforge.controller')\n", {"kvforge.controller"}),
        ("import importlib\nimportlib.import_module(name)\n", set()),  # a user's plugin name
        ("_EXPORTS = {'X': 'kvforge.worker.storage'}\n", {"kvforge.worker.storage"}),
    ],
)
def test_the_reader_sees_lazy_imports(tmp_path: Path, source: str, found: set[str]):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports_of(path) == found


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m for m in out.stdout.split() if m.startswith("kvforge")}


def test_the_scheduler_side_loads_no_backend_worker_or_kernel():
    loaded = loaded_after("import kvforge.scheduler")
    concrete = {
        "kvforge.attn_backends.gqa",
        "kvforge.attn_backends.mla",
        "kvforge.attn_backends.dsa",
        "kvforge.attn_backends.deepseek_v4",
    }
    assert not loaded & concrete
    assert not {
        m
        for m in loaded
        if m.startswith(("kvforge.ops", "kvforge.worker", "kvforge.models", "kvforge.controller"))
    }
    assert "kvforge.scheduler.block_manager" in loaded


def test_the_facade_still_loads_on_first_use():
    loaded = loaded_after("from kvforge import CacheController")
    assert {
        "kvforge.controller",
        "kvforge.worker.storage",
        "kvforge.scheduler.block_manager",
    } <= loaded
