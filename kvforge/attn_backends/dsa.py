"""DeepSeek V3.2 sparse attention (DSA): the MLA latent cache plus the lightning indexer's keys.

Roles, in order: ``key`` then ``indexer``. Layouts per token:

- ``kv_cache_dtype="fp8"`` (stored as uint8):
  ``key`` = 512 fp8 latent bytes + 4 float32 tile scales (16 B) + 64 bf16 rope values (128 B)
  = 656 bytes; ``indexer`` = 128 fp8 bytes + one float32 scale = 132 bytes.
- ``kv_cache_dtype="bf16"``: ``key`` = 576 bf16 values = 1,152 bytes; ``indexer`` unchanged,
  132 uint8 bytes: the indexer keys are fp8 with a float32 scale whatever the main KV dtype,
  as vLLM, SGLang and FastDeploy keep them. 1,152 + 132 = 1,284 bytes per token per layer.

Invariant: the ``indexer`` role is ``uint8 (index_head_dim + 4,)`` in every mode.

A layer that reuses another layer's top-k (GLM-5.2's shared-index layers, ``indexer=False``)
builds no indexer in vLLM and keeps the ``key`` role only, in the same layout.
"""

from __future__ import annotations

from typing import Literal

from kvforge._checks import ArgumentError
from kvforge.attn_backends._args import choice, group_name, width
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole

__all__ = ["DSABackend", "fp8_latent_entry_bytes"]

FP8_TILE = 128  # latent values quantised per float32 scale


def fp8_latent_entry_bytes(latent_dim: int, rope_dim: int, scale_bytes: int | None = None) -> int:
    """Bytes of one fp8 latent entry: fp8 latent + scales + bf16 rope.

    ``scale_bytes`` defaults to one float32 per 128-value tile of the latent.
    """
    if scale_bytes is None:
        scale_bytes = 4 * (-(-latent_dim // FP8_TILE))
    return latent_dim + scale_bytes + 2 * rope_dim


class DSABackend(DeclaredBackend):
    """Paged caches of a DeepSeek V3.2 DSA layer.

    Args:
        kv_lora_rank: latent width (512).
        qk_rope_head_dim: rotary key width (64).
        index_head_dim: indexer key width (128).
        block_size: tokens per block (64).
        kv_cache_dtype: ``"fp8"`` (uint8 storage, packed) or ``"bf16"`` (the main KV only; the
            indexer stays fp8 + scale in uint8).
        group: the group name (default ``"kv"``; ``None`` means the default).
        block_alignment: bytes every role's device block stride is a multiple of (default 1:
            no padding; 576 for engines that pad FlashMLA pages).
        indexer: whether the layer keeps indexer keys (default ``True``); ``False`` for a
            layer that reuses another layer's top-k and declares the ``key`` role only.

    Raises:
        ArgumentError: (a ``TypeError`` and a ``ValueError``) an argument of the wrong type
            or out of range, named with its value: every width and count must be a positive
            int (not a bool or a float), ``kv_cache_dtype`` ``"fp8"`` or ``"bf16"``, the group
            a non-empty str, ``indexer`` a bool. Everything is checked before anything is
            built.
    """

    def __init__(
        self,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        index_head_dim: int = 128,
        block_size: int = 64,
        kv_cache_dtype: Literal["fp8", "bf16"] = "fp8",
        group: str | None = "kv",
        block_alignment: int = 1,
        indexer: bool = True,
    ) -> None:
        owner = type(self).__name__
        kv_lora_rank = width(owner, "kv_lora_rank", kv_lora_rank)
        qk_rope_head_dim = width(owner, "qk_rope_head_dim", qk_rope_head_dim)
        index_head_dim = width(owner, "index_head_dim", index_head_dim)
        block_size = width(owner, "block_size", block_size, unit="tokens")
        choice(
            owner,
            "kv_cache_dtype",
            kv_cache_dtype,
            ("fp8", "bf16"),
            "kv_cache_dtype must be 'fp8' or 'bf16'",
        )
        group = group_name(owner, group, default="kv")
        block_alignment = width(owner, "block_alignment", block_alignment, unit="bytes")
        if not isinstance(indexer, bool):
            raise ArgumentError(f"{owner}: indexer must be a bool, got {indexer!r}")
        self.indexer = indexer
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.index_head_dim = index_head_dim
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.block_alignment = block_alignment
        kv = CacheGroup(name=group, block_size=block_size)
        if kv_cache_dtype == "fp8":
            key_dtype = "uint8"
            key_shape = (fp8_latent_entry_bytes(kv_lora_rank, qk_rope_head_dim),)
        else:
            key_shape, key_dtype = (kv_lora_rank + qk_rope_head_dim,), "bfloat16"
        key = CacheRole(
            name="key",
            group=group,
            entry_shape=key_shape,
            dtype=key_dtype,
            block_alignment=block_alignment,
        )
        # 128 fp8 values + one float32 scale, packed as bytes, in both modes
        index = CacheRole(
            name="indexer",
            group=group,
            entry_shape=(index_head_dim + 4,),
            dtype="uint8",
            block_alignment=block_alignment,
        )
        self.declare([kv], [key, index] if indexer else [key])

    def __repr__(self) -> str:
        return (
            f"DSABackend(kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim="
            f"{self.qk_rope_head_dim}, index_head_dim={self.index_head_dim}, block_size="
            f"{self.block_size}, kv_cache_dtype={self.kv_cache_dtype!r}"
            + (f", block_alignment={self.block_alignment}" if self.block_alignment != 1 else "")
            + (")" if self.indexer else ", indexer=False)")
        )
