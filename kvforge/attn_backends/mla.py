"""Multi-head latent attention (DeepSeek V2/V3): one compressed ``key`` cache, no value.

Each token stores the ``kv_lora_rank`` latent and the ``qk_rope_head_dim`` rotary key side by
side: 512 + 64 = 576 elements for DeepSeek V2/V3, 1,152 bytes in bf16.
"""

from __future__ import annotations

from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole, canonical_dtype

__all__ = ["MLABackend"]


class MLABackend(DeclaredBackend):
    """Paged latent cache of an MLA layer.

    Args:
        kv_lora_rank: latent width (512 for DeepSeek V2/V3).
        qk_rope_head_dim: rotary key width (64).
        block_size: tokens per block.
        dtype: cache dtype.
        group: the group name (default ``"kv"``).
        block_alignment: bytes every role's device block stride is a multiple of (default 1:
            no padding; 576 for engines that pad FlashMLA pages).
    """

    def __init__(
        self,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        block_size: int = 64,
        dtype: str = "bfloat16",
        group: str = "kv",
        block_alignment: int = 1,
    ) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.block_size = block_size
        self.dtype = canonical_dtype(dtype)
        self.block_alignment = block_alignment
        kv = CacheGroup(name=group, block_size=block_size)
        width = kv_lora_rank + qk_rope_head_dim
        self.declare(
            [kv],
            [
                CacheRole(
                    name="key",
                    group=group,
                    entry_shape=(width,),
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
