"""``kvforge plan`` tells the truth (issue 35, item 4): the plan's concurrency and warnings in
the table and in ``--json``; every figure labelled with what it counts (bytes per token per
group, per-request state per request, each pool counted once); stable JSON types; help text
on every flag of every subcommand; ``--max-model-len`` alone; ``--list-models``; the plugin
route in an unsupported model type's error.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from typing import Any

import pytest

from kvforge.cli.args import build_parser
from kvforge.cli.main import main
from kvforge.cli.plan_report import exact_json, read_exact
from kvforge.models.reading import bundled_models
from kvforge.models.registry import registered_model_types

# Qwen/Qwen3-32B config.json (published): 64 layers, 64 heads, 8 kv heads, head_dim 128,
# bfloat16, max_position_embeddings 40960
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 64,
}


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv: object) -> dict[str, Any]:
    code, out, err = run(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def flat(text: str) -> str:
    """Rich wraps long lines; compare words."""
    return " ".join(text.split())


# ------------------------------------------------------------------ warnings, concurrency


def test_qwen3_32b_sixteen_long_sequences_on_80_gib_warn_that_only_nine_fit(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_32B))
    argv = ["--config", config, "--device-memory", "80GiB"]
    argv += ["--max-num-seqs", "16", "--max-model-len", "32768"]
    report = plan_json(capsys, *argv)
    # one token: 64 layers * (k, v) * 8 heads * 128 dims * 2 B = 262,144 B; a sequence of
    # 32,768 tokens: 2,048 blocks of 16 = 8 GiB; 80 GiB holds 9 of them (10 would need
    # 80 GiB plus the null block)
    assert 64 * 2 * 8 * 128 * 2 == 262_144 and 32_768 * 262_144 == 8 * 1024**3
    assert report["max_concurrency"] == 9
    assert report["max_num_seqs"] == 16 and report["max_model_len"] == 32_768
    assert report["bytes_per_sequence"] == 8 * 1024**3
    warning = (
        "only 9 of 16 sequences of 32,768 tokens fit at once (one such sequence keeps "
        "8,589,934,592 bytes of cache live): raise --device-memory, or lower --max-num-seqs "
        "or --max-model-len"
    )
    assert report["warnings"] == [warning]
    code, out, _ = run(capsys, "plan", *argv)
    assert code == 0
    assert "holds 9 sequences of 32,768 tokens at once" in flat(out)
    assert f"warning: {warning}" in flat(out)


def test_a_plan_that_holds_every_sequence_has_no_warning(capsys):
    report = plan_json(
        capsys, "--model", "llama-3-8b", "--device-memory", "80GiB", "--max-num-seqs", "16"
    )
    # 8,192 tokens (the model's) * 131,072 B = 1 GiB a sequence: 79 fit in 80 GiB
    assert report["max_model_len"] == 8_192 and report["defaulted"] == ["max_model_len"]
    assert report["max_concurrency"] == 79 and report["warnings"] == []


def test_the_arena_shortfall_is_warned_too(capsys):
    """DeepSeek-V4-Flash's arena holds 218 sequences of 65,536 tokens in 60 GiB, fewer than
    256: the per-group planner's warning was dropped with the arena, the report keeps one."""
    argv = ["--model", "deepseek-v4-flash", "--device-memory", "60GiB"]
    report = plan_json(capsys, *argv, "--max-model-len", "65536", "--max-num-seqs", "256")
    assert report["arena"] is not None
    assert report["max_concurrency"] == 218
    assert report["warnings"][0].startswith("only 218 of 256 sequences of 65,536 tokens fit")


# ------------------------------------------------------------------ --max-model-len alone


def test_max_model_len_alone_plans_with_the_engine_default_of_sequences(capsys):
    report = plan_json(capsys, "--model", "llama-3-8b", "--max-model-len", "4096")
    assert report["max_model_len"] == 4_096 and report["max_num_seqs"] == 256
    assert report["defaulted"] == ["max_num_seqs"]
    assert report["device_memory"] == 8 * 1024**3  # --device-memory's default
    # 4,096 * 131,072 B = 512 MiB a sequence; 8 GiB holds 15 (16 would need the null block too)
    assert report["max_concurrency"] == 15
    assert report["warnings"][0].startswith(
        "only 15 of 256 (the engine default) sequences of 4,096 tokens fit at once"
    )


