"""Registry and plugins: bad registrations, the example plugin in-process, by ``--plugin``, and
through its ``kvforge.backends`` entry point in a fresh interpreter.

The example plugin (``examples/plugin``) need not be installed: tests put its directory on
``sys.path`` (and on ``PYTHONPATH`` for subprocesses), and entry-point discovery is checked with
a ``*.dist-info`` written to a temporary directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvforge.attn_backends import GQABackend, MLABackend
from kvforge.cli.main import main
from kvforge.cli.plan_report import read_exact
from kvforge.core.layout import CacheLayout
from kvforge.models import (
    ModelOptions,
    PluginError,
    build_gqa,
    build_qwen,
    from_hf_config,
    load_plugins,
    register_backend,
    register_model_type,
    registered_backends,
    registered_model_types,
)
from kvforge.models import registry as registry_module
from kvforge.models.plugins import load_plugin_module

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "examples" / "plugin"
SAMPLE = PLUGIN_DIR / "kvforge_example_plugin" / "starcoder" / "config.json"

# StarCoder-15B: 40 layers; multi-query: one kv head of 6144 / 48 = 128; bf16 cache
STARCODER_BYTES_PER_TOKEN = 40 * 2 * 1 * 128 * 2


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made by a test vanish with it."""
    monkeypatch.setattr(registry_module, "_model_types", dict(registry_module._model_types))
    monkeypatch.setattr(registry_module, "_backends", dict(registry_module._backends))


