"""Grouped-query (and multi-head) attention: paged ``key`` and ``value`` caches.

MHA is GQA with ``num_kv_heads == num_heads``. Quantised variants:

- ``kv_cache_quant="fp8"``: key/value stored in one byte per element (``float8_e4m3fn``);
- ``kv_cache_quant="block_wise_fp8"``: as fp8, plus ``key_scale`` and ``value_scale`` (one
  scale per token per kv head, ``scale_dtype`` float32 by default or bfloat16 as FastDeploy
  keeps them), in the order key, value, key_scale, value_scale.

Block layouts (``block_layout``), per key / value block of ``B`` tokens:

- ``"token_major"`` (default; vLLM's FlashAttention NHD and FlashInfer NHD):
  ``[B, kv_heads, head_dim]``; scales ``[B, kv_heads]`` (entry shape ``(kv_heads,)``);
- ``"head_major"`` (FastDeploy's ``[blocks, kv_heads, B, head_dim]``, FlashInfer HND):
  ``[kv_heads, B, head_dim]``; scales are declared head-major with entry shape
  ``(kv_heads, 1)``, so a block is ``[kv_heads, B, 1]``: the bytes of FastDeploy's bf16
  ``[blocks, kv_heads, B]`` scale cache exactly (adopt such a tensor as
  ``t.unsqueeze(-1)``, a view), since a head-major entry needs two dimensions.

Token-major is the default because it is what most attention kernels read (vLLM, SGLang);
head-major is an explicit choice for engines whose kernels read a head's tokens contiguously.

A sliding-window layer (Mistral / Gemma style) is the same backend with ``sliding_window``
set: its group is a ``sliding_window`` group named ``swa`` instead of the full group ``kv``.
A chunked local-attention layer (Llama-4) sets ``attention_chunk_size``: a ``chunked`` group
named ``chunked`` whose window restarts at every multiple of the chunk size.

Key and value heads may differ in width (MiMo-V2-Flash: 192-dim keys, 128-dim values):
``head_dim_v`` sets the value's, and the ``value`` role's entry is ``(num_kv_heads,
head_dim_v)``, as vLLM's ``AttentionSpec.head_size_v`` (``vllm/v1/kv_cache_interface.py``).
"""

from __future__ import annotations

from typing import Literal

from kvforge._checks import ArgumentError
from kvforge.attn_backends._args import choice, dtype_name, group_name, optional_width, width
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import BlockLayout, CacheGroup, CacheRole, GroupKind

__all__ = ["GQABackend", "MHABackend"]

KVCacheQuant = Literal["fp8", "block_wise_fp8"]
_QUANTS = ("fp8", "block_wise_fp8")
ScaleDtype = Literal["float32", "bfloat16"]
_SCALE_DTYPES = ("float32", "bfloat16")
_LAYOUTS = ("token_major", "head_major")


