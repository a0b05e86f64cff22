"""Mamba2 (selective state space) layers: a fixed-size state per request, not per token.

A Mamba2 mixer keeps two tensors per request, whatever the sequence length, with the shapes
and dtypes of vLLM's ``MambaStateShapeCalculator.mamba2_state_shape`` and
``MambaStateDtypeCalculator.mamba2_state_dtype``
(``vllm/model_executor/layers/mamba/mamba_utils.py``):

- ``conv_state`` ``[conv_kernel_size - 1 + num_speculative_tokens, conv_dim // tp_size]`` in
  the conv dtype: the last ``conv_kernel_size - 1`` inputs of the causal convolution over
  ``x``, ``B`` and ``C``, ``conv_dim = intermediate_size + 2 * n_groups' * state_size``.
  ``n_groups'`` is ``n_groups`` plus the groups tensor parallelism replicates so that every
  rank holds the groups of its heads (``extra_groups_for_head_shards``: none when ``tp_size``
  divides ``n_groups``, else ``tp_size - n_groups``). The layout is vLLM's default ``"SD"``
  (``get_conv_state_layout``: state length first, channels innermost);
- ``ssm_state`` ``[num_heads // tp_size, head_dim, state_size]`` in the SSM dtype: one
  ``head_dim x state_size`` matrix per head.

Dtypes follow vLLM's cache options: ``mamba_cache_dtype`` (``"auto"``: the model dtype) sets
the conv state, ``mamba_ssm_cache_dtype`` (``"auto"``: the conv state's dtype) the SSM state.
A model's builder says which it chose (Nemotron-H's engines keep the SSM state in float32 by
default: ``NemotronHForCausalLMConfig`` in ``vllm/model_executor/models/config.py``).

Both roles live in one ``per_request`` group (``mamba_state``, block size 1): a request takes
``1 + num_speculative_tokens`` slots when it first schedules (vLLM's MambaSpec
``num_speculative_blocks``) and keeps them until it is freed. The per-request bytes do not
depend on the number of tokens; a swap, for preemption or for a prefix snapshot, moves the
whole state. The backend declares ``snapshot_policy = "aligned"``, like the linear-attention
backend: the state sums up every token before the boundary, so a lost snapshot can only be
recomputed by running the whole prefix again, and it costs one fixed-size page.

``page_size_padded`` reproduces vLLM's hybrid layout, where every Mamba page is padded to the
attention page (``Platform._align_hybrid_block_size`` in ``vllm/platforms/interface.py``):
the ``ssm_state`` device block then ends the page, host pages keep the meaningful bytes only.

Worked example, one Falcon-H1-7B mixer (24 heads of 128, state 256, one group, kernel 4, bf16)::

    conv_dim = 3072 + 2 * 1 * 256 = 3584: conv [3, 3584] * 2 B     =    21,504 B
    ssm [24, 128, 256] * 2 B                                         = 1,572,864 B

>>> backend = Mamba2Backend(24, 128, 256, 4)
>>> backend.role("conv_state").entry_shape, backend.role("ssm_state").entry_shape
((3, 3584), (24, 128, 256))
>>> backend.state_bytes_per_request()
1594368
"""

from __future__ import annotations

import math
from typing import Any

from kvforge._checks import ArgumentError
from kvforge.attn_backends._args import dtype_name, optional_width, width
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole, GroupKind, SwapPurpose, TokenRange

__all__ = ["MAMBA_STATE_GROUP", "Mamba2Backend"]

MAMBA_STATE_GROUP = "mamba_state"
"""Name of the per-request group every Mamba2 layer shares."""


def extra_groups_for_head_shards(n_groups: int, tp_size: int) -> int:
    """Groups tensor parallelism replicates so each rank holds its heads' groups (vLLM's
    ``MambaStateShapeCalculator.extra_groups_for_head_shards``).

    >>> extra_groups_for_head_shards(8, 4), extra_groups_for_head_shards(1, 4)
    (0, 3)
    """
    return 0 if n_groups % tp_size == 0 else tp_size - n_groups


