"""BlockPool: one verb per action (take / share / release, retain / forget / evict), ref
counts, the reserved null block, the eviction hook; property-tested."""

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import OutOfBlocksError
from kvforge.scheduler import NULL_BLOCK, BlockPool


def test_fresh_pool_hands_out_ascending_ids_and_never_null():
    pool = BlockPool(5, "kv")
    assert (pool.num_usable, pool.num_free, pool.num_used) == (4, 4, 0)
    assert pool.take(3).tolist() == [1, 2, 3]
    assert pool.take(1).tolist() == [4]
    assert pool.num_free == 0


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(4, "kv")
    pool.take(2)
    with pytest.raises(OutOfBlocksError, match=r"device group 'kv' needs 2 free blocks but has 1"):
        pool.take(2)
    assert pool.num_free == 1


def test_ref_counts():
    pool = BlockPool(4, "kv")
    a, b = pool.take(2)
    pool.share([a])
    assert pool.ref_count(a) == 2
    pool.release([a])
    assert pool.num_free == 1  # still referenced once
    pool.release([a, b])
    assert pool.num_free == 3


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([NULL_BLOCK], "block 0 is the reserved null block of device group 'kv'"),
        ([9], r"block 9 is out of range for device group 'kv' with blocks 1..3"),
        ([2], "block 2 of device group 'kv' is already free"),
        ([1, 1], r"block 1 of device group 'kv' is referenced 1 times, cannot drop 2"),
        (["1"], "block id '1' is not an int"),
    ],
)
def test_bad_release_changes_nothing(ids, message):
    pool = BlockPool(4, "kv")
    pool.take(1)
    with pytest.raises((ValueError, TypeError), match=message):
        pool.release(ids)
    assert (pool.num_free, pool.ref_count(1)) == (2, 1)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([2], "release: block 2 of device group 'kv' is already free"),
        ([1, 1], r"release: block 1 of device group 'kv' is referenced 1 times, cannot drop 2"),
        ([1, 3, 1], r"block 1 of device group 'kv' is referenced 1 times, cannot drop 2"),
    ],
)
def test_release_held_still_checks_reference_counts(ids, message):
    # release_held skips only the id range check (a table cell holds ids the pool gave): a
    # repeat or an over-release would hand one block out twice, so it is refused
    pool = BlockPool(4, "kv")
    pool.take(1)
    free = pool.num_free
    with pytest.raises(ValueError, match=message):
        pool.release_held(np.array(ids, dtype=np.int32))
    assert (pool.num_free, pool.ref_count(1)) == (free, 1)
    pool.release_held(np.array([1], dtype=np.int32))
    assert (pool.num_free, pool.ref_count(1)) == (free + 1, 0)


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks for device group 'kv' must be an int >= 2"):
        BlockPool(1, "kv")
    with pytest.raises(ValueError, match="count must be an int >= 0, got -1"):
        BlockPool(3, "kv").take(-1)
    with pytest.raises(ValueError, match="share: block 1 of device group 'kv' is free"):
        BlockPool(3, "kv").share([1])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("share"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 20), steps=ops)
def test_random_sequences_never_leak_or_double_allocate(num_blocks, steps):
    pool = BlockPool(num_blocks, "kv")
    held: list[int] = []  # one entry per reference held
    for op, arg in steps:
        if op == "alloc":
            if arg > pool.num_free:
                with pytest.raises(OutOfBlocksError):
                    pool.take(arg)
                continue
            got = pool.take(arg).tolist()
            assert NULL_BLOCK not in got
            assert not set(got) & set(held), "a used block was handed out again"
            held += got
        elif held:
            block = held[arg % len(held)]
            if op == "free":
                pool.release([block])
                held.remove(block)
            else:
                pool.share([block])
                held.append(block)
        assert pool.num_used == len(set(held))
        assert pool.num_free + pool.num_used == pool.num_usable
        for b in set(held):
            assert pool.ref_count(b) == held.count(b)
    pool.release(held)
    assert pool.num_free == pool.num_usable


