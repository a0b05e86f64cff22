"""One vLLM layer as a kvforge declaration: :class:`VllmSpecBackend` carries a vLLM
``KVCacheSpec`` and declares the group and roles that hold its page byte for byte (a padded
page keeps its padding), for a spec no bundled backend reproduces. :data:`SUPPORTED_SPECS`
names the spec types kvforge plans. The translation both ways is in
:mod:`kvforge.integrations.vllm.specs`; ``tests/integrations/test_vllm_specs.py`` checks the
bytes of every bundled model.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvforge._checks import ArgumentError
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.integrations.vllm.spec_kinds import kind_of_spec
from kvforge.specs import (
    CacheGroup,
    CacheRole,
    canonical_dtype,
    check_role_in_group,
)

# spec type -> the group name prefix from_vllm_specs gives it; exact types only: a subclass
# (SinkFullAttentionSpec, RSWASpec, ...) means something these groups do not
SUPPORTED_SPECS: dict[type[KVCacheSpec], str] = {
    FullAttentionSpec: "full",
    SlidingWindowSpec: "swa",
    ChunkedLocalAttentionSpec: "chunked",
    MLAAttentionSpec: "mla",
    SlidingWindowMLASpec: "swa_mla",
    MambaSpec: "mamba",
}


def _role_dtype(name: str, dtype: Any) -> str:
    try:
        return canonical_dtype(dtype)
    except ValueError as exc:
        raise ArgumentError(f"layer {name!r}: {exc}") from None


def _declaration(name: str, spec: KVCacheSpec, group: str) -> tuple[CacheGroup, list[CacheRole]]:
    """The group and roles of one vLLM layer, byte for byte."""
    kind, window = kind_of_spec(spec)
    if isinstance(spec, MambaSpec):
        cache_group = CacheGroup(
            name=group, block_size=1, kind=kind, slots_per_request=1 + spec.num_speculative_blocks
        )
        roles = [
            CacheRole(
                name=f"state_{i}", group=group, entry_shape=shape, dtype=_role_dtype(name, dt)
            )
            for i, (shape, dt) in enumerate(zip(spec.shapes, spec.dtypes, strict=True))
        ]
        return cache_group, _pad(name, spec, cache_group, roles)
    assert isinstance(spec, AttentionSpec)
    ratio = spec.tokens_per_state
    if isinstance(ratio, Fraction):
        if ratio.denominator != 1:
            raise ArgumentError(
                f"layer {name!r}: tokens_per_state={ratio} stores several states per token; "
                "kvforge's compress ratios are whole tokens per entry"
            )
        ratio = int(ratio)
    cache_group = CacheGroup(name=group, block_size=spec.block_size, kind=kind, window=window)
    heads = spec.num_heads
    dtype = _role_dtype(name, spec.dtype)

    def role(role_name: str, width: int, dt: str) -> CacheRole:
        shape = (width,) if heads == 1 else (heads, width)
        return CacheRole(
            name=role_name, group=group, entry_shape=shape, dtype=dt, compress_ratio=ratio
        )

    if spec.state_content_bytes is not None:
        roles = [role("cache", spec.state_content_bytes, "uint8")]
    elif spec.head_size_v == 0:
        roles = [role("key", spec.head_size, dtype)]
    else:
        roles = [role("key", spec.head_size, dtype), role("value", spec.head_size_v, dtype)]
    return cache_group, _pad(name, spec, cache_group, roles)


def _pad(
    name: str, spec: KVCacheSpec, group: CacheGroup, roles: list[CacheRole]
) -> list[CacheRole]:
    """``roles`` with the last one's ``block_alignment`` making the device block vLLM's
    padded page (vLLM's own ``alignment`` where it gives exactly that page)."""
    padded, real = int(spec.page_size_bytes), int(spec.real_page_size_bytes)
    if padded == real:
        return roles
    others = sum(r.block_bytes(group) for r in roles[:-1])
    alignment = getattr(spec, "alignment", None)
    if not (len(roles) == 1 and alignment and -(-real // alignment) * alignment == padded):
        alignment = padded - others
    last = roles[-1].model_copy(update={"block_alignment": alignment})
    try:
        check_role_in_group(last, group)
    except ValueError as exc:
        raise ArgumentError(f"layer {name!r}: its padded page of {padded} B: {exc}") from None
    return [*roles[:-1], last]


class VllmSpecBackend(DeclaredBackend):
    """One vLLM layer's cache as a kvforge backend: one group, roles byte for byte.

    Roles: ``key`` and ``value`` (``[heads, head_size]`` each) for a K/V spec, ``key`` alone
    for a single-vector (MLA) spec, ``cache`` (uint8) for a packed one
    (``state_content_bytes``), ``state_<i>`` per state tensor of a ``MambaSpec``. vLLM's
    padding becomes the last role's ``block_alignment``; ``tokens_per_state`` the compress
    ratio. ``to_vllm_specs`` gives ``spec`` back unchanged.
    """

    def __init__(self, spec: KVCacheSpec, group: str, layer_name: str = "") -> None:
        self.spec = spec
        self.group_name = group
        try:
            cache_group, roles = _declaration(layer_name or group, spec, group)
            self.declare([cache_group], roles)
        except ValueError as exc:
            raise ArgumentError(f"layer {layer_name or group!r}: {exc}") from None

    def __repr__(self) -> str:
        return f"VllmSpecBackend({type(self.spec).__name__}, group={self.group_name!r})"
