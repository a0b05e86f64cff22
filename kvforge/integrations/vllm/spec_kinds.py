"""How each group kind reads in vLLM's spec language: one table, mapped once.

kvforge's kinds (:mod:`kvforge.kinds`) are engine-free rule objects and import no engine.
Which vLLM ``KVCacheSpec`` a group of a kind becomes is engine-specific, so it lives here: one
:class:`VllmKind` entry per kind, looked up by the kind's name (as vLLM maps each spec type to
its single-type cache manager once, in ``spec_manager_map``). The spec translation
(:mod:`kvforge.integrations.vllm.specs`) asks :func:`vllm_kind` and :func:`kind_of_spec` and
never compares kinds itself. A kind registered without an entry reads like a ``state`` group
(a window vLLM sizes by its own block), as before this table existed.
``tests/integrations/test_vllm_specs.py`` checks the bytes of every bundled model both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from kvforge.specs import CacheGroup, GroupKind

__all__ = ["VLLM_KINDS", "VllmKind", "kind_of_spec", "vllm_kind"]


@dataclass(frozen=True)
class VllmKind:
    """What a group of one kind is to vLLM.

    Attributes:
        kv_spec: the spec of a key / value layer (None: the kind has no such layer).
        kv_window: the keyword that carries ``group.window`` to it (None: no window).
        latent_spec: the spec of a single-vector (MLA family) cache; None: vLLM has none.
        latent_window: whether ``group.window`` goes to it as ``sliding_window``.
        per_request: a per-request state group: a ``MambaSpec``.
        follows_engine_block: vLLM sizes the group by ``cache_config.block_size``.
    """

    kv_spec: type[AttentionSpec] | None
    kv_window: str | None
    latent_spec: type[AttentionSpec] | None
    latent_window: bool
    per_request: bool
    follows_engine_block: bool

    def kv(self, group: CacheGroup, where: str, **kwargs: Any) -> KVCacheSpec:
        """The key / value spec of ``group`` from the spec's other fields."""
        if self.kv_spec is None:  # pragma: no cover - per-request groups take MambaSpec
            raise ArgumentError(f"{where}: vLLM has no attention spec for this group")
        if self.kv_window is not None:
            kwargs[self.kv_window] = group.window
        return self.kv_spec(**kwargs)

    def latent(self, group: CacheGroup, where: str, **kwargs: Any) -> KVCacheSpec:
        """The single-vector spec of ``group``; refused where vLLM has none."""
        if self.latent_spec is None:
            raise ArgumentError(
                f"{where}: vLLM has no chunked local-attention spec for a single-vector (MLA) cache"
            )
        if self.latent_window:
            kwargs["sliding_window"] = group.window
        return self.latent_spec(**kwargs)


_WINDOW = VllmKind(SlidingWindowSpec, "sliding_window", SlidingWindowMLASpec, True, False, True)
# a state group is a window vLLM sizes by the group's own block, never --block-size
_STATE = VllmKind(SlidingWindowSpec, "sliding_window", SlidingWindowMLASpec, True, False, False)

VLLM_KINDS: dict[str, VllmKind] = {
    GroupKind.FULL.value: VllmKind(FullAttentionSpec, None, MLAAttentionSpec, False, False, True),
    GroupKind.SLIDING_WINDOW.value: _WINDOW,
    GroupKind.CHUNKED.value: VllmKind(
        ChunkedLocalAttentionSpec, "attention_chunk_size", None, False, False, True
    ),
    GroupKind.STATE.value: _STATE,
    GroupKind.PER_REQUEST.value: VllmKind(None, None, None, False, True, False),
}
"""kind name -> what vLLM makes of a group of it."""


def vllm_kind(group: CacheGroup) -> VllmKind:
    """The entry of ``group``'s kind (a kind without one reads as ``state``)."""
    kind = group.kind
    return VLLM_KINDS.get(getattr(kind, "value", kind), _STATE)


# spec type -> (kind, the spec field holding its window), checked in this order
_SPEC_KINDS: tuple[tuple[type[KVCacheSpec], GroupKind, str | None], ...] = (
    (MambaSpec, GroupKind.PER_REQUEST, None),
    (SlidingWindowSpec, GroupKind.SLIDING_WINDOW, "sliding_window"),
    (ChunkedLocalAttentionSpec, GroupKind.CHUNKED, "attention_chunk_size"),
)


def kind_of_spec(spec: KVCacheSpec) -> tuple[GroupKind, int | None]:
    """The kind and window of the group a vLLM spec's layer belongs to (full otherwise)."""
    for cls, kind, window in _SPEC_KINDS:
        if isinstance(spec, cls):
            return kind, None if window is None else getattr(spec, window)
    return GroupKind.FULL, None
