"""The block sizes and state page vLLM picks for a hybrid attention / Mamba model.

vLLM keeps one page size for every layer of a hybrid model, so it grows the attention block
until an attention page holds a Mamba state page, then pads the Mamba page to exactly the
attention page (``Platform._align_hybrid_block_size`` in ``vllm/platforms/interface.py``,
called by ``update_block_size_for_backend`` once the model's layers exist)::

    attn_1   = one token of one attention layer (FullAttentionSpec(block_size=1).page_size_bytes)
    align    = max(smallest kernel block of the attention backend, block_size)   # 16 on CUDA
    block    = align * cdiv(mamba_page, align * attn_1), if that exceeds block_size
    padded   = block * attn_1 (the Mamba page, unless it is exactly that already)

With prefix caching vLLM switches to ``mamba_cache_mode="align"`` and ``mamba_block_size``
follows ``block_size`` (``MambaModelConfig.verify_and_update_config`` in
``vllm/model_executor/models/config.py``); without it ``mamba_block_size`` is
``max_model_len``. :func:`vllm_hybrid_sizes` computes the three numbers from a kvforge
declaration and :meth:`HybridSizes.pad` gives the declaration whose pages are vLLM's, so that
``to_vllm_specs(sizes.pad(backends), **sizes.spec_options())`` equals what vLLM's layers
declare. kvforge itself never needs the padding: its pools are per group.

Worked example, Falcon-H1-7B (2 kv heads of 128 in bf16, a 1,594,368-byte Mamba state)::

    attn_1 = 2 * 2 * 128 * 2 = 1,024 B;  block = 16 * cdiv(1,594,368, 16 * 1,024) = 1,568
    padded = 1,568 * 1,024 = 1,605,632 B
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvforge._checks import ArgumentError, check_int
from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.gqa import GQABackend
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.attn_backends.mamba import Mamba2Backend
from kvforge.specs import GroupKind

__all__ = ["HybridSizes", "vllm_hybrid_sizes"]

_MODES = ("none", "align")


@dataclass(frozen=True)
class HybridSizes:
    """What vLLM resolves for a hybrid model.

    Attributes:
        block_size: ``cache_config.block_size`` after alignment (the attention block).
        mamba_block_size: ``cache_config.mamba_block_size`` (``max_model_len`` without prefix
            caching, ``block_size`` in ``"align"`` mode).
        mamba_page_size_padded: ``cache_config.mamba_page_size_padded`` (``None``: the Mamba
            page is the attention page already).
        mamba_cache_mode: ``"none"`` or ``"align"``.
    """

    block_size: int
    mamba_block_size: int
    mamba_page_size_padded: int | None
    mamba_cache_mode: str

    def spec_options(self) -> dict[str, Any]:
        """The keyword arguments of ``to_vllm_specs`` that carry these sizes."""
        return {
            "block_size": self.block_size,
            "mamba_block_size": self.mamba_block_size,
            "mamba_cache_mode": self.mamba_cache_mode,
        }

    def pad(self, backends: Mapping[int, AttentionBackend]) -> dict[int, AttentionBackend]:
        """``backends`` with every state layer's page (Mamba2 and linear attention, vLLM's
        ``MambaSpec`` layers) padded to ``mamba_page_size_padded``; layers that shared a
        backend share its padded copy, other layers are kept as they are.

        Raises:
            ArgumentError: a state layer whose meaningful page exceeds
                ``mamba_page_size_padded`` (naming the layer and both sizes).
        """
        padded: dict[int, AttentionBackend] = {}
        copies: dict[int, AttentionBackend] = {}
        target = self.mamba_page_size_padded
        for layer, backend in backends.items():
            if isinstance(backend, Mamba2Backend | LinearAttentionBackend) and target is not None:
                if id(backend) not in copies:
                    options = backend.options() | {"page_size_padded": target}
                    cls = (
                        Mamba2Backend
                        if isinstance(backend, Mamba2Backend)
                        else LinearAttentionBackend
                    )
                    try:
                        copies[id(backend)] = cls(**options)
                    except ValueError as exc:
                        raise ArgumentError(f"layer {layer}: {exc}") from None
                backend = copies[id(backend)]
            padded[layer] = backend
        return padded


def _attention_token_bytes(backends: Mapping[int, AttentionBackend]) -> int:
    """Bytes of one token of the first full-attention GQA layer (vLLM sizes every attention
    page from the model config's heads, which these layers share)."""
    for layer in sorted(backends):
        backend = backends[layer]
        if not isinstance(backend, GQABackend):
            continue
        groups = backend.groups_by_name()
        roles = backend.cache_roles()
        if all(groups[r.group].kind is GroupKind.FULL for r in roles):
            per_token = sum(r.bytes_per_token for r in roles)  # a Fraction, whole for GQA
            return int(per_token)
    raise ArgumentError("backends: no full-attention GQA layer, so no attention page to align to")


def _state_page_bytes(backends: Mapping[int, AttentionBackend]) -> int:
    """The largest per-slot state of the Mamba2 / linear-attention layers."""
    pages = [
        sum(r.entry_bytes for r in b.cache_roles())
        for b in backends.values()
        if isinstance(b, Mamba2Backend | LinearAttentionBackend)
    ]
    if not pages:
        raise ArgumentError("backends: no Mamba2 or linear-attention layer: not a hybrid model")
    return max(pages)


def vllm_hybrid_sizes(
    backends: Mapping[int, AttentionBackend],
    *,
    max_model_len: int,
    block_size: int = 16,
    kernel_block_size: int = 16,
    mamba_cache_mode: str = "none",
) -> HybridSizes:
    """The sizes vLLM resolves for a hybrid model's declaration.

    Args:
        backends: the model (unpadded, as ``from_hf_config`` gives it).
        max_model_len: the engine's ``max_model_len`` (the Mamba block without prefix caching).
        block_size: ``--block-size`` (vLLM's default 16).
        kernel_block_size: the smallest kernel block of the attention backend
            (``get_supported_kernel_block_sizes``; 16 for FlashAttention).
        mamba_cache_mode: ``"none"``, or ``"align"`` (vLLM's choice with prefix caching).

    Raises:
        ArgumentError: a size that is not a positive int, an unknown mode, a model without a
            full-attention GQA layer or without a state layer; the message names it.
    """
    max_model_len = check_int("max_model_len", max_model_len, minimum=1)
    block_size = check_int("block_size", block_size, minimum=1)
    kernel_block_size = check_int("kernel_block_size", kernel_block_size, minimum=1)
    if mamba_cache_mode not in _MODES:
        raise ArgumentError(
            f"mamba_cache_mode must be one of {list(_MODES)}, got {mamba_cache_mode!r}"
        )
    attn_1 = _attention_token_bytes(backends)
    mamba_page = _state_page_bytes(backends)
    align = max(kernel_block_size, block_size)
    needed = align * -(-mamba_page // (align * attn_1))
    needed = kernel_block_size * -(-needed // kernel_block_size)
    block_size = max(block_size, needed)
    padded = block_size * attn_1
    return HybridSizes(
        block_size=block_size,
        mamba_block_size=block_size if mamba_cache_mode == "align" else max_model_len,
        mamba_page_size_padded=None if padded == mamba_page else padded,
        mamba_cache_mode=mamba_cache_mode,
    )
