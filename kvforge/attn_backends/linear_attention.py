"""Gated DeltaNet linear attention (Qwen3-Next): a fixed-size state per request, not per token.

A linear-attention layer keeps two tensors per request, whatever the sequence length:

- ``conv_state`` ``[conv_dim // tp_size, conv_kernel_size - 1 + num_speculative_tokens]`` in the
  model dtype: the last ``conv_kernel_size - 1`` inputs of the short causal convolution over the
  fused q / k / v projection, ``conv_dim = 2 * num_key_heads * key_head_dim + num_value_heads *
  value_head_dim`` (q and k share ``key_head_dim``);
- ``recurrent_state`` ``[num_value_heads // tp_size, key_head_dim, value_head_dim]`` in the
  recurrent dtype: the delta-rule memory, one ``key_head_dim x value_head_dim`` matrix per value
  head.

This is the sizing of vLLM's ``MambaStateShapeCalculator.gated_delta_net_state_shape`` and
SGLang's hybrid linear-attention pool: tensor parallelism splits the heads, so each rank holds
``num_key_heads // tp_size`` q / k heads and ``num_value_heads // tp_size`` v heads (``tp_size``
must divide both), and draft tokens of speculative decoding widen the conv window. The
backend's own default recurrent dtype is float32, as SGLang keeps it (vLLM's
``--mamba-ssm-cache-dtype float32``); the model readers pass the dtype vLLM resolves instead
(``MambaStateDtypeCalculator.gated_delta_net_state_dtype`` in
``vllm/model_executor/layers/mamba/mamba_utils.py``: ``"auto"`` is the conv state's dtype, the
model dtype; see :func:`~kvforge.models.families.build_qwen3_next`).

``page_size_padded`` reproduces vLLM's hybrid layout, where the state page is padded to the
attention page (``Platform._align_hybrid_block_size`` in ``vllm/platforms/interface.py``), as
:class:`~kvforge.attn_backends.mamba.Mamba2Backend` does: the ``recurrent_state`` device block
then ends the page; host pages keep the meaningful bytes only.

Both roles live in one ``per_request`` group (``linear_state``, block size 1,
``slots_per_request=1``): a request takes its slot when it first schedules and keeps it until it
is freed. Invariants: the per-request bytes (:meth:`LinearAttentionBackend.state_bytes_per_request`)
do not depend on the number of tokens; a swap, for preemption or for a prefix snapshot, moves the
whole state (a partial state is useless: it sums up every token).

The backend declares ``snapshot_policy = "aligned"``: the host and remote tiers keep the state
snapshots taken at aligned boundaries. Recomputing a lost snapshot means running the whole
prefix again (the state sums up every token, no window of tokens rebuilds it), and the
snapshot costs one fixed-size page, so without it a prefix whose snapshot the device evicted
could not be reused at all, however many of its full-attention blocks a tier holds.
"""

from __future__ import annotations

import math
from typing import Any

from kvforge._checks import ArgumentError
from kvforge.attn_backends._args import dtype_name, optional_width, width
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole, GroupKind, SwapPurpose, TokenRange

__all__ = ["LINEAR_STATE_GROUP", "LinearAttentionBackend"]

LINEAR_STATE_GROUP = "linear_state"
"""Name of the per-request group every linear-attention layer shares."""


