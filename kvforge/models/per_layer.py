"""Builders of the families whose layers differ in cache shape.

Each layer is a declaration of its own: a :class:`GQABackend` with that layer's kv heads, key
and value widths and window, or no backend at all for a layer that keeps no cache. Four
capabilities, each read from the config as the engines read it:

- **per-layer kv heads and head dims**: Llama-Nemotron NAS (``nemotron-nas``, DeciLM's
  ``block_configs``), Gemma-4 (its full layers use ``global_head_dim`` and, with
  ``attention_k_eq_v``, ``num_global_key_value_heads``), MiMo-V2 (window and full layers with
  their own heads);
- **layers without attention**: a NAS block whose ``attention.no_op`` is true has no cache;
- **key and value widths that differ**: MiMo-V2 (``head_dim`` 192, ``v_head_dim`` 128),
  ``GQABackend(head_dim_v=...)``;
- **cross-layer KV sharing**: the last ``num_kv_shared_layers`` layers of Gemma-3n and
  Gemma-4 read an earlier layer's cache and own none, as vLLM's
  ``kv_sharing_target_layer_name``: its ``GPUModelRunner.get_kv_cache_spec``
  (``vllm/v1/worker/gpu_model_runner.py``) skips such a layer, "so that KV cache management
  logic will act as this layer does not exist". :func:`kv_sharing` names the layer each one
  reads.

Layer ids stay the model's own (``model.layers.{i}``): a layer without a cache is absent from
the mapping, so ids may have gaps. MTP layers (MiMo-V2's one, only with
``num_speculative_tokens``) follow the main layers, as in
:mod:`kvforge.models.hf_config`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.gqa import GQABackend, KVCacheQuant
from kvforge.models.base import (
    LayerFields,
    ModelBackends,
    ModelOptions,
    NonNegativeInt,
    PositiveInt,
    parse_fields,
    short_repr,
)
from kvforge.models.reading import (
    FP8_NAMES,
    float_cache_dtype,
    max_position_embeddings,
    model_dtype,
    nested_errors,
    text_config,
)

__all__ = [
    "Gemma3nFields",
    "Gemma4Fields",
    "MiMoV2Fields",
    "NemotronNasFields",
    "build_gemma3n",
    "build_gemma4",
    "build_mimo_v2",
    "build_nemotron_nas",
    "kv_sharing",
]

_KINDS = ("full_attention", "sliding_attention")
_MIMO_V2_MTP_LAYERS = 1
"""MTP layers vLLM gives MiMo-V2 whatever ``num_nextn_predict_layers`` says
(``_MIMO_V2_FLASH_NUM_MTP_LAYERS`` in ``vllm/model_executor/models/mimo_v2_mtp.py``: "vLLM
currently supports only the first MiMo-V2 MTP layer")."""

# ---------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class _Storage:
    """What every layer of a model shares: cache dtype (or fp8 quant), block size, ranks."""

    dtype: str
    quant: KVCacheQuant | None
    block_size: int
    tp_size: int


def _storage(config: Mapping[str, Any], model_type: str, opts: ModelOptions) -> _Storage:
    """Cache storage from the options, by the GQA rules of :mod:`kvforge.models.hf_config`."""
    dtype = model_dtype(config, opts.dtype, model_type)
    quant: KVCacheQuant | None = None
    kv = opts.kv_cache_dtype
    if kv in FP8_NAMES:
        quant = "fp8"
    elif kv == "block_wise_fp8":
        quant = "block_wise_fp8"
    elif kv is not None and kv != "auto":
        dtype = float_cache_dtype(
            kv, model_type, "'auto', 'fp8', 'block_wise_fp8', 'bfloat16', 'float16' or 'float32'"
        )
    block = opts.block_size if opts.block_size is not None else 16
    return _Storage(dtype, quant, block, opts.tp_size)


def _kv_per_rank(heads: int, kv_heads: int, tp: int, where: str, model_type: str) -> int:
    """Kv heads one rank caches (vLLM's ``max(1, total_num_kv_heads // tp_size)``), checked:
    ``tp_size`` divides the heads, and the kv heads split or replicate evenly."""
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads="
            f"{kv_heads} (model_type {model_type!r})"
        )
    if heads % tp or (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
        raise ValueError(
            f"{where}: tp_size={tp} does not fit num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads}: tp_size must divide the heads, and divide the kv "
            f"heads or be a multiple of them (model_type {model_type!r})"
        )
    return max(1, kv_heads // tp)


class _Backends:
    """One :class:`GQABackend` per distinct layer shape (layers of a shape share it)."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage
        self.made: dict[tuple[int, int, int, int | None], GQABackend] = {}

    def get(self, kv_per_rank: int, head_dim: int, head_dim_v: int, window: int | None):
        key = (kv_per_rank, head_dim, head_dim_v, window)
        if key not in self.made:
            s = self.storage
            self.made[key] = GQABackend(
                kv_per_rank,
                head_dim,
                s.block_size,
                s.dtype,
                s.quant,
                sliding_window=window,
                head_dim_v=head_dim_v,
            )
        return self.made[key]


def _layer_types(
    layer_types: list[str], n: int, model_type: str, where: str = "layer_types"
) -> list[str]:
    if len(layer_types) != n:
        raise ValueError(
            f"{where} has {len(layer_types)} entries but num_hidden_layers={n} "
            f"(model_type {model_type!r})"
        )
    for i, kind in enumerate(layer_types):
        if kind not in _KINDS:
            raise ValueError(
                f"{where}[{i}]={short_repr(kind)} is not one of {list(_KINDS)} "
                f"(model_type {model_type!r})"
            )
    return layer_types


# ---------------------------------------------------------------------------------- NAS


class NemotronNasAttention(BaseModel):
    """``block_configs[i].attention`` of a DeciLM / Llama-Nemotron NAS config."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    no_op: StrictBool = False
    n_heads_in_group: PositiveInt | None = None
    replace_with_linear: StrictBool = False


class NemotronNasBlock(BaseModel):
    """One entry of ``block_configs`` (the ``ffn`` part holds no cache)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    attention: NemotronNasAttention


class NemotronNasFields(LayerFields):
    """Cache fields of ``nemotron-nas`` (DeciLM): one block config per layer."""

    num_attention_heads: PositiveInt
    hidden_size: PositiveInt
    head_dim: PositiveInt | None = None
    block_configs: list[NemotronNasBlock]


def build_nemotron_nas(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """Llama-Nemotron NAS (``nemotron-nas``, ``DeciLMForCausalLM``), as vLLM's
    ``DeciLMDecoderLayer`` (``vllm/model_executor/models/nemotron_nas.py``) builds it.

    Layer ``i`` has attention unless ``block_configs[i].attention.no_op``; then it has no
    cache and is absent from the result. Its kv heads are ``num_attention_heads //
    n_heads_in_group`` of that block; ``head_dim`` is ``config.head_dim`` or ``hidden_size //
    num_attention_heads`` (vLLM's ``LlamaAttention``). A block with ``replace_with_linear``
    attention is refused: vLLM builds attention for it all the same. The window fields of a
    block (``window_length``, ...) are not read by vLLM and not by kvforge.
    """
    f = parse_fields(NemotronNasFields, config, model_type)
    n, heads = f.num_hidden_layers, f.num_attention_heads
    if len(f.block_configs) != n:
        raise ValueError(
            f"block_configs has {len(f.block_configs)} entries but num_hidden_layers={n} "
            f"(model_type {model_type!r})"
        )
    options.mtp_layer_ids(n, f.num_nextn_predict_layers, model_type)  # refuses speculation
    head_dim = f.head_dim if f.head_dim is not None else f.hidden_size // heads
    made = _Backends(_storage(config, model_type, options))
    backends: dict[int, AttentionBackend] = {}
    for i, block in enumerate(f.block_configs):
        where = f"block_configs[{i}].attention"
        attn = block.attention
        if attn.no_op:
            continue
        if attn.replace_with_linear:
            raise ValueError(
                f"{where}.replace_with_linear=true is not supported (model_type "
                f"{model_type!r}): vLLM's nemotron_nas.py builds attention for such a block"
            )
        if attn.n_heads_in_group is None:
            raise ValueError(
                f"config is missing '{where}.n_heads_in_group' (needed for model_type "
                f"{model_type!r}: the block has attention, no_op is false)"
            )
        if heads % attn.n_heads_in_group:
            raise ValueError(
                f"{where}.n_heads_in_group={attn.n_heads_in_group} does not divide "
                f"num_attention_heads={heads} (model_type {model_type!r})"
            )
        kv = _kv_per_rank(heads, heads // attn.n_heads_in_group, options.tp_size, where, model_type)
        backends[i] = made.get(kv, head_dim, head_dim, None)
    if not backends:
        raise ValueError(
            f"block_configs has no block with attention (every attention.no_op is true): "
            f"model_type {model_type!r} would keep no KV cache"
        )
    return backends


# ---------------------------------------------------------------------------------- MiMo-V2


class MiMoV2Fields(LayerFields):
    """Cache fields of MiMo-V2 (``mimo_v2_flash``, ``mimo_v2``): full and sliding-window
    layers (``hybrid_layer_pattern``: 0 full, 1 sliding) with their own heads and widths."""

    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    v_head_dim: PositiveInt | None = None
    swa_num_attention_heads: PositiveInt
    swa_num_key_value_heads: PositiveInt
    swa_head_dim: PositiveInt
    swa_v_head_dim: PositiveInt | None = None
    sliding_window_size: PositiveInt
    hybrid_layer_pattern: list[Literal[0, 1]]


def build_mimo_v2(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """MiMo-V2 (``mimo_v2_flash``, ``mimo_v2``), as vLLM's ``MiMoV2FlashDecoderLayer``
    (``vllm/model_executor/models/mimo_v2.py``) builds it.

    ``hybrid_layer_pattern[i] == 1``: a sliding-window layer (window ``sliding_window_size``,
    group ``swa``) of ``swa_num_key_value_heads`` heads, keys ``swa_head_dim`` and values
    ``swa_v_head_dim`` wide; ``0``: a full layer (group ``kv``) of ``num_key_value_heads``,
    ``head_dim`` and ``v_head_dim``. A value width left out is the key's (vLLM's
    ``getattr(config, "v_head_dim", None)``), except ``v_head_dim`` of ``mimo_v2_flash``,
    which transformers' ``MiMoV2FlashConfig`` defaults to 128. One MTP layer (only with
    ``num_speculative_tokens``, whatever ``num_nextn_predict_layers`` says: vLLM's
    ``_MIMO_V2_FLASH_NUM_MTP_LAYERS``) is a sliding-window layer, as ``MiMoV2MTPLayer``
    (``mimo_v2_mtp.py``). Attention sinks are parameters, not cache.
    """
    f = parse_fields(MiMoV2Fields, config, model_type)
    n, tp = f.num_hidden_layers, options.tp_size
    if len(f.hybrid_layer_pattern) != n:
        raise ValueError(
            f"hybrid_layer_pattern has {len(f.hybrid_layer_pattern)} entries but "
            f"num_hidden_layers={n} (model_type {model_type!r})"
        )
    v_default = 128 if model_type == "mimo_v2_flash" else f.head_dim
    made = _Backends(_storage(config, model_type, options))
    full = made.get(
        _kv_per_rank(f.num_attention_heads, f.num_key_value_heads, tp, "full layers", model_type),
        f.head_dim,
        f.v_head_dim if f.v_head_dim is not None else v_default,
        None,
    )
    swa_kv = _kv_per_rank(
        f.swa_num_attention_heads, f.swa_num_key_value_heads, tp, "swa layers", model_type
    )
    swa_v = f.swa_v_head_dim if f.swa_v_head_dim is not None else f.swa_head_dim
    swa = made.get(swa_kv, f.swa_head_dim, swa_v, f.sliding_window_size)
    backends: dict[int, AttentionBackend] = {
        i: swa if kind == 1 else full for i, kind in enumerate(f.hybrid_layer_pattern)
    }
    backends.update(dict.fromkeys(options.mtp_layer_ids(n, _MIMO_V2_MTP_LAYERS, model_type), swa))
    return backends


# ---------------------------------------------------------------------------------- Gemma-3n / 4


class Gemma3nFields(LayerFields):
    """Gemma-3n's text fields, with transformers' ``Gemma3nTextConfig`` defaults (E4B's)."""

    num_hidden_layers: PositiveInt = 35
    num_attention_heads: PositiveInt = 8
    num_key_value_heads: PositiveInt = 2
    head_dim: PositiveInt = 256
    sliding_window: PositiveInt = 512
    layer_types: list[StrictStr] | None = None
    num_kv_shared_layers: NonNegativeInt = 15


class Gemma4Fields(LayerFields):
    """Gemma-4's text fields, with transformers' ``Gemma4TextConfig`` defaults."""

    num_hidden_layers: PositiveInt = 30
    num_attention_heads: PositiveInt = 8
    num_key_value_heads: PositiveInt = 4
    head_dim: PositiveInt = 256
    global_head_dim: PositiveInt = 512
    num_global_key_value_heads: PositiveInt | None = None
    attention_k_eq_v: StrictBool = False
    sliding_window: PositiveInt = 512
    layer_types: list[StrictStr] | None = None
    num_kv_shared_layers: NonNegativeInt = 0
    use_bidirectional_attention: StrictStr | None = None
    per_layer_config: dict[StrictStr, dict[str, Any]] | None = None


def _gemma3n_types(f: Gemma3nFields, model_type: str) -> list[str]:
    if f.layer_types is not None:
        return _layer_types(f.layer_types, f.num_hidden_layers, model_type)
    # transformers' Gemma3nTextConfig: every fifth layer is full
    return [_KINDS[0] if (i + 1) % 5 == 0 else _KINDS[1] for i in range(f.num_hidden_layers)]


def _gemma4_types(f: Gemma4Fields, model_type: str) -> list[str]:
    if f.layer_types is not None:
        types = list(_layer_types(f.layer_types, f.num_hidden_layers, model_type))
    else:  # transformers' Gemma4TextConfig: sliding_window_pattern 6 ("by default 5:1")
        types = [_KINDS[1] if (i + 1) % 6 else _KINDS[0] for i in range(f.num_hidden_layers)]
    types[-1] = _KINDS[0]  # "Last layer must use `full_attention`" (forced, with a warning)
    return types


def _gemma3n_targets(types: list[str], shared: int) -> dict[int, int]:
    """vLLM's ``Gemma3nAttention``: a shared full layer reads layer ``first - 1``, a shared
    sliding layer ``first - 2`` (``first = num_hidden_layers - num_kv_shared_layers``); a
    negative target means the layer keeps its own cache."""
    first = len(types) - shared
    targets = {}
    for i in range(first, len(types)):
        target = first - (2 if types[i] == _KINDS[1] else 1)
        if target >= 0:
            targets[i] = target
    return targets


def _gemma4_targets(types: list[str], shared: int, model_type: str) -> dict[int, int]:
    """vLLM's ``Gemma4Attention``: a shared layer reads the last non-shared layer of its
    type (a type no earlier layer has is an error there too)."""
    first = len(types) - shared
    targets = {}
    for i in range(first, len(types)) if shared else ():
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(
                f"layer {i} ({types[i]}) is one of the num_kv_shared_layers={shared} last "
                f"layers, but no earlier layer is {types[i]} to read (model_type {model_type!r})"
            )
        targets[i] = earlier[-1]
    return targets


def _gemma4_layer_shape(f: Gemma4Fields, types: list[str], model_type: str):
    """``layer -> (kv heads, head_dim)`` as transformers' ``Gemma4TextConfig`` fills
    ``per_layer_config`` (read by vLLM's ``Gemma4DecoderLayer``): a full layer takes
    ``global_head_dim`` and, when ``attention_k_eq_v``, ``num_global_key_value_heads``; a
    ``per_layer_config`` in the config replaces that rule."""
    overrides: dict[int, Mapping[str, Any]] = {}
    if f.per_layer_config is not None:
        for key, value in f.per_layer_config.items():
            if not key.strip().isdigit() or int(key) >= f.num_hidden_layers:
                raise ValueError(
                    f"config field per_layer_config key {key!r} is not a layer index below "
                    f"num_hidden_layers={f.num_hidden_layers} (model_type {model_type!r})"
                )
            overrides[int(key)] = value
    else:
        rule: dict[str, Any] = {"head_dim": f.global_head_dim}
        if f.attention_k_eq_v and f.num_global_key_value_heads is not None:
            rule["num_key_value_heads"] = f.num_global_key_value_heads
        overrides = {i: rule for i, kind in enumerate(types) if kind == _KINDS[0]}
    shapes = {}
    for i in range(f.num_hidden_layers):
        layer = parse_fields(_Gemma4Layer, {**f.model_dump(), **overrides.get(i, {})}, model_type)
        shapes[i] = (layer.num_key_value_heads, layer.head_dim)
    return shapes


class _Gemma4Layer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    num_key_value_heads: PositiveInt
    head_dim: PositiveInt


def kv_sharing(config: Mapping[str, Any]) -> dict[int, int]:
    """``{layer: the layer whose cache it reads}`` of a Gemma-3n or Gemma-4 config (empty for
    any other model type): the layers :func:`build_gemma3n` / :func:`build_gemma4` leave out
    of the plan, as vLLM gives them no cache of their own.

    Raises:
        ValueError: a bad field, named as the builders name it.
    """
    model_type = config.get("model_type")
    families: dict[str, Callable[[Mapping[str, Any], str], dict[int, int]]] = {
        "gemma3n": _gemma3n_sharing,
        "gemma3n_text": _gemma3n_sharing,
        "gemma4": _gemma4_sharing,
        "gemma4_text": _gemma4_sharing,
    }
    if not isinstance(model_type, str) or model_type not in families:
        return {}
    text = text_config(config, model_type)
    try:
        return families[model_type](text, model_type)
    except ValueError as exc:
        raise nested_errors(config, exc) from None


def _gemma3n_sharing(text: Mapping[str, Any], model_type: str) -> dict[int, int]:
    f = parse_fields(Gemma3nFields, text, model_type)
    return _gemma3n_targets(_gemma3n_types(f, model_type), _shared(f, model_type))


def _gemma4_sharing(text: Mapping[str, Any], model_type: str) -> dict[int, int]:
    f = parse_fields(Gemma4Fields, text, model_type)
    return _gemma4_targets(_gemma4_types(f, model_type), _shared(f, model_type), model_type)


def _shared(f: Gemma3nFields | Gemma4Fields, model_type: str) -> int:
    if f.num_kv_shared_layers >= f.num_hidden_layers:
        raise ValueError(
            f"config field num_kv_shared_layers = {f.num_kv_shared_layers} is invalid for "
            f"model_type {model_type!r}: it must be below num_hidden_layers="
            f"{f.num_hidden_layers} (some layer must own the cache the others read)"
        )
    return f.num_kv_shared_layers


def build_gemma3n(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Gemma-3n (``gemma3n`` with ``text_config``, or ``gemma3n_text``), as vLLM's
    ``Gemma3nAttention`` (``vllm/model_executor/models/gemma3n.py``) builds it.

    ``layer_types`` (default: every fifth layer full) picks a full layer (group ``kv``) or a
    sliding one (window ``sliding_window``, group ``swa``), all of ``num_key_value_heads``
    heads of ``head_dim``. The last ``num_kv_shared_layers`` (default 15) layers read an
    earlier layer's cache (:func:`kv_sharing`) and are absent from the result.
    """
    text = text_config(config, model_type)
    try:
        f = parse_fields(Gemma3nFields, text, model_type)
        types = _gemma3n_types(f, model_type)
        targets = _gemma3n_targets(types, _shared(f, model_type))
        options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
        tp = options.tp_size
        kv = _kv_per_rank(f.num_attention_heads, f.num_key_value_heads, tp, "layers", model_type)
        made = _Backends(_storage(text, model_type, options))
    except ValueError as exc:
        raise nested_errors(config, exc) from None
    backends: dict[int, AttentionBackend] = {
        i: made.get(kv, f.head_dim, f.head_dim, f.sliding_window if kind == _KINDS[1] else None)
        for i, kind in enumerate(types)
        if i not in targets
    }
    return ModelBackends(
        backends, model_type=model_type, max_position_embeddings=_max_len(text, model_type)
    )


def build_gemma4(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Gemma-4 (``gemma4`` with ``text_config``, or ``gemma4_text``), as vLLM's
    ``Gemma4DecoderLayer`` and ``Gemma4Attention`` (``vllm/model_executor/models/gemma4.py``)
    build it.

    Sliding layers (window ``sliding_window``, group ``swa``) have ``num_key_value_heads``
    heads of ``head_dim``; full layers (group ``kv``) ``global_head_dim`` and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads`` heads (:func:`_gemma4_layer_shape`).
    A full layer with ``attention_k_eq_v`` loads the key's weights into the value, and vLLM
    still stores both: both are planned. ``use_bidirectional_attention="all"`` narrows the
    window to ``sliding_window // 2 + 1``, as ``Gemma4TextConfig`` does. The last
    ``num_kv_shared_layers`` layers read an earlier layer's cache (:func:`kv_sharing`) and are
    absent from the result.
    """
    text = text_config(config, model_type)
    try:
        f = parse_fields(Gemma4Fields, text, model_type)
        types = _gemma4_types(f, model_type)
        targets = _gemma4_targets(types, _shared(f, model_type), model_type)
        shapes = _gemma4_layer_shape(f, types, model_type)
        options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
        made = _Backends(_storage(text, model_type, options))
        window = f.sliding_window
        if f.use_bidirectional_attention == "all":
            window = window // 2 + 1
        backends: dict[int, AttentionBackend] = {}
        for i, kind in enumerate(types):
            if i in targets:
                continue
            kv_heads, dim = shapes[i]
            where = f"layer {i}"
            kv = _kv_per_rank(f.num_attention_heads, kv_heads, options.tp_size, where, model_type)
            backends[i] = made.get(kv, dim, dim, window if kind == _KINDS[1] else None)
    except ValueError as exc:
        raise nested_errors(config, exc) from None
    return ModelBackends(
        backends, model_type=model_type, max_position_embeddings=_max_len(text, model_type)
    )


def _max_len(text: Mapping[str, Any], model_type: str) -> int | None:
    return max_position_embeddings(text, model_type)
