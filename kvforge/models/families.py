"""Builders of the GQA-shaped families: Llama, Mistral, Qwen, GLM, and the hybrids built on them.

Every layer of these models caches a key and a value per kv head (:class:`GQABackend`); the
families differ in which layers slide over a window (Mistral, Qwen, Gemma, gpt-oss), attend
within a chunk (Llama-4) or keep a linear-attention state instead (Qwen3-Next). Each
``build_*`` is a :data:`~kvforge.models.base.ModelBuilder`; the rules they follow (layer ids,
head counts under tensor parallelism, sliding-window layers, dtypes) are listed in
:mod:`kvforge.models.hf_config`. They are public so a plugin can register one of them for
another ``model_type`` of the same shape (``register_model_type("internlm3", build_gqa)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.gqa import GQABackend, KVCacheQuant
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.models.base import (
    LayerFields,
    ModelBackends,
    ModelOptions,
    NonNegativeInt,
    PositiveInt,
    parse_fields,
    short_repr,
)
from kvforge.models.engine_defaults import GEMMA3_TEXT, with_defaults
from kvforge.models.reading import (
    FP8_NAMES,
    float_cache_dtype,
    max_position_embeddings,
    model_dtype,
    nested_errors,
    text_config,
)
from kvforge.specs import canonical_dtype

__all__ = [
    "GQAFields",
    "Gemma3Pattern",
    "Llama4Fields",
    "Qwen3NextFields",
    "build_gemma2",
    "build_gemma3",
    "build_gpt_oss",
    "build_gqa",
    "build_llama4",
    "build_mistral",
    "build_qwen",
    "build_qwen3_next",
    "gated_deltanet_layers",
    "gated_deltanet_state_dtypes",
]


class GQAFields(LayerFields):
    """Cache fields of a Llama / Mistral / Qwen style GQA or MHA model."""

    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    sliding_window: PositiveInt | None = None
    use_sliding_window: StrictBool = False
    max_window_layers: NonNegativeInt | None = None
    layer_types: list[StrictStr] | None = None


# ---------------------------------------------------------------------------------- GQA

_SlidingRule = Callable[[GQAFields, str], frozenset[int]]


@dataclass(frozen=True)
class _GQAShape:
    """What every GQA layer of a model shares: heads per rank, head width, storage, block."""

    kv_per_rank: int
    head_dim: int
    dtype: str
    quant: KVCacheQuant | None
    block_size: int

    def backend(
        self, sliding_window: int | None = None, attention_chunk_size: int | None = None
    ) -> GQABackend:
        return GQABackend(
            self.kv_per_rank,
            self.head_dim,
            self.block_size,
            self.dtype,
            self.quant,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
        )


def _gqa_shape(
    f: GQAFields, dtype_config: Mapping[str, Any], model_type: str, opts: ModelOptions
) -> _GQAShape:
    """Heads, head width, cache dtype and block size of a GQA model (checked)."""
    heads = f.num_attention_heads
    kv_heads = f.num_key_value_heads if f.num_key_value_heads is not None else heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads} "
            f"(model_type {model_type!r})"
        )
    if f.head_dim is not None:
        head_dim = f.head_dim
    elif f.hidden_size is None:
        raise ValueError(
            f"config is missing 'head_dim' and 'hidden_size' (needed for model_type "
            f"{model_type!r}: head_dim defaults to hidden_size // num_attention_heads)"
        )
    elif f.hidden_size % heads:
        raise ValueError(
            f"hidden_size={f.hidden_size} is not divisible by num_attention_heads={heads}, so "
            f"head_dim cannot be derived (model_type {model_type!r}); set 'head_dim'"
        )
    else:
        head_dim = f.hidden_size // heads

    tp = opts.tp_size
    if heads % tp:
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by tp_size={tp} "
            f"(model_type {model_type!r})"
        )
    if (kv_heads % tp if tp <= kv_heads else tp % kv_heads) != 0:
        raise ValueError(
            f"tp_size={tp} and num_key_value_heads={kv_heads} do not fit: tp_size must divide "
            f"num_key_value_heads, or num_key_value_heads must divide tp_size "
            f"(model_type {model_type!r})"
        )
    kv_per_rank = max(1, kv_heads // tp)

    dtype = model_dtype(dtype_config, opts.dtype, model_type)
    quant: KVCacheQuant | None = None
    kv = opts.kv_cache_dtype
    if kv is None or kv == "auto":
        pass
    elif kv in FP8_NAMES:
        quant = "fp8"
    elif kv == "block_wise_fp8":
        quant = "block_wise_fp8"
    else:
        dtype = float_cache_dtype(
            kv, model_type, "'auto', 'fp8', 'block_wise_fp8', 'bfloat16', 'float16' or 'float32'"
        )
    block_size = opts.block_size if opts.block_size is not None else 16
    return _GQAShape(kv_per_rank, head_dim, dtype, quant, block_size)


def _gqa(
    config: Mapping[str, Any], model_type: str, opts: ModelOptions, rule: _SlidingRule
) -> dict[int, AttentionBackend]:
    f = parse_fields(GQAFields, config, model_type)
    shape = _gqa_shape(f, config, model_type, opts)

    n = f.num_hidden_layers
    sliding = _layer_types_sliding(f, model_type)
    if sliding is None:
        sliding = rule(f, model_type)
    mtp = opts.mtp_layer_ids(n, f.num_nextn_predict_layers, model_type)
    full_backend: GQABackend | None = None
    swa_backend: GQABackend | None = None

    def full() -> GQABackend:
        nonlocal full_backend
        if full_backend is None:
            full_backend = shape.backend()
        return full_backend

    def swa() -> GQABackend:
        nonlocal swa_backend
        if swa_backend is None:
            swa_backend = shape.backend(sliding_window=f.sliding_window)
        return swa_backend

    backends: dict[int, AttentionBackend] = {
        layer: swa() if layer in sliding else full() for layer in range(n)
    }
    for layer in mtp:
        backends[layer] = full()
    return backends


def _layers_of_type(
    layer_types: Sequence[str], n: int, kinds: tuple[str, str], model_type: str
) -> frozenset[int]:
    """Layers whose ``layer_types`` entry is ``kinds[1]``, after checking the list has one
    entry per layer and only ``kinds`` in it (errors name the entry and the model type)."""
    if len(layer_types) != n:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers={n} "
            f"(model_type {model_type!r})"
        )
    for i, kind in enumerate(layer_types):
        if kind not in kinds:
            raise ValueError(
                f"layer_types[{i}]={short_repr(kind)} is not one of {list(kinds)} "
                f"(model_type {model_type!r})"
            )
    return frozenset(i for i, k in enumerate(layer_types) if k == kinds[1])


def _layer_types_sliding(f: GQAFields, model_type: str) -> frozenset[int] | None:
    """Sliding main layers per ``layer_types``; ``None`` when the config has no list."""
    if f.layer_types is None:
        return None
    sliding = _layers_of_type(
        f.layer_types, f.num_hidden_layers, ("full_attention", "sliding_attention"), model_type
    )
    if sliding and f.sliding_window is None:
        raise ValueError(
            f"config is missing 'sliding_window' (needed for model_type {model_type!r}: "
            f"layer_types has sliding_attention layers)"
        )
    return sliding


def _never_slides(f: GQAFields, model_type: str) -> frozenset[int]:
    return frozenset()


def _slides_everywhere(f: GQAFields, model_type: str) -> frozenset[int]:
    return frozenset(range(f.num_hidden_layers)) if f.sliding_window is not None else frozenset()


def _qwen_slides(f: GQAFields, model_type: str) -> frozenset[int]:
    if not f.use_sliding_window:
        return frozenset()
    if f.sliding_window is None:
        raise ValueError(
            f"config is missing 'sliding_window' (needed for model_type {model_type!r} "
            f"with use_sliding_window=true)"
        )
    if f.max_window_layers is None:
        raise ValueError(
            f"config is missing 'max_window_layers' (needed for model_type {model_type!r} "
            f"with use_sliding_window=true)"
        )
    return frozenset(range(f.max_window_layers, f.num_hidden_layers))


def build_gqa(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """GQA / MHA, Llama's rule: only ``layer_types`` makes a layer slide."""
    return _gqa(config, model_type, options, _never_slides)


