"""The Mamba2 hybrids against the specs vLLM's own code declares for them (vLLM 0.33).

For each bundled hybrid, vLLM's side is built with vLLM's functions on the published config
(loaded through its ``transformers`` configuration class), not re-derived here:

- the config hooks an engine runs: ``MODELS_CONFIG_MAP[architecture].verify_and_update_config``
  (Nemotron-H's SSM dtype) and ``HybridAttentionMambaModelConfig.verify_and_update_config``
  (``mamba_cache_mode`` and ``mamba_block_size``) in ``vllm/model_executor/models/config.py``,
  then ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``) with the
  FlashAttention backend: the attention block and the padded Mamba page;
- each mixer's spec: ``MambaMixer2.get_kv_cache_spec`` (``layers/mamba/mamba_mixer2.py``:
  ``MambaBase.get_kv_cache_spec`` of ``layers/mamba/abstract.py`` plus one prefill checkpoint
  block) of a mixer whose state shapes and dtypes are the model class's
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``;
- each attention layer's spec: ``Attention.get_kv_cache_spec`` (``layers/attention/
  attention.py``) with the heads per rank and head size of the model's attention module
  (``falcon_h1.py``, ``nemotron_h.py``, ``granitemoehybrid.py``).

kvforge's side is ``to_vllm_specs`` of ``from_hf_config`` padded as
``vllm_hybrid_sizes`` says. vLLM names the layers ``model.layers.{i}.attn`` /
``model.{N + i}.mixer`` (Falcon-H1), ``model.layers.{i}.mixer.attn`` /
``model.layers.{i}.mixer`` (Nemotron-H), ``model.layers.{i}.self_attn.attn`` /
``model.layers.{i}.mixer`` (Granite-4.0-H); the comparison maps kvforge's layer ids to them.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

import torch
import transformers
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.model_executor.models.config import (
    MODELS_CONFIG_MAP,
    HybridAttentionMambaModelConfig,
)
from vllm.model_executor.models.falcon_h1 import FalconH1ForCausalLM
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_interface import MambaSpec

from kvforge._checks import ArgumentError
from kvforge.attn_backends import GQABackend, LinearAttentionBackend, Mamba2Backend
from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.hybrid_sizes import HybridSizes, vllm_hybrid_sizes
from kvforge.integrations.vllm.specs import from_vllm_specs, layer_page_bytes, to_vllm_specs
from kvforge.models import from_hf_config, load_model_config

MODEL_CLASSES = {
    "falcon_h1": FalconH1ForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _attention_shape(hf, model_type: str, tp: int) -> tuple[int, int]:
    """(kv heads per rank, head size) as each model's attention module computes them."""
    kv = max(1, hf.num_key_value_heads // tp)
    if model_type == "granitemoehybrid":  # GraniteMoeHybridAttention: hidden // heads always
        return kv, hf.hidden_size // hf.num_attention_heads
    head = getattr(hf, "head_dim", None)  # FalconH1 / NemotronH: head_dim, else hidden // heads
    return kv, head if head is not None else hf.hidden_size // hf.num_attention_heads


def _vllm_config(config: dict, *, tp: int, dtype: str, prefix_caching: bool, ssm: str):
    model_type = config["model_type"]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf = transformers.AutoConfig.for_model(model_type, **fields)
    kv, head = _attention_shape(hf, model_type, tp)
    model = NS(
        hf_config=hf,
        dtype=DTYPES[dtype],
        is_hybrid=True,
        use_mla=False,
        architecture=config["architectures"][0],
        model_impl="auto",
        convert_type="none",
        runner_type="generate",
        max_model_len=4096,
        get_num_kv_heads=lambda parallel: kv,
        get_head_size=lambda: head,
    )
    cache = NS(
        block_size=16,
        user_specified_block_size=False,
        enable_prefix_caching=prefix_caching,
        mamba_cache_mode="none",
        mamba_block_size=None,
        mamba_page_size_padded=None,
        cache_dtype="auto",
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype=ssm,
        use_replayssm=False,
        kv_cache_dtype_skip_layers=None,
        prefix_match_unit=None,
    )
    return NS(
        model_config=model,
        cache_config=cache,
        parallel_config=NS(tensor_parallel_size=tp),
        scheduler_config=NS(enable_chunked_prefill=True),
        compilation_config=NS(static_forward_context={}),
        num_speculative_tokens=0,
    )


def _vllm_specs(config: dict, **options) -> tuple[dict, object]:
    """vLLM's per-layer specs of ``config``, named as vLLM names them."""
    cfg = _vllm_config(config, **options)
    hook = MODELS_CONFIG_MAP.get(cfg.model_config.architecture)
    if hook is not None:
        hook.verify_and_update_config(cfg)
    HybridAttentionMambaModelConfig.verify_and_update_config(cfg)
    Platform._align_hybrid_block_size(cfg, FlashAttentionBackend)
    cls = MODEL_CLASSES[config["model_type"]]
    shapes = cls.get_mamba_state_shape_from_config(cfg)
    dtypes = cls.get_mamba_state_dtype_from_config(cfg)
    # a MambaMixer2 whose state methods give the model class's shapes and dtypes: its own
    # get_kv_cache_spec runs (no weights are built)
    mixer = MambaMixer2.__new__(MambaMixer2)
    torch.nn.Module.__init__(mixer)
    mixer.get_state_shape = lambda: shapes
    mixer.get_state_dtype = lambda: dtypes
    kv, head = _attention_shape(cfg.model_config.hf_config, config["model_type"], tp=options["tp"])
    attention = NS(
        attn_type=AttentionType.DECODER,
        kv_cache_dtype="auto",
        sliding_window=None,
        num_kv_heads=kv,
        head_size=head,
        head_size_v=head,
        kv_cache_torch_dtype=DTYPES[options["dtype"]],
    )
    return (
        {
            "mixer": mixer.get_kv_cache_spec(cfg),
            "attn": Attention.get_kv_cache_spec(attention, cfg),
        },
        cfg.cache_config,
    )


def _vllm_name(model_type: str, n: int, layer: int, kind: str) -> str:
    if model_type == "falcon_h1":
        return f"model.layers.{layer}.attn" if kind == "attn" else f"model.{layer}.mixer"
    if model_type == "nemotron_h":
        return f"model.layers.{layer}.mixer" + (".attn" if kind == "attn" else "")
    return f"model.layers.{layer}." + ("self_attn.attn" if kind == "attn" else "mixer")


# (bundled model, tp, model dtype, prefix caching, --mamba-ssm-cache-dtype)
CASES = [
    ("falcon-h1-7b", 1, "bfloat16", False, "auto"),
    ("falcon-h1-7b", 2, "bfloat16", True, "auto"),
    ("falcon-h1-7b", 1, "bfloat16", False, "float32"),
    ("nemotron-nano-9b-v2", 1, "bfloat16", False, "auto"),
    ("nemotron-nano-9b-v2", 4, "bfloat16", True, "bfloat16"),
    ("granite-4.0-h-small", 1, "bfloat16", False, "auto"),
    ("granite-4.0-h-small", 2, "float16", True, "float32"),
]


@pytest.mark.parametrize(("model", "tp", "dtype", "prefix_caching", "ssm"), CASES)
def test_to_vllm_specs_equals_what_vllms_layers_declare(model, tp, dtype, prefix_caching, ssm):
    config = load_model_config(model)
    model_type = config["model_type"]
    theirs, cache = _vllm_specs(config, tp=tp, dtype=dtype, prefix_caching=prefix_caching, ssm=ssm)

    backends = from_hf_config(
        model, tp_size=tp, dtype=dtype, mamba_ssm_cache_dtype=None if ssm == "auto" else ssm
    )
    mode = "align" if prefix_caching else "none"
    sizes = vllm_hybrid_sizes(backends, max_model_len=4096, mamba_cache_mode=mode)
    # the block sizes and padding vLLM resolved
    assert (sizes.block_size, sizes.mamba_block_size, sizes.mamba_page_size_padded) == (
        cache.block_size,
        cache.mamba_block_size,
        cache.mamba_page_size_padded,
    )
    assert sizes.mamba_cache_mode == cache.mamba_cache_mode == mode
    padded = sizes.pad(backends)
    ours = to_vllm_specs(padded, **sizes.spec_options())
    n = len(config.get("hybrid_override_pattern", "")) or config["num_hidden_layers"]
    expected = {}
    for layer, backend in padded.items():
        kind = "mixer" if isinstance(backend, Mamba2Backend) else "attn"
        ours_name = f"model.layers.{layer}." + ("mixer" if kind == "mixer" else "self_attn.attn")
        expected[ours_name] = (_vllm_name(model_type, n, layer, kind), theirs[kind])
    assert set(ours) == set(expected)
    for name, spec in ours.items():
        assert spec == expected[name][1], (name, expected[name][0])
    # one page size for every layer, as vLLM's hybrid allocator needs
    assert len({s.page_size_bytes for s in ours.values()}) == 1
    # kvforge's device blocks are vLLM's pages, its host pages the meaningful bytes
    pages = layer_page_bytes(padded, **sizes.spec_options())
    assert all(pages[k] == (s.page_size_bytes, s.real_page_size_bytes) for k, s in ours.items())


@pytest.mark.parametrize("model", ["falcon-h1-7b", "nemotron-nano-9b-v2", "granite-4.0-h-small"])
def test_from_vllm_specs_reads_vllms_specs_back(model):
    backends = from_hf_config(model)
    sizes = vllm_hybrid_sizes(backends, max_model_len=4096)
    specs = to_vllm_specs(sizes.pad(backends), **sizes.spec_options())
    back = from_vllm_specs(specs)
    layout = CacheLayout(back)
    for layer, name in enumerate(back.layer_names):
        buffers = [b for b in layout.buffers if b.layer == layer]
        assert sum(b.device_block_bytes for b in buffers) == specs[name].page_size_bytes
        assert sum(b.block_bytes for b in buffers) == specs[name].real_page_size_bytes
    assert to_vllm_specs(back) == specs
    # one group per distinct spec, as vLLM groups them: the attention group and the mixers'
    assert len(layout.groups) == 2


def test_unpadded_declaration_and_worked_numbers():
    backends = from_hf_config("falcon-h1-7b")
    spec = to_vllm_specs(backends, mamba_block_size=4096)["model.layers.44.mixer"]
    # 3 * 3584 * 2 + 24 * 128 * 256 * 2 = 1,594,368 B, no padding without an attention page
    assert isinstance(spec, MambaSpec) and spec.page_size_padded is None
    assert spec.page_size_bytes == spec.real_page_size_bytes == 1_594_368
    assert spec.shapes == ((3, 3584), (24, 128, 256))
    assert spec.mamba_type == MambaMixer2.mamba_type.fget(None)
    sizes = vllm_hybrid_sizes(backends, max_model_len=4096)
    # attention token 2 * 2 * 128 * 2 = 1,024 B: block 16 * cdiv(1,594,368, 16 * 1,024) = 1,568
    assert (sizes.block_size, sizes.mamba_page_size_padded) == (1_568, 1_568 * 1_024)


def test_speculative_tokens_widen_the_conv_state_and_add_slots():
    backend = Mamba2Backend(24, 128, 256, 4, num_speculative_tokens=2)
    spec = to_vllm_specs({0: backend}, mamba_block_size=4096)["model.layers.0.mixer"]
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=3072,
        n_groups=1,
        num_heads=24,
        head_dim=128,
        state_size=256,
        conv_kernel=4,
        num_spec=2,
    )
    assert spec.shapes == shapes and spec.num_speculative_blocks == 2