def test_neither_length_nor_sequences_plans_the_models_defaults(capsys):
    report = plan_json(capsys, "--model", "llama-3-8b")
    assert (report["max_num_seqs"], report["max_model_len"]) == (256, 8_192)
    assert report["defaulted"] == ["max_model_len", "max_num_seqs"]
    assert report["warnings"][0].startswith(
        "only 7 of 256 (the engine default) sequences of 8,192 (the model's) tokens fit"
    )


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-num-seqs", "4"],
            "--max-num-seqs 4 needs a sequence length: give --max-model-len (the model gives no "
            "max_position_embeddings to default it to)",
        ),
        (
            ["--backend", "mla", "--max-num-seqs", "2", "--layers", "2"],
            "--max-num-seqs 2 needs a sequence length: give --max-model-len",
        ),
        (["--model", "llama-3-8b", "--max-model-len", "0"], "'0' must be a positive integer"),
        (["--model", "llama-3-8b", "--max-num-seqs", "-1"], "'-1' must be a positive integer"),
        (
            ["--model", "llama-3-8b", "--num-blocks", "4", "--max-num-seqs", "3"],
            "--max-num-seqs does not apply with --num-blocks",
        ),
        (
            ["--model", "llama-3-8b", "--device-memory", "100MiB", "--max-model-len", "8192"],
            "too small",
        ),
        (["--list-models", "--model", "llama-3-8b"], "takes no model options, got --model"),
        (
            ["--list-models", "--json", "--layers", "2"],
            "--list-models lists the bundled configs and takes no model options, got --layers",
        ),
        (
            ["--list-models", "--max-model-len", "4096", "--own-pools"],
            "--list-models lists the bundled configs and takes no sizing options, got "
            "--max-model-len, --own-pools",
        ),
        (
            ["--list-models", "--device-memory", "8GiB", "--rank", "1"],
            "takes no sizing options, got --device-memory, --rank",
        ),
        (["--list-models", "--num-blocks", "4"], "takes no sizing options, got --num-blocks"),
    ],
)
def test_plan_bad_input(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert err.startswith("kvforge plan: ") and message in err and err.count("\n") == 1


def test_an_unsupported_model_type_names_the_plugin_route(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run(capsys, "plan", "--config", config)
    assert code == 2
    assert "unsupported model_type 'gpt2' (architectures ['GPT2LMHeadModel'])" in err
    assert "kvforge.models.register_model_type" in err
    assert "worked example: examples/plugin/" in err
    assert "kvforge --plugin" in err


# ------------------------------------------------------------------ labels


def test_bytes_per_token_name_their_group_kind_and_layers(capsys):
    """gpt-oss-20b: 12 sliding-window and 12 full layers of 8 kv heads x 64 dims in bf16."""
    report = plan_json(capsys, "--model", "gpt-oss-20b", "--num-blocks", "4")
    per_layer = 2 * 8 * 64 * 2  # (k, v) * heads * dims * bf16 = 2,048 B per token
    per_token = report["bytes_per_token"]
    assert per_token["history"] == exact_json(12 * per_layer)
    assert (per_token["history_layers"], per_token["num_layers"]) == (12, 24)
    rows = {r["group"]: r for r in per_token["groups"]}
    assert rows["swa"] == {
        "group": "swa",
        "kind": "sliding_window",
        "window": 128,
        "num_layers": 12,
        "bytes_per_token": exact_json(12 * per_layer),
        "counts": "a token only while it is inside the window of 128 tokens",
    }
    assert rows["kv"]["counts"] == "every token of the sequence, for as long as it runs"
    code, out, _ = run(capsys, "plan", "--model", "gpt-oss-20b", "--num-blocks", "4")
    assert code == 0
    assert (
        "KV bytes per token of history: 24,576 (full-history layers: 12 of 24 cache layers)" in out
    )


def test_per_request_state_is_per_request_not_per_token(capsys):
    """Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers, each a conv state of 8,192 x 3 bf16 and
    a recurrent state of 32 x 128 x 128 bf16 (vLLM's "auto": the model dtype) per request
    (docs/models.md)."""
    report = plan_json(capsys, "--model", "qwen3-next-80b-a3b", "--num-blocks", "4")
    per_layer = 8192 * 3 * 2 + 32 * 128 * 128 * 2
    assert per_layer == 1_097_728
    state = report["bytes_per_request"]
    assert state["total"] == 36 * per_layer == 39_518_208
    assert [(g["group"], g["kind"], g["num_layers"]) for g in state["groups"]] == [
        ("linear_state", "per_request", 36)
    ]
    # the per-token table leaves the state out: 12 full layers of 2 kv heads x 256 in bf16
    assert [g["group"] for g in report["bytes_per_token"]["groups"]] == ["kv"]
    assert read_exact(report["bytes_per_token"]["history"]) == 12 * 2 * 2 * 256 * 2
    code, out, _ = run(capsys, "plan", "--model", "qwen3-next-80b-a3b", "--num-blocks", "4")
    assert code == 0
    assert "39,518,208 B per request, whatever its length" in flat(out)


def test_deepseek_v4_flash_counts_the_arena_once(capsys):
    """The issue's case: per-role totals of every arena member added up to ~236 GiB against
    a 60 GiB budget. Roles now carry their group's planned share; the arena is one pool."""
    argv = ["--model", "deepseek-v4-flash", "--device-memory", "60GiB"]
    report = plan_json(capsys, *argv, "--max-model-len", "65536", "--max-num-seqs", "256")
    budget = 60 * 1024**3
    roles = sum(r["planned_bytes"] for r in report["roles"])
    groups = sum(g["planned_bytes"] for g in report["groups"])
    assert roles == groups <= budget
    # the per-group plan of docs/plans.md: swa 1,153, compressed 56,067, c4_state 3,073,
    # c128_state 5,633 blocks
    planned = {g["group"]: g["planned_blocks"] for g in report["groups"]}
    assert planned == {"swa": 1_153, "compressed": 56_067, "c4_state": 3_073, "c128_state": 5_633}
    (pool,) = report["pools"]
    assert pool["sharing"] == "arena" and pool["total_bytes"] == report["total_bytes"] <= budget
    assert pool["total_bytes"] == report["arena"]["total_bytes"]


@pytest.mark.parametrize("name", bundled_models())
def test_every_bundled_model_adds_up(capsys, name):
    """Roles add up to their groups' planned shares; pools, each counted once, add up to the
    plan's total; no group is in two pools; the total stays within the budget."""
    report = plan_json(capsys, "--model", name, "--device-memory", "80GiB")
    by_group: dict[str, int] = {}
    for r in report["roles"]:
        by_group[r["group"]] = by_group.get(r["group"], 0) + r["planned_bytes"]
    assert by_group == {g["group"]: g["planned_bytes"] for g in report["groups"]}
    members = [g for p in report["pools"] for g in p["groups"]]
    assert sorted(members) == sorted(g["group"] for g in report["groups"])
    assert sum(p["total_bytes"] for p in report["pools"]) == report["total_bytes"]
    assert report["total_bytes"] <= report["device_memory"] == 80 * 1024**3


# ------------------------------------------------------------------ JSON types

INT_KEYS = ("num_layers", "device_memory", "total_bytes")
INT_OR_NULL = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "max_concurrency")
INT_OR_NULL += ("max_tokens", "bytes_per_sequence")
ROLE_TYPES = {
    "role": str,
    "group": str,
    "entry_shape": list,
    "dtype": str,
    "compress_ratio": int,
    "block_shape": list,
    "bytes_per_block": int,
    "storage_name": str,
    "layers": list,
    "planned_bytes": int,
}
GROUP_INTS = ("block_size", "num_blocks", "planned_blocks", "bytes_per_block", "device_stride")
GROUP_INTS += ("planned_bytes", "token_capacity")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_exact(value: object) -> bool:
    if not isinstance(value, dict) or set(value) != {"numerator", "denominator", "value"}:
        return False
    exact = read_exact(value)
    return (exact.numerator, exact.denominator) == (value["numerator"], value["denominator"])


def _check_types(report: dict[str, Any]) -> None:
    assert all(_is_int(report[k]) for k in INT_KEYS)
    assert all(report[k] is None or _is_int(report[k]) for k in INT_OR_NULL)
    assert isinstance(report["warnings"], list) and all(
        isinstance(w, str) for w in report["warnings"]
    )
    for r in report["roles"]:
        assert {k: type(r[k]) for k in ROLE_TYPES} == ROLE_TYPES
        assert all(_is_int(x) for x in [*r["entry_shape"], *r["block_shape"], *r["layers"]])
    for g in report["groups"]:
        assert all(_is_int(g[k]) for k in GROUP_INTS)
        assert g["window"] is None or _is_int(g["window"])
        assert g["max_sequences"] is None or _is_int(g["max_sequences"])
    per_token = report["bytes_per_token"]
    assert _is_exact(per_token["history"]) and _is_int(per_token["history_layers"])
    assert all(_is_exact(row["bytes_per_token"]) for row in per_token["groups"])
    assert _is_int(report["bytes_per_request"]["total"])
    for p in report["pools"]:
        assert _is_int(p["total_bytes"]) and all(_is_int(n) for n in p["num_blocks"].values())
    if report["arena"] is not None:
        assert all(_is_exact(p) for p in report["arena"]["padding"].values())


@pytest.mark.parametrize("name", bundled_models())
def test_json_types_are_the_same_for_every_bundled_model(capsys, name):
    sized = ["--device-memory", "60GiB", "--max-model-len", "4096", "--max-num-seqs", "16"]
    for sizing in (["--num-blocks", "4"], [*sized, "--host-memory", "8GiB"]):
        report = plan_json(capsys, "--model", name, *sizing)
        _check_types(report)
        host = report["host"]
        if "--host-memory" not in sizing:
            assert host is None
            continue
        assert _is_int(host["memory"]) and _is_int(host["total_bytes"])
        assert all(_is_int(n) for n in [*host["pages"].values(), *host["page_bytes"].values()])
        assert host["max_tokens"] is None or _is_int(host["max_tokens"])


def test_a_fractional_figure_is_the_exact_object(capsys):
    """One compress-ratio-128 layer of DeepSeek-V4: 584 B per 128 tokens (4.5625 B/token)."""
    report = plan_json(
        capsys,
        "--backend",
        "deepseek-v4",
        "--compress-ratio",
        "128",
        "--layers",
        "1",
        "--num-blocks",
        "4",
        "--max-model-len",
        "4096",
    )
    history = report["bytes_per_token"]["history"]
    assert history["value"] == history["numerator"] / history["denominator"]
    assert history["denominator"] > 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (131_072, {"numerator": 131_072, "denominator": 1, "value": 131_072.0}),
        (Fraction(15_401, 4), {"numerator": 15_401, "denominator": 4, "value": 3_850.25}),
        (Fraction(6, 4), {"numerator": 3, "denominator": 2, "value": 1.5}),
    ],
)
def test_exact_json_round_trips(value, expected):
    assert exact_json(value) == expected
    assert read_exact(json.loads(json.dumps(expected))) == value


