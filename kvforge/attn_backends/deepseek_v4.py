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
float32 scale). bf16: ``swa_kv`` / ``compressed_kv`` 512 bf16 values; the ``indexer`` stays
132 uint8 bytes (fp8 + scale whatever the main KV dtype, as vLLM, SGLang and FastDeploy keep
it). States are float32: ratio-4 ``compressor_state`` 2*2*head_dim values,
``indexer_compressor_state`` 2*2*index_head_dim, ratio-128 ``compressor_state`` 2*head_dim.

Device blocks are padded: every role declares ``block_alignment=576`` by default, because
FlashMLA reads pages whose stride is a multiple of 576 bytes and vLLM and SGLang pad every
layer's block that way. Per layer and block, fp8 (meaningful bytes -> device stride):

=====================================  ==================================  ==================
role                                   meaningful (host page share)        device stride
=====================================  ==================================  ==================
``swa_kv``                             64 * 584 = 37,376                   65 * 576 = 37,440
``compressed_kv`` (r = 4)              64 * 584 = 37,376                   65 * 576 = 37,440
``indexer`` (r = 4)                    64 * 132 = 8,448                    15 * 576 = 8,640
``compressed_kv`` (r = 128)            2 * 584 = 1,168                     3 * 576 = 1,728
``compressor_state`` (r = 4)           4 * 8,192 = 32,768                  57 * 576 = 32,832
``indexer_compressor_state``           4 * 2,048 = 8,192                   15 * 576 = 8,640
``compressor_state`` (r = 128)         8 * 4,096 = 32,768                  57 * 576 = 32,832
=====================================  ==================================  ==================

``block_alignment=1`` turns the padding off. Host pages never carry it.
"""

from __future__ import annotations

from numbers import Integral
from typing import Literal

from kvforge._checks import ArgumentError
from kvforge.attn_backends._args import choice, width
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole, GroupKind

__all__ = ["COMPRESS_RATIOS", "FLASHMLA_PAGE_ALIGNMENT", "DeepseekV4Backend"]

COMPRESS_RATIOS = (0, 4, 128)
FLASHMLA_PAGE_ALIGNMENT = 576  # bytes: FlashMLA page strides are multiples of 576
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
        kv_cache_dtype: ``"fp8"`` (packed uint8 storage) or ``"bf16"`` (the main KV only; the
            indexer stays fp8 + scale in uint8).
        block_alignment: bytes every role's device block stride is a multiple of (default
            576, FlashMLA pages); 1 for unpadded blocks.

    Raises:
        ArgumentError: (a ``TypeError`` and a ``ValueError``) an argument of the wrong type
            or out of range, named with its value: ``compress_ratio`` an int of
            :data:`COMPRESS_RATIOS` (not a bool or a float), every width and the window a
            positive int with ``0 < qk_rope_head_dim < head_dim``, ``kv_cache_dtype``
            ``"fp8"`` or ``"bf16"``. Everything is checked before anything is built.
        ValueError: a ``block_alignment`` that gives a role a device stride of partial
            elements.
    """

    def __init__(
        self,
        compress_ratio: int,
        head_dim: int = 512,
        qk_rope_head_dim: int = 64,
        index_head_dim: int = 128,
        sliding_window: int = 128,
        kv_cache_dtype: Literal["fp8", "bf16"] = "fp8",
        block_alignment: int = FLASHMLA_PAGE_ALIGNMENT,
    ) -> None:
        owner = type(self).__name__
        compress_ratio = _compress_ratio(owner, compress_ratio)
        head_dim = width(owner, "head_dim", head_dim, minimum=2)
        qk_rope_head_dim = width(owner, "qk_rope_head_dim", qk_rope_head_dim)
        if qk_rope_head_dim >= head_dim:
            raise ArgumentError(
                f"{owner}: qk_rope_head_dim must be in (0, head_dim={head_dim}), got "
                f"{qk_rope_head_dim}"
            )
        index_head_dim = width(owner, "index_head_dim", index_head_dim)
        sliding_window = width(owner, "sliding_window", sliding_window, unit="tokens")
        choice(
            owner,
            "kv_cache_dtype",
            kv_cache_dtype,
            ("fp8", "bf16"),
            "kv_cache_dtype must be 'fp8' or 'bf16'",
        )
        block_alignment = width(owner, "block_alignment", block_alignment, unit="bytes")
        self.compress_ratio = compress_ratio
        self.head_dim = head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.index_head_dim = index_head_dim
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.block_alignment = block_alignment
        self._declare_caches()

    def _role(
        self, name: str, group: str, entry: tuple[int, ...], dtype: str, ratio: int = 1
    ) -> CacheRole:
        """One role, padded to this backend's ``block_alignment``."""
        return CacheRole(
            name=name,
            group=group,
            entry_shape=entry,
            dtype=dtype,
            compress_ratio=ratio,
            block_alignment=self.block_alignment,
        )

    def _declare_caches(self) -> None:
        """The groups and roles of this layer's compress ratio (the table in the module
        docstring): the window always, the compressed history for ratios 4 and 128, the
        compressor state of each."""
        head_dim, index_head_dim, ratio = self.head_dim, self.index_head_dim, self.compress_ratio
        if self.kv_cache_dtype == "fp8":
            kv_entry, dtype = (_fp8_entry_bytes(head_dim, self.qk_rope_head_dim),), "uint8"
        else:
            kv_entry, dtype = (head_dim,), "bfloat16"
        index_entry = (index_head_dim + 4,)  # 128 fp8 + one float32 scale, in both modes
        role = self._role
        swa = CacheGroup(
            name="swa", block_size=64, kind=GroupKind.SLIDING_WINDOW, window=self.sliding_window
        )
        groups = [swa]
        roles = [role("swa_kv", "swa", kv_entry, dtype)]
        if ratio:
            groups.append(CacheGroup(name="compressed", block_size=256, kind=GroupKind.FULL))
            roles.append(role("compressed_kv", "compressed", kv_entry, dtype, ratio))
        if ratio == 4:
            groups.append(CacheGroup(name="c4_state", block_size=4, kind=GroupKind.STATE, window=8))
            roles += [
                role("indexer", "compressed", index_entry, "uint8", 4),
                role("compressor_state", "c4_state", (2 * 2 * head_dim,), "float32"),
                role("indexer_compressor_state", "c4_state", (2 * 2 * index_head_dim,), "float32"),
            ]
        elif ratio == 128:
            groups.append(
                CacheGroup(name="c128_state", block_size=8, kind=GroupKind.STATE, window=128)
            )
            roles.append(role("compressor_state", "c128_state", (2 * head_dim,), "float32"))
        self.declare(groups, roles)

    def __repr__(self) -> str:
        return (
            f"DeepseekV4Backend(compress_ratio={self.compress_ratio}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, kv_cache_dtype={self.kv_cache_dtype!r}, "
            f"block_alignment={self.block_alignment})"
        )


def _compress_ratio(owner: str, value: object) -> int:
    """``value`` as one of :data:`COMPRESS_RATIOS`, refused (bools too) with the choices."""
    integral = isinstance(value, Integral) and not isinstance(value, bool)
    if not integral or int(value) not in COMPRESS_RATIOS:  # type: ignore[call-overload]
        raise ArgumentError(
            f"{owner}: compress_ratio must be one of {list(COMPRESS_RATIOS)}, got {value!r}"
        )
    return int(value)
