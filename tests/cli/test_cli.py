"""`kvforge plan`, `demo` and `bench`: output, JSON, and bad input refused up front as one line
with exit code 2 (never silently ignored, never a traceback); bugs keep their traceback."""

import json
import os
from fractions import Fraction

import pytest
import torch
from pydantic import BaseModel, ValidationError

from kvforge.cli import plan as cli_plan
from kvforge.cli.formatting import (
    UsageError,
    check_output_path,
    format_bytes,
    format_exact,
    one_line,
    parse_size,
)
from kvforge.cli.main import main
from kvforge.cli.plan_report import read_exact


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def inputs(tmp_path):
    """Files the bad-input tables refer to as "{name}"."""
    depth = 100_000  # json's decoder recurses per level: a RecursionError, unless caught
    (tmp_path / "deep.json").write_text(
        '{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}"
    )
    llama = {"model_type": "llama", "num_attention_heads": 8, "hidden_size": 512}
    (tmp_path / "huge.json").write_text(json.dumps(llama | {"num_hidden_layers": 10**9}))
    (tmp_path / "float.json").write_text(json.dumps(llama | {"num_hidden_layers": 1e9}))
    (tmp_path / "llama.json").write_text(json.dumps(llama | {"num_hidden_layers": 2}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("not a directory")
    return {
        "deep": tmp_path / "deep.json",
        "huge": tmp_path / "huge.json",
        "float": tmp_path / "float.json",
        "llama": tmp_path / "llama.json",
        "dir": tmp_path / "empty",
        "missing": tmp_path / "missing" / "out.json",
        "under_file": tmp_path / "file.txt" / "out.json",
    }


def fill(argv, inputs):
    return [str(inputs[a[1:-1]]) if a.startswith("{") else a for a in argv]


def test_parse_size_units():
    assert parse_size("60GiB") == 60 * 1024**3
    assert parse_size("512MB") == 512 * 1000**2
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2
    assert parse_size("4096") == 4096
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(12) == "12 B"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device-memory", "5XB"], "size '5XB' has unknown unit 'XB'"),
        (["--device-memory=-1GiB"], "size '-1GiB' is negative"),
        (["--device-memory", "lots"], "size 'lots' is not a number with an optional unit"),
        (["--device-memory", "0"], "size '0' must be more than 0 bytes"),
        (["--device-memory", "10KB"], "memory_budget=10,000 bytes is too small"),
        (["--layers", "0"], "'0' must be a positive integer"),
        (["--model", "nope"], "nope"),
        (
            ["--model", "llama-3-8b", "--backend", "mla"],
            "give one of --model, --config or --backend",
        ),
        (
            ["--max-num-seqs", "4"],
            "--max-num-seqs 4 needs a sequence length: give --max-model-len (the model gives no "
            "max_position_embeddings to default it to)",
        ),
        # zero usable blocks
        (
            ["--num-blocks", "1"],
            "argument --num-blocks: 1 leaves no usable block (block 0 of every group is the null block); give at least 2",
        ),
        (["--num-blocks", "0"], "argument --num-blocks: '0' must be a positive integer"),
        (
            ["--num-blocks", "4", "--max-num-seqs", "3"],
            "--max-num-seqs does not apply with --num-blocks",
        ),
        (["--num-blocks", "4", "--own-pools"], "--own-pools does not apply with --num-blocks"),
        # ranks
        (["--rank", "-1"], "argument --rank: '-1' must be a non-negative integer"),
        (
            ["--model", "llama-3-8b", "--tp-size", "4", "--rank", "4"],
            "--rank 4 is out of range for --tp-size 4 (ranks 0..3)",
        ),
        # options that do not apply to a model from a config
        (
            ["--model", "deepseek-v4-flash", "--head-dim", "64"],
            "--head-dim does not apply to a model from a config (--model deepseek-v4-flash); it takes --block-size, --dtype, --kv-cache-dtype, --tp-size, --num-speculative-tokens",
        ),
        (
            ["--model", "llama-3-8b", "--layers", "4"],
            "--layers does not apply to a model from a config (--model llama-3-8b)",
        ),
        (
            ["--config", "{llama}", "--kv-lora-rank", "4", "--layers", "2"],
            "--kv-lora-rank, --layers do not apply to a model from a config (--config ",
        ),
        (
            ["--model", "llama-3-8b", "--kv-cache-quant", "fp8"],
            "--kv-cache-quant does not apply to a model from a config",
        ),
        # ... or to its family
        (
            ["--model", "deepseek-v4-flash", "--block-size", "64"],
            "block_size=64 cannot be set for model_type 'deepseek_v4'",
        ),
        (
            ["--model", "deepseek-v4-flash", "--dtype", "float16"],
            "dtype='float16' does not apply to model_type 'deepseek_v4': its cache dtype is set by kv_cache_dtype ('fp8' or 'bf16')",
        ),
        (
            ["--model", "deepseek-v3.2", "--dtype", "bfloat16"],
            "dtype='bfloat16' does not apply to model_type 'deepseek_v32'",
        ),
        (
            ["--model", "deepseek-v3", "--kv-cache-dtype", "block_wise_fp8"],
            "kv_cache_dtype='block_wise_fp8' is not supported for model_type 'deepseek_v3'",
        ),
        (
            ["--model", "llama-3-8b", "--num-speculative-tokens", "1"],
            "num_speculative_tokens=1 needs MTP layers, but the config has num_nextn_predict_layers=0 (model_type 'llama')",
        ),
        (
            ["--model", "deepseek-v3", "--num-speculative-tokens", "-1"],
            "argument --num-speculative-tokens: '-1' must be a non-negative integer",
        ),
        # options that do not apply to the chosen backend
        (
            ["--backend", "mla", "--kv-cache-quant", "fp8"],
            "--kv-cache-quant does not apply to --backend mla; it takes --kv-lora-rank, --qk-rope-head-dim, --block-size, --dtype, --layers",
        ),
        (
            ["--backend", "deepseek-v4", "--head-dim", "64"],
            "--head-dim does not apply to --backend deepseek-v4; it takes --compress-ratio, --qk-rope-head-dim, --index-head-dim, --kv-cache-dtype, --layers",
        ),
        (
            ["--backend", "deepseek-v4", "--block-size", "64"],
            "--block-size does not apply to --backend deepseek-v4",
        ),
        (["--backend", "dsa", "--dtype", "float16"], "--dtype does not apply to --backend dsa"),
        (["--backend", "gqa", "--tp-size", "2"], "--tp-size does not apply to --backend gqa"),
        (
            ["--num-speculative-tokens", "1"],
            "--num-speculative-tokens does not apply to --backend gqa",
        ),
        (
            ["--backend", "dsa", "--kv-cache-dtype", "int4"],
            "kv_cache_dtype must be 'fp8' or 'bf16', got 'int4'",
        ),
        # --dtype names a floating-point cache dtype: the integer storage dtypes are not caches
        (
            ["--dtype", "int64"],
            "argument --dtype: 'int64' is not a cache dtype; use one of float32, float16, bfloat16, float8_e4m3fn, float8_e5m2",
        ),
        (
            ["--backend", "mla", "--dtype", "uint8"],
            "argument --dtype: 'uint8' is not a cache dtype",
        ),
        (
            ["--model", "llama-3-8b", "--dtype", "int8"],
            "argument --dtype: 'int8' is not a cache dtype",
        ),
        (["--dtype", "float128"], "argument --dtype: 'float128' is not a cache dtype"),
        (["--dtype", ""], "argument --dtype: '' is not a cache dtype"),
        # a float cache dtype that is not a model dtype is the model's to refuse, quoted as typed
        (
            ["--model", "llama-3-8b", "--dtype", "fp8"],
            "dtype='fp8' is not a model dtype; use one of ['float16', 'bfloat16', 'float32']",
        ),
        (
            ["--backend", "deepseek-v4", "--compress-ratio", "8"],
            "compress_ratio must be one of [0, 4, 128], got 8",
        ),
        (
            ["--list-models", "--backend", "mla"],
            "--list-models lists the bundled configs and takes no model options, got --backend",
        ),
        # layer counts and configs that would take minutes or a RecursionError
        (
            ["--layers", "1000000000"],
            "argument --layers: 1000000000 exceeds the maximum of 4096 cache layers a model may have",
        ),
        (["--layers", "1e9"], "argument --layers: '1e9' is not an integer"),
        (
            ["--config", "{huge}"],
            "config field num_hidden_layers = 1000000000 is out of range: kvforge supports at most 4096 cache layers per model (MAX_LAYERS)",
        ),
        (
            ["--config", "{float}"],
            "config field num_hidden_layers = 1000000000.0 is invalid for model_type 'llama': Input should be a valid integer",
        ),
        (["--config", "{deep}"], "nests JSON arrays or objects too deeply to be a model config"),
        (["--config", "{dir}"], "holds no config.json"),
        # output paths, refused before any work
        (["--json", "{dir}"], "cannot write --json '{dir}': it is a directory; give a file path"),
        (["--json", "{missing}"], "cannot write --json '{missing}': directory "),
        (["--json", "{under_file}"], "cannot write --json '{under_file}': '"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(capsys, inputs, argv, message):
    code, out, err = run(capsys, "plan", *fill(argv, inputs))
    assert code == 2 and out == ""
    assert message.format(**{k: str(v) for k, v in inputs.items()}) in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert not inputs["missing"].parent.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["demo", "--json", "{dir}"],
            "kvforge demo: error: cannot write --json '{dir}': it is a directory",
        ),
        (
            ["demo", "--json", "{missing}"],
            "kvforge demo: error: cannot write --json '{missing}': directory",
        ),
        (
            ["demo", "--layers", "4"],
            "kvforge demo: error: --layers does not apply to a model from a config (--model deepseek-v4-tiny)",
        ),
        (["demo", "--model", "deepseek-v4-tiny", "--head-dim", "64"], "--head-dim does not apply"),
        (
            ["demo", "--list-models", "--layers", "2"],
            "--list-models lists the bundled configs and takes no model options, got --layers",
        ),
        (
            ["demo", "--tier", "redis", "--prefix-conversations", "0"],
            "kvforge demo: error: --tier redis applies to the prefix-reuse phase, which --prefix-conversations 0 skips",
        ),
        (
            ["demo", "--tier", "mooncake", "--redis", "h:1"],
            "kvforge demo: error: --redis applies with --tier redis, not --tier mooncake",
        ),
        (
            ["demo", "--tier", "mooncake", "--mooncake-master", "h"],
            "kvforge demo: error: --mooncake-master must be HOST:PORT with a port in 1..65535, got 'h'",
        ),
        (
            ["demo", "--tier", "host", "--prefix-conversations", "0"],
            "kvforge demo: error: --tier host applies to the prefix-reuse phase, which --prefix-conversations 0 skips",
        ),
        (["demo", "--tier", "disk"], "argument --tier: invalid choice: 'disk'"),
        (
            ["bench", "--json", "{dir}"],
            "kvforge bench: error: cannot write --json '{dir}': it is a directory",
        ),
        (
            ["bench", "--json", "{under_file}"],
            "kvforge bench: error: cannot write --json '{under_file}': ",
        ),
    ],
)
def test_demo_and_bench_refuse_before_any_work(capsys, inputs, monkeypatch, argv, message):
    from kvforge.cli import bench, demo

    def must_not_run(*args, **kwargs):
        raise AssertionError("the command ran before refusing its input")

    monkeypatch.setattr(bench, "run_bench", must_not_run)
    monkeypatch.setattr(demo, "run_demo", must_not_run)
    code, out, err = run(capsys, *fill(argv, inputs))
    assert (code, out) == (2, "")
    assert message.format(**{k: str(v) for k, v in inputs.items()}) in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("error", [TypeError("a bug"), KeyError("a bug"), AttributeError("a bug")])
