"""The module graph: the contract sits at the bottom, no import circles, and the scheduler
side loads no concrete backend, no host cache and no kernel."""

import ast
import subprocess
import sys
from pathlib import Path

import kvforge

PACKAGE = Path(kvforge.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported: top-level statements and ``if`` blocks
    (``TYPE_CHECKING`` included: a type-only circle is still a circle in the design), not
    imports inside functions, which run on first use."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            stack.extend(node.body + node.orelse + getattr(node, "handlers", []))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvforge"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvforge"):
            found.add(node.module)
            for alias in node.names:  # ``from kvforge.x import submodule``
                if (PACKAGE.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists():
                    found.add(f"{node.module}.{alias.name}")
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: module_level_imports(path) & set(modules) for name, path in modules.items()}


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
    assert len(graph) > 30
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_contract_imports_nothing_from_the_controller_or_host_packages():
    graph = import_graph()
    for bottom in ("kvforge.specs", "kvforge.attn_backends.base", "kvforge.core.layout"):
        assert not {
            m
            for m in graph[bottom]
            if m.startswith(("kvforge.worker", "kvforge.worker", "kvforge.ops"))
            or m == "kvforge.controller"
        }, bottom


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m for m in out.stdout.split() if m.startswith("kvforge")}


def test_the_scheduler_side_loads_no_backend_host_cache_or_kernel():
    loaded = loaded_after("import kvforge.cache_controller")
    concrete = {
        "kvforge.attn_backends.gqa",
        "kvforge.attn_backends.mla",
        "kvforge.attn_backends.dsa",
        "kvforge.attn_backends.deepseek_v4",
        "kvforge.models.hf_config",
    }
    assert not loaded & concrete
    assert not {m for m in loaded if m.startswith(("kvforge.worker", "kvforge.ops", "kvforge.worker"))}
    assert "kvforge.scheduler.block_manager" in loaded


def test_the_facade_still_loads_on_first_use():
    loaded = loaded_after("from kvforge import CacheController")
    assert {"kvforge.controller", "kvforge.worker.storage"} <= loaded