BAD = [
    (dict(max_model_len=0), "max_model_len must be an int >= 1, got 0"),
    (dict(max_model_len=4096, block_size=True), "block_size must be an int >= 1"),
    (dict(max_model_len=4096, mamba_cache_mode="all"), "mamba_cache_mode must be one of"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_hybrid_sizes_refusals(kwargs, message):
    with pytest.raises(ArgumentError) as info:
        vllm_hybrid_sizes(from_hf_config("falcon-h1-7b"), **kwargs)
    assert message in str(info.value)


def test_hybrid_sizes_need_attention_and_state_layers():
    with pytest.raises(ArgumentError, match="no Mamba2 or linear-attention layer"):
        vllm_hybrid_sizes({0: GQABackend(8, 128)}, max_model_len=4096)
    with pytest.raises(ArgumentError, match="no full-attention GQA layer"):
        vllm_hybrid_sizes({0: Mamba2Backend(8, 16, 32, 4)}, max_model_len=4096)


def test_linear_attention_pages_are_padded_as_vllm_pads_them():
    """A Gated DeltaNet state beside attention layers: vLLM pads the state page to the
    attention page (``Platform._align_hybrid_block_size``), and so does ``HybridSizes.pad``."""
    # conv_dim = 2 * 4 * 64 + 8 * 64 = 1,024: conv [1024, 3] bf16 = 6,144 B; recurrent
    # [8, 64, 64] bf16 = 65,536 B: a 71,680-byte state
    linear = LinearAttentionBackend(4, 8, 64, 64, 4, recurrent_dtype="bfloat16")
    assert linear.state_bytes_per_request() == 1024 * 3 * 2 + 8 * 64 * 64 * 2 == 71_680
    # attention token 2 * 1 * 24 * 2 = 96 B: block 16 * cdiv(71,680, 16 * 96) = 752
    backends = {0: linear, 1: linear, 2: GQABackend(1, 24)}
    sizes = vllm_hybrid_sizes(backends, max_model_len=4096)
    assert (sizes.block_size, sizes.mamba_page_size_padded) == (752, 72_192) == (752, 752 * 96)
    padded = sizes.pad(backends)
    assert padded[0] is padded[1] and padded[2] is backends[2]  # layers keep sharing
    assert padded[0].page_size_padded == 72_192 and "page_size_padded=72192" in repr(padded[0])
    specs = to_vllm_specs(padded, **sizes.spec_options())
    state = specs["model.layers.0.linear_attn"]
    assert isinstance(state, MambaSpec)
    assert (state.page_size_bytes, state.real_page_size_bytes) == (72_192, 71_680)
    assert state.page_size_bytes == specs["model.layers.2.self_attn.attn"].page_size_bytes
    # vLLM's GDN spec: no prefill checkpoint without FlashInfer (qwen_gdn_linear_attn.py)
    assert state.num_prefill_checkpoint_blocks == 0
    pages = layer_page_bytes(padded, **sizes.spec_options())
    assert pages["model.layers.0.linear_attn"] == (72_192, 71_680)
    # kvforge's host pages stay unpadded: the device block pads the recurrent state only
    layout = CacheLayout(padded)
    [conv] = [b for b in layout.buffers if b.layer == 0 and b.role.name == "conv_state"]
    [rec] = [b for b in layout.buffers if b.layer == 0 and b.role.name == "recurrent_state"]
    assert (conv.device_block_bytes, rec.device_block_bytes) == (6_144, 72_192 - 6_144)
    assert (conv.block_bytes, rec.block_bytes) == (6_144, 65_536)


@pytest.mark.parametrize(
    ("padded", "message"),
    [
        (71_679, "page_size_padded=71679 is below the 71680 bytes of one request's conv and "
         "recurrent state"),
        (-1, "page_size_padded must be a positive int, got -1"),
    ],
)  # fmt: skip
def test_linear_attention_padding_refusals(padded, message):
    with pytest.raises(ArgumentError) as info:
        LinearAttentionBackend(4, 8, 64, 64, 4, recurrent_dtype="bfloat16", page_size_padded=padded)
    assert message in str(info.value)
    sizes = HybridSizes(
        block_size=16, mamba_block_size=16, mamba_page_size_padded=100, mamba_cache_mode="align"
    )
    with pytest.raises(
        ArgumentError, match="layer 0: LinearAttentionBackend: page_size_padded=100"
    ):
        sizes.pad({0: LinearAttentionBackend(4, 8, 64, 64, 4)})


def test_mamba2_specs_carry_vllms_prefill_checkpoint():
    """vLLM's MambaMixer2 declares one prefill checkpoint block at any token position (0.32
    and 0.33); to_vllm_specs carries it where vLLM's MambaSpec has the fields."""
    spec = to_vllm_specs({0: Mamba2Backend(8, 16, 32, 4)}, mamba_block_size=64)[
        "model.layers.0.mixer"
    ]
    assert (spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment) == (1, 1)


def test_to_vllm_specs_refuses_an_unknown_mamba_cache_mode():
    with pytest.raises(ArgumentError, match="mamba_cache_mode must be one of"):
        to_vllm_specs(from_hf_config("granite-4.0-h-small"), mamba_cache_mode="all")