def test_an_unexpected_error_in_a_command_is_a_traceback(capsys, monkeypatch, error):
    def broken(args):
        raise error

    monkeypatch.setattr(cli_plan, "plan_report", broken)
    with pytest.raises(type(error), match="a bug"):
        main(["plan"])


def test_input_errors_from_a_command_are_one_line(capsys, monkeypatch):
    class Options(BaseModel):
        requests: int

    def invalid(args):
        Options(requests="many")

    monkeypatch.setattr(cli_plan, "plan_report", invalid)
    code, _, err = run(capsys, "plan")
    assert code == 2
    assert err == (
        "kvforge plan: error: requests='many' is invalid: Input should be a valid integer, "
        "unable to parse string as an integer\n"
    )


def test_a_refused_run_leaves_an_existing_output_file_alone(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("earlier result")
    code, _, err = run(capsys, "plan", "--model", "llama-9", "--json", path)
    assert code == 2 and "no bundled model config named 'llama-9'" in err
    assert path.read_text() == "earlier result"


def test_plan_json_path_writes_the_report_and_prints_tables(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = run(
        capsys, "plan", "--backend", "mla", "--layers", "2", "--num-blocks", "3", "--json", path
    )
    assert code == 0
    # 2 layers * 576 * bf16
    assert "KV bytes per token of history: 2,304 (full-history layers: 2 of 2 cache layers)" in out
    assert read_exact(json.loads(path.read_text())["bytes_per_token"]["history"]) == 2 * 576 * 2
    code, out, _ = run(
        capsys, "plan", "--backend", "mla", "--layers", "2", "--num-blocks", "3", "--json", "-"
    )
    assert json.loads(out)["num_layers"] == 2


def test_check_output_path(tmp_path):
    existing = tmp_path / "kept.json"
    existing.write_text("data")
    check_output_path(str(existing), "--json")  # writable; not truncated by the check
    assert existing.read_text() == "data"
    new = tmp_path / "new.json"
    check_output_path(str(new), "--json")
    assert not new.exists()  # the probe file is removed
    check_output_path(os.devnull, "--json")
    with pytest.raises(UsageError, match=r"cannot write --out '.*': it is a directory"):
        check_output_path(str(tmp_path), "--out")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (131_072, "131,072"),
        (Fraction(15_401, 4), "3,850 1/4"),
        (Fraction(747, 4), "186 3/4"),
    ],
)
def test_format_exact(value, text):
    assert format_exact(value) == text


