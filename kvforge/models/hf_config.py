"""Build the ``layer id -> AttentionBackend`` mapping of a model from its Hugging Face config.

:func:`from_hf_config` reads the cache-relevant fields of a ``config.json`` (a dict, a path, or
the name of a config bundled under :mod:`kvforge.models.configs`) and returns one backend per
cache layer, as a :class:`~kvforge.models.registry.ModelBackends` (a ``dict`` that also
carries the config's ``max_position_embeddings``). Layers of the same kind share one backend
instance.

Dispatch goes through :mod:`kvforge.models.registry`: ``model_type`` selects a
registered builder; ``architectures`` is the fallback when the ``model_type`` is absent or not
registered. The bundled families register there like any plugin:

=======================================================  =====================================
``model_type`` (builder)                                 backend
=======================================================  =====================================
``llama`` (:func:`build_gqa`), ``mistral``, ``mixtral``  :class:`GQABackend` (MHA when
(:func:`build_mistral`), ``qwen2``, ``qwen2_moe``,       ``num_key_value_heads`` is absent)
``qwen3``, ``qwen3_moe`` (:func:`build_qwen`)
``deepseek_v2``, ``deepseek_v3`` (:func:`build_mla`)     :class:`MLABackend`
``deepseek_v32`` (:func:`build_dsa`; or V2/V3 with       :class:`DSABackend`
``index_head_dim``)
``deepseek_v4`` (:func:`build_deepseek_v4`)              :class:`DeepseekV4Backend`, one per
                                                         compress ratio in ``compress_ratios``
=======================================================  =====================================

The ``build_*`` functions are public so a plugin can register one of them for another
``model_type`` of the same shape (``register_model_type("internlm3", build_gqa, ...)``).

Rules a reader can check against the code:

- **Layer ids.** Main layers are ``0 .. num_hidden_layers - 1``. MTP / next-n layers
  (``num_nextn_predict_layers``, default 0) are cache layers only with
  ``num_speculative_tokens > 0`` (as in vLLM and SGLang, which allocate 61 cache layers for
  DeepSeek-V3 unless speculative decoding is on); they then have ids
  ``num_hidden_layers .. num_hidden_layers + n - 1``. GQA, MLA and DSA MTP layers use the main
  (full-attention) backend. A DeepSeek-V4 MTP layer ``k`` takes its ratio from
  ``compress_ratios[num_hidden_layers + k]`` when the list is that long, else ratio 0.
  Entries past the last cache layer are ignored (a published V4-Flash variant pads the list).
  A model has at most :data:`~kvforge.models.registry.MAX_LAYERS` (4096) cache layers.
- **GQA head counts.** ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA);
  ``head_dim`` defaults to ``hidden_size // num_attention_heads``. With tensor parallelism the
  cache holds ``max(1, num_key_value_heads // tp_size)`` kv heads per rank: ``tp_size`` must
  divide ``num_key_value_heads``, or (replication) ``num_key_value_heads`` must divide
  ``tp_size``. MLA, DSA and V4 caches hold one latent per token on every rank, whatever
  ``tp_size`` is.
- **Sliding windows (GQA).** When ``layer_types`` is present it decides per layer
  (``"full_attention"`` / ``"sliding_attention"``, the latter with window ``sliding_window``).
  Otherwise: Mistral / Mixtral slide on every layer when ``sliding_window`` is not null;
  Qwen2 / Qwen3 slide only when ``use_sliding_window`` is true, on layers
  ``>= max_window_layers`` (Hugging Face's rule); Llama never slides. A sliding layer gets a
  :class:`GQABackend` with ``sliding_window=W`` (group ``swa``), a full layer the plain one
  (group ``kv``).
- **Dtypes.** ``dtype`` defaults to the config's ``torch_dtype`` (or ``dtype``) when it is
  ``float16``, ``bfloat16`` or ``float32``, else ``"bfloat16"``; it is the cache dtype of GQA
  and MLA unless ``kv_cache_dtype`` says otherwise. ``kv_cache_dtype`` for GQA: ``None`` /
  ``"auto"`` (model dtype), a float dtype, ``"fp8"`` or ``"block_wise_fp8"``; for MLA: ``None``
  / ``"auto"``, a float dtype or ``"fp8"`` (576 fp8 values per token); for DSA and V4:
  ``"fp8"`` (default) or ``"bf16"``, and ``dtype`` does not apply (it is an error to set it).
- **DeepSeek-V4 ratios.** ``compress_ratios`` entries are 0, 4 or 128; an entry 1 (no
  compression, as some configs write it, e.g. vllm-ascend's ``[1, 1, 4, 128]``) loads as 0.
- **Block sizes.** ``block_size`` defaults to 16 for GQA and 64 for MLA / DSA. DeepSeek-V4
  block sizes are fixed by its groups, so passing ``block_size`` for V4 is an error.

Every problem is a ``ValueError`` (or ``FileNotFoundError`` / ``TypeError``) whose message
names the field, its value and the model type. A builder that returns something other than
``{int >= 0: AttentionBackend}`` is a bug in that builder: ``TypeError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.deepseek_v4 import COMPRESS_RATIOS, DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.gqa import GQABackend, KVCacheQuant
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.attn_backends.mla import MLABackend
from kvforge.models.registry import (
    MAX_LAYERS,
    ModelBackends,
    ModelOptions,
    RegisteredModelType,
    parse_fields,
    register_model_type,
    registered_model_types,
    short_repr,
)
from kvforge.specs import canonical_dtype

__all__ = [
    "ModelBackends",
    "ModelOptions",
    "build_deepseek_v4",
    "build_dsa",
    "build_gemma2",
    "build_gemma3",
    "build_gpt_oss",
    "build_gqa",
    "build_llama4",
    "build_mistral",
    "build_mla",
    "build_qwen",
    "build_qwen3_next",
    "bundled_models",
    "from_hf_config",
    "load_model_config",
]

ConfigSource = Mapping[str, Any] | str | os.PathLike

_BUNDLE_PACKAGE = "kvforge.models.configs"

_MODEL_DTYPES = ("float16", "bfloat16", "float32")
_FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")
_BF16_NAMES = ("bf16", "bfloat16")
_LATENT_DTYPE = "its cache dtype is set by kv_cache_dtype ('fp8' or 'bf16')"

# ---------------------------------------------------------------------------------- fields

PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
LayerCount = Annotated[StrictInt, Field(gt=0, le=MAX_LAYERS)]


class _LayerFields(BaseModel):
    """Fields every family reads. ``null`` in the config counts as absent."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    num_hidden_layers: LayerCount
    num_nextn_predict_layers: Annotated[StrictInt, Field(ge=0, le=MAX_LAYERS)] = 0