@pytest.fixture
def example(isolated_registry, monkeypatch):
    """The example plugin, importable and registered (in this test's registry)."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import kvforge_example_plugin as plugin

    # Its import may have registered in an earlier test's registry: registering the same
    # objects again is a no-op when they are already here.
    register_backend("fused-kv", plugin.FusedKVBackend)
    register_model_type(
        "gpt_bigcode", plugin.build_gpt_bigcode, architectures=("GPTBigCodeForCausalLM",)
    )
    return plugin


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def subprocess_env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------ registration


def _snapshot():
    return registered_backends(), registered_model_types()


@pytest.mark.parametrize(
    ("register", "error", "message"),
    [
        (
            lambda: register_backend(1, GQABackend),
            TypeError,
            "backend name must be a str, got int 1",
        ),
        (
            lambda: register_backend("", GQABackend),
            ValueError,
            "backend name '' is not a valid name",
        ),
        (
            lambda: register_backend("my gqa", GQABackend),
            ValueError,
            "backend name 'my gqa' is not a valid name",
        ),
        (
            lambda: register_backend("x", int),
            TypeError,
            "backend 'x': cls must be a subclass of AttentionBackend, got <class 'int'>",
        ),
        (
            lambda: register_backend("x", GQABackend, cli_builder=3),
            TypeError,
            "backend 'x': cli_builder must be callable or None, got 3",
        ),
        (
            lambda: register_backend(
                "x", GQABackend, cli_builder=lambda heads, /: GQABackend(heads, 8)
            ),
            TypeError,
            "backend 'x': builder parameter 'heads' is positional-only",
        ),
        (
            lambda: register_backend("gqa", MLABackend),
            ValueError,
            "backend 'gqa' is already registered to kvforge.attn_backends.gqa.GQABackend (cli_builder kvforge.models.bundled._gqa_from_cli), bundled with kvforge; refusing kvforge.attn_backends.mla.MLABackend (cli_builder None): pass replace=True to register_backend to replace it on purpose",
        ),
        (
            lambda: register_backend("gqa", GQABackend),
            ValueError,
            "backend 'gqa' is already registered",
        ),
        (
            lambda: register_backend("x", GQABackend, replace="yes"),
            TypeError,
            "backend 'x': replace must be a bool, got 'yes'",
        ),
        (
            lambda: register_model_type("llama", build_qwen, replace=1),
            TypeError,
            "model_type 'llama': replace must be a bool, got 1",
        ),
        (
            lambda: register_model_type(
                "new", build_qwen, architectures=("LlamaForCausalLM",), replace=True
            ),
            ValueError,
            "model_type 'new': architecture 'LlamaForCausalLM' already stands for model_type 'llama'",
        ),
        (
            lambda: register_model_type(None, build_gqa),
            TypeError,
            "model_type must be a str, got NoneType None",
        ),
        (
            lambda: register_model_type("new", 5),
            TypeError,
            "model_type 'new': builder must be callable, got 5",
        ),
        (
            lambda: register_model_type("llama", build_qwen),
            ValueError,
            "model_type 'llama' is already registered to kvforge.models.families.build_gqa (architectures ['LlamaForCausalLM']), bundled with kvforge; refusing kvforge.models.families.build_qwen (architectures []): pass replace=True to register_model_type to replace it on purpose",
        ),
        (
            lambda: register_model_type("llama", build_gqa),
            ValueError,
            "model_type 'llama' is already registered",
        ),
        (
            lambda: register_model_type("new", build_gqa, architectures="NewForCausalLM"),
            TypeError,
            "model_type 'new': architectures must be a sequence of names, not the string 'NewForCausalLM'",
        ),
        (
            lambda: register_model_type("new", build_gqa, architectures=(3,)),
            TypeError,
            "architecture must be a str, got int 3",
        ),
        (
            lambda: register_model_type("new", build_gqa, architectures=("A", "A")),
            ValueError,
            "model_type 'new': architectures ['A', 'A'] repeat a name",
        ),
        (
            lambda: register_model_type(
                "new", build_gqa, architectures=("NewForCausalLM", "LlamaForCausalLM")
            ),
            ValueError,
            "model_type 'new': architecture 'LlamaForCausalLM' already stands for model_type 'llama'",
        ),
    ],
)
def test_bad_registrations_change_nothing(register, error, message):
    before = _snapshot()
    with pytest.raises(error) as info:
        register()
    assert message in str(info.value)
    assert _snapshot() == before


def test_registering_the_same_objects_again_is_a_no_op():
    before = _snapshot()
    gqa = registered_backends()["gqa"]
    register_backend("gqa", gqa.cls, cli_builder=gqa.cli_builder)
    register_model_type("llama", build_gqa, architectures=["LlamaForCausalLM"])
    assert _snapshot() == before


def test_registered_backends_are_sorted_and_hold_the_bundled_ones():
    backends = registered_backends()
    assert list(backends) == sorted(backends)
    assert {"deepseek-v4", "dsa", "gqa", "mha", "mla"} <= set(backends)
    assert backends["mla"].cli_builder is None and backends["mla"].builder is MLABackend
    # the builder's parameters are the CLI options it takes
    assert list(backends["deepseek-v4"].parameters()) == [
        "compress_ratio",
        "qk_rope_head_dim",
        "index_head_dim",
        "kv_cache_dtype",
    ]
    # a copy: changing it registers nothing
    backends.pop("gqa")
    assert "gqa" in registered_backends()


def test_register_in_process(isolated_registry):
    class Tiny(GQABackend):
        """A backend a test defines: one kv head of 8."""

    def build_tiny(config, model_type, options):
        return {0: Tiny(1, 8), 1: Tiny(1, 8)}

    register_backend("tiny", Tiny, cli_builder=lambda block_size=4: Tiny(1, 8, block_size))
    register_model_type("tiny_lm", build_tiny, architectures=("TinyForCausalLM",))
    assert registered_backends()["tiny"].cls is Tiny
    backends = from_hf_config({"architectures": ["TinyForCausalLM"], "max_position_embeddings": 64})
    assert (list(backends), backends.model_type, backends.max_position_embeddings) == (
        [0, 1],
        "tiny_lm",
        64,
    )
    assert all(isinstance(b, Tiny) for b in backends.values())


def test_model_options_refuse_what_is_set():
    options = ModelOptions(tp_size=2, dtype="float16")
    assert options.is_set("tp_size") and options.is_set("dtype")
    assert not options.is_set("block_size") and not options.is_set("num_speculative_tokens")
    options.refuse("m", "block_size", "num_speculative_tokens", why="unused")  # not set: fine
    with pytest.raises(ValueError) as info:
        options.refuse("m", "block_size", "dtype", why="its cache dtype is fixed")
    assert (
        str(info.value)
        == "dtype='float16' does not apply to model_type 'm': its cache dtype is fixed"
    )
    with pytest.raises(KeyError, match=r"'dtypes' is not a ModelOptions field"):
        options.is_set("dtypes")
    assert ModelOptions(num_speculative_tokens=3).mtp_layer_ids(61, 1, "m") == range(61, 62)
    assert ModelOptions().mtp_layer_ids(61, 1, "m") == range(61, 61)


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        (3, TypeError, "plugin module name must be a str, got int"),
        (" ", ValueError, "plugin module name ' ' is empty"),
        (
            "kvforge_no_such_plugin",
            PluginError,
            "cannot import plugin module 'kvforge_no_such_plugin': ModuleNotFoundError",
        ),
    ],
)
def test_load_plugin_module_bad_names(name, error, message):
    before = _snapshot()
    with pytest.raises(error) as info:
        load_plugin_module(name)
    assert message in str(info.value)
    assert _snapshot() == before


# ------------------------------------------------------------------ the example plugin


def test_example_plugin_registers_its_backend_and_model_type(example):
    assert registered_backends()["fused-kv"].cls is example.FusedKVBackend
    entry = registered_model_types()["gpt_bigcode"]
    assert (entry.builder, entry.architectures) == (
        example.build_gpt_bigcode,
        ("GPTBigCodeForCausalLM",),
    )
    assert example.SAMPLE_CONFIG == SAMPLE


def test_from_hf_config_on_the_sample_config(example):
    backends = from_hf_config(SAMPLE)
    assert list(backends) == list(range(40))
    b = backends[0]
    assert isinstance(b, example.FusedKVBackend) and all(x is b for x in backends.values())
    # float32 checkpoint, served in bf16; multi-query: one kv head of 6144 // 48 = 128
    assert (b.num_kv_heads, b.head_dim, b.block_size, b.dtype) == (1, 128, 16, "bfloat16")
    assert [(r.name, r.group, r.entry_shape) for r in b.cache_roles()] == [
        ("kv", "kv", (2, 1, 128))
    ]
    assert (backends.model_type, backends.max_position_embeddings) == ("gpt_bigcode", 8192)
    layout = CacheLayout(backends)
    assert layout.kv_bytes_per_token() == STARCODER_BYTES_PER_TOKEN == 20_480
    # 40 layers * 16 tokens * (2 * 1 * 128) values * 2 bytes
    assert layout.bytes_per_block("kv") == 40 * 16 * 2 * 128 * 2


def test_sample_config_options(example):
    cfg = json.loads(SAMPLE.read_text())
    # multi-query: the one kv head is on every rank
    assert from_hf_config(cfg, tp_size=8)[0].num_kv_heads == 1
    # multi-head: 48 heads over 8 ranks
    assert from_hf_config(cfg | {"multi_query": False}, tp_size=8)[0].num_kv_heads == 6
    b = from_hf_config(cfg, kv_cache_dtype="fp8", block_size=32)[0]
    assert (b.dtype, b.block_size) == ("float8_e4m3fn", 32)
    assert from_hf_config(cfg, dtype="float16")[0].dtype == "float16"
    arch_only = {k: v for k, v in cfg.items() if k != "model_type"}
    assert from_hf_config(arch_only).model_type == "gpt_bigcode"


@pytest.mark.parametrize(
    ("overrides", "kwargs", "message"),
    [
        ({"n_layer": ...}, {}, "config is missing 'n_layer' (needed for model_type 'gpt_bigcode')"),
        (
            {"n_layer": 10**9},
            {},
            "config field n_layer = 1000000000 is invalid for model_type 'gpt_bigcode'",
        ),
        (
            {"n_embd": 6100},
            {},
            "n_embd=6100 is not divisible by n_head=48 (model_type 'gpt_bigcode')",
        ),
        ({}, {"tp_size": 5}, "n_head=48 is not divisible by tp_size=5 (model_type 'gpt_bigcode')"),
        (
            {},
            {"num_speculative_tokens": 1},
            "num_speculative_tokens=1 does not apply to model_type 'gpt_bigcode': GPT-BigCode has no MTP layers to cache",
        ),
        (
            {},
            {"kv_cache_dtype": "int4"},
            "kv_cache_dtype='int4' is not supported for model_type 'gpt_bigcode'",
        ),
    ],
)
def test_sample_config_errors(example, overrides, kwargs, message):
    cfg = json.loads(SAMPLE.read_text()) | overrides
    cfg = {k: v for k, v in cfg.items() if v is not ...}
    with pytest.raises(ValueError) as info:
        from_hf_config(cfg, **kwargs)
    assert message in str(info.value)


def test_fused_kv_caches_round_trip_through_the_controller(example):
    from kvforge import CacheController

    backends = {i: example.FusedKVBackend(2, 8, block_size=4, dtype="float32") for i in range(2)}
    ctl = CacheController(backends, device="cpu")
    ctl.initialize_kv_cache(num_blocks=8)
    ctl.initialize_host_cache(num_pages=8)
    assert ctl.storage_names == [
        "kv_caches_0_rank0.device0",
        "kv_caches_1_rank0.device0",
    ]
    # [blocks, tokens per block, key/value, kv heads, head_dim]
    assert tuple(ctl.get("kv", 1).shape) == (8, 4, 2, 2, 8)
    ctl.allocate("r", 10)  # 3 blocks
    blocks = ctl.block_table("r", "kv")
    for layer in (0, 1):
        cache = ctl.get("kv", layer)
        cache[blocks] = (
            torch.arange(3 * 4 * 2 * 2 * 8, dtype=torch.float32).view(3, 4, 2, 2, 8) + 1000 * layer
        )
    expected = {layer: ctl.get("kv", layer)[blocks].clone() for layer in (0, 1)}
    ctl.swap_out("r").wait()
    for layer in (0, 1):
        ctl.get("kv", layer).fill_(-1)  # scribble over every block, freed ones included
    ctl.swap_in("r").wait()
    again = ctl.block_table("r", "kv")
    for layer in (0, 1):
        live = ctl.get("kv", layer)[again]
        assert torch.equal(live[:2], expected[layer][:2])  # full blocks
        assert torch.equal(live[2, :2], expected[layer][2, :2])  # tokens 8, 9 of the last block
    ctl.free()


def test_fused_kv_backend_passes_the_conformance_kit(example):
    from kvforge.testing import CHECKS, check_backend

    report = check_backend(example.FusedKVBackend(2, 8, block_size=4, dtype="bfloat16"))
    assert [c.name for c in report.checks] == list(CHECKS)
    assert (report.layers, report.tokens, report.num_blocks) == ((0, 1), 13, {"kv": 6})
    round_trip = report.checks[CHECKS.index("swap_round_trip")]
    # 13 tokens x 2 layers x 2 purposes, each entry (key, value) x 2 heads x 8 dims x bf16 = 64 B
    assert (round_trip.entries, round_trip.bytes) == (13 * 2 * 2, 13 * 2 * 2 * 64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_kv_heads": 0, "head_dim": 8}, "num_kv_heads must be a positive integer, got 0"),
        ({"num_kv_heads": 1, "head_dim": 8.0}, "head_dim must be a positive integer, got 8.0"),
        (
            {"num_kv_heads": 1, "head_dim": 8, "block_size": True},
            "block_size must be a positive integer, got True",
        ),
    ],
)
def test_fused_kv_backend_bad_arguments(example, kwargs, message):
    with pytest.raises(ValueError) as info:
        example.FusedKVBackend(**kwargs)
    assert str(info.value) == message


# ------------------------------------------------------------------ CLI


def test_plan_with_plugin_option_in_process(example, capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--config",
        SAMPLE,
        "--plugin",
        "kvforge_example_plugin",
        "--num-blocks",
        "3",
        "--json",
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["num_layers"] == 40
    assert read_exact(report["bytes_per_token"]["history"]) == STARCODER_BYTES_PER_TOKEN
    [role] = report["roles"]
    assert (role["role"], role["entry_shape"], role["storage_name"]) == (
        "kv",
        [2, 1, 128],
        "kv_caches_{layer}_rank0.device0",
    )


def test_backend_choice_of_the_plugin(example, capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--backend",
        "fused-kv",
        "--num-kv-heads",
        "2",
        "--head-dim",
        "64",
        "--layers",
        "4",
        "--num-blocks",
        "3",
        "--json",
    )
    assert code == 0
    # 4 layers * (k, v) * 2 heads * 64 * bf16
    assert read_exact(json.loads(out)["bytes_per_token"]["history"]) == 4 * 2 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "--backend", "fused-kv"],
            "kvforge plan: error: --backend fused-kv needs --num-kv-heads, --head-dim",
        ),
        (
            [
                "plan",
                "--backend",
                "fused-kv",
                "--num-kv-heads",
                "1",
                "--head-dim",
                "8",
                "--kv-lora-rank",
                "4",
            ],
            "kvforge plan: error: --kv-lora-rank does not apply to --backend fused-kv; it takes --num-kv-heads, --head-dim, --block-size, --dtype, --layers",
        ),
        (
            ["plan", "--plugin", "kvforge_no_such_plugin", "--backend", "gqa"],
            "kvforge: error: cannot import plugin module 'kvforge_no_such_plugin': ModuleNotFoundError: No module named 'kvforge_no_such_plugin'",
        ),
        (["plan", "--plugin"], "kvforge: error: argument --plugin: expected one argument"),
    ],
)
def test_plugin_and_backend_errors_are_one_line_exit_2(example, capsys, argv, message):
    before = _snapshot()
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _snapshot() == before


# Plugin modules the failure table imports by --plugin, written to a temporary directory.
FAILING_PLUGINS = {
    "kvforge_p_crash": "raise RuntimeError('plugin bug')\n",
    "kvforge_p_exit0": "import sys\nsys.exit(0)\n",
    "kvforge_p_exit_text": "import sys\nsys.exit('bye')\n",
    "kvforge_p_llama": (
        "from kvforge.models import build_qwen, register_model_type\n"
        "register_model_type('llama', build_qwen)\n"
    ),
    "kvforge_p_arch": (
        "from kvforge.models import build_qwen, register_model_type\n"
        "register_model_type('my_llama', build_qwen, architectures=['LlamaForCausalLM'])\n"
    ),
    "kvforge_p_gqa": (
        "from kvforge.attn_backends import MLABackend\nfrom kvforge.models import register_backend\n"
        "register_backend('gqa', MLABackend)\n"
    ),
    # registers one thing, then fails: what it registered must be undone
    "kvforge_p_half": (
        "from kvforge.attn_backends import MLABackend\nfrom kvforge.models import register_backend\n"
        "register_backend('half-done', MLABackend)\nraise KeyError('second step')\n"
    ),
    "kvforge_p_lines": "raise ValueError('first line\\nsecond line')\n",
    "kvforge_p_bad_import": "import kvforge_no_such_dependency_xyz\n",
}


@pytest.fixture
def failing_plugins(isolated_registry, tmp_path, monkeypatch):
    for name, source in FAILING_PLUGINS.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (
            "kvforge_no_such_plugin",
            "cannot import plugin module 'kvforge_no_such_plugin': ModuleNotFoundError: No module named 'kvforge_no_such_plugin'",
        ),
        (
            "kvforge_p_bad_import",
            "cannot import plugin module 'kvforge_p_bad_import': ModuleNotFoundError: No module named 'kvforge_no_such_dependency_xyz'",
        ),
        (
            "kvforge_p_crash",
            "cannot import plugin module 'kvforge_p_crash': RuntimeError: plugin bug",
        ),
        (
            "kvforge_p_exit0",
            "cannot import plugin module 'kvforge_p_exit0': it called sys.exit(0) while loading",
        ),
        (
            "kvforge_p_exit_text",
            "cannot import plugin module 'kvforge_p_exit_text': it called sys.exit('bye') while loading",
        ),
        (
            "kvforge_p_llama",
            "cannot import plugin module 'kvforge_p_llama': ValueError: model_type 'llama' is already registered to "
            "kvforge.models.families.build_gqa (architectures ['LlamaForCausalLM']), bundled with kvforge; refusing "
            "kvforge.models.families.build_qwen (architectures []): pass replace=True to register_model_type to replace it on purpose",
        ),
        (
            "kvforge_p_arch",
            "ValueError: model_type 'my_llama': architecture 'LlamaForCausalLM' already stands for model_type 'llama'",
        ),
        (
            "kvforge_p_gqa",
            "cannot import plugin module 'kvforge_p_gqa': ValueError: backend 'gqa' is already registered to "
            "kvforge.attn_backends.gqa.GQABackend (cli_builder kvforge.models.bundled._gqa_from_cli), bundled with kvforge",
        ),
        ("kvforge_p_half", "cannot import plugin module 'kvforge_p_half': KeyError: 'second step'"),
        (
            "kvforge_p_lines",
            "cannot import plugin module 'kvforge_p_lines': ValueError: first line second line",
        ),
        ("", "kvforge: error: --plugin '': plugin module name '' is empty"),
        ("  ", "kvforge: error: --plugin '  ': plugin module name '  ' is empty"),
        (
            ".relative",
            "cannot import plugin module '.relative': TypeError: the 'package' argument is required",
        ),
    ],
)
def test_a_plugin_that_fails_to_load_is_one_line_exit_2_and_registers_nothing(
    failing_plugins, capsys, plugin, message
):
    before = _snapshot()
    code, out, err = run(capsys, "plan", "--plugin", plugin, "--num-blocks", "3")
    assert (code, out) == (2, "")
    assert err.startswith("kvforge: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # state: nothing registered (the half-done plugin's first registration was undone), the
    # module is not left half-imported, and every command still works
    assert _snapshot() == before
    assert "half-done" not in registered_backends()
    assert plugin.strip() == "" or plugin not in sys.modules
    assert (
        run(capsys, "plan", "--backend", "gqa", "--layers", "2", "--num-blocks", "3", "--json")[0]
        == 0
    )
    code, out, err = run(capsys, "--help")
    assert (code, err) == (0, "") and "usage: kvforge" in out


def test_help_still_works_with_a_failing_plugin(failing_plugins, capsys):
    before = _snapshot()
    for argv in (
        ["--plugin", "kvforge_p_llama", "--help"],
        ["plan", "--plugin", "kvforge_p_exit0", "-h"],
    ):
        code, out, err = run(capsys, *argv)
        assert code == 0 and "usage: kvforge" in out
        assert (
            err.startswith("kvforge: warning: cannot import plugin module")
            and len(err.splitlines()) == 1
        )
    assert _snapshot() == before


def test_replace_is_explicit_and_replaces_the_bundled_entry(isolated_registry):
    register_model_type("llama", build_qwen, architectures=("MyLlamaForCausalLM",), replace=True)
    entry = registered_model_types()["llama"]
    assert (entry.builder, entry.architectures, entry.bundled) == (
        build_qwen,
        ("MyLlamaForCausalLM",),
        False,
    )
    # the bundled architecture went with the replaced entry
    assert (
        from_hf_config(
            {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}
        )[0].sliding_window
        is None
    )
    with pytest.raises(ValueError, match="unsupported model_type None"):
        from_hf_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    register_backend("gqa", MLABackend, replace=True)
    assert (
        registered_backends()["gqa"].cls is MLABackend and not registered_backends()["gqa"].bundled
    )
    # replaced once, a name is no longer bundled: registering it again still needs replace
    with pytest.raises(
        ValueError,
        match=r"backend 'gqa' is already registered to .*MLABackend .cli_builder None.; refusing",
    ):
        register_backend("gqa", GQABackend)


def test_a_transaction_undoes_its_registrations_on_any_exception(isolated_registry):
    from kvforge.models.registry import transaction

    before = _snapshot()
    for error in (RuntimeError("x"), SystemExit(0), KeyboardInterrupt()):
        with pytest.raises(type(error)), transaction():
            register_backend("temp", MLABackend)
            register_model_type("temp_lm", build_gqa, replace=True)
            raise error
        assert _snapshot() == before
    with transaction():
        register_backend("kept", MLABackend)
    assert "kept" in registered_backends()


def test_the_bundled_entries_are_there_before_anyone_can_register():
    # a fresh interpreter that reaches the registry by its deepest path and registers first
    script = textwrap.dedent(
        """
        from kvforge.models.registry import register_model_type, registered_model_types
        from kvforge.models.families import build_qwen
        assert registered_model_types()["llama"].bundled
        try:
            register_model_type("llama", build_qwen)
        except ValueError as exc:
            print(exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "bundled with kvforge" in proc.stdout


def test_plan_with_plugin_option_in_a_subprocess():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvforge.cli.main",
            "plan",
            "--config",
            str(SAMPLE),
            "--plugin",
            "kvforge_example_plugin",
            "--max-num-seqs",
            "4",
            "--device-memory",
            "1GiB",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(PLUGIN_DIR),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert read_exact(report["bytes_per_token"]["history"]) == STARCODER_BYTES_PER_TOKEN
    assert report["max_model_len"] == 8192  # n_positions, since --max-model-len was not given


# ------------------------------------------------------------------ entry points


def write_dist_info(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[kvforge.backends]\n{entry_points}\n")


def test_entry_point_discovery_in_a_subprocess(tmp_path):
    write_dist_info(
        tmp_path, "kvforge-example-plugin-copy", "example-copy = kvforge_example_plugin"
    )
    script = textwrap.dedent(
        f"""
        import json
        from kvforge.models import load_plugins, registered_backends, registered_model_types
        from kvforge.cli.main import main

        assert "gpt_bigcode" not in registered_model_types()
        first = load_plugins()
        assert "example-copy" in first, first
        assert load_plugins() == ()  # each entry point is imported once
        assert "gpt_bigcode" in registered_model_types() and "fused-kv" in registered_backends()
        # the CLI loads the entry points itself: no --plugin needed
        raise SystemExit(main(["plan", "--config", {str(SAMPLE)!r}, "--num-blocks", "3", "--json"]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=subprocess_env(tmp_path, PLUGIN_DIR),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        read_exact(json.loads(proc.stdout)["bytes_per_token"]["history"])
        == STARCODER_BYTES_PER_TOKEN
    )


def test_a_broken_entry_point_is_named(tmp_path, monkeypatch, capsys):
    write_dist_info(tmp_path, "kvforge-broken-plugin", "broken = kvforge_no_such_module_xyz")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = (
        "kvforge plugin entry point 'broken = kvforge_no_such_module_xyz' (group "
        "'kvforge.backends', distribution 'kvforge-broken-plugin' 0.1.0) failed to load: "
        "ModuleNotFoundError: No module named 'kvforge_no_such_module_xyz'"
    )
    with pytest.raises(PluginError) as info:
        load_plugins()
    assert str(info.value) == message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    # the CLI says the same in one line, exit 2, and tries again next time
    code, out, err = run(capsys, "plan", "--list-models")
    assert (code, out, err) == (2, "", f"kvforge: error: {message}\n")


@pytest.mark.parametrize(
    ("entry_point", "cause"),
    [
        ("exits = kvforge_p_exit0", "it called sys.exit(0) while loading"),
        (
            "llama = kvforge_p_llama",
            "ValueError: model_type 'llama' is already registered to kvforge.models.families.build_gqa",
        ),
        ("half = kvforge_p_half", "KeyError: 'second step'"),
        ("function = kvforge_p_crash:register", "RuntimeError: plugin bug"),
    ],
)
def test_an_entry_point_that_fails_is_one_line_and_registers_nothing(
    failing_plugins, tmp_path, capsys, entry_point, cause
):
    write_dist_info(tmp_path, "kvforge-failing-plugin", entry_point)
    before = _snapshot()
    code, out, err = run(capsys, "plan", "--backend", "gqa", "--num-blocks", "3")
    assert (code, out) == (2, "")
    name, value = (part.strip() for part in entry_point.split("="))
    assert err.startswith(
        f"kvforge: error: kvforge plugin entry point '{name} = {value}' (group 'kvforge.backends'"
    )
    assert f"failed to load: {cause}" in err and len(err.splitlines()) == 1
    assert _snapshot() == before
    code, out, err = run(capsys, "--help")  # help still works, and says what failed
    assert (
        code == 0
        and "usage: kvforge" in out
        and err.startswith("kvforge: warning: kvforge plugin entry point")
    )


def test_an_entry_point_may_name_a_register_function(isolated_registry, tmp_path, monkeypatch):
    (tmp_path / "kvforge_ep_function.py").write_text(
        "from kvforge.models import build_gqa, register_model_type\n"
        "CALLS = []\n"
        "def register():\n"
        "    CALLS.append(1)\n"
        "    register_model_type('ep_gqa', build_gqa)\n"
    )
    write_dist_info(tmp_path, "kvforge-ep-function", "ep-function = kvforge_ep_function:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "ep-function" in load_plugins()
    assert "ep-function" not in load_plugins()
    import kvforge_ep_function

    assert kvforge_ep_function.CALLS == [1]  # called once
    assert registered_model_types()["ep_gqa"].builder is build_gqa


def test_a_backend_the_cli_cannot_build_says_so(isolated_registry, capsys):
    class Windowed(GQABackend):
        def __init__(self, window: int, block_size: int = 16) -> None:
            super().__init__(1, 8, block_size, sliding_window=window)

    register_backend("windowed", Windowed)
    code, _, err = run(capsys, "plan", "--backend", "windowed")
    assert code == 2
    assert err == (
        "kvforge plan: error: --backend windowed cannot be built from command-line options: its "
        "builder needs ['window'], which no option sets (register it with a cli_builder)\n"
    )