@pytest.mark.parametrize(
    ("obj", "error", "message"),
    [
        (3.5, TypeError, "an exact figure is an int or a Fraction, got 3.5"),
        (True, TypeError, "an exact figure is an int or a Fraction, got True"),
        ("15401/4", TypeError, "an exact figure is an int or a Fraction, got '15401/4'"),
    ],
)
def test_exact_json_refuses_what_is_not_exact(obj, error, message):
    with pytest.raises(error) as info:
        exact_json(obj)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ("15401/4", "an exact figure is an object with keys numerator, denominator and value"),
        ({"numerator": 1, "denominator": 2}, "with keys numerator, denominator and value"),
        ({"numerator": 1, "denominator": 0, "value": 0.0}, "denominator > 0"),
        ({"numerator": 1.5, "denominator": 2, "value": 0.75}, "must be ints"),
        ({"numerator": True, "denominator": 2, "value": 0.5}, "must be ints"),
    ],
)
def test_read_exact_refuses_a_malformed_object(obj, message):
    with pytest.raises(ValueError, match=message):
        read_exact(obj)


# ------------------------------------------------------------------ help, --list-models


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


@pytest.mark.parametrize("command", [None, "plan", "demo", "bench"])
def test_every_flag_of_every_subcommand_has_help_text(command):
    parser = build_parser()
    sub = parser if command is None else _subparsers(parser)[command]
    flags = [a for a in sub._actions if a.option_strings]
    assert len(flags) >= 2  # -h and at least one more
    assert [a.option_strings[0] for a in flags if not a.help] == []