class GQAFields(_LayerFields):
    """Cache fields of a Llama / Mistral / Qwen style GQA or MHA model."""

    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    sliding_window: PositiveInt | None = None
    use_sliding_window: StrictBool = False
    max_window_layers: NonNegativeInt | None = None
    layer_types: list[StrictStr] | None = None


class MLAFields(_LayerFields):
    """Cache fields of a DeepSeek V2 / V3 (MLA) model."""

    kv_lora_rank: PositiveInt
    qk_rope_head_dim: PositiveInt


class DSAFields(MLAFields):
    """Cache fields of a DeepSeek V3.2 (DSA) model: MLA plus the indexer key width."""

    index_head_dim: PositiveInt


class V4Fields(_LayerFields):
    """Cache fields of a DeepSeek-V4 model."""

    compress_ratios: list[StrictInt]
    sliding_window: PositiveInt
    head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    index_head_dim: PositiveInt


# ---------------------------------------------------------------------------------- loading


def bundled_models() -> list[str]:
    """Sorted names of the configs bundled with kvforge (file stems, e.g. ``"llama-3-8b"``)."""
    root = resources.files(_BUNDLE_PACKAGE)
    return sorted(
        entry.name.removesuffix(".json")
        for entry in root.iterdir()
        if entry.is_file() and entry.name.endswith(".json")
    )


