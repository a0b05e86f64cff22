"""Build the ``layer id -> AttentionBackend`` mapping of a model from its Hugging Face config.

:func:`from_hf_config` reads the cache-relevant fields of a ``config.json`` (a dict, a path, or
the name of a config bundled under :mod:`kvforge.model_configs`) and returns one backend per
cache layer. Layers of the same kind share one backend instance.

Supported families (dispatch on ``model_type``; ``architectures`` is the fallback when the
``model_type`` is absent or unknown):

=======================================================  =====================================
``model_type``                                           backend
=======================================================  =====================================
``llama``, ``mistral``, ``mixtral``, ``qwen2``,          :class:`GQABackend` (MHA when
``qwen2_moe``, ``qwen3``, ``qwen3_moe``                  ``num_key_value_heads`` is absent)
``deepseek_v2``, ``deepseek_v3``                         :class:`MLABackend`
``deepseek_v32`` (or V2/V3 with ``index_head_dim``)      :class:`DSABackend`
``deepseek_v4``                                          :class:`DeepseekV4Backend`, one per
                                                         compress ratio in ``compress_ratios``
=======================================================  =====================================

Rules a reader can check against the code:

- **Layer ids.** Main layers are ``0 .. num_hidden_layers - 1``. MTP / next-n layers
  (``num_nextn_predict_layers``, default 0) are cache layers too, with ids
  ``num_hidden_layers .. num_hidden_layers + n - 1``. GQA, MLA and DSA MTP layers use the
  main (full-attention) backend. A DeepSeek-V4 MTP layer ``k`` takes its ratio from
  ``compress_ratios[num_hidden_layers + k]`` when the list is that long, else ratio 0.
  Entries past the last cache layer are ignored (a published V4-Flash variant pads the list).
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
  ``"fp8"`` (default) or ``"bf16"``.
- **Block sizes.** ``block_size`` defaults to 16 for GQA and 64 for MLA / DSA. DeepSeek-V4
  block sizes are fixed by its groups, so passing ``block_size`` for V4 is an error.

Every problem is a ``ValueError`` (or ``FileNotFoundError`` / ``TypeError``) whose message
names the field, its value and the model type.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.deepseek_v4 import COMPRESS_RATIOS, DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.gqa import GQABackend, KVCacheQuant
from kvforge.attn_backends.mla import MLABackend
from kvforge.specs import canonical_dtype

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "bundled_models",
    "from_hf_config",
    "load_model_config",
]

ConfigSource = Mapping[str, Any] | str | os.PathLike

_BUNDLE_PACKAGE = "kvforge.model_configs"

_GQA_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_MLA_TYPES = ("deepseek_v2", "deepseek_v3")
_DSA_TYPES = ("deepseek_v32",)
_V4_TYPES = ("deepseek_v4",)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(
    sorted(_GQA_TYPES + _MLA_TYPES + _DSA_TYPES + _V4_TYPES)
)
"""Every ``model_type`` :func:`from_hf_config` understands."""

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}

_MODEL_DTYPES = ("float16", "bfloat16", "float32")
_FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")
_BF16_NAMES = ("bf16", "bfloat16")

# ---------------------------------------------------------------------------------- fields

PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]


class _LayerFields(BaseModel):
    """Fields every family reads. ``null`` in the config counts as absent."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    num_hidden_layers: PositiveInt
    num_nextn_predict_layers: NonNegativeInt = 0


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