def test_one_line():
    assert one_line(ValueError("first\n  second")) == "first second"
    assert one_line(FileNotFoundError(2, "No such file or directory", "x")) == (
        "[Errno 2] No such file or directory: 'x'"
    )
    with pytest.raises(ValidationError) as info:
        type("M", (BaseModel,), {"__annotations__": {"n": int}})(n=[1] * 100)
    assert (
        one_line(info.value)
        == "n=[1, 1, 1, 1, 1, 1, 1, 1, ...] is invalid: Input should be a valid integer"
    )


def test_plan_json_for_bundled_flash(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "deepseek-v4-flash",
        "--device-memory",
        "60GiB",
        "--max-model-len",
        "65536",
        "--max-num-seqs",
        "16",
        "--host-memory",
        "64GiB",
        "--own-pools",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert report["arena"] is None
    groups = {g["group"]: g for g in report["groups"]}
    assert list(groups) == ["swa", "compressed", "c4_state", "c128_state"]
    # window groups hold max_num_seqs windows, one batch-wide step allowance of
    # cdiv(8192 batched tokens, block_size) + max_num_seqs blocks, and the null block:
    # swa 16 * 3 + (8192 / 64 + 16) + 1; c128_state 16 * 17 + (8192 / 8 + 16) + 1
    assert groups["swa"]["num_blocks"] == 16 * 3 + 128 + 16 + 1 == 193
    assert groups["c128_state"]["num_blocks"] == 16 * 17 + 1024 + 16 + 1 == 1313
    assert report["total_bytes"] <= 60 * 1024**3
    # exact: 1,002,240 device bytes per 256-token block of the compressed group (blocks padded
    # to 576 B: 21 x (65 x 576 + 15 x 576) + 20 x 3 x 576), 1,002,240 / 256 = 3,915, a whole
    # number, still carried as the exact object (denominator 1)
    history = report["bytes_per_token"]["history"]
    assert history == {"numerator": 3_915, "denominator": 1, "value": 3_915.0}
    assert read_exact(history) == 3_915 == Fraction(1_002_240, 256)
    assert 21 * (65 * 576 + 15 * 576) + 20 * 3 * 576 == 1_002_240
    roles = {(r["role"], r["group"]): r for r in report["roles"]}
    assert len(roles[("swa_kv", "swa")]["layers"]) == 43  # the MTP layer only with drafts
    assert len(roles[("indexer", "compressed")]["layers"]) == 21
    assert (
        roles[("indexer", "compressed")]["storage_name"] == "indexer_caches_{layer}_rank0.device0"
    )
    assert report["host"]["total_bytes"] <= 64 * 1024**3


def test_plan_names_groups_that_can_share_a_pool(capsys):
    args = ["plan", "--model", "gpt-oss-20b", "--device-memory", "8GiB"]
    args += ["--max-model-len", "8192", "--max-num-seqs", "8"]
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0
    report = json.loads(out)
    planned = {g["group"]: g["planned_blocks"] for g in report["groups"]}
    pool = planned["swa"] + planned["kv"]
    # one pool of every block of both groups, one null block (the spare one is usable),
    # counted once: 12 layers * (k, v) * 16 tokens * 8 heads * 64 dims * 2 B per block
    assert report["pools"] == [
        {
            "groups": ["swa", "kv"],
            "sharing": "shared",
            "num_blocks": {"swa": pool, "kv": pool},
            "total_bytes": pool * 393_216,
        }
    ]
    assert 12 * 2 * 16 * 8 * 64 * 2 == 393_216
    assert [g["num_blocks"] for g in report["groups"]] == [pool, pool]
    assert report["total_bytes"] == pool * 393_216
    code, out, _ = run(capsys, *args)
    assert code == 0
    assert f"│ swa, kv │ shared  │ swa {pool:,}, kv {pool:,} │" in out
    code, out, _ = run(
        capsys, "plan", "--model", "deepseek-v4-flash", "--num-blocks", "9", "--json"
    )
    pools = json.loads(out)["pools"]
    assert code == 0 and [(p["groups"], p["sharing"]) for p in pools] == [
        (["swa"], "own"),
        (["compressed"], "own"),
        (["c4_state"], "own"),
        (["c128_state"], "own"),
    ]


def test_plan_table_from_flags(capsys):
    code, out, _ = run(capsys, "plan", "--backend", "gqa", "--layers", "32", "--num-blocks", "100")
    assert code == 0
    assert "key_caches_{layer}_rank0.device0" in out
    assert (
        "KV bytes per token of history: 131,072 (full-history layers: 32 of 32 cache layers)" in out
    )
    assert "0-31" in out


@pytest.mark.parametrize(
    ("dtype", "stored", "itemsize"),
    [
        ("fp8", "float8_e4m3fn", 1),
        ("float8_e5m2", "float8_e5m2", 1),
        ("bf16", "bfloat16", 2),
        ("fp32", "float32", 4),
    ],
)
def test_plan_dtype_takes_every_float_cache_dtype(capsys, dtype, stored, itemsize):
    code, out, _ = run(
        capsys,
        "plan",
        "--backend",
        "gqa",
        "--layers",
        "1",
        "--dtype",
        dtype,
        "--num-blocks",
        "2",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert {r["dtype"] for r in report["roles"]} == {stored}
    # one layer: (key, value) * 8 kv heads * 128 dims * itemsize
    assert read_exact(report["bytes_per_token"]["history"]) == 2 * 8 * 128 * itemsize


def test_plan_from_config_path(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 256,
            }
        )
    )
    code, out, _ = run(capsys, "plan", "--config", str(cfg), "--num-blocks", "3", "--json")
    assert code == 0
    report = json.loads(out)
    # 2 layers * (k, v) * 2 heads * 64 dims * 2 bytes
    assert read_exact(report["bytes_per_token"]["history"]) == 2 * 2 * 2 * 64 * 2