def _read_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin} is not valid JSON: {exc}") from None
    except RecursionError:
        # json's decoder recurses once per nesting level; no config nests more than a few.
        raise ValueError(
            f"{origin} nests JSON arrays or objects too deeply to be a model config"
        ) from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise ValueError(f"{origin} is not a usable JSON config: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{origin} must hold a JSON object (a Hugging Face config), got {type(data).__name__}"
        )
    return data


def load_model_config(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """Read a model config: a path to a ``config.json`` (or to a directory holding one), or
    the name of a bundled config (see :func:`bundled_models`).

    An existing path wins over a bundled name.

    Raises:
        FileNotFoundError: nothing exists at the path and no bundled config has that name.
        ValueError: the file is not valid JSON, nests too deeply, or does not hold a JSON
            object.
        TypeError: the argument is neither a string nor a path.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path must be a str or os.PathLike, got {type(name_or_path).__name__}"
        )
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"directory {str(name_or_path)!r} holds no config.json")
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {exc}") from None
        return _read_json(text, f"config file {str(path)!r}")
    name = str(name_or_path)
    if isinstance(name_or_path, str) and name in bundled_models():
        text = resources.files(_BUNDLE_PACKAGE).joinpath(f"{name}.json").read_text("utf-8")
        return _read_json(text, f"bundled config {name!r}")
    raise FileNotFoundError(
        f"no config file at {name!r} and no bundled model config named {name!r}; "
        f"bundled: {bundled_models()}"
    )


# ---------------------------------------------------------------------------------- helpers


def _model_dtype(config: Mapping[str, Any], dtype: str | None) -> str:
    if dtype is not None:
        return dtype  # already checked by from_hf_config
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str):
            try:
                name = canonical_dtype(value)
            except ValueError:
                continue
            if name in _MODEL_DTYPES:
                return name
    return "bfloat16"


def _latent_cache_dtype(kv_cache_dtype: str | None, model_type: str) -> Literal["fp8", "bf16"]:
    """DSA / V4: ``"fp8"`` or ``"bf16"``."""
    if kv_cache_dtype is None or kv_cache_dtype in _FP8_NAMES:
        return "fp8"
    if kv_cache_dtype in _BF16_NAMES:
        return "bf16"
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported for model_type {model_type!r}; "
        "use 'fp8' or 'bf16'"
    )


def _float_cache_dtype(kv_cache_dtype: str, model_type: str, allowed: str) -> str:
    try:
        name = canonical_dtype(kv_cache_dtype)
    except ValueError:
        name = ""
    if name not in _MODEL_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported for model_type "
            f"{model_type!r}; use {allowed}"
        )
    return name


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

    dtype = _model_dtype(dtype_config, opts.dtype)
    quant: KVCacheQuant | None = None
    kv = opts.kv_cache_dtype
    if kv is None or kv == "auto":
        pass
    elif kv in _FP8_NAMES:
        quant = "fp8"
    elif kv == "block_wise_fp8":
        quant = "block_wise_fp8"
    else:
        dtype = _float_cache_dtype(
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


# ---------------------------------------------------------------------------------- MLA / DSA


def build_mla(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> dict[int, AttentionBackend]:
    """DeepSeek V2 / V3 (MLA); a config with ``index_head_dim`` is DSA (:func:`build_dsa`)."""
    if config.get("index_head_dim") is not None:
        return build_dsa(config, model_type, options)
    f = parse_fields(MLAFields, config, model_type)
    dtype = _model_dtype(config, options.dtype)
    kv = options.kv_cache_dtype
    if kv is None or kv == "auto":
        pass
    elif kv in _FP8_NAMES:
        dtype = "float8_e4m3fn"
    else:
        dtype = _float_cache_dtype(
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
    """DeepSeek V3.2 (DSA): MLA's latent plus an indexer key per token."""
    f = parse_fields(DSAFields, config, model_type)
    options.refuse(model_type, "dtype", why=_LATENT_DTYPE)
    kv_cache_dtype = _latent_cache_dtype(options.kv_cache_dtype, model_type)
    mtp = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    backend = DSABackend(
        kv_lora_rank=f.kv_lora_rank,
        qk_rope_head_dim=f.qk_rope_head_dim,
        index_head_dim=f.index_head_dim,
        block_size=options.block_size if options.block_size is not None else 64,
        kv_cache_dtype=kv_cache_dtype,
    )
    return dict.fromkeys([*range(f.num_hidden_layers), *mtp], backend)


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
    options.refuse(model_type, "dtype", why=_LATENT_DTYPE)
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
    kv_cache_dtype = _latent_cache_dtype(options.kv_cache_dtype, model_type)
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


# ---------------------------------------------------------------------------------- hybrids
# Gemma-2 / Gemma-3 / gpt-oss (sliding + full), Llama-4 (chunked + full), Qwen3-Next
# (linear + full). Multimodal configs (``gemma3``, ``llama4``) nest the language model's fields
# under ``text_config``; the builders read them there.

_TEXT_PREFIXES = (
    ("config is missing ", "config.text_config is missing "),
    ("config has null for ", "config.text_config has null for "),
    ("config field ", "config field text_config."),
)


def _text_config(config: Mapping[str, Any], model_type: str) -> Mapping[str, Any]:
    """The language model's fields: ``text_config`` when the config has one (multimodal
    wrappers), else the config itself. The wrapper's ``torch_dtype`` / ``dtype`` applies when
    ``text_config`` states none (published Gemma-3 and Llama-4 configs keep it outside)."""
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, Mapping):
        raise ValueError(
            f"config field text_config = {short_repr(text)} is invalid for model_type "
            f"{model_type!r}: it must be a JSON object"
        )
    merged = dict(text)
    if merged.get("torch_dtype") is None and merged.get("dtype") is None:
        for key in ("torch_dtype", "dtype"):
            if config.get(key) is not None:
                merged[key] = config[key]
    return merged


