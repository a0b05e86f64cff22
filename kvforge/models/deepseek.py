"""Builders of the DeepSeek families: MLA (V2, V3), DSA (V3.2) and DeepSeek-V4.

Their caches hold one compressed latent per token on every tensor-parallel rank, so
``tp_size`` changes nothing here. MLA stores it in the model dtype (or fp8); DSA adds an
indexer key and stores both as ``"fp8"`` (default) or ``"bf16"``; V4 has one
:class:`DeepseekV4Backend` per compress ratio in ``compress_ratios`` (0, 4 or 128), whose
groups fix the block sizes. The rules are listed in :mod:`kvforge.models.hf_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.deepseek_v4 import COMPRESS_RATIOS, DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.mla import MLABackend
from kvforge.models.base import (
    LayerFields,
    ModelOptions,
    PositiveInt,
    parse_fields,
)
from kvforge.models.reading import (
    FP8_NAMES,
    LATENT_DTYPE,
    float_cache_dtype,
    latent_cache_dtype,
    model_dtype,
)

__all__ = [
    "DSAFields",
    "IndexShareFields",
    "MLAFields",
    "V4Fields",
    "build_deepseek_v4",
    "build_dsa",
    "build_mla",
    "index_sharing_layers",
]


class MLAFields(LayerFields):
    """Cache fields of a DeepSeek V2 / V3 (MLA) model."""

    kv_lora_rank: PositiveInt
    qk_rope_head_dim: PositiveInt


class DSAFields(MLAFields):
    """Cache fields of a DeepSeek V3.2 (DSA) model: MLA plus the indexer key width."""

    index_head_dim: PositiveInt


class IndexShareFields(BaseModel):
    """The fields that let a DSA layer reuse another layer's top-k (and so build no indexer)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    index_topk_freq: PositiveInt = 1
    index_topk_pattern: Any = None
    index_skip_topk_offset: StrictInt = 2

    @field_validator("index_topk_pattern")
    @classmethod
    def _pattern(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(c, str) for c in value):
            return value
        raise ValueError("it must be a string or a list of strings ('F' runs, 'S' shares)")


class V4Fields(LayerFields):
    """Cache fields of a DeepSeek-V4 model."""

    compress_ratios: list[StrictInt]
    sliding_window: PositiveInt
    head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    index_head_dim: PositiveInt


# ---------------------------------------------------------------------------------- MLA / DSA