def test_list_models(capsys):
    code, out, _ = run(capsys, "plan", "--list-models")
    assert code == 0 and "deepseek-v4-flash" in out.split()


def test_bench_runs_and_writes_json(tmp_path):
    from kvforge.cli.bench import BenchCase, _SynthBackend, run_bench, write_json

    case = BenchCase("tiny", {i: _SynthBackend(1_168) for i in range(3)}, "kv", 64 * 1_168 * 3)
    results = run_bench(cases=[case], repeats=3, progress=False, device="cpu")
    assert [r.direction for r in results] == ["out", "in"]
    for r in results:
        assert r.page_bytes == 3 * 1_168 and r.min_plane_bytes == 1_168 and r.num_planes == 3
        assert r.bytes == r.blocks * r.page_bytes == 64 * 3 * 1_168
        assert r.gbps > 0 and r.memcpy_gbps > 0 and r.loop_gbps > 0
    path = tmp_path / "bench.json"
    write_json(results, str(path))
    rows = json.loads(path.read_text())
    assert set(rows[0]) >= {
        "layout",
        "direction",
        "page_bytes",
        "bytes",
        "gbps",
        "memcpy_gbps",
        "loop_gbps",
        "ratio_vs_memcpy",
        "ratio_vs_loop",
    }


def test_bench_batched_requests():
    from kvforge.cli.bench import BenchCase, _SynthBackend, run_bench

    # 3 requests of 8 pages each (plus an interleaved fourth) move in one call
    backends = {i: _SynthBackend(1_168) for i in range(2)}
    case = BenchCase("batch", backends, "kv", 8 * 2 * 1_168, requests=3)
    results = run_bench(cases=[case], repeats=3, progress=False, device="cpu")
    for r in results:
        assert (r.requests, r.blocks, r.bytes) == (3, 24, 24 * 2 * 1_168)


