"""The merged, ordered view of every layer's declared caches.

:class:`CacheLayout` is built once from ``layer id -> backend`` and answers every question
that depends only on the declarations: which groups exist, the ordered list of (role, layer)
buffers, per-group byte counts. It allocates nothing.

Bytes come in two figures: *device* bytes count each role's block stride, alignment padding
included (``CacheRole.device_block_bytes``); *host page* bytes count only the meaningful bytes
of the offloaded roles (host pages never carry device padding). Per-token figures are exact
:class:`~fractions.Fraction` values, since a compressed role stores a fraction of an entry per
token.

Ordering invariant: buffers are layer-major (ascending layer id) and, within a layer, follow
the backend's ``cache_roles()`` order. Groups are ordered by the first buffer that uses them.
Neither depends on the order in which the mapping was built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

from kvforge._checks import check_bool, check_int
from kvforge.attn_backends.base import AttentionBackend
from kvforge.kinds import GroupFamily, rule_of
from kvforge.specs import CacheGroup, CacheRole, GroupKind, strict_int

__all__ = [
    "DEFAULT_WINDOWED_MAX_MODEL_LEN",
    "CacheBuffer",
    "CacheLayout",
    "check_share_pools",
    "resolve_max_model_len",
    "table_widths",
]


def check_share_pools(share_pools: object) -> bool:
    """``share_pools`` itself, refused unless it is a bool (every side checks it alike)."""
    return check_bool("share_pools", share_pools)


@dataclass(frozen=True)
class CacheBuffer:
    """One (role, layer) buffer.

    Attributes:
        index: its position in the ordered cache list.
        layer: the layer id.
        role: the role spec.
        group: the role's group spec.
    """

    index: int
    layer: int
    role: CacheRole
    group: CacheGroup

    @property
    def key(self) -> tuple[str, int]:
        return (self.role.name, self.layer)

    @property
    def block_bytes(self) -> int:
        """Meaningful bytes of one block (its share of a host page)."""
        return self.role.block_bytes(self.group)

    @property
    def device_block_bytes(self) -> int:
        """Device stride of one block: :attr:`block_bytes` rounded up to the role's alignment."""
        return self.role.device_block_bytes(self.group)


def _check_backends(backends: Mapping[int, AttentionBackend]) -> dict[int, AttentionBackend]:
    if not isinstance(backends, Mapping):
        raise TypeError(
            f"backends must be a mapping of layer id -> AttentionBackend, got "
            f"{type(backends).__name__}"
        )
    if not backends:
        raise ValueError("backends is empty: give at least one layer id -> AttentionBackend")
    checked: dict[int, AttentionBackend] = {}
    for layer in sorted(backends, key=lambda k: (not isinstance(k, int), str(k))):
        backend = backends[layer]
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"backends has layer id {layer!r}; layer ids must be ints >= 0")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"backends[{layer}] is a {type(backend).__name__}, not an AttentionBackend"
            )
        checked[layer] = backend
    return checked


