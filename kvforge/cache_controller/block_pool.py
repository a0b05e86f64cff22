"""A fixed-size pool of block ids with O(1) allocate/free and reference counts.

Invariants:

- block id ``NULL_BLOCK`` (0) is reserved: it is never handed out, never freed, and block
  tables use it for positions that hold no block (outside a window, not yet written). Kernels
  may read or write it harmlessly, so padded tables need no special case.
- every other id is either free (ref count 0, on the free list exactly once) or used
  (ref count >= 1, not on the free list); ``num_free + num_used == num_usable``.
- a failed call changes nothing: inputs are checked in full before any count moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvforge.errors import OutOfBlocksError

__all__ = ["NULL_BLOCK", "BlockPool"]

NULL_BLOCK = 0


class BlockPool:
    """Block ids ``1 .. num_blocks - 1`` of one group (id 0 is the null block).

    A fresh pool hands out ascending ids, so early allocations are contiguous runs, which keeps
    host transfers to few large copies.

    Args:
        num_blocks: physical blocks including the null block (>= 2).
        name: the group name, used in error messages.
        kind: ``"device"`` or ``"host"``, used in error messages.
    """

    def __init__(self, num_blocks: int, name: str, kind: str = "device") -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
            raise ValueError(
                f"num_blocks for {kind} group {name!r} must be an int >= 2 (one usable block "
                f"plus the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.name = name
        self.kind = kind
        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() yields 1, 2, 3, ...

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_ids([block_id], "ref_count")
        return self._ref[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (ref count 1 each).

        Raises:
            OutOfBlocksError: fewer than ``count`` blocks are free.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise OutOfBlocksError(self.kind, self.name, count, len(self._free), "allocate")
        ids = [self._free.pop() for _ in range(count)]
        for i in ids:
            self._ref[i] = 1
        return ids

    def incref(self, block_ids: Sequence[int]) -> None:
        """Share used blocks once more (e.g. a prefix shared by two requests)."""
        self._check_ids(block_ids, "incref")
        for i in block_ids:
            if self._ref[i] == 0:
                raise ValueError(f"incref: block {i} of {self.kind} group {self.name!r} is free")
        for i in block_ids:
            self._ref[i] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the pool.

        Raises:
            ValueError: an id is the null block, out of range, already free, or dropped more
                times than it is referenced; nothing is changed then.
        """
        self._check_ids(block_ids, "free")
        drops: dict[int, int] = {}
        for i in block_ids:
            drops[i] = drops.get(i, 0) + 1
        for i, n in drops.items():
            if n > self._ref[i]:
                state = "already free" if self._ref[i] == 0 else f"referenced {self._ref[i]} times"
                raise ValueError(
                    f"free: block {i} of {self.kind} group {self.name!r} is {state}, "
                    f"cannot drop {n} reference(s)"
                )
        for i in block_ids:
            self._ref[i] -= 1
            if self._ref[i] == 0:
                self._free.append(i)

    def _check_ids(self, block_ids: Sequence[int], action: str) -> None:
        for i in block_ids:
            if not isinstance(i, int) or isinstance(i, bool):
                raise TypeError(f"{action}: block id {i!r} is not an int")
            if i == NULL_BLOCK:
                raise ValueError(
                    f"{action}: block {NULL_BLOCK} is the reserved null block of "
                    f"{self.kind} group {self.name!r}"
                )
            if not 0 < i < self.num_blocks:
                raise ValueError(
                    f"{action}: block {i} is out of range for {self.kind} group {self.name!r} "
                    f"with blocks 1..{self.num_blocks - 1}"
                )

    def __repr__(self) -> str:
        return (
            f"BlockPool({self.kind} {self.name!r}: {self.num_used} used, {self.num_free} free "
            f"of {self.num_usable})"
        )