def test_retained_blocks_stay_evictable_and_the_hook_hears_evictions_oldest_first():
    heard = []
    pool = BlockPool(5, "kv", on_evict=lambda ids: heard.append(ids.tolist()))
    a, b, c = pool.take(3).tolist()
    pool.retain(a)
    pool.retain(b)
    pool.release([a, b, c])  # a and b keep their bytes: evictable, still free capacity
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (4, 2, 0)
    pool.share([b])  # a hit takes b back
    assert (pool.num_evictable, pool.ref_count(b)) == (1, 1)
    got = pool.take(2).tolist()  # the free stack has c and 4: nothing evicted
    assert sorted(got) == [c, 4] and heard == []
    assert pool.take(1).tolist() == [a]  # short: a is evicted, the hook hears first
    assert heard == [[a]] and not pool.is_retained(a) and pool.evictions == 1


def test_forget_returns_an_evictable_block_without_the_hook():
    heard = []
    pool = BlockPool(3, "kv", on_evict=heard.append)
    a = int(pool.take(1)[0])
    pool.retain(a)
    pool.release([a])
    pool.forget(a)
    assert (pool.num_evictable, pool.num_free, heard) == (0, 2, [])


def test_ref_counts_are_public_and_read_only():
    pool = BlockPool(4, "kv")
    a = int(pool.take(1)[0])
    assert pool.ref_counts[a] == 1
    with pytest.raises(ValueError, match="read-only"):
        pool.ref_counts[a] = 5


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0], "share: block 0 is the reserved null block"),
        ([-1], r"share: block -1 is out of range for device group 'kv' with blocks 1..3"),
        ([3], "share: block 3 of device group 'kv' is free"),
        ([True], "share: block id True is not an int"),
    ],
)
def test_bad_share_changes_nothing(ids, message):
    pool = BlockPool(4, "kv")
    pool.take(1)
    with pytest.raises((ValueError, TypeError), match=message):
        pool.share(ids)
    assert (pool.num_free, pool.ref_count(1)) == (2, 1)


def _pool_state(pool: BlockPool) -> tuple:
    return pool.ref_counts.tolist(), pool._stack[: pool._num_free].tolist(), pool.num_free


@settings(max_examples=150, deadline=None)
@given(
    takes=st.integers(1, 30),
    picks=st.lists(st.integers(0, 40), min_size=0, max_size=12),
    shared=st.booleans(),
)
def test_a_listed_release_is_the_array_release(takes, picks, shared):
    """``release_listed`` (a few ids in scalar stores) frees, orders and refuses exactly as
    ``release_held`` of the same ids: the same counts and free stack, the same error for a
    repeat or a free block, and nothing changed then."""
    pools = [BlockPool(41, "kv"), BlockPool(41, "kv")]
    for pool in pools:
        held = pool.take(takes)
        if shared:
            pool.share(held[:1])
    ids = [int(held[p % takes]) if p < 35 else 40 for p in picks]  # 40: never taken
    outcomes = []
    for pool, release in zip(pools, ("listed", "held"), strict=True):
        try:
            if release == "listed":
                pool.release_listed(list(ids))
            else:
                pool.release_held(np.array(ids, dtype=np.int32))
            outcomes.append(None)
        except ValueError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
    assert _pool_state(pools[0]) == _pool_state(pools[1])


@pytest.mark.parametrize("count", [1, 2, 8, 9, 20])
def test_a_few_taken_blocks_are_the_many_path(count):
    pool = BlockPool(30, "kv")
    taken = pool.take(count)
    assert taken.dtype == np.int32 and taken.tolist() == list(range(1, count + 1))
    assert pool.ref_counts[1 : count + 1].tolist() == [1] * count
    assert pool.num_free == 29 - count


