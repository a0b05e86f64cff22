"""The runnable examples run as tests, so they cannot rot."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_backend_example():
    result = load("custom_backend").main()
    assert "key_summary_caches_2_rank0.device0" in result["names"]
    assert result["names"].index("key_summary_caches_0_rank0.device0") == 2
    # 100 tokens * 8 roles (k, v, summary on layers 0 and 2; k, v on layer 1)
    assert result["written"] == result["verified"] == 100 * 8
    assert result["mismatched"] == 0
    # 7 blocks of 16 tokens; per block: 2 * 3 layers * (16*4*64*2) + 2 * (16*4*4)
    assert result["bytes_moved"] == 7 * (2 * 3 * 16 * 4 * 64 * 2 + 2 * 16 * 4 * 4)


def test_engine_wiring_example():
    counters = load("engine_wiring").main()
    assert counters["preemptions"] >= 1 and counters["resumes"] >= 1
    assert counters["verified"] > 0 and counters["mismatched"] == 0


def test_readme_usage_snippet_runs():
    import re

    readme = (EXAMPLES.parent / "README.md").read_text()
    # the usage snippet runs here; the tiers snippet needs a Redis server (its calls run for
    # real in tests/store/test_remote_tier.py), so it is compiled only
    snippet, tiers = re.findall(r"```python\n(.*?)```", readme, re.S)
    compile(tiers, "README.md", "exec")
    assert "initialize_remote_tier" in tiers and "initialize_host_tier" in tiers
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["ctl"].closed
    # req-0 took blocks 1..7 of 16 tokens in the batched step (req-1 took 8..11), and its
    # 101st token still fits in block 7: slots 16 .. 116
    assert namespace["slots"].tolist() == list(range(16, 16 + 101))


def test_adding_a_backend_snippets_run_in_order():
    import re

    doc = (EXAMPLES.parent / "docs" / "adding_a_backend.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert snippets
    namespace: dict = {}
    for i, snippet in enumerate(snippets):
        exec(compile(snippet, f"adding_a_backend.md#{i}", "exec"), namespace)