def test_every_subcommand_is_checked_for_help_text():
    assert sorted(_subparsers(build_parser())) == ["bench", "demo", "plan"]


def test_plan_help_prints_every_flag_with_its_text(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    for text in ("--max-model-len", "max_position_embeddings", "--max-num-seqs", "default 256"):
        assert text in flat(out)


def test_list_models_lists_bundled_configs_and_supported_model_types(capsys):
    code, out, err = run(capsys, "plan", "--list-models")
    assert code == 0 and err == ""
    assert "bundled configs (kvforge plan --model NAME)" in out
    assert "supported model types (kvforge plan --config config.json)" in out
    cells = {c.strip() for line in out.splitlines() for c in line.split("│")}
    assert set(bundled_models()) <= cells
    assert set(registered_model_types()) <= cells
    # the row of one config: name, model_type (nested type), layers, group kinds
    rows = [[c.strip() for c in line.split("│")][1:-1] for line in out.splitlines()]
    assert ["gemma-3-12b", "gemma3 (gemma3_text)", "48", "sliding_window, full"] in rows
    assert ["llama", "LlamaForCausalLM", "llama-3-8b", "kvforge"] in rows
    assert "examples/plugin/" in flat(out)


def test_list_models_as_json(capsys, tmp_path):
    listed = plan_json(capsys, "--list-models")
    names = [b["name"] for b in listed["bundled"]]
    assert names == bundled_models()
    gemma = listed["bundled"][names.index("gemma-3-12b")]
    assert gemma == {
        "name": "gemma-3-12b",
        "model_type": "gemma3",
        "text_model_type": "gemma3_text",
        "num_layers": 48,
        "kinds": ["sliding_window", "full"],
    }
    types = {t["model_type"]: t for t in listed["model_types"]}
    assert set(types) == set(registered_model_types())
    builder = registered_model_types()["llama"].builder
    assert types["llama"] == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "builder": f"{builder.__module__}.{builder.__qualname__}",
        "bundled": True,
        "configs": ["llama-3-8b"],
    }
    path = tmp_path / "models.json"
    code, out, _ = run(capsys, "plan", "--list-models", "--json", path)
    assert code == 0 and json.loads(path.read_text()) == listed
    assert "bundled configs (kvforge plan --model NAME)" in out
    code, _, err = run(capsys, "plan", "--list-models", "--json", tmp_path / "no" / "x.json")
    assert code == 2 and "cannot write --json" in err and "does not exist" in err


