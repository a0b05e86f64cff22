"""A cache whose key and value share one role, and the Hugging Face model type that uses it.

GPT-BigCode (StarCoder, SantaCoder) computes key and value with one projection, and its
Hugging Face implementation keeps them fused: with multi-query attention, one
``[..., 2 * head_dim]`` tensor per layer holds the key followed by the value.
:class:`FusedKVBackend` stores that layout paged: one role ``kv`` of entry shape
``[2, num_kv_heads, head_dim]`` (index 0 the key, index 1 the value), so one block of a layer
is one contiguous run holding both, and an offload moves one plane per layer instead of two.

Per token and layer: ``2 * num_kv_heads * head_dim * itemsize`` bytes, as for GQA's separate
key and value; only the layout differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvforge.attn_backends.base import DeclaredBackend
from kvforge.models import MAX_LAYERS, ModelBackends, ModelOptions, parse_fields
from kvforge.specs import CacheGroup, CacheRole, canonical_dtype

__all__ = ["FusedKVBackend", "GPTBigCodeFields", "build_gpt_bigcode"]

_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")


class FusedKVBackend(DeclaredBackend):
    """Paged fused key/value cache: one role ``kv`` of entry shape ``[2, heads, head_dim]``.

    Args:
        num_kv_heads: key/value heads per layer (after the tensor-parallel split).
        head_dim: dimension of one head.
        block_size: tokens per block.
        dtype: cache dtype (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float8_e4m3fn"``).
    """

    def __init__(
        self, num_kv_heads: int, head_dim: int, block_size: int = 16, dtype: str = "bfloat16"
    ) -> None:
        for name, value in (
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = canonical_dtype(dtype)
        group = CacheGroup(name="kv", block_size=block_size)
        role = CacheRole(
            name="kv", group="kv", entry_shape=(2, num_kv_heads, head_dim), dtype=self.dtype
        )
        self.declare([group], [role])

    def __repr__(self) -> str:
        return (
            f"FusedKVBackend(num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"block_size={self.block_size}, dtype={self.dtype!r})"
        )


class GPTBigCodeFields(BaseModel):
    """The cache fields of a GPT-BigCode ``config.json`` (Hugging Face's own names)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    n_layer: Annotated[StrictInt, Field(gt=0, le=MAX_LAYERS)]
    n_head: Annotated[StrictInt, Field(gt=0)]
    n_embd: Annotated[StrictInt, Field(gt=0)]
    multi_query: StrictBool = True  # Hugging Face's default for this model type
    n_positions: Annotated[StrictInt, Field(gt=0)] | None = None


def _model_dtype(config: Mapping[str, Any], options: ModelOptions) -> str:
    """``options.dtype``, else the checkpoint's half-precision dtype, else ``bfloat16``:
    float32 checkpoints (StarCoder ships one) are served in half precision."""
    if options.dtype is not None:
        return options.dtype
    value = config.get("torch_dtype")
    if value in ("float16", "bfloat16"):
        return value
    return "bfloat16"


def build_gpt_bigcode(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """``{layer: FusedKVBackend}`` of a GPT-BigCode model (a kvforge ``ModelBuilder``).

    Multi-query models keep their one key/value head on every tensor-parallel rank; others
    split ``n_head`` heads over ``tp_size`` ranks. ``kv_cache_dtype``: ``None`` / ``"auto"``
    (the model dtype), ``"fp8"`` or a float dtype.
    """
    f = parse_fields(GPTBigCodeFields, config, model_type)
    options.refuse(
        model_type, "num_speculative_tokens", why="GPT-BigCode has no MTP layers to cache"
    )
    if f.n_embd % f.n_head:
        raise ValueError(
            f"n_embd={f.n_embd} is not divisible by n_head={f.n_head} (model_type {model_type!r})"
        )
    if f.n_head % options.tp_size:
        raise ValueError(
            f"n_head={f.n_head} is not divisible by tp_size={options.tp_size} "
            f"(model_type {model_type!r})"
        )
    kv_heads = 1 if f.multi_query else f.n_head // options.tp_size
    dtype = _model_dtype(config, options)
    kv = options.kv_cache_dtype
    if kv in _FP8_NAMES:
        dtype = "float8_e4m3fn"
    elif kv is not None and kv != "auto":
        try:
            dtype = canonical_dtype(kv)
        except ValueError:
            dtype = ""
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={kv!r} is not supported for model_type {model_type!r}; use "
                "'auto', 'fp8', 'bfloat16', 'float16' or 'float32'"
            )
    backend = FusedKVBackend(
        kv_heads,
        f.n_embd // f.n_head,
        options.block_size if options.block_size is not None else 16,
        dtype,
    )
    return ModelBackends(
        dict.fromkeys(range(f.n_layer), backend), max_position_embeddings=f.n_positions
    )
