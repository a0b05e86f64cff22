"""Multi-head latent attention (DeepSeek V2/V3): one compressed ``key`` cache, no value.

Each token stores the ``kv_lora_rank`` latent and the ``qk_rope_head_dim`` rotary key side by
side: 512 + 64 = 576 elements for DeepSeek V2/V3, 1,152 bytes in bf16.
"""

from __future__ import annotations

from kvforge.attn_backends._args import dtype_name, group_name, width
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole

__all__ = ["MLABackend"]


class MLABackend(DeclaredBackend):
    """Paged latent cache of an MLA layer.

    Args:
        kv_lora_rank: latent width (512 for DeepSeek V2/V3).
        qk_rope_head_dim: rotary key width (64).
        block_size: tokens per block.
        dtype: cache dtype.
        group: the group name (default ``"kv"``; ``None`` means the default).
        block_alignment: bytes every role's device block stride is a multiple of (default 1:
            no padding; 576 for engines that pad FlashMLA pages).

    Raises:
        ArgumentError: (a ``TypeError`` and a ``ValueError``) an argument of the wrong type
            or out of range, named with its value: every width and count must be a positive
            int (not a bool or a float), the dtype one kvforge stores, the group a non-empty
            str. Everything is checked before anything is built.
    """

    def __init__(
        self,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        block_size: int = 64,
        dtype: str = "bfloat16",
        group: str | None = "kv",
        block_alignment: int = 1,
    ) -> None:
        owner = type(self).__name__
        kv_lora_rank = width(owner, "kv_lora_rank", kv_lora_rank)
        qk_rope_head_dim = width(owner, "qk_rope_head_dim", qk_rope_head_dim)
        block_size = width(owner, "block_size", block_size, unit="tokens")
        dtype = dtype_name(owner, "dtype", dtype)
        group = group_name(owner, group, default="kv")
        block_alignment = width(owner, "block_alignment", block_alignment, unit="bytes")
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.block_alignment = block_alignment
        kv = CacheGroup(name=group, block_size=block_size)
        self.declare(
            [kv],
            [
                CacheRole(
                    name="key",
                    group=group,
                    entry_shape=(kv_lora_rank + qk_rope_head_dim,),
                    dtype=self.dtype,
                    block_alignment=block_alignment,
                )
            ],
        )

    def __repr__(self) -> str:
        return (
            f"MLABackend(kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim="
            f"{self.qk_rope_head_dim}, block_size={self.block_size}, dtype={self.dtype!r}"
            + (f", block_alignment={self.block_alignment})" if self.block_alignment != 1 else ")")
        )
