"""kvforge backends <-> vLLM KVCacheSpecs (kvforge.integrations.vllm.specs) and
``kvforge plan --vllm-specs``: bytes per block agree per vLLM layer both ways; bad input is
one ArgumentError (or one CLI error line, exit 2) naming what is wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

import torch
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvforge._checks import ArgumentError
from kvforge.attn_backends import (
    DeepseekV4Backend,
    DSABackend,
    GQABackend,
    LinearAttentionBackend,
    MHABackend,
    MLABackend,
)
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.cli.main import main
from kvforge.cli.plan_report import read_exact
from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.specs import (
    VllmSpecBackend,
    dump_vllm_specs,
    from_vllm_specs,
    layer_page_bytes,
    load_vllm_specs,
    to_vllm_specs,
)
from kvforge.models import from_hf_config
from kvforge.specs import CacheGroup, CacheRole, GroupKind

BACKENDS = {
    "gqa": GQABackend(8, 128, block_size=16),
    "mha_fp16": MHABackend(32, 64, block_size=32, dtype="float16"),
    "gqa_fp8": GQABackend(8, 128, block_size=16, kv_cache_quant="fp8"),
    "gqa_block_wise_fp8": GQABackend(4, 128, block_size=16, kv_cache_quant="block_wise_fp8"),
    "gqa_head_major": GQABackend(8, 128, block_size=16, block_layout="head_major"),
    "sliding_window": GQABackend(8, 256, block_size=16, sliding_window=4096),
    "chunked": GQABackend(8, 128, block_size=64, attention_chunk_size=8192),
    "mla": MLABackend(512, 64, block_size=64),
    "mla_padded": MLABackend(512, 64, block_size=64, block_alignment=576),
    "dsa_fp8": DSABackend(block_size=64),
    "dsa_bf16": DSABackend(block_size=64, kv_cache_dtype="bf16"),
    "dsv4_r0": DeepseekV4Backend(0),
    "dsv4_r4": DeepseekV4Backend(4),
    "dsv4_r128": DeepseekV4Backend(128),
    "dsv4_bf16_r4": DeepseekV4Backend(4, kv_cache_dtype="bf16"),
    "dsv4_unpadded": DeepseekV4Backend(4, block_alignment=1),
}


def _check_both_ways(backends) -> None:
    """to_vllm: page bytes == kvforge device bytes, real == meaningful; from_vllm: per layer
    the same again; and back to vLLM gives the same specs."""
    specs = to_vllm_specs(backends)
    ours = layer_page_bytes(backends)
    assert set(ours) == set(specs)
    for name, spec in specs.items():
        assert ours[name] == (spec.page_size_bytes, spec.real_page_size_bytes), name
    back = from_vllm_specs(specs)
    layout = CacheLayout(back)
    for layer, name in enumerate(back.layer_names):
        buffers = [b for b in layout.buffers if b.layer == layer]
        assert sum(b.device_block_bytes for b in buffers) == specs[name].page_size_bytes, name
        assert sum(b.block_bytes for b in buffers) == specs[name].real_page_size_bytes, name
    assert to_vllm_specs(back) == specs


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_round_trip_bytes_per_block(kind: str) -> None:
    _check_both_ways({0: BACKENDS[kind], 1: BACKENDS[kind]})


@pytest.mark.parametrize(
    "model",
    [
        "llama-3-8b",
        "gemma-2-9b",
        "gpt-oss-20b",
        "deepseek-v3",
        "deepseek-v3.2",
        "deepseek-v4-tiny",
        "llama-4-scout-17b-16e",
        "qwen3-next-80b-a3b",
    ],
)
def test_round_trip_bundled_models(model: str) -> None:
    _check_both_ways(from_hf_config(model))


def test_worked_numbers() -> None:
    spec = to_vllm_specs({0: BACKENDS["gqa"]})["model.layers.0.self_attn.attn"]
    assert type(spec) is FullAttentionSpec and spec.page_size_bytes == 16 * 8 * 2 * 128 * 2
    # DeepSeek-V4 fp8: 64 * 584 = 37,376 meaningful, 65 * 576 = 37,440 on the device
    swa = to_vllm_specs({0: BACKENDS["dsv4_r4"]})["model.layers.0.attn.swa_cache"]
    assert (swa.page_size_bytes, swa.real_page_size_bytes) == (37_440, 37_376)
    # block-wise fp8 is vLLM's fp8_per_token_head: (128 + 128) fp8 + 2 float32 scales a head
    bw = to_vllm_specs({0: BACKENDS["gqa_block_wise_fp8"]})["model.layers.0.self_attn.attn"]
    assert bw.state_content_bytes == 264 and bw.page_size_bytes == 16 * 4 * 264


def test_names_and_specs_match_vllms_own_deepseek_v4() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    vb = pytest.importorskip("vllm_baseline")
    for model in ("deepseek-v4-tiny", "llama-3-8b", "gemma-2-9b"):
        cfg = vb.build_vllm_engine_config(
            model, max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096
        )
        theirs, _ = vb.vllm_layer_specs(cfg, model)
        assert to_vllm_specs(from_hf_config(model)) == theirs, model
        _check_plan_of(theirs)


def _check_plan_of(specs) -> None:
    back = from_vllm_specs(specs)
    layout = CacheLayout(back)
    # one group per distinct spec, as vLLM groups layers
    distinct = []
    for s in specs.values():
        if s not in distinct:
            distinct.append(s)
    assert len(layout.groups) == len(distinct)


def test_block_size_follows_the_engine() -> None:
    specs = to_vllm_specs({0: BACKENDS["gqa"], 1: BACKENDS["dsv4_r4"]}, block_size=64)
    assert specs["model.layers.0.self_attn.attn"].block_size == 64
    assert specs["model.layers.1.attn"].block_size == 64  # compressed follows
    assert specs["model.layers.1.attn.swa_cache"].block_size == 64  # fixed 64 anyway
    assert specs["model.layers.1.attn.compressor.state_cache"].block_size == 4  # fixed


def test_identical_specs_share_a_backend_and_group() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=512
    )
    back = from_vllm_specs({"a": full, "b": swa, "c": full})
    assert back[0] is back[2] and isinstance(back[0], GQABackend)
    assert [g.name for g in CacheLayout(back).groups] == ["full", "swa"]
    assert back.layer_names == ("a", "b", "c")


class _Chunky(DeclaredBackend):
    def __init__(self) -> None:
        group = CacheGroup(name="c", block_size=16, kind=GroupKind.CHUNKED, window=64)
        self.declare([group], [CacheRole(name="latent", group="c", entry_shape=(8,), dtype="bf16")])


class _Extra(DeclaredBackend):
    def __init__(self) -> None:
        group = CacheGroup(name="kv", block_size=16)
        roles = [
            CacheRole(name=n, group="kv", entry_shape=(2, 8), dtype="bf16")
            for n in ("key", "value", "bias")
        ]
        self.declare([group], roles)


@pytest.mark.parametrize(
    ("backends", "kwargs", "message"),
    [
        (
            {0: GQABackend(4, 64, kv_cache_quant="block_wise_fp8", scale_dtype="bfloat16")},
            {},
            "role 'key_scale' is bfloat16",
        ),
        ({0: _Chunky()}, {}, "group 'c', role latent: vLLM has no chunked"),
        ({0: _Extra()}, {}, "not role 'bias'"),
        ({0: LinearAttentionBackend(4, 8, 64, 64, 4)}, {}, "mamba_block_size"),
        ({0: DeepseekV4Backend(128)}, {"block_size": 64}, "block_size=64"),
        ({0: BACKENDS["gqa"]}, {"block_size": 0}, "block_size must be an int >= 1"),
        ({0: BACKENDS["gqa"]}, {"block_size": True}, "block_size must be an int >= 1"),
        ({}, {}, "backends"),
        ([BACKENDS["gqa"]], {}, "backends"),
    ],
)
def test_to_vllm_refusals(backends, kwargs, message: str) -> None:
    with pytest.raises(ArgumentError, match=None) as info:
        to_vllm_specs(backends, **kwargs)
    assert message in str(info.value)


def test_linear_attention_with_a_mamba_block() -> None:
    backends = {0: LinearAttentionBackend(4, 8, 64, 64, 4)}
    spec = to_vllm_specs(backends, mamba_block_size=4096)["model.layers.0.linear_attn"]
    assert spec.page_size_bytes == backends[0].state_bytes_per_request()


_FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([_FULL], "specs must be a mapping"),
        ({}, "specs is empty"),
        ({"": _FULL}, "non-empty strs"),
        ({"x": 3}, "layer 'x': kvforge cannot plan a int (not a vLLM KVCacheSpec)"),
        (
            {
                "x": SinkFullAttentionSpec(
                    block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
                )
            },
            "layer 'x': kvforge cannot plan a SinkFullAttentionSpec",
        ),
        (
            {
                "x": CrossAttentionSpec(
                    block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
                )
            },
            "layer 'x': kvforge cannot plan a CrossAttentionSpec",
        ),
        (
            {"x": UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"y": _FULL})},
            "layer 'x': a UniformTypeKVCacheSpecs",
        ),
        (
            {
                "x": MLAAttentionSpec(
                    block_size=16,
                    num_kv_heads=1,
                    head_size=8,
                    dtype=torch.bfloat16,
                    tokens_per_state=3,
                )
            },
            "layer 'x'",
        ),
    ],
)
def test_from_vllm_refusals(specs, message: str) -> None:
    with pytest.raises(ArgumentError) as info:
        from_vllm_specs(specs)
    assert message in str(info.value)


def test_a_spec_gqa_cannot_carry_stays_a_spec() -> None:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=64
    )
    back = from_vllm_specs({"x": spec})
    assert isinstance(back[0], VllmSpecBackend)
    assert to_vllm_specs(back) == {"x": spec}


def test_dump_load_round_trip() -> None:
    for model in ("deepseek-v4-tiny", "qwen3-next-80b-a3b", "gemma-2-9b"):
        specs = to_vllm_specs(from_hf_config(model))
        data = json.loads(json.dumps(dump_vllm_specs(specs)))
        assert load_vllm_specs(data) == specs


def _dump(**fields):
    return {"format": "kvforge.vllm_specs/1", "layers": {"l0": fields}}


GOOD = {
    "type": "FullAttentionSpec",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 128,
    "dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be a JSON object"),
        ({"format": "other/2", "layers": {}}, "format must be 'kvforge.vllm_specs/1'"),
        ({"layers": {}}, "non-empty object 'layers'"),
        ({"layers": {"l0": 3}}, "layer 'l0': must be an object"),
        (_dump(**(GOOD | {"type": "CrossAttentionSpec"})), "field 'type' must be one of"),
        (
            _dump(**(GOOD | {"block_size": "16"})),
            "field 'block_size' must be an int >= 0, got '16'",
        ),
        (_dump(**(GOOD | {"block_size": 16.0})), "field 'block_size' must be an int"),
        (_dump(**(GOOD | {"block_size": True})), "field 'block_size' must be an int"),
        (_dump(**(GOOD | {"dtype": "bfloat17"})), "field 'dtype' must be a dtype name"),
        (_dump(**(GOOD | {"kv_quant_mode": "FP9"})), "field 'kv_quant_mode' must be a member"),
        (_dump(**(GOOD | {"heads": 8})), "FullAttentionSpec has no field 'heads'"),
        (_dump(**(GOOD | {"block_size": None})), "field 'block_size' must be given"),
        (_dump(**{k: v for k, v in GOOD.items() if k != "head_size"}), "vLLM refuses"),
        (
            _dump(type="MambaSpec", block_size=16, shapes=[[2, "x"]], dtypes=["bfloat16"]),
            "field 'shapes' must be a list of shapes",
        ),
    ],
)
def test_load_refusals(data, message: str) -> None:
    with pytest.raises(ArgumentError) as info:
        load_vllm_specs(data)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------- CLI


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_vllm_specs_equals_the_kvforge_plan(capsys, tmp_path) -> None:
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(dump_vllm_specs(to_vllm_specs(from_hf_config("llama-3-8b")))))
    code, out, err = run(capsys, "plan", "--vllm-specs", path, "--num-blocks", "64", "--json")
    assert code == 0, err
    ours = json.loads(out)
    code, out, err = run(capsys, "plan", "--model", "llama-3-8b", "--num-blocks", "64", "--json")
    native = json.loads(out)
    assert (
        read_exact(ours["bytes_per_token"]["history"])
        == read_exact(native["bytes_per_token"]["history"])
        == 131_072
    )
    assert ours["total_bytes"] == native["total_bytes"]
    code, out, err = run(capsys, "plan", "--vllm-specs", path)
    assert code == 0 and "kvforge plan: vLLM specs" in out and "KV bytes per token" in out


def test_plan_vllm_specs_deepseek_v4_bytes(capsys, tmp_path) -> None:
    path = tmp_path / "specs.json"
    specs = to_vllm_specs(from_hf_config("deepseek-v4-tiny"))
    path.write_text(json.dumps(dump_vllm_specs(specs)))
    code, out, err = run(capsys, "plan", "--vllm-specs", path, "--num-blocks", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    per_group = {g["group"]: g["bytes_per_block"] for g in report["groups"]}
    assert sum(per_group.values()) == sum(s.page_size_bytes for s in specs.values())


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("{not json", [], "is not JSON"),
        (
            json.dumps(_dump(**(GOOD | {"block_size": "16"}))),
            [],
            "field 'block_size' must be an int >= 0, got '16'",
        ),
        (json.dumps(_dump(**(GOOD | {"type": "Nope"}))), [], "field 'type' must be one of"),
        (json.dumps(_dump(**GOOD)), ["--model", "llama-3-8b"], "cannot be combined"),
        (json.dumps(_dump(**GOOD)), ["--block-size", "32"], "--block-size cannot be combined"),
    ],
)
def test_plan_vllm_specs_bad_input(capsys, tmp_path, content, extra, message) -> None:
    path = tmp_path / "specs.json"
    path.write_text(content)
    code, out, err = run(capsys, "plan", "--vllm-specs", path, *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err and message in err, err


def test_plan_vllm_specs_missing_file(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "plan", "--vllm-specs", tmp_path / "nope.json")
    assert code == 2 and err.count("\n") == 1 and "nope.json" in err


def test_plan_vllm_specs_without_vllm(capsys, tmp_path, monkeypatch) -> None:
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(_dump(**GOOD)))
    for name in ("vllm", "kvforge.integrations.vllm", "kvforge.integrations.vllm.specs"):
        monkeypatch.setitem(sys.modules, name, None)
    code, _, err = run(capsys, "plan", "--vllm-specs", path)
    assert code == 2 and err.count("\n") == 1
    assert "install the extra kvforge[vllm]" in err


def test_the_cli_does_not_import_vllm_at_import_time() -> None:
    import subprocess

    code = (
        "import sys, kvforge.cli.main, kvforge.cli.plan, kvforge.cli.args; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