def build_mistral(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """GQA, Mistral's rule: every layer slides when ``sliding_window`` is not null."""
    return _gqa(config, model_type, options, _slides_everywhere)


def build_qwen(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """GQA, Qwen's rule: with ``use_sliding_window``, layers ``>= max_window_layers`` slide."""
    return _gqa(config, model_type, options, _qwen_slides)


def _with_max_len(
    backends: Mapping[int, AttentionBackend], text: Mapping[str, Any], model_type: str
) -> ModelBackends:
    """The backends plus ``max_position_embeddings`` of the (possibly nested) text config."""
    return ModelBackends(
        backends,
        model_type=model_type,
        max_position_embeddings=max_position_embeddings(text, model_type),
    )


def _alternate_slides(f: GQAFields, model_type: str) -> frozenset[int]:
    """Even layers slide, odd layers are full (Gemma-2's and gpt-oss's default
    ``layer_types``: ``"sliding_attention" if (i + 1) % 2 else "full_attention"``)."""
    if f.sliding_window is None:
        raise ValueError(
            f"config is missing 'sliding_window' (needed for model_type {model_type!r}: "
            "even layers use sliding-window attention)"
        )
    return frozenset(range(0, f.num_hidden_layers, 2))


def build_gemma2(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """Gemma-2: ``layer_types`` when present, else layers 0, 2, 4, ... slide (window
    ``sliding_window``) and layers 1, 3, 5, ... are full."""
    return _gqa(config, model_type, options, _alternate_slides)


def build_gpt_oss(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """gpt-oss: ``layer_types`` (published) or, as Hugging Face defaults it, even layers slide
    with window ``sliding_window`` (128) and odd layers are full. Attention sinks are
    parameters, not cache."""
    return _gqa(config, model_type, options, _alternate_slides)


class Gemma3Pattern(BaseModel):
    """Gemma-3's layer pattern: every ``sliding_window_pattern``-th layer is global."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sliding_window_pattern: PositiveInt | None = None


def build_gemma3(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Gemma-3 (``gemma3`` with ``text_config``, or ``gemma3_text``): ``layer_types`` when
    present, else layer ``i`` slides unless ``(i + 1) % sliding_window_pattern == 0``
    (pattern 6: five local layers, then one global).

    Fields the config leaves out take ``Gemma3TextConfig``'s defaults
    (:data:`~kvforge.models.engine_defaults.GEMMA3_TEXT`: ``head_dim`` 256, 8 heads, 4 kv
    heads, pattern 6, window 4096), which vLLM's ``Gemma3Attention`` reads: the published
    Gemma-3-4B and -12B configs state no ``head_dim``, and it is not ``hidden_size //
    num_attention_heads`` (240 for 12B).
    """
    text = dict(text_config(config, model_type))
    if text.get("sliding_window_pattern") is None and "_sliding_window_pattern" in text:
        # transformers >= 4.53 saves the same number under a private name
        text["sliding_window_pattern"] = text["_sliding_window_pattern"]
    text = with_defaults(text, GEMMA3_TEXT)
    try:
        if text.get("use_bidirectional_attention") is True:
            raise ValueError(
                "config field use_bidirectional_attention = True is not supported for "
                f"model_type {model_type!r}: a bidirectional Gemma-3 (an embedding model) runs "
                "encoder-only attention in vLLM (Gemma3TextModelConfig: is_causal = not "
                "use_bidirectional_attention), which keeps no KV cache"
            )
        every = parse_fields(Gemma3Pattern, text, model_type).sliding_window_pattern

        def rule(f: GQAFields, mt: str) -> frozenset[int]:
            if every is None:
                raise ValueError(
                    f"config is missing 'sliding_window_pattern' (needed for model_type {mt!r} "
                    "without layer_types)"
                )
            if f.sliding_window is None:
                raise ValueError(
                    f"config is missing 'sliding_window' (needed for model_type {mt!r}: "
                    "local layers use sliding-window attention)"
                )
            return frozenset(i for i in range(f.num_hidden_layers) if (i + 1) % every)

        backends = _gqa(text, model_type, options, rule)
    except ValueError as exc:
        raise nested_errors(config, exc) from None
    return _with_max_len(backends, text, model_type)


class Llama4Fields(GQAFields):
    """Llama-4's text fields: GQA plus chunked local attention on the RoPE layers."""

    attention_chunk_size: PositiveInt | None = None
    no_rope_layers: list[StrictInt] | None = None
    no_rope_layer_interval: PositiveInt = 4


def _llama4_chunked(f: Llama4Fields, model_type: str) -> frozenset[int]:
    """The chunked layers of Llama-4.

    ``layer_types`` (newer saves: ``"chunked_attention"`` / ``"full_attention"``) decides when
    present. Else ``no_rope_layers[i]`` is 1 for a RoPE layer, which attends within its chunk,
    and 0 for a NoPE layer, which attends globally; an empty or absent list is Hugging Face's
    default ``int((i + 1) % no_rope_layer_interval != 0)`` (layers 3, 7, 11, ... global with
    interval 4). ``attention_chunk_size`` null: no layer is chunked (vLLM's rule).
    """
    n = f.num_hidden_layers
    if f.layer_types is not None:
        chunked = _layers_of_type(
            f.layer_types, n, ("full_attention", "chunked_attention"), model_type
        )
        if chunked and f.attention_chunk_size is None:
            raise ValueError(
                f"config is missing 'attention_chunk_size' (needed for model_type "
                f"{model_type!r}: layer_types has chunked_attention layers)"
            )
        return chunked
    if f.attention_chunk_size is None:
        return frozenset()
    if f.no_rope_layers:
        if len(f.no_rope_layers) != n:
            raise ValueError(
                f"no_rope_layers has {len(f.no_rope_layers)} entries but num_hidden_layers={n} "
                f"(model_type {model_type!r})"
            )
        for i, flag in enumerate(f.no_rope_layers):
            if flag not in (0, 1):
                raise ValueError(
                    f"no_rope_layers[{i}]={flag!r} is not 0 (NoPE, global) or 1 (RoPE, chunked) "
                    f"(model_type {model_type!r})"
                )
        return frozenset(i for i, flag in enumerate(f.no_rope_layers) if flag == 1)
    every = f.no_rope_layer_interval
    return frozenset(i for i in range(n) if (i + 1) % every)


def build_llama4(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Llama-4 (``llama4`` with ``text_config``, or ``llama4_text``): chunked local attention
    (group ``chunked``, window ``attention_chunk_size``) on the RoPE layers, full attention
    on the NoPE layers (see :func:`_llama4_chunked`)."""
    text = text_config(config, model_type)
    try:
        f = parse_fields(Llama4Fields, text, model_type)
        shape = _gqa_shape(f, text, model_type, options)
        chunked = _llama4_chunked(f, model_type)
        mtp = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    except ValueError as exc:
        raise nested_errors(config, exc) from None
    full = shape.backend()
    local = shape.backend(attention_chunk_size=f.attention_chunk_size) if chunked else full
    backends: dict[int, AttentionBackend] = {
        i: local if i in chunked else full for i in range(f.num_hidden_layers)
    }
    backends.update(dict.fromkeys(mtp, full))
    return _with_max_len(backends, text, model_type)


class Qwen3NextFields(GQAFields):
    """Qwen3-Next: GQA full-attention layers plus Gated DeltaNet linear-attention layers."""

    full_attention_interval: PositiveInt | None = None
    linear_num_key_heads: PositiveInt
    linear_num_value_heads: PositiveInt
    linear_key_head_dim: PositiveInt
    linear_value_head_dim: PositiveInt
    linear_conv_kernel_dim: Annotated[StrictInt, Field(ge=2)]


def _qwen3_next_full(f: Qwen3NextFields, model_type: str) -> frozenset[int]:
    """Full-attention layers: ``layer_types`` when present, else every
    ``full_attention_interval``-th layer (``(i + 1) % interval == 0``: 3, 7, 11, ... for 4)."""
    n = f.num_hidden_layers
    if f.layer_types is not None:
        linear = _layers_of_type(
            f.layer_types, n, ("full_attention", "linear_attention"), model_type
        )
        return frozenset(range(n)) - linear
    if f.full_attention_interval is None:
        raise ValueError(
            f"config is missing 'full_attention_interval' (needed for model_type "
            f"{model_type!r} without layer_types)"
        )
    every = f.full_attention_interval
    return frozenset(i for i in range(n) if (i + 1) % every == 0)


def build_qwen3_next(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """Qwen3-Next: full-attention layers get a :class:`GQABackend` (group ``kv``), the others
    a :class:`LinearAttentionBackend` (group ``linear_state``, one slot per request).

    ``kv_cache_dtype`` applies to the GQA layers. The state dtypes are vLLM's
    (:func:`gated_deltanet_state_dtypes`): the conv state in ``mamba_cache_dtype``, the
    recurrent state in ``mamba_ssm_cache_dtype``, both ``"auto"`` by default: the model dtype
    (SGLang keeps the recurrent state in float32: ``mamba_ssm_cache_dtype="float32"`` plans
    that). ``tp_size`` must divide ``linear_num_key_heads`` and ``linear_num_value_heads``. MTP
    layers (only with ``num_speculative_tokens`` and ``num_nextn_predict_layers``) are full
    attention, and the draft tokens widen every conv state.
    """
    return gated_deltanet_layers(config, model_type, options)


def gated_deltanet_state_dtypes(
    config: Mapping[str, Any], model_type: str, options: ModelOptions, ssm_auto: str | None = None
) -> tuple[str, str]:
    """``(conv dtype, recurrent dtype)`` of a Gated DeltaNet layer, as vLLM resolves them
    (``MambaStateDtypeCalculator.gated_delta_net_state_dtype`` in
    ``vllm/model_executor/layers/mamba/mamba_utils.py``, which Qwen3-Next's and Qwen3.5's
    ``get_mamba_state_dtype_from_config`` call with the cache config's options): the conv
    state takes ``mamba_cache_dtype`` (``"auto"``: the model dtype); the recurrent state
    ``mamba_ssm_cache_dtype``, whose ``"auto"`` is ``ssm_auto`` (what the family's config
    says, e.g. Qwen3.5's ``mamba_ssm_dtype``), else the conv state's dtype.

    vLLM's CPU platform switches an ``"auto"`` recurrent state to float32 on machines with
    AVX512-BF16 (``CpuPlatform.check_and_update_config`` in ``vllm/platforms/cpu.py``: its
    accelerated GDN kernel); ``mamba_ssm_cache_dtype="float32"`` plans that.
    """
    conv = options.mamba_cache_dtype
    conv = model_dtype(config, options.dtype, model_type) if conv in (None, "auto") else conv
    ssm = options.mamba_ssm_cache_dtype
    if ssm in (None, "auto"):
        ssm = conv if ssm_auto is None else ssm_auto
    return canonical_dtype(conv), canonical_dtype(ssm)


def gated_deltanet_layers(
    config: Mapping[str, Any],
    model_type: str,
    options: ModelOptions,
    *,
    recurrent_auto: str | None = None,
) -> dict[int, AttentionBackend]:
    """The layers of a Gated DeltaNet hybrid of Qwen3-Next's shape (see
    :func:`build_qwen3_next`); ``recurrent_auto`` is the recurrent dtype an ``"auto"``
    ``mamba_ssm_cache_dtype`` means for the family (``None``: the conv state's dtype)."""
    f = parse_fields(Qwen3NextFields, config, model_type)
    shape = _gqa_shape(f, config, model_type, options)
    full_layers = _qwen3_next_full(f, model_type)
    mtp = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    tp = options.tp_size
    for name, heads in (
        ("linear_num_key_heads", f.linear_num_key_heads),
        ("linear_num_value_heads", f.linear_num_value_heads),
    ):
        if heads % tp:
            raise ValueError(
                f"{name}={heads} is not divisible by tp_size={tp} (model_type {model_type!r}): "
                "tensor parallelism splits the linear-attention heads"
            )
    conv_dtype, recurrent_dtype = gated_deltanet_state_dtypes(
        config, model_type, options, recurrent_auto
    )
    full = shape.backend()
    linear = LinearAttentionBackend(
        f.linear_num_key_heads,
        f.linear_num_value_heads,
        f.linear_key_head_dim,
        f.linear_value_head_dim,
        f.linear_conv_kernel_dim,
        tp_size=tp,
        conv_dtype=conv_dtype,
        recurrent_dtype=recurrent_dtype,
        num_speculative_tokens=options.num_speculative_tokens if len(mtp) else 0,
    )
    backends: dict[int, AttentionBackend] = {
        i: full if i in full_layers else linear for i in range(f.num_hidden_layers)
    }
    backends.update(dict.fromkeys(mtp, full))
    return backends
