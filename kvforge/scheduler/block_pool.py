"""A fixed-size pool of block ids with O(1) allocate/free and reference counts.

Invariants:

- block id ``NULL_BLOCK`` (0) is reserved: it is never handed out, never freed, and block
  tables use it for positions that hold no block (outside a window, not yet written). Kernels
  may read or write it harmlessly, so padded tables need no special case.
- every other id is either free (ref count 0, on the free stack exactly once) or used
  (ref count >= 1, not on the free stack); ``num_free + num_used == num_usable``.
- a failed call changes nothing: inputs are checked in full before any count moves.

The free stack and the counts are numpy arrays, so the scheduler side can take or return the
blocks of a whole step in a few array operations (:meth:`BlockPool.take`,
:meth:`BlockPool.release`) instead of a Python loop per block.

With prefix caching (:meth:`BlockPool.enable_caching`) a block that reaches ref count 0 while
it holds a key does not go back to the free stack: it becomes *evictable*, keeps its bytes and
its key, and can be shared again by a later request with the same prefix. It is evicted (its
key dropped, least recently released first) only when :meth:`BlockPool.take` finds the free
stack short. ``num_free`` counts both: evictable blocks are free capacity.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

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
        if num_blocks > np.iinfo(np.int32).max:
            raise ValueError(
                f"num_blocks for {kind} group {name!r} is {num_blocks:,}; block ids are int32, "
                f"so at most {np.iinfo(np.int32).max:,}"
            )
        self.num_blocks = num_blocks
        self.name = name
        self.kind = kind
        self._ref = np.zeros(num_blocks, dtype=np.int32)
        # The free stack: the top is at index _num_free - 1, so a fresh pool pops 1, 2, 3, ...
        self._stack = np.arange(num_blocks - 1, NULL_BLOCK, -1, dtype=np.int32)
        self._num_free = num_blocks - 1
        # prefix caching (off until enable_caching): block -> key of blocks that hold one, and
        # the evictable ones (ref 0, keyed) in eviction order, oldest first
        self.keys: dict[int, object] | None = None
        self._evictable: dict[int, None] = {}
        self._on_evict: Callable[[list[int]], None] | None = None
        self.evictions = 0
        self._shared = False  # set once any block gets a second holder

    def enable_caching(self, on_evict: Callable[[list[int]], None]) -> None:
        """Keep keyed blocks evictable at ref count 0; ``on_evict(block_ids)`` is told before
        their keys are dropped."""
        self.keys = {}
        self._on_evict = on_evict

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be taken: the free stack plus the evictable cached blocks."""
        return self._num_free + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def ref_count(self, block_id: int) -> int:
        self._check_ids([block_id], "ref_count")
        return int(self._ref[block_id])

    # ------------------------------------------------------------------ checked API

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (ref count 1 each).

        Raises:
            OutOfBlocksError: fewer than ``count`` blocks are free.
        """
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if count > self.num_free:
            raise OutOfBlocksError(self.kind, self.name, count, self.num_free, "allocate")
        return self.take(count).tolist()

    def incref(self, block_ids: Sequence[int]) -> None:
        """Share used blocks once more (e.g. a prefix shared by two requests)."""
        self._check_ids(block_ids, "incref")
        for i in block_ids:
            if self._ref[i] == 0:
                raise ValueError(f"incref: block {i} of {self.kind} group {self.name!r} is free")
        self._shared = True
        np.add.at(self._ref, np.asarray(block_ids, dtype=np.int64), 1)

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
                ref = int(self._ref[i])
                state = "already free" if ref == 0 else f"referenced {ref} times"
                raise ValueError(
                    f"free: block {i} of {self.kind} group {self.name!r} is {state}, "
                    f"cannot drop {n} reference(s)"
                )
        self.release(np.asarray(block_ids, dtype=np.int32))

    # ------------------------------------------------------------------ unchecked, batched

    def take(self, count: int) -> np.ndarray:
        """``count`` free blocks as ``int32 [count]`` (ref count 1 each); the caller has
        checked ``count <= num_free``. Evicts cached blocks when the free stack is short."""
        if count > self._num_free:
            self.evict(count - self._num_free)
        top = self._num_free
        ids = self._stack[top - count : top][::-1].copy()
        self._num_free = top - count
        self._ref[ids] = 1
        return ids

    def release(self, block_ids: np.ndarray) -> None:
        """Drop one reference to each of ``block_ids`` (ids may repeat); the caller holds
        those references. Blocks reaching zero go back on the free stack."""
        if not len(block_ids):
            return
        if self._shared:  # a shared block may be dropped twice in one call
            np.subtract.at(self._ref, block_ids, 1)
            zero = block_ids[self._ref[block_ids] == 0]
            if len(zero) > 1:  # distinct, in the order given (chain order decides eviction)
                _, first = np.unique(zero, return_index=True)
                zero = zero[np.sort(first)]
        else:  # every used block has one holder: the ids are distinct
            self._ref[block_ids] -= 1
            zero = block_ids[self._ref[block_ids] == 0]
        if self.keys:
            keyed = [b for b in zero.tolist() if b in self.keys]
            if keyed:
                for b in reversed(keyed):  # the deepest block of a chain is evicted first
                    self._evictable[b] = None
                zero = zero[~np.isin(zero, keyed)]
        top = self._num_free
        self._stack[top : top + len(zero)] = zero[::-1]
        self._num_free = top + len(zero)

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to used or evictable blocks (a prefix hit)."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._evictable[b]
            else:
                self._shared = True
            self._ref[b] += 1

    def evict(self, count: int) -> list[int]:
        """Drop the keys of the ``count`` least recently released evictable blocks and put
        them on the free stack."""
        victims = list(itertools.islice(self._evictable, count))
        if self._on_evict is not None and victims:
            self._on_evict(victims)
        assert self.keys is not None or not victims
        for b in victims:
            del self._evictable[b]
            del self.keys[b]  # type: ignore[union-attr]
        top = self._num_free
        self._stack[top : top + len(victims)] = victims[::-1]
        self._num_free = top + len(victims)
        self.evictions += len(victims)
        return victims

    def forget(self, block_id: int) -> None:
        """Drop the key of a block (evictable ones go back on the free stack)."""
        if self.keys is None or block_id not in self.keys:
            return
        if block_id in self._evictable:
            self.evict_one(block_id)
        else:
            del self.keys[block_id]

    def evict_one(self, block_id: int) -> None:
        if self._on_evict is not None:
            self._on_evict([block_id])
        del self._evictable[block_id]
        del self.keys[block_id]  # type: ignore[union-attr]
        self._stack[self._num_free] = block_id
        self._num_free += 1
        self.evictions += 1

    def _check_ids(self, block_ids: Sequence[int], action: str) -> None:
        for i in block_ids:
            if not isinstance(i, int | np.integer) or isinstance(i, bool):
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