def _nested_errors(config: Mapping[str, Any], error: ValueError) -> ValueError:
    """``error`` with the field named inside ``text_config`` when the fields came from there."""
    message = str(error)
    if config.get("text_config") is not None:
        for old, new in _TEXT_PREFIXES:
            if message.startswith(old):
                return ValueError(new + message[len(old) :])
    return ValueError(message)


def _with_max_len(
    backends: Mapping[int, AttentionBackend], text: Mapping[str, Any], model_type: str
) -> ModelBackends:
    """The backends plus ``max_position_embeddings`` of the (possibly nested) text config."""
    return ModelBackends(
        backends,
        model_type=model_type,
        max_position_embeddings=_max_position_embeddings(text, model_type),
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
    (pattern 6: five local layers, then one global)."""
    text = _text_config(config, model_type)
    try:
        source = dict(text)
        if source.get("sliding_window_pattern") is None:
            # transformers >= 4.53 saves the same number under a private name
            source["sliding_window_pattern"] = text.get("_sliding_window_pattern")
        every = parse_fields(Gemma3Pattern, source, model_type).sliding_window_pattern

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
        raise _nested_errors(config, exc) from None
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
    text = _text_config(config, model_type)
    try:
        f = parse_fields(Llama4Fields, text, model_type)
        shape = _gqa_shape(f, text, model_type, options)
        chunked = _llama4_chunked(f, model_type)
        mtp = options.mtp_layer_ids(f.num_hidden_layers, f.num_nextn_predict_layers, model_type)
    except ValueError as exc:
        raise _nested_errors(config, exc) from None
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

    ``kv_cache_dtype`` applies to the GQA layers; the conv state takes the model dtype and the
    recurrent state is float32, as in SGLang. ``tp_size`` must divide
    ``linear_num_key_heads`` and ``linear_num_value_heads``. MTP layers (only with
    ``num_speculative_tokens`` and ``num_nextn_predict_layers``) are full attention, and the
    draft tokens widen every conv state.
    """
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
    full = shape.backend()
    linear = LinearAttentionBackend(
        f.linear_num_key_heads,
        f.linear_num_value_heads,
        f.linear_key_head_dim,
        f.linear_value_head_dim,
        f.linear_conv_kernel_dim,
        tp_size=tp,
        conv_dtype=_model_dtype(config, options.dtype),
        recurrent_dtype="float32",
        num_speculative_tokens=options.num_speculative_tokens if len(mtp) else 0,
    )
    backends: dict[int, AttentionBackend] = {
        i: full if i in full_layers else linear for i in range(f.num_hidden_layers)
    }
    backends.update(dict.fromkeys(mtp, full))
    return backends


# ---------------------------------------------------------------------------------- dispatch


def _registration(config: Mapping[str, Any]) -> RegisteredModelType:
    types = registered_model_types()
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in types:
        return types[model_type]
    architectures = config.get("architectures")
    if isinstance(architectures, (list, tuple)):
        for arch in architectures:
            for entry in types.values():
                if isinstance(arch, str) and arch in entry.architectures:
                    return entry
    raise ValueError(
        f"unsupported model_type {short_repr(model_type)} (architectures "
        f"{short_repr(architectures)}); registered model_type values: {', '.join(types)} "
        "(a plugin registers more: kvforge.models.registry.register_model_type)"
    )


def _check_layer_counts(config: Mapping[str, Any]) -> None:
    """Refuse an absurd layer count before any builder loops over it."""
    for key in ("num_hidden_layers", "num_nextn_predict_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LAYERS:
            raise ValueError(
                f"config field {key} = {short_repr(value)} is out of range: kvforge supports "
                f"at most {MAX_LAYERS} cache layers per model (MAX_LAYERS)"
            )


def _max_position_embeddings(config: Mapping[str, Any], model_type: str) -> int | None:
    value = config.get("max_position_embeddings")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"config field max_position_embeddings = {short_repr(value)} is invalid for "
            f"model_type {model_type!r}: it must be a positive integer"
        )
    return value


def _checked_result(result: object, entry: RegisteredModelType) -> dict[int, AttentionBackend]:
    """What a builder returned, checked: a builder that breaks its contract is a bug."""
    where = f"the builder of model_type {entry.model_type!r} ({entry.builder!r})"
    if not isinstance(result, Mapping):
        raise TypeError(f"{where} returned {type(result).__name__}, not a mapping")
    if not result:
        raise TypeError(f"{where} returned no layers")
    for layer, backend in result.items():
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise TypeError(f"{where} returned layer id {short_repr(layer)}; ids are ints >= 0")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"{where} returned {type(backend).__name__} for layer {layer}, not an "
                "AttentionBackend"
            )
    if len(result) > MAX_LAYERS:
        raise ValueError(
            f"model_type {entry.model_type!r} has {len(result)} cache layers; kvforge supports "
            f"at most {MAX_LAYERS} (MAX_LAYERS)"
        )
    return {layer: result[layer] for layer in sorted(result)}


