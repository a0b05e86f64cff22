"""Per-request block tables over per-group pools, and slot mappings.

Invariants:

- a request has one table per group; entry ``i`` covers tokens
  ``[i * block_size, (i + 1) * block_size)`` and holds a block id or ``NULL_BLOCK``;
- a table is as long as its group needs for the request's tokens; in windowed groups
  (``sliding_window``, ``state``) every block wholly before the live window is back in the
  pool and its entry is ``NULL_BLOCK``, so a long request holds a bounded number of blocks;
- :meth:`BlockTables.allocate` is all-or-nothing across groups: it checks every group before
  it takes or returns a single block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvforge.cache_controller.block_pool import NULL_BLOCK, BlockPool
from kvforge.errors import OutOfBlocksError, RequestStateError
from kvforge.specs import CacheGroup

__all__ = ["BlockTables", "RequestTables", "first_live_block"]


def first_live_block(group: CacheGroup, num_tokens: int) -> int:
    """Index of the first block a request of ``num_tokens`` tokens can still read."""
    return group.live_token_range(num_tokens).start // group.block_size


@dataclass
class RequestTables:
    """The block tables of one request."""

    num_tokens: int
    tables: dict[str, list[int]] = field(default_factory=dict)

    def held(self, group: str) -> list[int]:
        """Real (non-null) block ids the request holds in ``group``."""
        return [b for b in self.tables[group] if b != NULL_BLOCK]


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise RequestStateError(f"request_id must be a non-empty str, got {request_id!r}")
    return request_id


class BlockTables:
    """Block pools of every group and the tables of every live request.

    Args:
        groups: the groups, in the controller's order.
        num_blocks: physical blocks per group (null block included).
    """

    def __init__(self, groups: Sequence[CacheGroup], num_blocks: Mapping[str, int]) -> None:
        self.groups: dict[str, CacheGroup] = {g.name: g for g in groups}
        self.order: tuple[str, ...] = tuple(g.name for g in groups)
        self.pools: dict[str, BlockPool] = {
            name: BlockPool(num_blocks[name], name) for name in self.order
        }
        self.requests: dict[str, RequestTables] = {}

    def get(self, request_id: str) -> RequestTables:
        check_request_id(request_id)
        try:
            return self.requests[request_id]
        except KeyError:
            raise RequestStateError(
                f"request {request_id!r} has no blocks on the device (never allocated, freed, "
                "or swapped out)"
            ) from None

    # ------------------------------------------------------------------ growth

    def plan_growth(
        self, current: RequestTables | None, num_tokens: int
    ) -> dict[str, tuple[int, list[int]]]:
        """For each group: (new blocks to take, held blocks that fall out of the window).

        Raises:
            OutOfBlocksError: some group cannot supply its new blocks, even counting the
                blocks the growth itself returns.
        """
        growth: dict[str, tuple[int, list[int]]] = {}
        for name in self.order:
            group = self.groups[name]
            table = current.tables[name] if current is not None else []
            new_len = group.blocks_for(num_tokens)
            first = first_live_block(group, num_tokens)
            needed = max(0, new_len - max(len(table), first))
            dropped = [b for b in table[:first] if b != NULL_BLOCK]
            growth[name] = (needed, dropped)
        for name, (needed, dropped) in growth.items():
            free = self.pools[name].num_free + len(dropped)
            if needed > free:
                raise OutOfBlocksError("device", name, needed, free, "allocate")
        return growth

    def allocate(self, request_id: str, num_tokens: int) -> RequestTables:
        """Grow (or create) ``request_id`` to cover ``num_tokens`` tokens in every group."""
        check_request_id(request_id)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        current = self.requests.get(request_id)
        if current is not None and num_tokens < current.num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} is less than the {current.num_tokens} tokens request "
                f"{request_id!r} already holds; tables only grow"
            )
        growth = self.plan_growth(current, num_tokens)
        state = current or RequestTables(num_tokens=0, tables={n: [] for n in self.order})
        for name, (needed, dropped) in growth.items():
            group, pool, table = self.groups[name], self.pools[name], state.tables[name]
            pool.free(dropped)
            first = first_live_block(group, num_tokens)
            for i in range(min(first, len(table))):
                table[i] = NULL_BLOCK
            table.extend(
                [NULL_BLOCK] * max(0, min(first, group.blocks_for(num_tokens)) - len(table))
            )
            table.extend(pool.allocate(needed))
        state.num_tokens = num_tokens
        self.requests[request_id] = state
        return state

    def adopt(self, request_id: str, num_tokens: int) -> RequestTables:
        """Give a request that holds nothing fresh blocks for its live window (swap in)."""
        if request_id in self.requests:
            raise RequestStateError(f"request {request_id!r} already holds device blocks")
        return self.allocate(request_id, num_tokens)

    def adopt_many(self, requests: Sequence[tuple[str, int]]) -> list[RequestTables]:
        """:meth:`adopt` for several ``(request_id, num_tokens)`` at once, all or nothing.

        Raises:
            OutOfBlocksError: some group lacks the blocks of the whole batch (nothing changed).
            RequestStateError: a request already holds device blocks, or an id is invalid
                (nothing changed).
            ValueError: an id listed twice, or a bad ``num_tokens`` (nothing changed).
        """
        needed = dict.fromkeys(self.order, 0)
        seen: set[str] = set()
        for request_id, num_tokens in requests:
            check_request_id(request_id)
            if request_id in seen:
                raise ValueError(f"request {request_id!r} is listed twice")
            seen.add(request_id)
            if request_id in self.requests:
                raise RequestStateError(f"request {request_id!r} already holds device blocks")
            if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
                raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
            for name in self.order:
                group = self.groups[name]
                needed[name] += group.blocks_for(num_tokens) - min(
                    first_live_block(group, num_tokens), group.blocks_for(num_tokens)
                )
        for name, count in needed.items():
            if count > self.pools[name].num_free:
                raise OutOfBlocksError("device", name, count, self.pools[name].num_free, "swap_in")
        return [self.allocate(r, n) for r, n in requests]

    def release(self, request_id: str) -> RequestTables:
        """Return every block of ``request_id`` to the pools and forget it."""
        state = self.get(request_id)
        for name in self.order:
            self.pools[name].free(state.held(name))
        del self.requests[request_id]
        return state

    # ------------------------------------------------------------------ lookups

    def table(self, request_id: str, group: str) -> list[int]:
        state = self.get(request_id)
        if group not in self.groups:
            raise ValueError(f"group {group!r} does not exist; groups are {list(self.order)}")
        return list(state.tables[group])

    def slot_mapping(
        self,
        request_id: str,
        group: str,
        positions: Sequence[int] | torch.Tensor,
        compress_ratio: int = 1,
    ) -> torch.Tensor:
        """Cache slots (``block * entries_per_block + offset``) of token positions.

        Position ``p`` of a role with compress ratio ``r`` produces an entry only when a
        compressed token completes (``p % r == r - 1``), at entry ``p // r``, which lives in
        block ``table[(p // r) // (block_size // r)]``. Positions that produce no entry, lie
        outside the group's window, or fall in a null block map to ``-1``.

        Returns:
            int64 tensor shaped like ``positions``.
        """
        state = self.get(request_id)
        spec = self.groups.get(group)
        if spec is None:
            raise ValueError(f"group {group!r} does not exist; groups are {list(self.order)}")
        if not isinstance(compress_ratio, int) or compress_ratio < 1:
            raise ValueError(f"compress_ratio must be an int >= 1, got {compress_ratio!r}")
        if spec.block_size % compress_ratio:
            raise ValueError(
                f"compress_ratio={compress_ratio} does not divide block_size={spec.block_size} "
                f"of group {group!r}"
            )
        pos = torch.as_tensor(positions, dtype=torch.int64, device="cpu")
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= state.num_tokens):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise ValueError(
                f"position {bad} is outside request {request_id!r}, which holds tokens "
                f"0..{state.num_tokens - 1}"
            )
        r = compress_ratio
        per_block = spec.block_size // r
        entry = pos // r
        table = torch.tensor(state.tables[group], dtype=torch.int64)
        block = table[entry // per_block]
        live_start = spec.live_token_range(state.num_tokens).start
        valid = (pos % r == r - 1) & (pos >= live_start) & (block != NULL_BLOCK)
        slots = block * per_block + entry % per_block
        return torch.where(valid, slots, torch.full_like(slots, -1))