class LinearAttentionBackend(DeclaredBackend):
    """Conv and recurrent state of one Gated DeltaNet layer (its snapshots kept by the tiers:
    ``snapshot_policy = "aligned"``).

    Args:
        num_key_heads: q / k heads of the layer (``linear_num_key_heads``), before the
            tensor-parallel split.
        num_value_heads: v heads (``linear_num_value_heads``), before the split.
        key_head_dim: width of a q / k head (``linear_key_head_dim``).
        value_head_dim: width of a v head (``linear_value_head_dim``).
        conv_kernel_size: width of the causal convolution (``linear_conv_kernel_dim``), >= 2.
        tp_size: tensor-parallel ranks; it must divide both head counts.
        conv_dtype: ``conv_state`` dtype (the model dtype).
        recurrent_dtype: ``recurrent_state`` dtype (default float32).
        num_speculative_tokens: draft tokens per step; each widens the conv window by one.
        page_size_padded: bytes of one device page of both states (vLLM's
            ``mamba_page_size_padded``); default the meaningful bytes.

    Raises:
        ArgumentError: (a ``TypeError`` and a ``ValueError``) a size that is not a positive
            int (bools and floats included), ``conv_kernel_size < 2``, a negative
            ``num_speculative_tokens``, a ``tp_size`` that does not divide a head count, a
            ``page_size_padded`` below the meaningful bytes, or an unknown dtype; the message
            names the argument and its value. Everything is checked before anything is built.
    """

    snapshot_policy = "aligned"

    def __init__(
        self,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int,
        *,
        tp_size: int = 1,
        conv_dtype: str = "bfloat16",
        recurrent_dtype: str = "float32",
        num_speculative_tokens: int = 0,
        page_size_padded: int | None = None,
    ) -> None:
        owner = type(self).__name__
        num_key_heads = width(owner, "num_key_heads", num_key_heads, unit="heads")
        num_value_heads = width(owner, "num_value_heads", num_value_heads, unit="heads")
        key_head_dim = width(owner, "key_head_dim", key_head_dim)
        value_head_dim = width(owner, "value_head_dim", value_head_dim)
        conv_kernel_size = width(owner, "conv_kernel_size", conv_kernel_size, minimum=2)
        tp_size = width(owner, "tp_size", tp_size, unit="ranks")
        num_speculative_tokens = width(
            owner, "num_speculative_tokens", num_speculative_tokens, minimum=0
        )
        for name, heads in (("num_key_heads", num_key_heads), ("num_value_heads", num_value_heads)):
            if heads % tp_size:
                raise ArgumentError(
                    f"{owner}: tp_size={tp_size} does not divide {name}={heads}: tensor "
                    "parallelism splits the linear-attention heads across ranks"
                )
        conv_dtype = dtype_name(owner, "conv_dtype", conv_dtype)
        recurrent_dtype = dtype_name(owner, "recurrent_dtype", recurrent_dtype)
        padded = optional_width(owner, "page_size_padded", page_size_padded)
        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.conv_kernel_size = conv_kernel_size
        self.tp_size = tp_size
        self.num_speculative_tokens = num_speculative_tokens
        self.conv_dtype = conv_dtype
        self.recurrent_dtype = recurrent_dtype
        self.declare(*self._declaration(owner, padded))

    def _declaration(
        self, owner: str, page_size_padded: int | None
    ) -> tuple[list[CacheGroup], list[CacheRole]]:
        tp, spec = self.tp_size, self.num_speculative_tokens
        group = CacheGroup(
            name=LINEAR_STATE_GROUP,
            block_size=1,
            kind=GroupKind.PER_REQUEST,
            slots_per_request=1,
        )
        conv = CacheRole(
            name="conv_state",
            group=group.name,
            entry_shape=(self.conv_dim // tp, self.conv_kernel_size - 1 + spec),
            dtype=self.conv_dtype,
        )
        recurrent = CacheRole(
            name="recurrent_state",
            group=group.name,
            entry_shape=(self.num_value_heads // tp, self.key_head_dim, self.value_head_dim),
            dtype=self.recurrent_dtype,
        )
        real = conv.entry_bytes + recurrent.entry_bytes
        self.page_size_padded = page_size_padded
        if page_size_padded is not None and page_size_padded != real:
            if page_size_padded < real:
                raise ArgumentError(
                    f"{owner}: page_size_padded={page_size_padded} is below the {real} bytes "
                    "of one request's conv and recurrent state"
                )
            alignment = page_size_padded - conv.entry_bytes
            recurrent = recurrent.model_copy(update={"block_alignment": alignment})
        return [group], [conv, recurrent]

    # ------------------------------------------------------------------ sizes

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution over all ranks: q and k (``key_head_dim`` each) plus v."""
        return (
            2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        )

    @property
    def conv_state_bytes(self) -> int:
        """Bytes of one request's ``conv_state`` on one rank."""
        return self.role("conv_state").entry_bytes

    @property
    def recurrent_state_bytes(self) -> int:
        """Bytes of one request's ``recurrent_state`` on one rank."""
        return self.role("recurrent_state").entry_bytes

    def state_bytes_per_request(self) -> int:
        """Meaningful bytes one request holds in this layer on one rank, whatever its length:
        every slot of every role (no device padding)."""
        slots = self.groups_by_name()[LINEAR_STATE_GROUP].slots_per_request
        return slots * sum(math.prod(r.entry_shape) * r.itemsize for r in self.cache_roles())

    def options(self) -> dict[str, Any]:
        """The constructor's arguments, to build a variant
        (``LinearAttentionBackend(**options)``)."""
        return {
            "num_key_heads": self.num_key_heads,
            "num_value_heads": self.num_value_heads,
            "key_head_dim": self.key_head_dim,
            "value_head_dim": self.value_head_dim,
            "conv_kernel_size": self.conv_kernel_size,
            "tp_size": self.tp_size,
            "conv_dtype": self.conv_dtype,
            "recurrent_dtype": self.recurrent_dtype,
            "num_speculative_tokens": self.num_speculative_tokens,
            "page_size_padded": self.page_size_padded,
        }

    # ------------------------------------------------------------------ swap

    def offload_selection(
        self, role: CacheRole, num_tokens: int, purpose: SwapPurpose
    ) -> TokenRange:
        """The whole state, for either purpose.

        ``preempt``: resuming needs the state as it was. ``prefix``: the state at a boundary is
        a snapshot that cannot be recomputed from a window of tokens, so it moves too (unlike
        the compressor ``state`` groups, whose tail is recomputed).
        """
        group = self.groups_by_name()[role.group]
        if not role.offload:
            return TokenRange(start=num_tokens, end=num_tokens)
        return group.live_token_range(num_tokens)

    def __repr__(self) -> str:
        extra = f", tp_size={self.tp_size}" if self.tp_size != 1 else ""
        if self.num_speculative_tokens:
            extra += f", num_speculative_tokens={self.num_speculative_tokens}"
        if self.page_size_padded is not None:
            extra += f", page_size_padded={self.page_size_padded}"
        return (
            f"LinearAttentionBackend(num_key_heads={self.num_key_heads}, "
            f"num_value_heads={self.num_value_heads}, key_head_dim={self.key_head_dim}, "
            f"value_head_dim={self.value_head_dim}, conv_kernel_size={self.conv_kernel_size}, "
            f"conv_dtype={self.conv_dtype!r}, recurrent_dtype={self.recurrent_dtype!r}{extra})"
        )