@settings(max_examples=200, deadline=None)
@given(
    takes=st.integers(1, 30),
    picks=st.sets(st.integers(0, 29), min_size=1, max_size=20),
    shared=st.sets(st.integers(0, 29), max_size=6),
    retained=st.sets(st.integers(0, 29), max_size=8),
)
def test_release_few_is_release_and_restore_few_takes_it_back(takes, picks, shared, retained):
    """``release_few`` of ids ``held_counts`` accepts leaves a pool exactly as ``release_held``
    of the same ids: counts, free stack and the evictable blocks in their order, with blocks
    shared and retained; ``restore_few`` then puts back the pool as it was before, and
    before a release it changes nothing."""
    pools = [BlockPool(41, "kv"), BlockPool(41, "kv")]
    for pool in pools:
        held = pool.take(takes)
        pool.share([int(held[i]) for i in sorted(shared) if i < takes])
        for i in sorted(retained):
            if i < takes:
                pool.retain(int(held[i]))
    ids = [int(held[i]) for i in sorted(picks, key=lambda i: (i * 7) % 30) if i < takes]
    if not ids:
        return
    few, array = pools

    def full_state(pool: BlockPool) -> tuple:
        return (*_pool_state(pool), list(pool._evictable))

    before = full_state(few)
    counts = few.held_counts(ids)
    assert counts is not None and [int(c) for c in counts] == [
        1 + (held.tolist().index(b) in shared) for b in ids
    ]
    num_free = few.num_free
    few.restore_few(ids, counts, num_free)  # never begun: nothing changes
    assert full_state(few) == before
    few.release_few(ids)
    array.release_held(np.array(ids, dtype=np.int32))
    assert full_state(few) == full_state(array)
    few.restore_few(ids, counts, num_free)
    assert full_state(few) == before


@pytest.mark.parametrize(
    ("ids", "why"),
    [([3, 3], "a repeat"), ([3, 30], "a free block"), (list(range(1, 66)), "65 ids")],
)
def test_held_counts_declines_what_release_few_cannot_drop(ids, why):
    pool = BlockPool(80, "kv")
    pool.take(70)
    pool.release([30])
    before = _pool_state(pool)
    assert pool.held_counts(ids) is None, why
    assert _pool_state(pool) == before


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_pool_counts_and_stacks_its_own_blocks(how):
    """The scalar views a few-id release reads and writes (``held_counts``, ``release_few``,
    ``restore_few``) are the copy's own arrays after a copy: the original does not move."""
    import copy
    import pickle

    pool = BlockPool(9, "kv")
    held = pool.take(5).tolist()
    before = _pool_state(pool)
    twin = copy.deepcopy(pool) if how == "deepcopy" else pickle.loads(pickle.dumps(pool))
    ids = held[1:4]
    counts = twin.held_counts(ids)
    assert counts == [1, 1, 1] and all(type(c) is int for c in counts)
    twin.release_few(ids)
    assert _pool_state(pool) == before
    assert twin.ref_counts[ids].tolist() == [0, 0, 0] and twin.num_free == 3 + 3
    twin.restore_few(ids, counts, 3)
    assert twin.num_free == 3 and twin.ref_counts[ids].tolist() == [1, 1, 1]
    twin.release_few(ids)
    assert twin.take(3).tolist() == ids  # pushed in the order release gives: first on top
    assert _pool_state(pool) == before


def test_restore_counts_takes_back_a_share_of_cached_blocks_whole_part_way_or_never_begun():
    """A share of cached blocks (count 0, evictable) taken back by their saved counts: the
    blocks the share never reached keep their place in LRU order, those it reached are
    evictable again as a release leaves them (the chain's first block the most recent),
    and a block at count 0 that is not retained is never made evictable."""
    pool = BlockPool(16, "g")
    ids = pool.take(6)
    for b in ids.tolist():
        pool.retain(b)
    pool.release(ids)  # six cached blocks, in release order
    order = list(pool._evictable)
    chain = np.array(order[2:5], dtype=np.int32)  # a three-block chain, first block first
    before = pool.counts_of(chain)
    for reached in range(len(chain) + 1):
        p = copy.deepcopy(pool)
        if reached:
            p.share(chain[:reached])
        p.restore_counts(chain, before)
        assert not p.ref_counts.any() and p.num_free == pool.num_free
        untouched = [b for b in order if b not in chain[:reached].tolist()]
        # a release of the chain adds its deepest block first: the first one is evicted last
        assert list(p._evictable) == untouched + chain[:reached].tolist()[::-1], reached
    loose = BlockPool(16, "g")  # a free block's saved count 0: it stays on the free stack
    free_before = loose._stack[: loose._num_free].tolist()
    loose.restore_counts(np.array([3], dtype=np.int32), np.array([0], dtype=np.int32))
    assert not loose._evictable and loose._stack[: loose._num_free].tolist() == free_before
