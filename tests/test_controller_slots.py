"""``CacheController.slot_mapping`` of a few positions given as Python ints or a CPU ``int64``
tensor (the per-request path, ``_few_slots``) is the array path's answer (positions given as
a numpy array): the same slots, the same ``-1`` outside the live window or the latest step,
the same refusal of a position outside the request. Random requests of the DeepSeek-V4 groups
(a window, compressor states, a compressed full group) and a plain GQA group grow by random
steps; after each, every group is asked at random positions, compress ratios included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import CacheController, DeepseekV4Backend, GQABackend

RATIOS = {"swa": [1, 2, 4], "compressed": [1, 4], "c4_state": [1, 4], "c128_state": [1, 2]}


def _controller() -> CacheController:
    ctl = CacheController(
        {0: DeepseekV4Backend(4), 1: DeepseekV4Backend(128), 2: GQABackend(2, 8, 4)}
    )
    ctl.initialize_kv_cache(num_blocks=600, max_num_seqs=4, max_model_len=512)
    return ctl


def _answer(ctl: CacheController, *args: object) -> object:
    try:
        return ctl.slot_mapping(*args).tolist()
    except ValueError as exc:
        return ("ValueError", str(exc))


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 70)), min_size=1, max_size=12),
    data=st.data(),
)
def test_a_few_positions_map_as_the_array_path(steps, data):
    ctl = _controller()
    with ctl:
        for request, grow in steps:
            rid = f"r{request}"
            held = ctl.num_tokens(rid) if rid in ctl.requests else 0
            ctl.allocate(rid, min(held + grow, 512))
            n = ctl.num_tokens(rid)
            for group in ctl.groups:
                ratio = data.draw(st.sampled_from(RATIOS.get(group, [1])))
                few = data.draw(st.lists(st.integers(-1, n), min_size=0, max_size=8))
                array = _answer(ctl, rid, group, np.array(few, dtype=np.int64), ratio)
                assert _answer(ctl, rid, group, few, ratio) == array
                assert _answer(ctl, rid, group, tuple(few), ratio) == array
                tensor = torch.tensor(few, dtype=torch.int64)
                assert _answer(ctl, rid, group, tensor, ratio) == array


@pytest.mark.parametrize(
    ("positions", "ratio", "error", "message"),
    [
        ([5, 40], 1, ValueError, "position 40 is outside request 'a', which holds tokens 0..39"),
        ([-1], 1, ValueError, "position -1 is outside request 'a', which holds tokens 0..39"),
        ([1.0], 1, ValueError, "positions must be ints, got 1.0"),
        ([True], 1, ValueError, "positions must be ints, got True"),
        # beyond int64: worded by the array path, as before the few-position path
        ([2**63], 1, ValueError, "position -9223372036854775808 is outside request 'a'"),
        ([-1, 2**63], 1, ValueError, "positions must be integers, got dtype float64"),
        ([0], np.array([2, 2]), TypeError, r"compress_ratio must be an int >= 1, got array"),
        ([0], torch.tensor([2, 2]), TypeError, r"compress_ratio must be an int >= 1, got tensor"),
        ([0], True, TypeError, "compress_ratio must be an int >= 1, got True"),
        ([0], 3, ValueError, "compress_ratio=3 does not divide block_size=64 of group 'swa'"),
    ],
)
def test_bad_few_positions_are_refused_and_change_nothing(positions, ratio, error, message):
    ctl = _controller()
    ctl.allocate("a", 40)
    tables = {g: ctl.block_table("a", g) for g in ctl.groups}
    with pytest.raises(error, match=message):
        ctl.slot_mapping("a", "swa", positions, ratio)
    assert {g: ctl.block_table("a", g) for g in ctl.groups} == tables
    assert ctl.num_tokens("a") == 40


def test_one_decode_position_maps_into_the_block_just_taken():
    ctl = _controller()
    ctl.allocate("a", 64)
    ctl.allocate("a", 65)  # token 64 opens block 16 of the 4-token state group
    table = ctl.block_table("a", "c4_state")
    slot = ctl.slot_mapping("a", "c4_state", torch.tensor([64]))
    assert slot.dtype == torch.int64 and slot.tolist() == [table[16] * 4]
