"""BlockPool: O(1) allocate/free, ref counts, reserved null block; property-tested."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import OutOfBlocksError
from kvforge.scheduler import NULL_BLOCK, BlockPool


def test_fresh_pool_hands_out_ascending_ids_and_never_null():
    pool = BlockPool(5, "kv")
    assert (pool.num_usable, pool.num_free, pool.num_used) == (4, 4, 0)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) == [4]
    assert pool.num_free == 0


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(4, "kv")
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError, match=r"device group 'kv' needs 2 free blocks but has 1"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_ref_counts():
    pool = BlockPool(4, "kv")
    a, b = pool.allocate(2)
    pool.incref([a])
    assert pool.ref_count(a) == 2
    pool.free([a])
    assert pool.num_free == 1  # still referenced once
    pool.free([a, b])
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
def test_bad_free_changes_nothing(ids, message):
    pool = BlockPool(4, "kv")
    pool.allocate(1)
    with pytest.raises((ValueError, TypeError), match=message):
        pool.free(ids)
    assert (pool.num_free, pool.ref_count(1)) == (2, 1)


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks for device group 'kv' must be an int >= 2"):
        BlockPool(1, "kv")
    with pytest.raises(ValueError, match="count must be an int >= 0, got -1"):
        BlockPool(3, "kv").allocate(-1)
    with pytest.raises(ValueError, match="incref: block 1 of device group 'kv' is free"):
        BlockPool(3, "kv").incref([1])


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
                    pool.allocate(arg)
                continue
            got = pool.allocate(arg)
            assert NULL_BLOCK not in got
            assert not set(got) & set(held), "a used block was handed out again"
            held += got
        elif held:
            block = held[arg % len(held)]
            if op == "free":
                pool.free([block])
                held.remove(block)
            else:
                pool.incref([block])
                held.append(block)
        assert pool.num_used == len(set(held))
        assert pool.num_free + pool.num_used == pool.num_usable
        for b in set(held):
            assert pool.ref_count(b) == held.count(b)
    pool.free(held)
    assert pool.num_free == pool.num_usable