def test_bench_whole_requests():
    from kvforge import DeepseekV4Backend
    from kvforge.cli.bench import BenchCase, run_bench

    # two small V4 requests of 300 tokens through swap_out_many / swap_in_many, every group
    small = {
        i: DeepseekV4Backend(r, head_dim=64, qk_rope_head_dim=16, index_head_dim=16)
        for i, r in enumerate((0, 4, 128))
    }
    case = BenchCase("request", small, None, 300, requests=2)
    results = run_bench(cases=[case], repeats=3, progress=False, device="cpu")
    from kvforge import CacheController

    ctl = CacheController(small)
    ctl.initialize_kv_cache(num_blocks=60)
    ctl.initialize_host_cache(num_pages=60)
    for end in (64, 128, 192, 256, 300):  # grown step by step, as the benchmark grows them
        for r in ("a", "b"):
            ctl.allocate(r, end)
    expected = sum(h.bytes_moved for h in ctl.swap_out_many(["a", "b"]))
    for r in results:
        assert (r.requests, r.bytes) == (2, expected)
        assert r.num_planes == sum(len(ctl.layout.offload_buffers(g)) for g in ctl.groups)
        assert r.gbps > 0 and r.loop_gbps > 0


def test_bench_cache_state(monkeypatch):
    from kvforge.cli import bench, timing
    from kvforge.platform import get_platform

    case = bench.BenchCase("tiny", {i: bench._SynthBackend(64) for i in range(2)}, "kv", 4096)
    platform = get_platform("cpu")
    buffers = [torch.arange(256, dtype=torch.int64).view(torch.uint8)]
    before = buffers[0].clone()
    fast = pytest.importorskip("kvforge.ops.cpu_fast")
    flush, label = bench.cache_flusher(platform, buffers)
    assert label == ("cold data" if fast.can_evict() else "cold")
    flush()  # evicting (or flushing around) a buffer never changes its bytes
    assert torch.equal(buffers[0], before)
    warm = bench.run_bench(cases=[case], repeats=3, progress=False, device="cpu", warm_cache=True)
    assert [r.cache for r in warm] == ["warm", "warm"]

    monkeypatch.setattr(fast, "can_evict", lambda: False)  # e.g. an ARM host
    monkeypatch.setattr(timing, "FLUSH_MIN_BYTES", 1 << 20)
    flush, label = bench.cache_flusher(platform, buffers)
    assert label == "cold"
    flush()
    results = bench.run_bench(cases=[case], repeats=3, progress=False, device="cpu")
    assert [r.cache for r in results] == ["cold", "cold"]
    with pytest.raises(RuntimeError, match="evict_from_caches needs x86-64"):
        fast.evict_from_caches(buffers)