def test_a_model_without_history_and_its_host_pages_read_as_such(capsys):
    """Mistral-7B-v0.1: every layer slides (window 4,096), so no layer keeps the history;
    host pages print per group. 32 layers * (k, v) * 8 heads * 128 dims * 2 B * 16 tokens =
    2,097,152 B a page; 16 GiB holds 8,192 of them."""
    argv = ["--model", "mistral-7b-v0.1", "--device-memory", "20GiB", "--max-model-len", "32768"]
    argv += ["--max-num-seqs", "64", "--host-memory", "16GiB"]
    report = plan_json(capsys, *argv)
    assert report["bytes_per_token"]["history"] == exact_json(0)
    assert report["bytes_per_token"]["history_layers"] == 0
    pages = report["host"]["pages"]["swa"]
    assert report["host"]["page_bytes"] == {"swa": 32 * 2 * 8 * 128 * 2 * 16} == {"swa": 2_097_152}
    assert pages <= 16 * 1024**3 // 2_097_152 == 8_192
    code, out, _ = run(capsys, "plan", *argv)
    assert code == 0
    assert (
        "KV bytes per token of history: 0 (full-history layers: 0 of 32 cache layers; no layer keeps the "
        "whole history)" in flat(out)
    )
    assert f"host pages: swa {pages:,} (" in flat(out)
