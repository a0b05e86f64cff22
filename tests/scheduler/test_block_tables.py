"""Request block tables, windows, all-or-nothing growth and slot mappings."""

import pytest
import torch
from _helpers import grow
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import (
    NULL_BLOCK,
    CacheController,
    DeepseekV4Backend,
    GQABackend,
    OutOfBlocksError,
    RequestStateError,
)


def v4_controller(swa=8, compressed=8, c4=8, c128=20):
    ctl = CacheController(
        {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: DeepseekV4Backend(128)}
    )
    ctl.initialize_kv_cache(
        num_blocks={"swa": swa, "compressed": compressed, "c4_state": c4, "c128_state": c128}
    )
    return ctl


def test_full_group_grows_block_by_block():
    ctl = CacheController({0: GQABackend(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=10)
    ctl.allocate("a", 5)
    assert ctl.block_table("a", "kv") == [1, 2]
    ctl.allocate("a", 8)
    assert ctl.block_table("a", "kv") == [1, 2]
    ctl.allocate("a", 9)
    assert ctl.block_table("a", "kv") == [1, 2, 3]
    assert ctl.num_used_blocks("kv") == 3
    ctl.free_request("a")
    assert ctl.num_free_blocks("kv") == 9


def test_window_groups_keep_a_step_then_return_blocks_outside_the_window():
    ctl = v4_controller(c4=60, c128=40)
    ctl.allocate("r", 100)
    # one 100-token step writes every token, so every window group holds every block
    assert ctl.block_table("r", "swa") == [1, 2]
    assert NULL_BLOCK not in ctl.block_table("r", "c4_state")  # 25 blocks of 4 tokens
    assert ctl.num_used_blocks("c4_state") == 25
    ctl.allocate("r", 200)
    # the step reads back from token 100: swa keeps 100 + 1 - 128 < 0 -> all 4 blocks;
    # c4_state (window 8) from token 93 -> block 23 on; c128_state (window 128) all 25
    assert ctl.num_used_blocks("swa") == 4
    c4 = ctl.block_table("r", "c4_state")
    assert c4[:23] == [NULL_BLOCK] * 23 and NULL_BLOCK not in c4[23:] and len(c4) == 50
    assert ctl.num_used_blocks("c128_state") == 25
    ctl.allocate("r", 201)  # a decode step: token 200 reads 73..200
    swa = ctl.block_table("r", "swa")
    assert swa[0] == NULL_BLOCK and NULL_BLOCK not in swa[1:] and len(swa) == 4
    assert ctl.num_used_blocks("swa") == 3
    # c4_state: 193..200 -> blocks 48..50; c128_state: 73..200 -> blocks 9..25 = 17
    assert ctl.num_used_blocks("c4_state") == 3
    assert ctl.num_used_blocks("c128_state") == 17
    # compressed is full: 201 tokens -> 1 block of 256
    assert ctl.num_used_blocks("compressed") == 1


def test_allocation_is_all_or_nothing_across_groups():
    # 9 usable c128_state blocks of 8 tokens; 40 tokens take 5, 80 need 5 more
    ctl = v4_controller(c4=40, c128=10)
    ctl.allocate("a", 40)
    before = {g: ctl.num_free_blocks(g) for g in ctl.groups}
    with pytest.raises(
        OutOfBlocksError, match=r"device group 'c128_state' needs 5 free blocks but has 4"
    ):
        ctl.allocate("a", 80)
    assert {g: ctl.num_free_blocks(g) for g in ctl.groups} == before
    assert ctl.block_table("a", "swa") == [1]
    with pytest.raises(OutOfBlocksError):
        ctl.allocate("b", 100)
    assert {g: ctl.num_free_blocks(g) for g in ctl.groups} == before
    with pytest.raises(RequestStateError):
        ctl.block_table("b", "swa")


def test_request_errors():
    ctl = v4_controller()
    with pytest.raises(RequestStateError, match="request 'nope' has no blocks on the device"):
        ctl.free_request("nope")
    ctl.allocate("a", 10)
    ctl.free_request("a")
    with pytest.raises(RequestStateError, match="request 'a' has no blocks"):
        ctl.free_request("a")
    with pytest.raises(RequestStateError, match="request_id must be a non-empty str, got 3"):
        ctl.allocate(3, 10)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1, got 0"):
        ctl.allocate("a", 0)
    ctl.allocate("a", 10)
    with pytest.raises(ValueError, match="num_tokens=5 is less than the 10 tokens"):
        ctl.allocate("a", 5)
    with pytest.raises(
        ValueError,
        match=r"group 'kv' does not exist; groups are \['swa', 'compressed', 'c4_state', 'c128_state'\]",
    ):
        ctl.block_table("a", "kv")


def test_slot_mapping_ratio_1():
    ctl = CacheController({0: GQABackend(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=10)
    ctl.allocate("x", 3)
    ctl.allocate("y", 9)  # y: blocks 2, 3, 4
    slots = ctl.slot_mapping("y", "kv", [0, 3, 4, 8])
    assert slots.dtype == torch.int64
    assert slots.tolist() == [2 * 4 + 0, 2 * 4 + 3, 3 * 4 + 0, 4 * 4 + 0]


@pytest.mark.parametrize("ratio", [4, 128])
def test_slot_mapping_compressed(ratio):
    ctl = v4_controller(c4=60, c128=60)
    grow(ctl, "r", 600)
    table = ctl.block_table("r", "compressed")  # 600 tokens -> 3 blocks of 256
    per_block = 256 // ratio
    positions = list(range(600))
    slots = ctl.slot_mapping("r", "compressed", positions, compress_ratio=ratio).tolist()
    for p, s in zip(positions, slots, strict=True):
        if p % ratio != ratio - 1:
            assert s == -1, p
        else:
            e = p // ratio
            assert s == table[e // per_block] * per_block + e % per_block, p
    assert sum(s >= 0 for s in slots) == 600 // ratio


def test_slot_mapping_window_positions_map_to_minus_one():
    ctl = v4_controller(c4=60, c128=60)
    grow(ctl, "r", 200)
    table = ctl.block_table("r", "swa")
    slots = ctl.slot_mapping("r", "swa", [0, 71, 72, 130, 199]).tolist()
    assert slots[:2] == [-1, -1]  # outside the last 128 tokens
    assert slots[2:] == [table[1] * 64 + 8, table[2] * 64 + 2, table[3] * 64 + 7]
    state = ctl.slot_mapping("r", "c4_state", [191, 192, 199]).tolist()
    c4 = ctl.block_table("r", "c4_state")
    assert state == [-1, c4[48] * 4 + 0, c4[49] * 4 + 3]


def test_slot_mapping_errors():
    ctl = v4_controller()
    ctl.allocate("r", 10)
    with pytest.raises(
        ValueError, match=r"position 10 is outside request 'r', which holds tokens 0..9"
    ):
        ctl.slot_mapping("r", "swa", [10])
    with pytest.raises(ValueError, match="position -1 is outside"):
        ctl.slot_mapping("r", "swa", [-1])
    with pytest.raises(ValueError, match="compress_ratio=3 does not divide block_size=256"):
        ctl.slot_mapping("r", "compressed", [2], compress_ratio=3)
    with pytest.raises(ValueError, match="compress_ratio must be an int >= 1, got 0"):
        ctl.slot_mapping("r", "compressed", [2], compress_ratio=0)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.booleans()), max_size=30)
)
def test_random_growth_and_frees_never_leak(steps):
    ctl = v4_controller(swa=12, compressed=6, c4=120, c128=80)
    lengths: dict[str, int] = {}
    for rid, extra, free in steps:
        name = f"r{rid}"
        if free and name in lengths:
            ctl.free_request(name)
            del lengths[name]
            continue
        target = lengths.get(name, 0) + extra
        before = {g: ctl.num_free_blocks(g) for g in ctl.groups}
        if target > ctl.scheduler.max_model_len:
            # past the table's width: refused by name, and nothing moves
            with pytest.raises(ValueError, match=f"{target} tokens exceed max_model_len="):
                ctl.allocate(name, target)
            assert {g: ctl.num_free_blocks(g) for g in ctl.groups} == before
            continue
        try:
            ctl.allocate(name, target)
            lengths[name] = target
        except OutOfBlocksError:
            assert {g: ctl.num_free_blocks(g) for g in ctl.groups} == before
        for g in ctl.groups:
            held = [b for r in lengths for b in ctl.block_table(r, g) if b != NULL_BLOCK]
            assert len(held) == len(set(held)), "a block is in two tables"
            assert ctl.num_used_blocks(g) == len(held)
            assert ctl.num_used_blocks(g) + ctl.num_free_blocks(
                g
            ) == ctl.scheduler.num_usable_blocks(g)
    for name in lengths:
        ctl.free_request(name)
    assert all(ctl.num_used_blocks(g) == 0 for g in ctl.groups)