class CacheLayout:
    """Groups, ordered buffers and byte counts of a model.

    Args:
        backends: layer id -> backend (layers may use different backends, an instance may
            serve several layers).
        max_model_len: the model's longest sequence in tokens, when known (a config's
            ``max_position_embeddings``); memory plans default to it. When omitted, a
            ``max_model_len`` or else ``max_position_embeddings`` attribute of ``backends`` is
            used (``from_hf_config`` returns a mapping that carries the latter).

    Raises:
        ValueError: empty mapping, bad layer ids, a backend whose declaration is inconsistent,
            two backends that declare the same group name with different specs, or a
            ``max_model_len`` that is not a positive int.
        TypeError: a value is not an :class:`AttentionBackend`.
    """

    def __init__(
        self, backends: Mapping[int, AttentionBackend], max_model_len: int | None = None
    ) -> None:
        checked = _check_backends(backends)
        if max_model_len is None:  # what the model's config says, when the mapping carries it
            max_model_len = getattr(backends, "max_model_len", None)
            if max_model_len is None:
                max_model_len = getattr(backends, "max_position_embeddings", None)
        self.max_model_len: int | None = (
            None
            if max_model_len is None
            else strict_int("max_model_len", max_model_len, unit="tokens")
        )
        self.layers: tuple[int, ...] = tuple(sorted(checked))
        self.backends: dict[int, AttentionBackend] = {
            layer: checked[layer] for layer in self.layers
        }

        groups: dict[str, CacheGroup] = {}
        declared_by: dict[str, int] = {}
        entries: list[CacheBuffer] = []
        for layer in self.layers:
            backend = self.backends[layer]
            backend.validate()
            own = backend.groups_by_name()
            for role in backend.cache_roles():
                group = own[role.group]
                known = groups.get(group.name)
                if known is None:
                    groups[group.name] = group
                    declared_by[group.name] = layer
                elif known != group:
                    first = declared_by[group.name]
                    raise ValueError(
                        f"group {group.name!r} is declared differently by layer {first} "
                        f"({self.backends[first]!r}: {known!r}) and layer {layer} "
                        f"({backend!r}: {group!r})"
                    )
                entries.append(CacheBuffer(len(entries), layer, role, group))
        self.buffers: tuple[CacheBuffer, ...] = tuple(entries)
        # Ordered by first use in the layer-major list, a deterministic order.
        ordered: list[CacheGroup] = []
        for e in self.buffers:
            if e.group not in ordered:
                ordered.append(e.group)
        self.groups: tuple[CacheGroup, ...] = tuple(ordered)
        self._index = {e.key: e for e in self.buffers}
        self._buffers_by_layers: dict[tuple[int, ...], tuple[CacheBuffer, ...]] = {}

    # ------------------------------------------------------------------ lookups

    @cached_property
    def group_map(self) -> dict[str, CacheGroup]:
        return {g.name: g for g in self.groups}

    def group(self, name: str) -> CacheGroup:
        try:
            return self.group_map[name]
        except KeyError:
            raise ValueError(
                f"group {name!r} does not exist; groups are {[g.name for g in self.groups]}"
            ) from None

    def entry(self, role: str, layer: int) -> CacheBuffer:
        try:
            return self._index[(role, layer)]
        except KeyError:
            if layer not in self.backends:
                raise KeyError(
                    f"layer {layer!r} has no caches; layers are {list(self.layers)}"
                ) from None
            roles = [r.name for r in self.backends[layer].cache_roles()]
            raise KeyError(f"layer {layer} has no role {role!r}; its roles are {roles}") from None

    def buffers_of(self, group: str) -> tuple[CacheBuffer, ...]:
        """Buffers of ``group`` in list order."""
        return tuple(e for e in self.buffers if e.group.name == group)

    @cached_property
    def _compress_ratios(self) -> dict[str, tuple[int, ...]]:
        return {
            g.name: tuple(sorted({e.role.compress_ratio for e in self.buffers_of(g.name)}))
            for g in self.groups
        }

    def compress_ratios(self, group: str) -> tuple[int, ...]:
        """The distinct compress ratios of ``group``'s roles, ascending: a step computes one
        slot mapping per ratio (DeepSeek-V4-Flash: ``compressed`` ``(4, 128)``, its ratio-4
        and ratio-128 layers in one group; ``swa`` ``(1,)``)."""
        return self._compress_ratios[self.group(group).name]

    def buffers_of_layers(self, layers: tuple[int, ...]) -> tuple[CacheBuffer, ...]:
        """Buffers of ``layers`` in list order (a backend's layers, asked on every swap)."""
        found = self._buffers_by_layers.get(layers)
        if found is None:
            members = set(layers)
            found = tuple(e for e in self.buffers if e.layer in members)
            self._buffers_by_layers[layers] = found
        return found

    @cached_property
    def _offload_buffers(self) -> dict[str, tuple[CacheBuffer, ...]]:
        # the layout never changes after construction; swaps ask for this on every call
        return {
            g.name: tuple(e for e in self.buffers_of(g.name) if e.role.offload) for g in self.groups
        }

    def offload_buffers(self, group: str) -> tuple[CacheBuffer, ...]:
        """Buffers of ``group`` that swaps move, in list order: the planes of a host page."""
        found = self._offload_buffers.get(group)
        return found if found is not None else ()

    @cached_property
    def _offload_roles(self) -> dict[str, tuple[tuple[AttentionBackend, CacheRole], ...]]:
        found: dict[str, dict[tuple[int, str], tuple[AttentionBackend, CacheRole]]] = {}
        for e in self.buffers:
            if e.role.offload:
                backend = self.backends[e.layer]
                found.setdefault(e.group.name, {}).setdefault(
                    (id(backend), e.role.name), (backend, e.role)
                )
        return {g: tuple(pairs.values()) for g, pairs in found.items()}

    def offload_roles(self, group: str) -> tuple[tuple[AttentionBackend, CacheRole], ...]:
        """Distinct (backend instance, role) pairs that swaps of ``group`` move, in list order.

        ``offload_selection`` sees a role, not a layer, so a swap asks each pair once: 43
        layers of DeepSeek-V4-Flash share three backends.
        """
        found = self._offload_roles.get(group)
        return found if found is not None else ()

    @cached_property
    def _backend_layers(self) -> tuple[tuple[AttentionBackend, tuple[int, ...]], ...]:
        by_id: dict[int, tuple[AttentionBackend, list[int]]] = {}
        for layer in self.layers:
            backend = self.backends[layer]
            by_id.setdefault(id(backend), (backend, []))[1].append(layer)
        return tuple((b, tuple(ls)) for b, ls in by_id.values())

    def backend_layers(self) -> list[tuple[AttentionBackend, tuple[int, ...]]]:
        """Each distinct backend instance with its layers, ordered by its first layer."""
        return list(self._backend_layers)

    # ------------------------------------------------------------------ shared pools

    @cached_property
    def pool_sets(self) -> tuple[tuple[str, ...], ...]:
        """Groups that can share one block pool, in group order; one tuple per pool.

        Two groups can share when their buffers pair up byte for byte: the same number of
        buffers with the same device block strides (as sorted lists). Then block ``b`` of
        the ``k``-th buffer of every member can live in the same bytes, so one id space of
        ``N`` blocks costs ``N`` pages once, and the groups draw on one free list instead of
        each keeping its own headroom (how a hybrid engine shares memory between its full
        and sliding-window layers). Per-request groups never share: their slots are
        snapshotted, not paged.

        gpt-oss-20b: 12 full and 12 sliding-window layers with the same K/V shapes, so
        ``(("swa", "kv"),)``; DeepSeek-V4-Flash: every group's pages differ, so each group is
        a set of its own. A group served by a backend that overrides ``create_kv_cache``
        lays out its own memory, which the storage cannot place in shared bytes, so it is a
        set of its own too (``share_pools``, on by default, shares where it can).
        """
        own_memory = set()
        for backend, layers in self._backend_layers:
            method = getattr(type(backend), "create_kv_cache", None)
            if method is not AttentionBackend.create_kv_cache:
                own_memory.update(e.group.name for e in self.buffers_of_layers(layers))
        by_shape: dict[tuple[int, ...], list[str]] = {}
        sets: list[list[str]] = []
        for g in self.groups:
            if g.rule.per_request or g.name in own_memory:
                sets.append([g.name])
                continue
            shape = tuple(sorted(e.device_block_bytes for e in self.buffers_of(g.name)))
            members = by_shape.get(shape)
            if members is None:
                members = by_shape[shape] = [g.name]
                sets.append(members)
            else:
                members.append(g.name)
        return tuple(tuple(s) for s in sets)

    def pools(
        self,
        share_pools: bool,
        num_blocks: Mapping[str, int],
        refusal: str = "num_blocks gives {} to",
    ) -> tuple[tuple[str, ...], ...]:
        """The groups of each pool, in group order: :attr:`pool_sets` with ``share_pools``,
        else every group alone. The groups of one pool must have the same count in
        ``num_blocks`` (the pool's); ``refusal`` words the error around the counts.

        Raises:
            TypeError: ``share_pools`` is not a bool.
            ValueError: two groups of one pool with different counts.
        """
        sets = (
            self.pool_sets
            if check_share_pools(share_pools)
            else tuple((g.name,) for g in self.groups)
        )
        for members in sets:
            if len(members) == 1:
                continue
            counts = {g: num_blocks[g] for g in members}
            if len(set(counts.values())) > 1:
                raise ValueError(
                    f"{refusal.format(counts)} groups {list(members)}, which share one pool "
                    "(share_pools=True): give each of them the pool's block count"
                )
        return sets

    def pool_of(self, group: str, share_pools: bool) -> tuple[str, ...]:
        """The groups whose pool ``group`` draws on (itself alone unless ``share_pools``)."""
        name = self.group(group).name
        if not share_pools:
            return (name,)
        return next(s for s in self.pool_sets if name in s)

    # ------------------------------------------------------------------ bytes

    @cached_property
    def _device_block_bytes(self) -> dict[str, int]:
        return {
            g.name: sum(e.device_block_bytes for e in self.buffers_of(g.name)) for g in self.groups
        }

    @cached_property
    def _host_page_bytes(self) -> dict[str, int]:
        return {
            g.name: sum(e.block_bytes for e in self.offload_buffers(g.name)) for g in self.groups
        }

    def bytes_per_block(self, group: str) -> int:
        """Device bytes of one block of ``group`` across every layer and role, alignment
        padding included (the sum of the roles' device block strides)."""
        return self._device_block_bytes[self.group(group).name]

    def host_page_bytes(self, group: str) -> int:
        """Bytes of one host page of ``group``: its offloaded roles, packed, no padding."""
        return self._host_page_bytes[self.group(group).name]

    def bytes_per_token_by_kind(self) -> dict[GroupKind | str, Fraction]:
        """Exact device bytes per token, block-amortised, summed per group kind.

        ``sum(bytes_per_block(g) / block_size(g))`` over the groups of each token-indexed kind
        present (``full``, ``sliding_window``, ``state``, ``chunked``). What a token costs
        while it is live: for ``full`` groups for ever, for the others only while it is inside
        their window. ``per_request`` groups cost per request, not per token (see
        :meth:`bytes_per_request`) and are left out.
        """
        found: dict[GroupKind | str, Fraction] = {}
        for g in self.groups:
            if g.rule.per_request:
                continue
            share = Fraction(self.bytes_per_block(g.name), g.block_size)
            found[g.kind] = found.get(g.kind, Fraction(0)) + share
        return found

    def bytes_per_request(self) -> int:
        """Device bytes every request holds in ``per_request`` groups, whatever its length."""
        return sum(
            g.slots_per_request * self.bytes_per_block(g.name)
            for g in self.groups
            if g.rule.per_request
        )

    def kv_bytes_per_token(self) -> int | Fraction:
        """Device bytes one more token of history costs, block-amortised and exact.

        Over the ``full`` groups: ``sum(bytes_per_block(g) / block_size(g))``, e.g.
        ``2 * layers * kv_heads * head_dim * itemsize`` for GQA. An ``int`` when whole, else a
        :class:`~fractions.Fraction` (a compressed role stores 584 B per 128 tokens).

        A model with no full group (every layer slides, as in Mistral-7B-v0.1) keeps no
        history; its figure is then what a token costs while it is live in the window groups
        (``sliding_window``, ``chunked`` and ``state``), never 0. The per-kind breakdown is
        :meth:`bytes_per_token_by_kind`.
        """
        by_kind = self.bytes_per_token_by_kind()
        history = [v for kind, v in by_kind.items() if rule_of(kind).history]
        total = sum(history, Fraction(0)) if history else None
        if total is None:
            total = sum(by_kind.values(), Fraction(0))
        return total.numerator if total.denominator == 1 else total


#: Table width (tokens) used when no ``max_model_len`` is given and no full group bounds it.
DEFAULT_WINDOWED_MAX_MODEL_LEN = 1 << 17


def resolve_max_model_len(
    layout: CacheLayout, num_blocks: Mapping[str, int], max_model_len: int | None
) -> int:
    """``max_model_len``, or its default: the tokens the smallest full group holds, at most
    131,072 (the tables are ``max_num_seqs x max_model_len / block_size`` ids: a default
    must not make them larger than the caches)."""
    if max_model_len is None:
        full = [
            (num_blocks[g.name] - 1) * g.block_size
            for g in layout.groups
            if g.family is GroupFamily.HISTORY
        ]
        max_model_len = min([*full, DEFAULT_WINDOWED_MAX_MODEL_LEN])
    return check_int("max_model_len", max_model_len, minimum=1)


def table_widths(layout: CacheLayout, max_num_seqs: int, max_model_len: int) -> dict[str, int]:
    """Columns of each group's table: the blocks ``max_model_len`` tokens span, or the slots
    of a per-request group. Shared by both sides so their tables have one shape."""
    check_int("max_num_seqs", max_num_seqs, minimum=1)
    return {g.name: g.rule.table_width(g, max_model_len) for g in layout.groups}