class Mamba2Backend(DeclaredBackend):
    """Conv and SSM state of one Mamba2 mixer (snapshots kept by the tiers:
    ``snapshot_policy = "aligned"``).

    Args:
        num_heads: SSM heads (``mamba_n_heads`` / ``mamba_num_heads``), before the split.
        head_dim: width of a head (``mamba_d_head`` / ``mamba_head_dim``).
        state_size: SSM state per head channel (``mamba_d_state`` / ``ssm_state_size``).
        conv_kernel_size: width of the causal convolution (``mamba_d_conv`` /
            ``conv_kernel``), >= 2.
        n_groups: groups of ``B`` / ``C`` (``mamba_n_groups`` / ``n_groups``).
        intermediate_size: channels of ``x`` (``mamba_d_ssm``, or ``mamba_expand *
            hidden_size``); default ``num_heads * head_dim``.
        tp_size: tensor-parallel ranks; it must divide ``num_heads`` and the conv channels.
        conv_dtype: ``conv_state`` dtype (the resolved ``mamba_cache_dtype``).
        ssm_dtype: ``ssm_state`` dtype (the resolved ``mamba_ssm_cache_dtype``); default
            ``conv_dtype``, as vLLM's ``"auto"``.
        num_speculative_tokens: draft tokens per step; each widens the conv window by one
            and adds a state slot per request.
        page_size_padded: bytes of one device page of both states (vLLM's
            ``mamba_page_size_padded``); default the meaningful bytes.

    Raises:
        ArgumentError: (a ``TypeError`` and a ``ValueError``) a size that is not a positive
            int (bools and floats included), ``conv_kernel_size < 2``, a negative
            ``num_speculative_tokens``, a ``tp_size`` that does not divide the heads or the
            conv channels, a ``page_size_padded`` below the meaningful bytes, or an unknown
            dtype; the message names the argument and its value. Everything is checked
            before anything is built.
    """

    snapshot_policy = "aligned"

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        state_size: int,
        conv_kernel_size: int,
        *,
        n_groups: int = 1,
        intermediate_size: int | None = None,
        tp_size: int = 1,
        conv_dtype: str = "bfloat16",
        ssm_dtype: str | None = None,
        num_speculative_tokens: int = 0,
        page_size_padded: int | None = None,
    ) -> None:
        owner = type(self).__name__
        self.num_heads = width(owner, "num_heads", num_heads, unit="heads")
        self.head_dim = width(owner, "head_dim", head_dim)
        self.state_size = width(owner, "state_size", state_size)
        self.conv_kernel_size = width(owner, "conv_kernel_size", conv_kernel_size, minimum=2)
        self.n_groups = width(owner, "n_groups", n_groups, unit="groups")
        inner = optional_width(owner, "intermediate_size", intermediate_size)
        self.intermediate_size = self.num_heads * self.head_dim if inner is None else inner
        self.tp_size = width(owner, "tp_size", tp_size, unit="ranks")
        self.num_speculative_tokens = width(
            owner, "num_speculative_tokens", num_speculative_tokens, minimum=0
        )
        self.conv_dtype = dtype_name(owner, "conv_dtype", conv_dtype)
        self.ssm_dtype = (
            self.conv_dtype if ssm_dtype is None else dtype_name(owner, "ssm_dtype", ssm_dtype)
        )
        self._check_split(owner)
        self.declare(
            *self._declaration(owner, optional_width(owner, "page_size_padded", page_size_padded))
        )

    def _check_split(self, owner: str) -> None:
        tp = self.tp_size
        if self.num_heads % tp:
            raise ArgumentError(
                f"{owner}: tp_size={tp} does not divide num_heads={self.num_heads}: tensor "
                "parallelism splits the SSM heads across ranks"
            )
        if self.conv_dim % tp:
            raise ArgumentError(
                f"{owner}: tp_size={tp} does not divide the conv channels {self.conv_dim} "
                f"(intermediate_size={self.intermediate_size} + 2 * {self.padded_groups} "
                f"groups * state_size={self.state_size})"
            )

    def _declaration(
        self, owner: str, page_size_padded: int | None
    ) -> tuple[list[CacheGroup], list[CacheRole]]:
        tp, spec = self.tp_size, self.num_speculative_tokens
        group = CacheGroup(
            name=MAMBA_STATE_GROUP,
            block_size=1,
            kind=GroupKind.PER_REQUEST,
            slots_per_request=1 + spec,
        )
        conv = CacheRole(
            name="conv_state",
            group=group.name,
            entry_shape=(self.conv_kernel_size - 1 + spec, self.conv_dim // tp),
            dtype=self.conv_dtype,
        )
        ssm = CacheRole(
            name="ssm_state",
            group=group.name,
            entry_shape=(self.num_heads // tp, self.head_dim, self.state_size),
            dtype=self.ssm_dtype,
        )
        real = conv.entry_bytes + ssm.entry_bytes
        self.page_size_padded = page_size_padded
        if page_size_padded is not None and page_size_padded != real:
            if page_size_padded < real:
                raise ArgumentError(
                    f"{owner}: page_size_padded={page_size_padded} is below the {real} bytes "
                    "of one request's conv and SSM state"
                )
            ssm = ssm.model_copy(update={"block_alignment": page_size_padded - conv.entry_bytes})
        return [group], [conv, ssm]

    # ------------------------------------------------------------------ sizes

    @property
    def padded_groups(self) -> int:
        """``n_groups`` plus the groups replicated for the head shards."""
        return self.n_groups + extra_groups_for_head_shards(self.n_groups, self.tp_size)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution over all ranks: ``x`` plus ``B`` and ``C``."""
        return self.intermediate_size + 2 * self.padded_groups * self.state_size

    @property
    def conv_state_bytes(self) -> int:
        """Bytes of one slot's ``conv_state`` on one rank."""
        return self.role("conv_state").entry_bytes

    @property
    def ssm_state_bytes(self) -> int:
        """Bytes of one slot's ``ssm_state`` on one rank."""
        return self.role("ssm_state").entry_bytes

    def state_bytes_per_request(self) -> int:
        """Meaningful bytes one request holds in this layer on one rank, whatever its length:
        every slot of both roles (no device padding)."""
        slots = self.groups_by_name()[MAMBA_STATE_GROUP].slots_per_request
        return slots * sum(math.prod(r.entry_shape) * r.itemsize for r in self.cache_roles())

    def options(self) -> dict[str, Any]:
        """The constructor's arguments, to build a variant (``Mamba2Backend(**options)``)."""
        return {
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "state_size": self.state_size,
            "conv_kernel_size": self.conv_kernel_size,
            "n_groups": self.n_groups,
            "intermediate_size": self.intermediate_size,
            "tp_size": self.tp_size,
            "conv_dtype": self.conv_dtype,
            "ssm_dtype": self.ssm_dtype,
            "num_speculative_tokens": self.num_speculative_tokens,
            "page_size_padded": self.page_size_padded,
        }

    # ------------------------------------------------------------------ swap

    def offload_selection(
        self, role: CacheRole, num_tokens: int, purpose: SwapPurpose
    ) -> TokenRange:
        """The whole state, for either purpose (a partial state is useless: it sums up every
        token, and no window of tokens rebuilds it)."""
        group = self.groups_by_name()[role.group]
        if not role.offload:
            return TokenRange(start=num_tokens, end=num_tokens)
        return group.live_token_range(num_tokens)

    def __repr__(self) -> str:
        extra = ""
        if self.intermediate_size != self.num_heads * self.head_dim:
            extra += f", intermediate_size={self.intermediate_size}"
        if self.tp_size != 1:
            extra += f", tp_size={self.tp_size}"
        if self.num_speculative_tokens:
            extra += f", num_speculative_tokens={self.num_speculative_tokens}"
        if self.page_size_padded is not None:
            extra += f", page_size_padded={self.page_size_padded}"
        return (
            f"Mamba2Backend(num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"state_size={self.state_size}, conv_kernel_size={self.conv_kernel_size}, "
            f"n_groups={self.n_groups}, conv_dtype={self.conv_dtype!r}, "
            f"ssm_dtype={self.ssm_dtype!r}{extra})"
        )
