"""DeepSeek-V4 hybrid attention: sliding window on every layer, compressed caches on some.

Each layer has a compress ratio ``r`` in {0, 4, 128} (0 = no compression). Groups and roles:

=============  ====================  =========================  ==================================
group          block_size (tokens)   kind                       roles
=============  ====================  =========================  ==================================
``swa``        64                    sliding_window (window W)  ``swa_kv`` (every layer)
``compressed`` 256                   full                       ``compressed_kv`` (r = 4, 128),
                                                                ``indexer`` (r = 4)
``c4_state``   4                     state, window 8            ``compressor_state``,
                                                                ``indexer_compressor_state`` (r=4)
``c128_state`` 8                     state, window 128          ``compressor_state`` (r = 128)
=============  ====================  =========================  ==================================

Entry layouts. fp8 (uint8 storage): ``swa_kv`` and ``compressed_kv`` are 584 bytes
(``head_dim - rope`` = 448 fp8 values, 64 bf16 rope values = 128 bytes, 8 scale bytes: one
power-of-two exponent per 64 fp8 values, 7 used); ``indexer`` is 132 bytes (128 fp8 + one
float32 scale). bf16: ``swa_kv`` / ``compressed_kv`` 512 values, ``indexer`` 128 values.
States are float32: ratio-4 ``compressor_state`` 2*2*head_dim values,
``indexer_compressor_state`` 2*2*index_head_dim, ratio-128 ``compressor_state`` 2*head_dim.
"""

from __future__ import annotations

from typing import Literal

from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole, GroupKind

__all__ = ["COMPRESS_RATIOS", "DeepseekV4Backend"]

COMPRESS_RATIOS = (0, 4, 128)
SCALE_TILE = 64  # fp8 values per one-byte exponent scale


def _fp8_entry_bytes(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    scales = -(-nope // SCALE_TILE)
    scale_bytes = -(-scales // 8) * 8  # exponents are stored as whole 8-byte words
    return nope + 2 * rope_dim + scale_bytes


class DeepseekV4Backend(DeclaredBackend):
    """Caches of one DeepSeek-V4 layer kind.

    Args:
        compress_ratio: 0 (sliding window only), 4 (compressed + indexer) or 128 (compressed).
        head_dim: attention head width (512).
        qk_rope_head_dim: rotary part of the head (64).
        index_head_dim: indexer key width (128).
        sliding_window: tokens kept by the ``swa`` group (128).
        kv_cache_dtype: ``"fp8"`` (packed uint8 storage) or ``"bf16"``.
    """

    def __init__(
        self,
        compress_ratio: int,
        head_dim: int = 512,
        qk_rope_head_dim: int = 64,
        index_head_dim: int = 128,
        sliding_window: int = 128,
        kv_cache_dtype: Literal["fp8", "bf16"] = "fp8",
    ) -> None:
        if compress_ratio not in COMPRESS_RATIOS:
            raise ValueError(
                f"compress_ratio must be one of {list(COMPRESS_RATIOS)}, got {compress_ratio!r}"
            )
        if kv_cache_dtype not in ("fp8", "bf16"):
            raise ValueError(f"kv_cache_dtype must be 'fp8' or 'bf16', got {kv_cache_dtype!r}")
        if not 0 < qk_rope_head_dim < head_dim:
            raise ValueError(
                f"qk_rope_head_dim must be in (0, head_dim={head_dim}), got {qk_rope_head_dim}"
            )
        self.compress_ratio = compress_ratio
        self.head_dim = head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.index_head_dim = index_head_dim
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype

        if kv_cache_dtype == "fp8":
            kv_entry, index_entry, dtype = (
                (_fp8_entry_bytes(head_dim, qk_rope_head_dim),),
                (index_head_dim + 4,),
                "uint8",
            )
        else:
            kv_entry, index_entry, dtype = (head_dim,), (index_head_dim,), "bfloat16"

        swa = CacheGroup(
            name="swa", block_size=64, kind=GroupKind.SLIDING_WINDOW, window=sliding_window
        )
        groups = [swa]
        roles = [CacheRole(name="swa_kv", group="swa", entry_shape=kv_entry, dtype=dtype)]
        if compress_ratio:
            groups.append(CacheGroup(name="compressed", block_size=256, kind=GroupKind.FULL))
            roles.append(
                CacheRole(
                    name="compressed_kv",
                    group="compressed",
                    entry_shape=kv_entry,
                    dtype=dtype,
                    compress_ratio=compress_ratio,
                )
            )
        if compress_ratio == 4:
            groups.append(CacheGroup(name="c4_state", block_size=4, kind=GroupKind.STATE, window=8))
            roles += [
                CacheRole(
                    name="indexer",
                    group="compressed",
                    entry_shape=index_entry,
                    dtype=dtype,
                    compress_ratio=4,
                ),
                CacheRole(
                    name="compressor_state",
                    group="c4_state",
                    entry_shape=(2 * 2 * head_dim,),
                    dtype="float32",
                ),
                CacheRole(
                    name="indexer_compressor_state",
                    group="c4_state",
                    entry_shape=(2 * 2 * index_head_dim,),
                    dtype="float32",
                ),
            ]
        elif compress_ratio == 128:
            groups.append(
                CacheGroup(name="c128_state", block_size=8, kind=GroupKind.STATE, window=128)
            )
            roles.append(
                CacheRole(
                    name="compressor_state",
                    group="c128_state",
                    entry_shape=(2 * head_dim,),
                    dtype="float32",
                )
            )
        self._declare(groups, roles)

    def __repr__(self) -> str:
        return (
            f"DeepseekV4Backend(compress_ratio={self.compress_ratio}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, kv_cache_dtype={self.kv_cache_dtype!r})"
        )