def _options(**kwargs: Any) -> ModelOptions:
    try:
        opts = ModelOptions(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"])
        raise ValueError(
            f"{field}={short_repr(err.get('input'))} is invalid: {err['msg']}"
        ) from None
    if opts.dtype is not None:
        try:
            name = canonical_dtype(opts.dtype)
        except ValueError:
            name = ""
        if name not in _MODEL_DTYPES:
            raise ValueError(
                f"dtype={opts.dtype!r} is not a model dtype; use one of {list(_MODEL_DTYPES)}"
            )
        opts = opts.model_copy(update={"dtype": name})
    return opts


def from_hf_config(
    config: ConfigSource,
    *,
    block_size: int | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    tp_size: int = 1,
    num_speculative_tokens: int = 0,
) -> ModelBackends:
    """The ``layer id -> backend`` mapping of a model, from its Hugging Face config.

    Args:
        config: the parsed ``config.json`` (a mapping), a path to it (or to the directory
            holding it), or the name of a bundled config (see :func:`bundled_models`).
        block_size: tokens per block; default 16 for GQA, 64 for MLA / DSA. Not allowed for
            DeepSeek-V4, whose groups fix their block sizes.
        dtype: model / cache dtype for GQA and MLA; default from the config's ``torch_dtype``
            when it is a float dtype, else ``"bfloat16"``. Not allowed for DSA and V4.
        kv_cache_dtype: cache storage (see the module docstring); default: the model dtype for
            GQA / MLA, ``"fp8"`` for DSA / V4.
        tp_size: tensor-parallel ranks; GQA caches hold ``max(1, kv_heads // tp_size)`` heads.
        num_speculative_tokens: draft tokens per step; the MTP layers
            (``num_nextn_predict_layers``) get caches only when it is > 0, and then the model
            must have some.

    Returns:
        A :class:`~kvforge.models.registry.ModelBackends`: ``{layer_id: backend}``
        with ascending ids, main layers first, then MTP layers; layers of the same kind share
        one backend instance. It is a ``dict`` subclass (index it by layer id as before) that
        also carries ``model_type`` and the config's ``max_position_embeddings`` (``None``
        when absent), the default ``max_model_len`` of a memory plan.

    Raises:
        ValueError: an unsupported ``model_type``, a missing, null or invalid field, more than
            :data:`~kvforge.models.registry.MAX_LAYERS` layers, an inconsistent config,
            or bad options (also one that does not apply to the model); the message names the
            field and the value.
        FileNotFoundError: ``config`` is a path or name that does not exist.
        TypeError: ``config`` is not a mapping, string or path; or a registered builder
            returned something other than ``{int >= 0: AttentionBackend}``.
    """
    if isinstance(config, (str, os.PathLike)):
        config = load_model_config(config)
    elif not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a mapping (a parsed config.json), a path or a bundled model "
            f"name, got {type(config).__name__}"
        )
    opts = _options(
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        tp_size=tp_size,
        num_speculative_tokens=num_speculative_tokens,
    )
    entry = _registration(config)
    _check_layer_counts(config)
    max_len = _max_position_embeddings(config, entry.model_type)
    result = entry.builder(config, entry.model_type, opts)
    if isinstance(result, ModelBackends) and result.max_position_embeddings is not None:
        max_len = result.max_position_embeddings
    return ModelBackends(
        _checked_result(result, entry), model_type=entry.model_type, max_position_embeddings=max_len
    )