def test_bench_moved_bytes_are_exactly_the_moved_blocks_and_pages():
    from kvforge import CacheController
    from kvforge.cli import bench

    # two planes of 64 and 16 bytes per block; a request of 3 blocks, interleaved with another
    backends = {0: bench._SynthBackend(64), 1: bench._SynthBackend(16)}
    ctl = CacheController(backends)
    ctl.initialize_kv_cache(num_blocks=10)
    ctl.initialize_host_cache(num_pages=10)
    bench._grow_interleaved(ctl, ["r"], 3 * ctl.layout.group("kv").block_size, 1)
    [move] = bench._group_moves(ctl, ["r"], ["kv"])
    views = bench._moved_bytes([move])
    want = [(p.data_ptr() + b * p.shape[1], p.shape[1]) for p in move.planes for b in move.ids]
    page = move.host.page_bytes
    want += [(move.host.pages.data_ptr() + i * page, page) for i in move.pages]
    assert [(v.data_ptr(), v.numel()) for v in views] == want
    assert all(v.is_contiguous() for v in views) and len(move.ids) == 3


def test_bench_command_quick_json(tmp_path, monkeypatch, capsys):
    from kvforge.cli import bench

    small = bench.BenchCase(
        "tiny", {i: bench._SynthBackend(37_376) for i in range(2)}, "kv", 1 << 20
    )
    monkeypatch.setattr(bench, "default_cases", lambda quick: [small])
    path = tmp_path / "out.json"
    code, out, _ = run(
        capsys,
        "bench",
        "--quick",
        "--device",
        "cpu",
        "--repeats",
        "3",
        "--no-progress",
        "--warm-cache",
        "--json",
        str(path),
    )
    assert code == 0
    assert "tiny" in out and "vs memcpy" in out
    assert {row["cache"] for row in json.loads(path.read_text())} == {"warm"}
    assert [row["direction"] for row in json.loads(path.read_text())] == ["out", "in"]


