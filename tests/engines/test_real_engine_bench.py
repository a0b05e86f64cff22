"""``benchmarks/real_engine.py`` end to end at tiny sizes: two real engines (the CPU build of
vLLM, in fresh processes of the engine virtualenv) on one ``redis-server``; the JSON record's
structure, and every loaded prefix (vLLM's device cache, kvforge's host pages, the store)
giving the recompute's first token and top-3 logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _engines import engine_missing, engine_python

MISSING = engine_missing()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _optional
from _optional import redis_missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "real_engine.py"
SIZES = [64, 128]
# 88,080,384 weights a token multiplies: 8 * (1024*(1024 + 2*128) + 1024*1024 + 3*1024*2816);
# KV per token: 2 * 8 layers * 128 (2 KV heads of 64) * 4 bytes = 8192
PARAMS, KV_BYTES = 88_080_384, 8192


def test_the_benchmark_runs_and_loaded_outputs_equal_the_recompute(tmp_path):
    if redis_missing() is not None:
        pytest.skip(f"{redis_missing()} (.ci/run installs it)")
    out = tmp_path / "real.json"
    argv = ["--sizes", "64,128", "--repeats", "1", "--stores", "redis", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVFORGE_ENGINE_PYTHON": engine_python()}
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["sizes"] == SIZES and record["repeats"] == 1 and record["stores"] == ["redis"]
    assert record["vllm_version"].startswith("0.3")
    model = record["model"]
    assert model["params_per_token"] == PARAMS and model["kv_bytes_per_token"] == KV_BYTES
    assert model["flops_per_kv_byte"] == 2 * PARAMS / KV_BYTES
    # the attention scores at context n: 2 * 8 layers * 1024 * n more FLOPs per token
    assert model["flops_per_kv_byte_at"]["128"] == (2 * PARAMS + 2 * 8 * 1024 * 128) / KV_BYTES
    assert list(record["results"]) == ["64", "128"]
    for n, row in record["results"].items():
        assert list(row) == ["recompute", "device", "host", "redis"]
        for source, fig in row.items():
            (run,) = fig["runs"]
            assert fig["median_s"] == fig["min_s"] == fig["max_s"] == run["seconds"] > 0
            assert run["token_ids_equal"] and run["top_tokens_equal"], (n, source, run)
            assert fig["outputs_equal"] is True
            assert fig["max_logprob_diff"] < 1e-4, (n, source)
            if source == "recompute":
                assert run["cached_tokens"] == 0 and fig["ratio_to_recompute"] == 1.0
                continue
            assert fig["hits"] == 1 and run["cached_tokens"] == int(n), (n, source, run)
            assert fig["ratio_to_recompute"] == fig["median_s"] / row["recompute"]["median_s"]
        # kvforge moved exactly the prefix's KV from its pages; vLLM's own cache moved none
        assert row["device"]["bytes_per_token"] == 0
        assert row["host"]["bytes_per_token"] == row["redis"]["bytes_per_token"] == KV_BYTES
    assert "time to first token" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "64,x"], "--sizes='64,x': must be comma-separated integers"),
        (["--sizes", "48"], "--sizes=[48]: each must be a positive multiple of 32"),
        (["--stores", "redis,etcd"], "--stores='redis,etcd': must be distinct names of"),
        (["--repeats", "0"], "--repeats=0: must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(argv, message):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--engine-python", sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
