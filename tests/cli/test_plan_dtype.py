"""``kvforge plan --dtype``: ``auto`` (the default) plans a config as engines serve it
(float32 configs in bfloat16, vLLM's ``_resolve_auto_dtype``); a dtype plans that dtype."""

import json

import pytest

from kvforge.cli.main import main
from kvforge.cli.plan_report import read_exact


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# Gemma-2-9B: history is kept by the 21 full layers, (2 * 8 kv heads * 256) values each
GEMMA2_TOKEN_VALUES = 21 * 2 * 8 * 256


@pytest.mark.parametrize(
    ("argv", "stored", "bytes_per_token"),
    [
        ([], "bfloat16", GEMMA2_TOKEN_VALUES * 2),  # config says float32: downcast
        (["--dtype", "auto"], "bfloat16", GEMMA2_TOKEN_VALUES * 2),
        (["--dtype", "float32"], "float32", GEMMA2_TOKEN_VALUES * 4),
        (["--dtype", "fp32"], "float32", GEMMA2_TOKEN_VALUES * 4),
        (["--dtype", "bf16"], "bfloat16", GEMMA2_TOKEN_VALUES * 2),
        (["--dtype", "float16"], "float16", GEMMA2_TOKEN_VALUES * 2),
    ],
)
def test_plan_gemma2_dtype(capsys, argv, stored, bytes_per_token):
    code, out, err = run(
        capsys, "plan", "--model", "gemma-2-9b", *argv, "--num-blocks", "2", "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert {r["dtype"] for r in report["roles"]} == {stored}
    assert (
        read_exact(report["bytes_per_token"]["history"])
        == bytes_per_token
        == 172_032 * (2 if stored == "float32" else 1)
    )


def test_plan_config_file_in_float32(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    llama = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 256,
    }
    cfg.write_text(json.dumps(llama | {"torch_dtype": "float32"}))
    for argv, itemsize in (([], 2), (["--dtype", "float32"], 4)):
        code, out, err = run(capsys, "plan", "--config", cfg, *argv, "--num-blocks", "2", "--json")
        assert code == 0, err
        # 2 layers * (key, value) * 4 heads * 64
        assert (
            read_exact(json.loads(out)["bytes_per_token"]["history"]) == 2 * 2 * 4 * 64 * itemsize
        )


def test_dtype_auto_with_a_backend_is_its_default(capsys):
    outs = []
    for argv in ([], ["--dtype", "auto"]):
        code, out, _ = run(
            capsys,
            "plan",
            "--backend",
            "gqa",
            "--layers",
            "1",
            *argv,
            "--num-blocks",
            "2",
            "--json",
        )
        assert code == 0
        outs.append(json.loads(out))
    assert outs[0] == outs[1]
    # --dtype auto is "not given", so it applies even to a backend without a dtype
    code, _, err = run(capsys, "plan", "--backend", "dsa", "--dtype", "auto", "--num-blocks", "2")
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "gemma-2-9b", "--dtype", "float64"],
            "argument --dtype: 'float64' is not a cache dtype; use one of float32, float16, bfloat16, "
            "float8_e4m3fn, float8_e5m2 (or an alias: fp32, fp16, bf16, fp8), or auto",
        ),
        (
            ["--model", "gemma-2-9b", "--dtype", "AUTO"],
            "argument --dtype: 'AUTO' is not a cache dtype",
        ),
        (
            ["--model", "gemma-2-9b", "--dtype", "fp8"],
            "dtype='fp8' is not a model dtype; use one of ['float16', 'bfloat16', 'float32'] or 'auto'",
        ),
        (
            ["--model", "deepseek-v4-flash", "--dtype", "float32"],
            "dtype='float32' does not apply to model_type 'deepseek_v4'",
        ),
    ],
)
def test_bad_dtype_is_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv, "--num-blocks", "2")
    assert code == 2 and out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1