@pytest.mark.parametrize(
    ("tokens", "layers", "ranges"), [(None, 61, "0-60"), ("0", 61, "0-60"), ("3", 62, "0-61")]
)
def test_plan_num_speculative_tokens_adds_the_mtp_layer(capsys, tokens, layers, ranges):
    argv = ["plan", "--model", "deepseek-v3", "--num-blocks", "3"]
    if tokens is not None:
        argv += ["--num-speculative-tokens", tokens]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["num_layers"] == layers
    # (512 + 64) bf16 values per layer
    assert read_exact(report["bytes_per_token"]["history"]) == layers * 576 * 2
    assert report["roles"][0]["layers"] == list(range(layers))
    code, out, _ = run(capsys, *argv)
    assert f"({layers} cache layers)" in out and ranges in out


def test_plan_tp_size_splits_kv_heads(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "llama-3-8b", "--tp-size", "4", "--num-blocks", "3", "--json"
    )
    assert code == 0
    # 8 kv heads over 4 ranks: 2 per rank; 32 layers * (k, v) * 2 heads * 128 dims * 2 bytes
    assert read_exact(json.loads(out)["bytes_per_token"]["history"]) == 32 * 2 * 2 * 128 * 2
    code, _, err = run(capsys, "plan", "--model", "llama-3-8b", "--tp-size", "3")
    assert code == 2 and "tp_size" in err and len(err.strip().splitlines()) == 1


def test_plan_puts_groups_whose_pages_differ_in_one_arena(capsys):
    args = ["plan", "--model", "deepseek-v4-flash", "--device-memory", "60GiB"]
    args += ["--max-model-len", "65536", "--max-num-seqs", "16"]
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0
    report = json.loads(out)
    arena = report["arena"]
    assert arena["groups"] == ["swa", "compressed", "c4_state", "c128_state"]
    assert arena["home"] == "compressed"
    tail = arena["tail_blocks"] * 1_013_760  # compressed's stride
    assert report["total_bytes"] == arena["num_slabs"] * arena["slab_bytes"] + tail
    assert report["total_bytes"] <= 60 * 1024**3 < report["total_bytes"] + 1_013_760
    for g in report["groups"]:
        k = arena["blocks_per_slab"][g["group"]]
        # every group's ids span the arena, the home group's the tail too; its stride
        # divides the slab exactly
        extra = arena["tail_blocks"] if g["group"] == "compressed" else 0
        assert g["num_blocks"] == arena["num_slabs"] * k + extra
        assert g["device_stride"] * k == arena["slab_bytes"]
        assert g["bytes_per_block"] <= g["device_stride"] <= g["bytes_per_block"] * 1.03
        assert g["max_sequences"] is None  # the arena holds sequences for all its groups
    # the arena's bytes are counted once, in one pool
    assert [p["sharing"] for p in report["pools"]] == ["arena"]
    assert report["pools"][0]["total_bytes"] == report["total_bytes"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    assert "draw on one arena of" in out and "device padding per block" in out
    assert f"compressed keeps slab 0 past the null blocks and {arena['tail_blocks']:,}" in out