def build_mla(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """DeepSeek V2 / V3 (MLA); a config with ``index_head_dim`` is DSA (:func:`build_dsa`)."""
    if config.get("index_head_dim") is not None:
        return build_dsa(config, model_type, options)
    f = parse_fields(MLAFields, config, model_type)
    dtype = model_dtype(config, options.dtype, model_type)
    kv = options.kv_cache_dtype
    if kv is None or kv == "auto":
        pass
    elif kv in FP8_NAMES:
        dtype = "float8_e4m3fn"
    else:
        dtype = float_cache_dtype(
            kv, model_type, "'auto', 'fp8', 'bfloat16', 'float16' or 'float32'"
        )
    mtp = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    backend = MLABackend(
        kv_lora_rank=f.kv_lora_rank,
        qk_rope_head_dim=f.qk_rope_head_dim,
        block_size=options.block_size if options.block_size is not None else 64,
        dtype=dtype,
    )
    return dict.fromkeys([*range(f.num_hidden_layers), *mtp], backend)


def build_dsa(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """DeepSeek V3.2 (DSA): MLA's latent plus an indexer key per token.

    A main layer that reuses another layer's top-k (:func:`index_sharing_layers`, GLM-5.2's
    shared-index layers) builds no indexer in vLLM: it gets a :class:`DSABackend` with
    ``indexer=False`` (the latent only, in the same layout and group). MTP layers keep their
    indexer.
    """
    f = parse_fields(DSAFields, config, model_type)
    sharing = set(index_sharing_layers(config, f.num_hidden_layers, model_type))
    options.refuse(model_type, "dtype", why=LATENT_DTYPE)
    kv_cache_dtype = latent_cache_dtype(options.kv_cache_dtype, model_type)
    mtp = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    shape = {
        "kv_lora_rank": f.kv_lora_rank,
        "qk_rope_head_dim": f.qk_rope_head_dim,
        "index_head_dim": f.index_head_dim,
        "block_size": options.block_size if options.block_size is not None else 64,
        "kv_cache_dtype": kv_cache_dtype,
    }
    full = DSABackend(**shape)
    shared = DSABackend(**shape, indexer=False) if sharing else full
    return {
        layer: shared if layer in sharing else full for layer in [*range(f.num_hidden_layers), *mtp]
    }


def index_sharing_layers(
    config: Mapping[str, Any], num_hidden_layers: int, model_type: str
) -> list[int]:
    """The main layers of a DSA model that build no indexer: they reuse the top-k of an
    earlier layer ("IndexCache").

    vLLM's rule (``DeepseekV2MLAAttention.__init__`` in
    ``vllm/model_executor/models/deepseek_v2.py``): with ``index_topk_pattern`` (a string or a
    list), layer ``i`` shares when ``pattern[i] == "S"`` (layers past its end do not); else
    layer ``i`` shares when ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0``
    (defaults 2 and 1: no layer shares). MTP layers never share. ``transformers``'
    ``indexer_types`` is not read (vLLM 0.33 does not read it either).
    """
    f = parse_fields(IndexShareFields, config, model_type)
    pattern = f.index_topk_pattern
    if pattern is not None:
        return [i for i in range(min(num_hidden_layers, len(pattern))) if pattern[i] == "S"]
    freq, offset = f.index_topk_freq, f.index_skip_topk_offset
    return [i for i in range(num_hidden_layers) if max(i - offset + 1, 0) % freq != 0]


# ---------------------------------------------------------------------------------- V4


def build_deepseek_v4(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """DeepSeek-V4: one :class:`DeepseekV4Backend` per compress ratio, shared by its layers."""
    f = parse_fields(V4Fields, config, model_type)
    if options.block_size is not None:
        raise ValueError(
            f"block_size={options.block_size} cannot be set for model_type {model_type!r}: its "
            "groups fix the block sizes (swa 64, compressed 256, c4_state 4, c128_state 8)"
        )
    options.refuse(model_type, "dtype", why=LATENT_DTYPE)
    n = f.num_hidden_layers
    mtp = options.mtp_layer_ids(n, f.num_nextn_predict_layers, model_type)
    ratios = f.compress_ratios
    if len(ratios) < n:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries but num_hidden_layers={n} "
            f"(model_type {model_type!r}): every main layer needs a ratio"
        )
    layers = [*range(n), *mtp]
    per_layer: dict[int, int] = {}
    for i in layers:
        ratio = ratios[i] if i < len(ratios) else 0
        if ratio == 1:  # "compress every token by 1" is no compression: ratio 0's layer
            ratio = 0
        if ratio not in COMPRESS_RATIOS:
            raise ValueError(
                f"compress_ratios[{i}]={ratio!r} is not one of {sorted({*COMPRESS_RATIOS, 1})} "
                f"(model_type {model_type!r})"
            )
        per_layer[i] = ratio
    if not 0 < f.qk_rope_head_dim < f.head_dim:
        raise ValueError(
            f"qk_rope_head_dim={f.qk_rope_head_dim} must be smaller than head_dim={f.head_dim} "
            f"(model_type {model_type!r})"
        )
    kv_cache_dtype = latent_cache_dtype(options.kv_cache_dtype, model_type)
    kinds: dict[int, DeepseekV4Backend] = {}
    backends: dict[int, AttentionBackend] = {}
    for layer in layers:
        ratio = per_layer[layer]
        if ratio not in kinds:
            kinds[ratio] = DeepseekV4Backend(
                compress_ratio=ratio,
                head_dim=f.head_dim,
                qk_rope_head_dim=f.qk_rope_head_dim,
                index_head_dim=f.index_head_dim,
                sliding_window=f.sliding_window,
                kv_cache_dtype=kv_cache_dtype,
            )
        backends[layer] = kinds[ratio]
    return backends
