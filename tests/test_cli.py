"""`kvforge plan` and `kvforge bench`: output, JSON and one-line errors with exit code 2."""

import json

import pytest
import torch

from kvforge.commands.cli import main
from kvforge.commands.formatting import format_bytes, parse_size


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


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
        (["--max-num-seqs", "4"], "--max-num-seqs and --max-model-len go together"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, _out, err = run(capsys, "plan", *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


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
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    groups = {g["group"]: g for g in report["groups"]}
    assert list(groups) == ["swa", "compressed", "c4_state", "c128_state"]
    # window groups hold max_num_seqs windows: swa 16 * 3 + null; c128_state 16 * 17 + null
    assert groups["swa"]["num_blocks"] == 16 * 3 + 1
    assert groups["c128_state"]["num_blocks"] == 16 * 17 + 1
    assert report["total_bytes"] <= 60 * 1024**3
    roles = {(r["role"], r["group"]): r for r in report["roles"]}
    assert len(roles[("swa_kv", "swa")]["layers"]) == 43  # the MTP layer only with drafts
    assert len(roles[("indexer", "compressed")]["layers"]) == 21
    assert (
        roles[("indexer", "compressed")]["storage_name"] == "indexer_caches_{layer}_rank0.device0"
    )
    assert report["host"]["total_bytes"] <= 64 * 1024**3


def test_plan_table_from_flags(capsys):
    code, out, _ = run(capsys, "plan", "--backend", "gqa", "--layers", "32", "--num-blocks", "100")
    assert code == 0
    assert "key_caches_{layer}_rank0.device0" in out
    assert "KV bytes per token (full groups): 131,072" in out
    assert "0-31" in out


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
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2


def test_list_models(capsys):
    code, out, _ = run(capsys, "plan", "--list-models")
    assert code == 0 and "deepseek-v4-flash" in out.split()


def test_bench_runs_and_writes_json(tmp_path):
    from kvforge.commands.bench import BenchCase, _SynthBackend, run_bench, write_json

    case = BenchCase("tiny", {i: _SynthBackend(1_168) for i in range(3)}, "kv", 64 * 1_168 * 3)
    results = run_bench(cases=[case], repeats=1, progress=False, device="cpu")
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
    from kvforge.commands.bench import BenchCase, _SynthBackend, run_bench

    # 3 requests of 8 pages each (plus an interleaved fourth) move in one call
    backends = {i: _SynthBackend(1_168) for i in range(2)}
    case = BenchCase("batch", backends, "kv", 8 * 2 * 1_168, requests=3)
    results = run_bench(cases=[case], repeats=1, progress=False, device="cpu")
    for r in results:
        assert (r.requests, r.blocks, r.bytes) == (3, 24, 24 * 2 * 1_168)


def test_bench_whole_requests():
    from kvforge import DeepseekV4Backend
    from kvforge.commands.bench import BenchCase, run_bench

    # two small V4 requests of 300 tokens through swap_out_many / swap_in_many, every group
    small = {
        i: DeepseekV4Backend(r, head_dim=64, qk_rope_head_dim=16, index_head_dim=16)
        for i, r in enumerate((0, 4, 128))
    }
    case = BenchCase("request", small, None, 300, requests=2)
    results = run_bench(cases=[case], repeats=1, progress=False, device="cpu")
    from kvforge import CacheController

    ctl = CacheController(small)
    ctl.initialize_kv_cache(num_blocks=60)
    ctl.initialize_host_cache(num_blocks=60)
    for end in (64, 128, 192, 256, 300):  # grown step by step, as the benchmark grows them
        for r in ("a", "b"):
            ctl.allocate(r, end)
    expected = sum(h.bytes_moved for h in ctl.swap_out_many(["a", "b"]))
    for r in results:
        assert (r.requests, r.bytes) == (2, expected)
        assert r.num_planes == sum(len(ctl.layout.offload_entries(g)) for g in ctl.groups)
        assert r.gbps > 0 and r.loop_gbps > 0


def test_bench_cache_state(monkeypatch):
    from kvforge.commands import bench
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
    warm = bench.run_bench(cases=[case], repeats=1, progress=False, device="cpu", warm_cache=True)
    assert [r.cache for r in warm] == ["warm", "warm"]

    monkeypatch.setattr(fast, "can_evict", lambda: False)  # e.g. an ARM host
    monkeypatch.setattr(bench, "FLUSH_MIN_BYTES", 1 << 20)
    flush, label = bench.cache_flusher(platform, buffers)
    assert label == "cold"
    flush()
    results = bench.run_bench(cases=[case], repeats=1, progress=False, device="cpu")
    assert [r.cache for r in results] == ["cold", "cold"]
    with pytest.raises(RuntimeError, match="evict_from_caches needs x86-64"):
        fast.evict_from_caches(buffers)


def test_bench_moved_bytes_are_exactly_the_moved_blocks_and_pages():
    from kvforge import CacheController
    from kvforge.commands import bench

    # two planes of 64 and 16 bytes per block; a request of 3 blocks, interleaved with another
    backends = {0: bench._SynthBackend(64), 1: bench._SynthBackend(16)}
    ctl = CacheController(backends)
    ctl.initialize_kv_cache(num_blocks=10)
    ctl.initialize_host_cache(num_blocks=10)
    bench._grow_interleaved(ctl, ["r"], 3 * ctl.layout.group("kv").block_size, 1)
    [move] = bench._group_moves(ctl, ["r"], ["kv"])
    views = bench._moved_bytes([move])
    want = [(p.data_ptr() + b * p.shape[1], p.shape[1]) for p in move.planes for b in move.ids]
    page = move.host.page_bytes
    want += [(move.host.pages.data_ptr() + i * page, page) for i in move.pages]
    assert [(v.data_ptr(), v.numel()) for v in views] == want
    assert all(v.is_contiguous() for v in views) and len(move.ids) == 3


def test_bench_command_quick_json(tmp_path, monkeypatch, capsys):
    from kvforge.commands import bench

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
        "1",
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
    assert report["kv_bytes_per_token"] == layers * 576 * 2
    assert report["roles"][0]["layers"] == list(range(layers))
    code, out, _ = run(capsys, *argv)
    assert f"({layers} cache layers)" in out and ranges in out


def test_plan_tp_size_splits_kv_heads(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "llama-3-8b", "--tp-size", "4", "--num-blocks", "3", "--json"
    )
    assert code == 0
    # 8 kv heads over 4 ranks: 2 per rank; 32 layers * (k, v) * 2 heads * 128 dims * 2 bytes
    assert json.loads(out)["kv_bytes_per_token"] == 32 * 2 * 2 * 128 * 2
    code, _, err = run(capsys, "plan", "--model", "llama-3-8b", "--tp-size", "3")
    assert code == 2 and "tp_size" in err and len(err.strip().splitlines()) == 1