# ---------------------------------------------------------------------------------- bundled
# Registered through the public API, exactly as a plugin would.

_BUNDLED: tuple[tuple[str, Callable[..., dict[int, AttentionBackend]], str], ...] = (
    ("llama", build_gqa, "LlamaForCausalLM"),
    ("mistral", build_mistral, "MistralForCausalLM"),
    ("mixtral", build_mistral, "MixtralForCausalLM"),
    ("qwen2", build_qwen, "Qwen2ForCausalLM"),
    ("qwen2_moe", build_qwen, "Qwen2MoeForCausalLM"),
    ("qwen3", build_qwen, "Qwen3ForCausalLM"),
    ("qwen3_moe", build_qwen, "Qwen3MoeForCausalLM"),
    ("deepseek_v2", build_mla, "DeepseekV2ForCausalLM"),
    ("deepseek_v3", build_mla, "DeepseekV3ForCausalLM"),
    ("deepseek_v32", build_dsa, "DeepseekV32ForCausalLM"),
    ("deepseek_v4", build_deepseek_v4, "DeepseekV4ForCausalLM"),
    ("gemma2", build_gemma2, "Gemma2ForCausalLM"),
    ("gemma3", build_gemma3, "Gemma3ForConditionalGeneration"),
    ("gemma3_text", build_gemma3, "Gemma3ForCausalLM"),
    ("gpt_oss", build_gpt_oss, "GptOssForCausalLM"),
    ("llama4", build_llama4, "Llama4ForConditionalGeneration"),
    ("llama4_text", build_llama4, "Llama4ForCausalLM"),
    ("glm4_moe", build_gqa, "Glm4MoeForCausalLM"),
    ("qwen3_next", build_qwen3_next, "Qwen3NextForCausalLM"),
)

for _model_type, _builder, _arch in _BUNDLED:
    register_model_type(_model_type, _builder, architectures=(_arch,))