class GQABackend(DeclaredBackend):
    """Paged K/V caches of a GQA/MHA layer.

    Args:
        num_kv_heads: key/value heads per layer (after tensor-parallel split).
        head_dim: dimension of one head.
        block_size: tokens per block.
        dtype: cache dtype when not quantised (e.g. ``"bfloat16"``).
        kv_cache_quant: ``None``, ``"fp8"`` or ``"block_wise_fp8"``.
        sliding_window: tokens kept by a sliding-window layer; ``None`` for full attention.
        group: the group name (``None``, the default: ``"kv"``, ``"swa"`` with a sliding
            window, ``"chunked"`` with a chunk size).
        attention_chunk_size: chunk of a chunked local-attention layer; ``None`` otherwise.
        block_layout: ``"token_major"`` (default) or ``"head_major"`` (see the module).
        scale_dtype: ``"float32"`` (default) or ``"bfloat16"``: dtype of the block-wise fp8
            scales; only with ``kv_cache_quant="block_wise_fp8"``.
        head_dim_v: dimension of one value head; ``None`` (default): ``head_dim``.

    Raises:
        ArgumentError: (a ``TypeError`` and a ``ValueError``) an argument of the wrong type,
            out of range or in a combination that does not exist, named with its value: heads,
            widths, block size, window and chunk must be positive ints (not bools or floats),
            the dtype one kvforge stores, the group a non-empty str (``None`` picks the
            default). Everything is checked before anything is built.

    Per-token bytes per layer: ``num_kv_heads * (head_dim + head_dim_v) * itemsize`` (``2 *
    num_kv_heads * head_dim * itemsize`` when the widths agree), plus ``2 * num_kv_heads *
    scale_itemsize`` for block-wise scales (4 for float32, 2 for bf16).
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: str = "bfloat16",
        kv_cache_quant: KVCacheQuant | None = None,
        sliding_window: int | None = None,
        group: str | None = None,
        attention_chunk_size: int | None = None,
        block_layout: BlockLayout = "token_major",
        scale_dtype: ScaleDtype | None = None,
        head_dim_v: int | None = None,
    ) -> None:
        owner = type(self).__name__
        num_kv_heads = width(owner, "num_kv_heads", num_kv_heads, unit="heads")
        head_dim = width(owner, "head_dim", head_dim)
        head_dim_v = head_dim if head_dim_v is None else width(owner, "head_dim_v", head_dim_v)
        block_size = width(owner, "block_size", block_size, unit="tokens")
        dtype = dtype_name(owner, "dtype", dtype)
        if kv_cache_quant is not None:
            choice(
                owner,
                "kv_cache_quant",
                kv_cache_quant,
                _QUANTS,
                f"kv_cache_quant must be None or one of {list(_QUANTS)}",
            )
        sliding_window, attention_chunk_size, default_group = _window_args(
            owner, sliding_window, attention_chunk_size
        )
        group = group_name(owner, group, default=default_group)
        choice(owner, "block_layout", block_layout, _LAYOUTS)
        if scale_dtype is not None:
            if kv_cache_quant != "block_wise_fp8":
                raise ArgumentError(
                    f"{owner}: scale_dtype={scale_dtype!r} needs kv_cache_quant='block_wise_fp8', "
                    f"got kv_cache_quant={kv_cache_quant!r}"
                )
            choice(owner, "scale_dtype", scale_dtype, _SCALE_DTYPES)
        self.block_layout: BlockLayout = block_layout
        self.scale_dtype: str | None = (
            (scale_dtype or "float32") if kv_cache_quant == "block_wise_fp8" else None
        )
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.block_size = block_size
        self.dtype = dtype
        self.kv_cache_quant = kv_cache_quant
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        kv_group = _kv_group(group, block_size, sliding_window, attention_chunk_size)
        self.declare([kv_group], self._kv_roles(kv_group.name))

    def _kv_roles(self, group: str) -> list[CacheRole]:
        """``key`` and ``value`` (fp8 under a quant), then their block-wise scales if any."""
        store = self.dtype if self.kv_cache_quant is None else "float8_e4m3fn"
        roles = [
            CacheRole(
                name=n,
                group=group,
                entry_shape=(self.num_kv_heads, dim),
                dtype=store,
                block_layout=self.block_layout,
            )
            for n, dim in (("key", self.head_dim), ("value", self.head_dim_v))
        ]
        if self.scale_dtype is not None:
            # head-major needs a second entry dimension: (kv_heads, 1) gives [kv_heads, B, 1]
            heads = self.num_kv_heads
            scale_shape = (heads,) if self.block_layout == "token_major" else (heads, 1)
            roles += [
                CacheRole(
                    name=n,
                    group=group,
                    entry_shape=scale_shape,
                    dtype=self.scale_dtype,
                    block_layout=self.block_layout,
                )
                for n in ("key_scale", "value_scale")
            ]
        return roles

    def __repr__(self) -> str:
        extra = f", kv_cache_quant={self.kv_cache_quant!r}" if self.kv_cache_quant else ""
        if self.head_dim_v != self.head_dim:
            extra += f", head_dim_v={self.head_dim_v}"
        if self.scale_dtype not in (None, "float32"):
            extra += f", scale_dtype={self.scale_dtype!r}"
        if self.block_layout != "token_major":
            extra += f", block_layout={self.block_layout!r}"
        if self.sliding_window is not None:
            extra += f", sliding_window={self.sliding_window}"
        if self.attention_chunk_size is not None:
            extra += f", attention_chunk_size={self.attention_chunk_size}"
        return (
            f"{type(self).__name__}(num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"block_size={self.block_size}, dtype={self.dtype!r}{extra})"
        )


class MHABackend(GQABackend):
    """Multi-head attention: GQA with as many kv heads as heads."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: str = "bfloat16",
        kv_cache_quant: KVCacheQuant | None = None,
        block_layout: BlockLayout = "token_major",
        scale_dtype: ScaleDtype | None = None,
    ) -> None:
        num_heads = width(type(self).__name__, "num_heads", num_heads, unit="heads")
        super().__init__(
            num_heads,
            head_dim,
            block_size,
            dtype,
            kv_cache_quant,
            block_layout=block_layout,
            scale_dtype=scale_dtype,
        )


def _window_args(
    owner: str, sliding_window: object, attention_chunk_size: object
) -> tuple[int | None, int | None, str]:
    """The checked window (or chunk) and the group name it defaults to: ``chunked`` for a
    chunk, ``swa`` for a window, ``kv`` for full history; both at once is refused."""
    window = optional_width(owner, "sliding_window", sliding_window, unit="tokens")
    chunk = optional_width(owner, "attention_chunk_size", attention_chunk_size, unit="tokens")
    if window is not None and chunk is not None:
        raise ArgumentError(
            f"{owner}: give sliding_window or attention_chunk_size, not both (got "
            f"{window} and {chunk})"
        )
    if chunk is not None:
        return window, chunk, "chunked"
    return window, chunk, "kv" if window is None else "swa"


def _kv_group(name: str, block_size: int, window: int | None, chunk: int | None) -> CacheGroup:
    """The one group of the key/value roles: chunked, sliding-window or full."""
    if chunk is not None:
        return CacheGroup(name=name, block_size=block_size, kind=GroupKind.CHUNKED, window=chunk)
    if window is None:
        return CacheGroup(name=name, block_size=block_size, kind=GroupKind.FULL)
    return CacheGroup(
        name=name, block_size=block_size, kind=GroupKind.SLIDING_WINDOW, window=window
    )