class _Options(BaseModel):
    """The keyword arguments of :func:`from_hf_config`, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: PositiveInt | None = None
    dtype: StrictStr | None = None
    kv_cache_dtype: StrictStr | None = None
    tp_size: PositiveInt = 1


_F = TypeVar("_F", bound=_LayerFields)


def _where(loc: tuple[int | str, ...]) -> str:
    text = str(loc[0])
    for part in loc[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _parse(fields: type[_F], config: Mapping[str, Any], model_type: str) -> _F:
    """Validate the fields ``fields`` reads from ``config``, with errors that name them."""
    for name, info in fields.model_fields.items():
        if info.is_required() and config.get(name) is None:
            state = "is missing" if name not in config else "has null for"
            raise ValueError(f"config {state} {name!r} (needed for model_type {model_type!r})")
    data = {k: v for k, v in config.items() if k in fields.model_fields and v is not None}
    try:
        return fields.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(
            f"config field {_where(err['loc'])} = {err.get('input')!r} is invalid for "
            f"model_type {model_type!r}: {err['msg']}"
        ) from None


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
        ValueError: the file is not valid JSON or does not hold a JSON object.
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


# ---------------------------------------------------------------------------------- dispatch


def _model_type(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    architectures = config.get("architectures")
    if isinstance(architectures, (list, tuple)):
        for arch in architectures:
            if isinstance(arch, str) and arch in _ARCHITECTURES:
                return _ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported model_type {model_type!r} (architectures {architectures!r}); "
        f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


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


def _gqa(config: Mapping[str, Any], model_type: str, opts: _Options) -> dict[int, AttentionBackend]:
    f = _parse(GQAFields, config, model_type)
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

    dtype = _model_dtype(config, opts.dtype)
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

    n = f.num_hidden_layers
    sliding = _sliding_layers(f, model_type)
    block_size = opts.block_size if opts.block_size is not None else 16
    full_backend: GQABackend | None = None
    swa_backend: GQABackend | None = None

    def full() -> GQABackend:
        nonlocal full_backend
        if full_backend is None:
            full_backend = GQABackend(kv_per_rank, head_dim, block_size, dtype, quant)
        return full_backend

    def swa() -> GQABackend:
        nonlocal swa_backend
        if swa_backend is None:
            swa_backend = GQABackend(
                kv_per_rank, head_dim, block_size, dtype, quant, sliding_window=f.sliding_window
            )
        return swa_backend

    backends: dict[int, AttentionBackend] = {
        layer: swa() if layer in sliding else full() for layer in range(n)
    }
    for layer in range(n, n + f.num_nextn_predict_layers):
        backends[layer] = full()
    return backends


def _sliding_layers(f: GQAFields, model_type: str) -> frozenset[int]:
    """Main layers that attend over a sliding window (see the module docstring)."""
    n = f.num_hidden_layers
    if f.layer_types is not None:
        if len(f.layer_types) != n:
            raise ValueError(
                f"layer_types has {len(f.layer_types)} entries but num_hidden_layers={n} "
                f"(model_type {model_type!r})"
            )
        kinds = ("full_attention", "sliding_attention")
        for i, kind in enumerate(f.layer_types):
            if kind not in kinds:
                raise ValueError(
                    f"layer_types[{i}]={kind!r} is not one of {list(kinds)} "
                    f"(model_type {model_type!r})"
                )
        sliding = frozenset(i for i, k in enumerate(f.layer_types) if k == "sliding_attention")
        if sliding and f.sliding_window is None:
            raise ValueError(
                f"config is missing 'sliding_window' (needed for model_type {model_type!r}: "
                f"layer_types has sliding_attention layers)"
            )
        return sliding
    if model_type in ("mistral", "mixtral"):
        return frozenset(range(n)) if f.sliding_window is not None else frozenset()
    if model_type.startswith("qwen") and f.use_sliding_window:
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
        return frozenset(range(f.max_window_layers, n))
    return frozenset()


def _mla(config: Mapping[str, Any], model_type: str, opts: _Options) -> dict[int, AttentionBackend]:
    if config.get("index_head_dim") is not None:
        return _dsa(config, model_type, opts)
    f = _parse(MLAFields, config, model_type)
    dtype = _model_dtype(config, opts.dtype)
    kv = opts.kv_cache_dtype
    if kv is None or kv == "auto":
        pass
    elif kv in _FP8_NAMES:
        dtype = "float8_e4m3fn"
    else:
        dtype = _float_cache_dtype(
            kv, model_type, "'auto', 'fp8', 'bfloat16', 'float16' or 'float32'"
        )
    backend = MLABackend(
        kv_lora_rank=f.kv_lora_rank,
        qk_rope_head_dim=f.qk_rope_head_dim,
        block_size=opts.block_size if opts.block_size is not None else 64,
        dtype=dtype,
    )
    return dict.fromkeys(range(f.num_hidden_layers + f.num_nextn_predict_layers), backend)


def _dsa(config: Mapping[str, Any], model_type: str, opts: _Options) -> dict[int, AttentionBackend]:
    f = _parse(DSAFields, config, model_type)
    backend = DSABackend(
        kv_lora_rank=f.kv_lora_rank,
        qk_rope_head_dim=f.qk_rope_head_dim,
        index_head_dim=f.index_head_dim,
        block_size=opts.block_size if opts.block_size is not None else 64,
        kv_cache_dtype=_latent_cache_dtype(opts.kv_cache_dtype, model_type),
    )
    return dict.fromkeys(range(f.num_hidden_layers + f.num_nextn_predict_layers), backend)


def _v4(config: Mapping[str, Any], model_type: str, opts: _Options) -> dict[int, AttentionBackend]:
    f = _parse(V4Fields, config, model_type)
    if opts.block_size is not None:
        raise ValueError(
            f"block_size={opts.block_size} cannot be set for model_type {model_type!r}: its "
            "groups fix the block sizes (swa 64, compressed 256, c4_state 4, c128_state 8)"
        )
    n, mtp = f.num_hidden_layers, f.num_nextn_predict_layers
    ratios = f.compress_ratios
    if len(ratios) < n:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries but num_hidden_layers={n} "
            f"(model_type {model_type!r}): every main layer needs a ratio"
        )
    per_layer = [ratios[i] if i < len(ratios) else 0 for i in range(n + mtp)]
    for i, ratio in enumerate(per_layer):
        if ratio not in COMPRESS_RATIOS:
            raise ValueError(
                f"compress_ratios[{i}]={ratio!r} is not one of {list(COMPRESS_RATIOS)} "
                f"(model_type {model_type!r})"
            )
    if not 0 < f.qk_rope_head_dim < f.head_dim:
        raise ValueError(
            f"qk_rope_head_dim={f.qk_rope_head_dim} must be smaller than head_dim={f.head_dim} "
            f"(model_type {model_type!r})"
        )
    kv_cache_dtype = _latent_cache_dtype(opts.kv_cache_dtype, model_type)
    kinds: dict[int, DeepseekV4Backend] = {}
    backends: dict[int, AttentionBackend] = {}
    for layer, ratio in enumerate(per_layer):
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


_Builder = Callable[[Mapping[str, Any], str, _Options], dict[int, AttentionBackend]]

_BUILDERS: dict[str, _Builder] = {
    **dict.fromkeys(_GQA_TYPES, _gqa),
    **dict.fromkeys(_MLA_TYPES, _mla),
    **dict.fromkeys(_DSA_TYPES, _dsa),
    **dict.fromkeys(_V4_TYPES, _v4),
}


def from_hf_config(
    config: ConfigSource,
    *,
    block_size: int | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    tp_size: int = 1,
) -> dict[int, AttentionBackend]:
    """The ``layer id -> backend`` mapping of a model, from its Hugging Face config.

    Args:
        config: the parsed ``config.json`` (a mapping), a path to it (or to the directory
            holding it), or the name of a bundled config (see :func:`bundled_models`).
        block_size: tokens per block; default 16 for GQA, 64 for MLA / DSA. Not allowed for
            DeepSeek-V4, whose groups fix their block sizes.
        dtype: model / cache dtype for GQA and MLA; default from the config's ``torch_dtype``
            when it is a float dtype, else ``"bfloat16"``.
        kv_cache_dtype: cache storage (see the module docstring); default: the model dtype for
            GQA / MLA, ``"fp8"`` for DSA / V4.
        tp_size: tensor-parallel ranks; GQA caches hold ``max(1, kv_heads // tp_size)`` heads.

    Returns:
        ``{layer_id: backend}`` with ascending ids, main layers first, then MTP layers. Layers
        of the same kind share one backend instance.

    Raises:
        ValueError: an unsupported ``model_type``, a missing, null or invalid field, an
            inconsistent config, or bad options; the message names the field and the value.
        FileNotFoundError: ``config`` is a path or name that does not exist.
        TypeError: ``config`` is not a mapping, string or path.
    """
    if isinstance(config, (str, os.PathLike)):
        config = load_model_config(config)
    elif not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a mapping (a parsed config.json), a path or a bundled model "
            f"name, got {type(config).__name__}"
        )
    try:
        opts = _Options(
            block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, tp_size=tp_size
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(
            f"{_where(err['loc'])}={err.get('input')!r} is invalid: {err['msg']}"
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
    model_type = _model_type(config)
    return _BUILDERS[model_type](config, model_type, opts)
