"""The randomized differential soak (``benchmarks/soak.py``) at CI size, and two ways a
window group once lost a block of its resting window (a step of no tokens; a truncation into
a released block), found by the soak and pinned here.

The soak drives the facade and an independent model with the same random operations and
checks after each one that they agree; a bad call must change nothing (pool counts, tables,
swapped set, token counts, a hash of every cache byte); every live byte reads back after swap
ins and at the end. A failure names the seed and the operation, so it replays with
``python benchmarks/soak.py --ops N --seed S``. One seed runs with prefix caching
(``--prefix``): requests extend earlier prompts' prefixes and every reused byte is verified.
Shared pools (``--share-pools``) run alone and with prefix caching: a full GQA layer whose
pages pair up with the sliding-window GQA layer's draws on the same pool, in the same bytes,
and the model counts one free figure for both groups.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge import CacheController, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.scheduler import BlockManager
from kvforge.verify import read_entries, verify_request, write_entries, write_request

ROOT = Path(__file__).resolve().parents[2]


def _load_soak():
    spec = importlib.util.spec_from_file_location("kvforge_soak", ROOT / "benchmarks/soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvforge_soak"] = module
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


@pytest.mark.soak
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_soak_fixed_seeds(seed: int) -> None:
    report = soak.run_soak(120, seed)
    assert sum(report.ops[name] for name, _, _ in soak.OPERATIONS) == 120
    # the run did real work: swaps came back and were verified byte for byte
    assert report.ops["swap_in"] > 0 and report.entries_verified > 0
    assert report.bytes_verified > 0
    assert sum(report.bad_calls.values()) > 0


@pytest.mark.soak
@pytest.mark.parametrize("share_pools", [False, True], ids=["own_pools", "shared_pools"])
def test_soak_with_prefix_caching(share_pools: bool) -> None:
    report = soak.run_soak(150, 7, prefix=True, share_pools=share_pools)
    assert sum(report.ops[name] for name, _, _ in soak.OPERATIONS) == 150
    # requests started on cached prefixes (boundary 256: the LCM of the V4 and GQA blocks)
    # and their reused blocks were verified with the rest of their bytes; with shared pools a
    # hit needs gqa_full's whole chain and gqa_swa's tail, both kept in the one pool
    assert report.ops["prefix_admit"] > 0 and report.prefix_hits > 0
    assert report.reused_tokens > 0 and report.reused_tokens % 256 == 0
    assert report.ops["swap_in"] > 0 and report.entries_verified > 0
    assert sum(report.bad_calls.values()) > 0


@pytest.mark.soak
def test_soak_with_shared_pools() -> None:
    report = soak.run_soak(120, 2, share_pools=True)
    assert sum(report.ops[name] for name, _, _ in soak.OPERATIONS) == 120
    assert all(report.ops[name] == 0 for name in soak.PREFIX_ONLY)
    # steps the model refused for the shared pool (named by its first group that asked) and
    # the controller refused alike; swaps came back byte for byte; bad calls changed nothing
    assert report.short_of["gqa_swa"] > 0 and report.short_of["gqa_full"] == 0
    assert report.ops["swap_in"] > 0 and report.entries_verified > 0
    assert report.bytes_verified > 0
    assert sum(report.bad_calls.values()) > 0


def test_shared_pool_soak_pairs_the_gqa_layers_in_one_pool() -> None:
    run = soak.Soak(0, share_pools=True)
    ctl, manager = run.ctl, run.ctl.scheduler
    assert ("gqa_swa", "gqa_full") in ctl.layout.pool_sets
    assert run.model.pool_of["gqa_full"] == ("gqa_swa", "gqa_full")
    assert run.model.pool_of["swa"] == ("swa",)
    assert manager.pool("gqa_swa") is manager.pool("gqa_full")
    assert manager.pool("swa") is not manager.pool("gqa_swa")
    # one pool of 40 blocks, 39 usable, counted for both groups
    assert ctl.num_free_blocks("gqa_swa") == ctl.num_free_blocks("gqa_full") == 39
    # the worker side: layer 3 (gqa_swa) and layer 4 (gqa_full) buffers are the same bytes
    for role in ("key", "value"):
        assert ctl.get(role, 3).data_ptr() == ctl.get(role, 4).data_ptr()
    assert ctl.get("key", 3).data_ptr() != ctl.get("value", 3).data_ptr()
    # without share_pools the soak's controller has no gqa_full layer at all
    assert "gqa_full" not in soak.Soak(0).ctl.groups


def _gqa_pair() -> dict[int, GQABackend]:
    """A sliding window W = 32 and a full layer, both 1 kv head of dim 8 in 16-token blocks:
    512 B pages in both groups, so they pair up."""
    return {
        0: GQABackend(1, 8, block_size=16, sliding_window=32, group="gqa_swa"),
        1: GQABackend(1, 8, block_size=16, group="gqa_full"),
    }


def test_model_counts_one_free_figure_for_a_shared_pool() -> None:
    # one pool of 9 blocks (8 usable) for both groups, the model against BlockManager
    layout = CacheLayout(_gqa_pair())
    counts = {"gqa_swa": 9, "gqa_full": 9}
    manager = BlockManager(layout, counts, soak.MAX_SEQS, soak.MAX_MODEL_LEN, share_pools=True)
    model = soak.Model(list(layout.groups), counts, soak.SHARED_POOLS)
    assert model.pools == (("gqa_swa", "gqa_full"),)

    def step(ids: list[str], new: list[int]) -> list[str]:
        accepted = model.step(ids, new)
        got = manager.schedule(ids, new)
        manager.end_step(got)
        assert list(got.request_ids) == accepted, (got, accepted)
        for rid, n in zip(ids, new, strict=True):
            if rid in accepted:
                model.apply_step(rid, n, 0)
        for g in counts:
            assert manager.num_free_blocks(g) == model.free(g)
            assert int(np.count_nonzero(manager.table(g))) == model.used(g)
        return accepted

    # 64 tokens: 4 blocks in each group, 8 - 4 - 4 = 0 free
    assert step(["r"], [64]) == ["r"] and model.free("gqa_full") == 0
    # 16 more: each group needs 1 block (2 > 0 free), but the window reads from
    # 64 + 1 - 32 = 33, so gqa_swa gives back blocks 0 and 1: 2 credits cover both groups
    assert step(["r"], [16]) == ["r"]
    assert (model.used("gqa_swa"), model.used("gqa_full")) == (3, 5)
    # a new request needs 1 block in each group, 2 > 0 free: refused by both
    assert step(["s"], [16]) == []
    model.resident.pop("r")
    manager.finish(["r"])
    assert model.free("gqa_swa") == manager.num_free_blocks("gqa_full") == 8


MODEL_POOLS = [
    ("unknown_group", (("gqa_swa", "nope"),), "must name groups of ['gqa_full', 'gqa_swa']"),
    ("group_twice", (("gqa_swa", "gqa_swa"),), "must name groups of ['gqa_full', 'gqa_swa']"),
]


@pytest.mark.parametrize(
    ("pools", "fragment"), [c[1:] for c in MODEL_POOLS], ids=[c[0] for c in MODEL_POOLS]
)
def test_model_refuses_pools_that_do_not_name_its_groups(pools, fragment) -> None:
    groups = list(CacheLayout(_gqa_pair()).groups)
    with pytest.raises(ValueError) as info:
        soak.Model(groups, {"gqa_swa": 9, "gqa_full": 9}, pools)
    assert fragment in str(info.value)


def test_model_refuses_a_pool_with_two_block_counts() -> None:
    groups = list(CacheLayout(_gqa_pair()).groups)
    with pytest.raises(ValueError, match=r"pool \('gqa_swa', 'gqa_full'\) needs one block count"):
        soak.Model(groups, {"gqa_swa": 9, "gqa_full": 12}, soak.SHARED_POOLS)


@pytest.mark.slow
def test_prefix_rows_run_only_with_prefix_caching() -> None:
    report = soak.run_soak(60, 0)
    assert all(report.ops[name] == 0 for name in soak.PREFIX_ONLY)


def test_operation_table_is_complete() -> None:
    names = [name for name, _, _ in soak.OPERATIONS]
    assert names == [
        "schedule",
        "allocate",
        "truncate",
        "swap_out",
        "swap_in",
        "free",
        "verify",
        "bad_call",
        "prefix_admit",
        "prefix_reset",
    ]
    assert {"prefix_admit", "prefix_reset"} == soak.PREFIX_ONLY
    assert all(weight > 0 for _, weight, _ in soak.OPERATIONS)
    assert len({name for name, _ in soak.BAD_CALLS}) == len(soak.BAD_CALLS)
    assert {name for name, _ in soak.BAD_CALLS} >= soak.KNOWN_LATE_CHECKS


@pytest.mark.parametrize(
    "name",
    [
        "lookup_not_query",
        "lookup_bare_query",
        "lookup_float_tokens",
        "stale_match",
        "matches_length",
        "matches_type",
        "match_for_running",
    ],
)
def test_prefix_bad_calls_are_refused_and_change_nothing(name: str) -> None:
    run = soak.Soak(7, prefix=True)
    prompt = list(range(300))
    step = run.ctl.schedule(["a"], [300], new_token_ids=[prompt])
    run.model.apply_step("a", 300, 0)
    run.model.resident["a"].tokens = prompt
    run.write("a", 0, 300)
    run.ctl.end_step(step)
    run.prompts.append(prompt)
    assert step.allocation.request_ids == ("a",)
    built = dict(soak.BAD_CALLS)[name](run)
    assert built is not None
    call, exc, fragment = built
    run.expect_refused(call, exc, fragment)  # raises unless refused with no state change
    run.check()
    run.verify("a")


def test_float_token_ids_are_refused_before_any_change() -> None:
    run = soak.Soak(7, prefix=True)
    call, exc, fragment = dict(soak.BAD_CALLS)["schedule_float_token_ids"](run)
    run.expect_refused(call, exc, fragment)


def test_soak_detects_a_lost_byte() -> None:
    """The verification is live: scribbling over one written entry fails the next verify."""
    run = soak.Soak(5)
    run.ctl.end_step(run.ctl.schedule(["x"], [40]))
    run.model.apply_step("x", 40, 11)
    run.write("x", 0, 40)
    run.verify("x")
    slot = int(run.ctl.slot_mapping("x", "gqa_swa", [39])[0])
    entry = run.ctl.layout.entry("key", 3)
    cache = run.ctl.kv_caches[entry.index]
    slots = torch.tensor([slot])
    write_entries(cache, entry, slots, read_entries(cache, entry, slots) ^ 1)
    with pytest.raises(AssertionError, match="entries differ"):
        run.verify("x")


def _swa_request(n: int) -> CacheController:
    """GQA with a sliding window W=8 over blocks of B=4, one request decoded token by token
    to ``n`` tokens, every token written."""
    ctl = CacheController({0: GQABackend(1, 8, block_size=4, sliding_window=8)})
    ctl.initialize_kv_cache(num_blocks=40, max_num_seqs=4, max_model_len=256)
    ctl.initialize_host_cache(num_pages=40)
    for p in range(n):
        step = ctl.schedule(["a"], [1])
        write_request(ctl, "a", 3, [p])
        ctl.end_step(step)
    return ctl


def _swap_round_trip(ctl: CacheController) -> None:
    ctl.swap_out("a")
    for t in ctl.kv_caches:
        t.view(torch.uint8).fill_(0xAB)
    ctl.swap_in("a")


def test_zero_token_step_keeps_resting_window() -> None:
    # 87 tokens at rest: the window is tokens 79..86 (87 - 8), blocks 19..21 of 4 tokens
    ctl = _swa_request(87)
    assert (
        ctl.block_table("a", "swa")[19:] != [0, 0, 0] and 0 not in ctl.block_table("a", "swa")[19:]
    )
    ctl.end_step(ctl.schedule(["a"], [0]))  # nothing scheduled: nothing the request reads may go
    assert 0 not in ctl.block_table("a", "swa")[19:]
    _swap_round_trip(ctl)
    assert verify_request(ctl, "a", 3).mismatched == 0


def test_truncate_into_released_window_then_swap_in() -> None:
    # 90 tokens: the last step started at token 89, reading from 89 + 1 - 8 = 82, so blocks
    # 0..19 (tokens 0..79) went back. Truncating to 87 puts the resting window at 79..86:
    # token 79 lies in released block 19.
    ctl = _swa_request(90)
    assert ctl.block_table("a", "swa")[:20] == [0] * 20
    used = ctl.num_used_blocks("swa")
    try:
        ctl.truncate("a", 87)
    except ValueError as err:  # refusing is a correct answer: nothing changed
        assert "cannot truncate" in str(err)
        assert (ctl.num_tokens("a"), ctl.num_used_blocks("swa")) == (90, used)
        return
    held = ctl.num_used_blocks("swa")
    _swap_round_trip(ctl)
    assert ctl.num_used_blocks("swa") == held  # a swap in holds what the swap out left
    assert verify_request(ctl, "a", 3).mismatched == 0
