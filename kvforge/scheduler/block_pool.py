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
:meth:`BlockPool.release`) instead of a Python loop per block. One request's few blocks
(:meth:`BlockPool.held_counts`, :meth:`BlockPool.release_few`,
:meth:`BlockPool.restore_few`) are read and written through ``memoryview`` objects of the
same arrays, whose items are Python ints: half the cost of numpy's scalars, the same memory
(``tests/scheduler/test_block_pool.py`` holds them to the arrays).

A block the prefix cache *retains* (:meth:`BlockPool.retain`) does not go back to the free
stack when its ref count reaches 0: it becomes *evictable*, keeps its bytes, and can be shared
again by a later request with the same prefix. It is evicted, least recently released first,
only when :meth:`BlockPool.take` finds the free stack short. Before the pool frees the
victims, its *eviction listeners* hear of them, in registration order
(:meth:`BlockPool.add_eviction_listener`: the host tier demotes them there), and then its
*keeper* (``on_evict``: the one owner of the blocks' keys, the prefix cache on a device pool,
the host tier on its page pool), which forgets their keys: every listener still sees the
victims as the keeper knew them. No listener wraps another. ``num_free`` counts both:
evictable blocks are free capacity.

One verb per action: :meth:`take`, :meth:`share`, :meth:`release` move references;
:meth:`retain`, :meth:`forget`, :meth:`evict` move blocks in and out of the evictable set.
Every verb checks its input with array operations before any count moves. An undo (the swap
book's all-or-nothing) takes back a take (:meth:`put_back`) or releases
(:meth:`restore_counts`) that an exception, ``KeyboardInterrupt`` included, cut short at any
line: both rebuild the free stack from saved values, never from how far the verb got
(``tests/scheduler/test_swap_faults.py``, the pools' lines). An eviction changes nothing of
the pool until its listeners and keeper are done; from its first store on it completes,
whatever line an exception strikes (each store sets a value read before the first), and so
does a :meth:`forget`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from kvforge.errors import OutOfBlocksError

__all__ = ["NULL_BLOCK", "BlockPool", "run_whole"]

NULL_BLOCK = 0
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # no Python-level wrappers per call


def run_whole(part: Callable[[], None]) -> None:
    """Run ``part``, a change whose every store sets a value read before the first one; cut
    short by an exception at any line (``KeyboardInterrupt`` included), run it again whole,
    then let the exception go on. A change that must not stop half way (no undo could say
    which half ran) completes instead."""
    try:
        part()
    except BaseException:
        part()
        raise


_INTS = (int, np.integer)
_FEW = 16  # up to this many ids, Python loops over scalars beat numpy's per-call overhead
_FEW_HELD = 64  # one request's blocks of a pool: a freed row releases them in scalar stores


class BlockPool:
    """Block ids ``1 .. num_blocks - 1`` of one group (id 0 is the null block).

    A fresh pool hands out ascending ids, so early allocations are contiguous runs, which keeps
    host transfers to few large copies.

    Args:
        num_blocks: physical blocks including the null block (>= 2).
        name: the group name, used in error messages.
        kind: ``"device"`` or ``"host"``, used in error messages.
        on_evict: the keeper's hook, told ``on_evict(victims)`` after every eviction
            listener and before the victims go back on the free stack: the owner of the
            retained blocks' keys (the prefix cache, or the host tier of its own pages),
            which forgets them. Set once by that owner; others add a listener instead.
    """

    def __init__(
        self,
        num_blocks: int,
        name: str,
        kind: str = "device",
        on_evict: Callable[[np.ndarray], None] | None = None,
    ) -> None:
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
        # the same counts, read and written one at a time as Python ints (a few held ids of
        # a freed row): half the cost of a numpy scalar per id; the arrays are never
        # rebound, so the views stay theirs (a copy of the pool builds its own: __setstate__)
        self._ref_items = memoryview(self._ref)
        self._scratch = np.zeros(num_blocks, dtype=np.int32)  # release's repeat check
        self._order = np.arange(num_blocks, dtype=np.int32)  # positions, for that check
        # The free stack: the top is at index _num_free - 1, so a fresh pool pops 1, 2, 3, ...
        self._stack = np.arange(num_blocks - 1, NULL_BLOCK, -1, dtype=np.int32)
        self._stack_items = memoryview(self._stack)  # as _ref_items, for a few pushes
        self._num_free = num_blocks - 1
        # blocks the prefix cache retains, and those of them at ref 0 in eviction order
        self._retained = np.zeros(num_blocks, dtype=bool)
        self._ever_retained = False  # no block was ever retained: release skips the lookup
        self._evictable: dict[int, None] = {}
        self.on_evict = on_evict
        self._listeners: list[Callable[[np.ndarray], None]] = []  # add_eviction_listener
        self.evictions = 0
        self._shared = False  # set once any block gets a second holder

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        del state["_ref_items"], state["_stack_items"]  # a memoryview does not copy
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._ref_items = memoryview(self._ref)  # views of the copy's own arrays
        self._stack_items = memoryview(self._stack)

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

    @property
    def ref_counts(self) -> np.ndarray:
        """Reference counts of every block id (read-only ``int32 [num_blocks]``)."""
        view = self._ref.view()
        view.flags.writeable = False
        return view

    def counts_of(self, block_ids: np.ndarray) -> np.ndarray:
        """Reference counts of ``block_ids`` (valid ids; a copy, ``int32``): what an undo
        saves before a release, without the read-only view of :attr:`ref_counts`."""
        return self._ref[block_ids]

    def add_eviction_listener(self, listener: Callable[[np.ndarray], None]) -> None:
        """Tell ``listener(victims)`` (``int32`` block ids) of every eviction from now on,
        before the keeper (``on_evict``) forgets the victims' keys and before they go back on
        the free stack: listeners run in the order they were added, each exactly once per
        eviction, and none of them replaces or wraps another. A listener must not take or
        release blocks of this pool (the eviction is under way).

        Raises:
            TypeError: ``listener`` is not callable (nothing changed).
        """
        if not callable(listener):
            raise TypeError(
                f"add_eviction_listener: listener must be callable, got "
                f"{type(listener).__name__} for {self.kind} group {self.name!r}"
            )
        self._listeners.append(listener)

    def remove_eviction_listener(self, listener: Callable[[np.ndarray], None]) -> None:
        """Stop telling ``listener`` (the very object :meth:`add_eviction_listener` took) of
        evictions; one that is not listening is left as it is (an undo of an add that may
        not have run)."""
        self._listeners[:] = [x for x in self._listeners if x is not listener]

    @property
    def has_eviction_listeners(self) -> bool:
        """Whether a listener hears of evictions (one may queue a copy that reads the
        victims: the host tier's offloads)."""
        return bool(self._listeners)

    def ref_count(self, block_id: int) -> int:
        self._check_ids(np.asarray([block_id]), "ref_count")
        return int(self._ref[block_id])

    def is_retained(self, block_id: int) -> bool:
        return bool(self._retained[block_id])

    # ------------------------------------------------------------------ references

    def take(self, count: int, into: list[np.ndarray] | None = None) -> np.ndarray:
        """``count`` free blocks as ``int32 [count]`` (ref count 1 each). Evicts retained
        blocks, least recently released first, when the free stack is short. ``into``: a
        list the ids are appended to before they leave the free stack, so that an undo
        (:meth:`put_back`) knows them even when an exception strikes part way.

        Raises:
            ValueError: ``count`` is not an int >= 0.
            OutOfBlocksError: fewer than ``count`` blocks are free (nothing changed).
        """
        exact = type(count) is int  # the common case: one type test
        if not (exact or (isinstance(count, _INTS) and not isinstance(count, bool))) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if count > self.num_free:
            raise OutOfBlocksError(self.kind, self.name, int(count), self.num_free, "take")
        if count > self._num_free:
            self.evict(count - self._num_free)
        top = self._num_free
        ids = self._stack[top - count : top][::-1].copy()
        if into is not None:
            into.append(ids)
        self._num_free = top - count
        if count <= _FEW:  # a decode step's one or two blocks: scalar stores beat a scatter
            ref = self._ref
            for b in ids.tolist():
                ref[b] = 1
        else:
            self._ref[ids] = 1
        return ids

    def share(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Take one more reference to used or evictable blocks (a prefix hit, a second
        holder).

        Raises:
            ValueError: an id is the null block, out of range, or free (nothing changed).
        """
        ids = self._check_ids(np.asarray(block_ids), "share")
        free = ids[(self._ref[ids] == 0) & ~self._retained[ids]]
        if len(free):
            raise ValueError(
                f"share: block {int(free[0])} of {self.kind} group {self.name!r} is free"
            )
        for b in ids.tolist():
            if self._ref[b] == 0:
                del self._evictable[b]
            else:
                self._shared = True
            self._ref[b] += 1

    def release(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Drop one reference to each block (ids may repeat). Blocks reaching zero go back on
        the free stack, or become evictable when retained (the deepest block of a chain is
        evicted first).

        Raises:
            ValueError: an id is the null block, out of range, already free, or dropped more
                times than it is referenced (nothing changed).
        """
        self._release(self._check_ids(np.asarray(block_ids), "release"))

    def release_held(self, block_ids: np.ndarray) -> None:
        """:meth:`release` of ids read from the scheduler side's own table cells
        (``int32 [n]``, the null block filtered out): a cell holds only ids :meth:`take` or
        :meth:`share` handed out, so the id range check is skipped. The reference counts are
        checked as in :meth:`release` (a repeat or an over-release raises, nothing changed):
        they are what keeps one block from being handed out twice."""
        self._release(block_ids)

    def release_listed(self, block_ids: list[int]) -> None:
        """:meth:`release_held` of ids given as a Python list (one request's cells, read
        with ``tolist``): the same checks and order, without an array for a few ids."""
        if block_ids and not self._release_few(block_ids):
            self._release(np.array(block_ids, dtype=np.int32))

    def _release_few(self, block_ids: list[int]) -> bool:
        """Release a few distinct, held ids of an unshared pool that retains nothing, in
        scalar stores; ``False``, having changed nothing, for anything else (more ids, a
        repeat, an over-release: :meth:`_release` decides and words it)."""
        if len(block_ids) > _FEW or self._shared or self._ever_retained:
            return False
        if self._held_counts(block_ids) is None:
            return False
        self.release_few(block_ids)
        return True

    def held_counts(self, block_ids: list[int]) -> list[int] | None:
        """The reference counts of ``block_ids`` (a non-empty Python list) when
        :meth:`release_few` may drop them: at most 64 distinct ids, each held (a count of 1
        or more); ``None`` otherwise. Reads only; an arena pool, whose slabs count their
        blocks, answers ``None``. The counts are what :meth:`restore_few` puts back."""
        if len(block_ids) > _FEW_HELD or len(set(block_ids)) != len(block_ids):
            return None
        ref = self._ref_items
        counts = [ref[b] for b in block_ids]
        return counts if min(counts) >= 1 else None

    _held_counts = held_counts  # this pool's own check (an arena answers held_counts None)

    def release_few(self, block_ids: list[int]) -> None:
        """:meth:`release` of ``block_ids``, which :meth:`held_counts` accepted (they or ids
        among them) with none of them changed since, in scalar stores and no check: each
        drops one reference; those at none go on the free stack, or become evictable when
        retained, in the order :meth:`release` gives them."""
        ref = self._ref_items
        if not self._shared:  # each held block has one reference, now none
            for b in block_ids:
                ref[b] = 0
            zero = block_ids
        else:
            zero = []
            for b in block_ids:
                left = ref[b] - 1
                ref[b] = left
                if not left:
                    zero.append(b)
        if self._ever_retained:
            retained = self._retained
            keyed = [b for b in zero if retained[b]]
            if keyed:  # evicted deepest first: the chain's tail is its least recent
                for b in reversed(keyed):
                    self._evictable[b] = None
                zero = [b for b in zero if not retained[b]]
        top = self._num_free
        stack = self._stack_items
        for b in reversed(zero):  # scalar pushes: the first released ends on top
            stack[top] = b
            top += 1
        self._num_free = top

    def restore_few(self, block_ids: list[int], counts: list[int], num_free: int) -> None:
        """Take back :meth:`release_few` of ``block_ids`` (in one call or in parts), whole,
        cut short by an exception, or never begun, when their counts were ``counts``
        (:meth:`held_counts`) and ``num_free`` blocks were free before it and nothing else
        ran on this pool since: the counts, the evictable set and the free stack are as they
        were. (A held block is never evictable, so every one of ``block_ids`` found
        evictable was made so by the release.)"""
        ref, evictable = self._ref_items, self._evictable
        for b, count in zip(block_ids, counts, strict=True):
            if b in evictable:
                del evictable[b]
            ref[b] = count
        self._num_free = num_free - len(evictable)

    def put_back(self, block_ids: np.ndarray) -> None:
        """Take back a :meth:`take` of ``block_ids`` (the ids it appended to ``into``),
        whole, cut short by an exception at any line, or never begun: each is free again
        (count 0) and on the free stack once, those that left it back on top in the order
        they left. Blocks the take evicted to make room stay evicted (free).
        """
        self._ref[block_ids] = 0
        top = self._num_free
        gone = block_ids[~np.isin(block_ids, self._stack[:top])][::-1]
        self._stack[top : top + len(gone)] = gone
        self._num_free = top + len(gone)

    def restore_counts(self, block_ids: np.ndarray, counts: np.ndarray) -> None:
        """Take back releases or shares of ``block_ids`` (distinct ids; ``counts``, from
        :meth:`counts_of`), whole, cut short by an exception at any line, or never begun:
        the counts come back, and each id the releases freed leaves the free stack (the
        other ids keep their order) or the evictable set. An id whose saved count is 0 (a
        share of a cached block taken back) is evictable again: where it was if the share
        never reached it, else the most recently released, deepest of a chain first as
        :meth:`release` orders them.

        The undo of a release that may have stopped part way: unlike reversing it (taking
        the freed blocks back off the top of the stack), it does not depend on how far the
        release got. A release cut short between a count store and its push leaves a block
        at count 0 that is on no stack; one cut short after its pushes but before the free
        count moved leaves the pushed ids above the stack's top. Both read back as before.
        """
        self._ref[block_ids] = counts
        idle = counts == 0
        held = block_ids[~idle] if idle.any() else block_ids
        evictable = self._evictable
        if evictable:  # a held block is never evictable: any of them there was made so
            for b in held.tolist():
                evictable.pop(b, None)
        top = self._num_free
        free = self._stack[:top]
        back = np.isin(free, held)
        if back.any():
            keep = free[~back]
            self._stack[: len(keep)] = keep
            self._num_free = len(keep)
        if held is not block_ids:  # (share takes only cached blocks at count 0)
            for b in block_ids[idle][::-1].tolist():
                if b not in evictable and self._retained[b]:
                    evictable[b] = None

    def _release(self, block_ids: np.ndarray) -> None:
        """:meth:`release` of ids :meth:`_check_ids` passed (the counts are checked here)."""
        n = len(block_ids)
        if not n or (n <= _FEW and self._release_few(block_ids.tolist())):
            return
        if self._shared:  # a shared block may be dropped twice in one call
            uniq, counts = np.unique(block_ids, return_counts=True)
            bad = counts > self._ref[uniq]
            if bad.any():
                self._over_release(int(uniq[bad][0]), int(counts[bad][0]))
            np.subtract.at(self._ref, block_ids, 1)
            zero = block_ids[self._ref[block_ids] == 0]
            if len(zero) > 1:  # distinct, in the order given (chain order decides eviction)
                _, first = np.unique(zero, return_index=True)
                zero = zero[np.sort(first)]
        else:  # every used block has one holder: the ids are distinct
            # a repeated id: the later of two writes to one cell wins, so some position does
            # not read back its own index (O(n), no sort)
            if n <= 40:  # short: Python sets and min beat the array passes
                repeated = len(set(block_ids.tolist())) != n
                over = repeated or min(self._ref[block_ids].tolist()) < 1
            else:
                held = self._ref[block_ids]
                order = self._order[:n] if n <= len(self._order) else np.arange(n, dtype=np.int32)
                self._scratch[block_ids] = order
                repeated = bool((self._scratch[block_ids] != order).any())
                over = repeated or _MIN(held) < 1
            if over:
                uniq, counts = np.unique(block_ids, return_counts=True)
                bad = counts > self._ref[uniq]
                self._over_release(int(uniq[bad][0]), int(counts[bad][0]))
            # unshared, every held block has exactly one reference: all of them reach zero
            self._ref[block_ids] = 0
            zero = block_ids
        if self._ever_retained:
            keyed = self._retained[zero]
            if keyed.any():
                for b in reversed(zero[keyed].tolist()):
                    self._evictable[b] = None
                zero = zero[~keyed]
        top = self._num_free
        self._stack[top : top + len(zero)] = zero[::-1]
        self._num_free = top + len(zero)

    def _over_release(self, block: int, drops: int) -> None:
        ref = int(self._ref[block])
        state = "already free" if ref == 0 else f"referenced {ref} times"
        raise ValueError(
            f"release: block {block} of {self.kind} group {self.name!r} is {state}, "
            f"cannot drop {drops} reference(s)"
        )

    # ------------------------------------------------------------------ the evictable set

    def retain(self, block_id: int) -> None:
        """Keep ``block_id`` (in use) evictable rather than free once its last holder
        releases it: the prefix cache registered its key."""
        self._retained[block_id] = True
        self._ever_retained = True

    def forget(self, block_id: int) -> None:
        """Stop retaining ``block_id``; an evictable one goes back on the free stack. The
        caller (the prefix cache) drops the key itself, so the eviction hook is not told."""
        if not self._retained[block_id]:
            return
        if block_id not in self._evictable:  # in use: it goes when its holders release it
            self._retained[block_id] = False
            return
        top = self._num_free
        self._stack[top] = block_id  # above the free count: nothing until it is counted
        try:
            self._retained[block_id] = False
            del self._evictable[block_id]
            self._num_free = top + 1
        except BaseException:  # completed whatever line it struck: the block is free
            self._retained[block_id] = False
            self._evictable.pop(block_id, None)
            self._num_free = top + 1
            raise

    def evict(self, count: int | None = None, block_ids: Sequence[int] | None = None) -> np.ndarray:
        """Put evictable blocks on the free stack, telling the eviction listeners (in the
        order they were added) and then the keeper (``on_evict``) first: the ``count`` least
        recently released, or exactly ``block_ids`` (each must be evictable). Returns their
        ids.

        Raises:
            ValueError: a ``block_ids`` entry is not evictable (nothing changed).
        """
        if block_ids is not None:
            victims = self._check_ids(np.asarray(block_ids), "evict")
            stray = [b for b in victims.tolist() if b not in self._evictable]
            if stray:
                raise ValueError(
                    f"evict: block {stray[0]} of {self.kind} group {self.name!r} is not "
                    "evictable (in use, or not retained)"
                )
        else:
            n = min(int(count or 0), len(self._evictable))
            victims = np.fromiter(itertools.islice(self._evictable, n), dtype=np.int32, count=n)
        if not len(victims):
            return victims
        # until the victims leave the evictable set nothing of the pool has changed: an
        # exception in a listener or the keeper leaves them evictable (a keeper forgets a key
        # before its block can be taken, and skips a victim it no longer knows)
        for listener in self._listeners:
            listener(victims)
        if self.on_evict is not None:
            self.on_evict(victims)
        # from the pool's first store on, the eviction completes: under an exception at any
        # line, ``KeyboardInterrupt`` included, it runs again whole (each store sets a value
        # read before the first one) and the exception propagates
        done = (victims.tolist(), self._num_free, self.evictions)
        try:
            self._free_victims(victims, *done, again=False)
        except BaseException:
            self._free_victims(victims, *done, again=True)
            raise
        return victims

    def _free_victims(
        self, victims: np.ndarray, listed: list[int], top: int, evictions: int, again: bool
    ) -> None:
        """Move the victims of an eviction from the evictable set to the free stack, which
        held ``top`` free blocks before, and count them. Each store sets a value, so running
        it again after it was cut short completes it (``again``: a second run)."""
        evictable = self._evictable
        for b in listed:
            evictable.pop(b, None)
        self._retained[victims] = False
        self._stack[top : top + len(listed)] = victims[::-1]
        self._num_free, self.evictions = top + len(listed), evictions + len(listed)

    def _check_ids(self, block_ids: np.ndarray, action: str) -> np.ndarray:
        if block_ids.ndim != 1 or (
            block_ids.size and (block_ids.dtype == bool or block_ids.dtype.kind not in "iu")
        ):
            values = block_ids.ravel().tolist()
            bad = next((i for i in values if not isinstance(i, int) or isinstance(i, bool)), values)
            raise TypeError(f"{action}: block id {bad!r} is not an int")
        if not block_ids.size:
            return block_ids.astype(np.int32)
        if block_ids.size <= 40:  # a Python min / max of a short list beats two reductions
            values = block_ids.tolist()
            low, high = min(values), max(values)
        else:
            low, high = int(_MIN(block_ids)), int(_MAX(block_ids))
        if low < 0 or high >= self.num_blocks:
            i = low if low < 0 else high
            raise ValueError(
                f"{action}: block {i} is out of range for {self.kind} group {self.name!r} "
                f"with blocks 1..{self.num_blocks - 1}"
            )
        if low == NULL_BLOCK:
            raise ValueError(
                f"{action}: block {NULL_BLOCK} is the reserved null block of "
                f"{self.kind} group {self.name!r}"
            )
        return block_ids.astype(np.int32, copy=False)

    def __repr__(self) -> str:
        return (
            f"BlockPool({self.kind} {self.name!r}: {self.num_used} used, {self.num_free} free "
            f"of {self.num_usable})"
        )
