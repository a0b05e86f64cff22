"""The slab arena on the worker side: one allocation, every tensor a fixed view of it, and
every byte a request wrote reads back while slabs change hands under it.

DeepSeek-V4-tiny on a budget of a few dozen slabs, prefix caching on: random prompts that
share prefixes, chunked prefills, decodes, frees, swaps out and in. After every operation
every live request's bytes are verified, and at the end every tensor still has the pointer,
shape and strides it was created with (what CUDA graphs and engines rely on).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import CacheController
from kvforge.core.arena import plan_arena
from kvforge.core.values import BlockCopy, PrefixQuery
from kvforge.errors import BlockOwnershipError
from kvforge.models import from_hf_config
from kvforge.verify import token_seeds, verify_request, write_step

BUDGET = 96 << 20


def controller(prefix: bool = True) -> CacheController:
    ctl = CacheController(from_hf_config("deepseek-v4-tiny"), enable_prefix_caching=prefix)
    plan = ctl.initialize_kv_cache(
        memory_budget=BUDGET, max_num_seqs=6, max_model_len=4096, max_num_batched_tokens=512
    )
    assert plan.arena is not None and ctl.storage.arena == plan.arena
    return ctl


def meta(ctl: CacheController) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    return [(t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in ctl.kv_caches]


def run(ctl: CacheController, rid: str, toks: np.ndarray, match=None, chunk: int = 512):
    seeds = token_seeds(toks)
    done = match.num_tokens if match is not None else 0
    first = True
    while done < len(toks):
        n = min(chunk, len(toks) - done)
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[toks[done : done + n]],
            prefix_matches=[match] if first else None,
        )
        if step.allocation.refused:
            ctl.end_step(step)
            return None
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done, first = done + n, False
    return seeds


def test_the_arena_is_one_allocation_of_views_with_padded_strides() -> None:
    ctl = controller()
    arena = ctl.storage.arena
    assert ctl.device_bytes == arena.total_bytes <= BUDGET
    base = min(t.data_ptr() for t in ctl.kv_caches)
    for i, g in enumerate(arena.groups):
        for e, offset in zip(ctl.layout.buffers_of(g), arena.buffer_offsets[i], strict=True):
            t = ctl.get(*e.key)
            assert t.shape[0] == arena.num_blocks(g)
            assert t.stride(0) * t.element_size() == arena.block_stride[i]
            assert t.data_ptr() - base == offset  # block 0 of every group starts the arena
    # a step's slots land inside the request's own blocks, in its group's stride
    assert arena.block_stride[0] * arena.blocks_per_slab[0] == arena.slab_bytes


@pytest.mark.slow
def test_bytes_survive_slabs_moving_between_groups() -> None:
    ctl = controller()
    ctl.initialize_host_cache(num_pages=64)
    shapes = meta(ctl)
    arena = ctl.scheduler.arena
    rng = np.random.default_rng(3)
    system = rng.integers(0, 50_000, 768)
    seeds: dict[str, object] = {}
    swapped: set[str] = set()

    def check() -> None:
        for r, s in seeds.items():
            if r not in swapped:
                assert verify_request(ctl, r, s).mismatched == 0, r
        arena.check()

    for n in range(24):
        rid = f"r{n}"
        tail = rng.integers(0, 50_000, int(rng.integers(64, 900)))
        toks = np.concatenate([system[: int(rng.integers(0, 768))], tail])
        [match] = ctl.lookup([PrefixQuery(toks)])
        got = run(ctl, rid, toks, match)
        assert got is not None, rid
        seeds[rid] = got
        if rng.integers(0, 3) == 1:
            ctl.swap_out(rid).wait()
            swapped.add(rid)
        for r in sorted(swapped):
            if r != rid and rng.integers(0, 2):
                ctl.swap_in(r).wait()
                swapped.discard(r)
        while len(seeds) > 3:  # keep rows free: the oldest goes
            victim = next(iter(seeds))
            ctl.free_request(victim)
            seeds.pop(victim)
            swapped.discard(victim)
        check()
    for r in list(seeds):
        ctl.free_request(r)
    seeds.clear()
    swapped.clear()
    # every slab now holds cached blocks only; one long prompt takes the slabs it needs
    # from the groups that cached them
    toks = rng.integers(0, 50_000, 4000)
    seeds["long"] = run(ctl, "long", toks)
    assert seeds["long"] is not None
    assert arena.moves > 0
    check()
    assert meta(ctl) == shapes


def test_a_copy_into_another_groups_slab_is_refused() -> None:
    ctl = controller()
    toks = np.arange(1, 700)
    assert run(ctl, "a", toks) is not None
    arena = ctl.storage.arena
    k_full = arena.blocks_per_slab[arena.groups.index("compressed")]
    k_swa = arena.blocks_per_slab[arena.groups.index("swa")]
    window = np.asarray(ctl.block_table("a", "swa"))
    slab = window[window != 0][0] // k_swa  # swa's slabs are whole slabs that move
    forged = slab * k_full + 1  # a compressed block id inside the swa group's slab
    with pytest.raises(BlockOwnershipError, match=r"lies in slab .* of the arena"):
        ctl.storage.copy_blocks(
            [BlockCopy("compressed", np.array([forged], np.int32), np.array([forged], np.int32))]
        )


BAD_CREATES = [
    ({"share_pools": False}, ValueError, "arena needs share_pools=True"),
    ({"arena": "x"}, TypeError, "arena must be an ArenaGeometry or None, got str"),
    ({"shrink": True}, ValueError, "num_blocks gives .* to arena group 'swa'"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_CREATES)
def test_bad_arena_creates_leave_the_storage_empty(change, error, message) -> None:
    ctl = CacheController(from_hf_config("deepseek-v4-tiny"))
    arena = plan_arena(ctl.layout, BUDGET)
    blocks = {g.name: 4 for g in ctl.layout.groups}
    blocks.update({g: arena.num_blocks(g) for g in arena.groups})
    if change.pop("shrink", False):
        blocks["swa"] -= 1
    args = {"share_pools": True, "arena": arena, **change}
    with pytest.raises(error, match=message):
        ctl.storage.create(blocks, 4, 4096, **args)
    assert not ctl.storage.ready


def test_tensors_are_zero_and_on_the_cpu() -> None:
    ctl = controller(prefix=False)
    assert all(t.device.type == "cpu" and not torch.any(t != 0) for t in ctl.kv_caches[:4])


def test_host_pages_stay_unpadded_beside_the_arena() -> None:
    ctl = controller()
    ctl.initialize_host_cache(num_pages=8)
    arena = ctl.storage.arena
    for i, g in enumerate(arena.groups):
        page = ctl.layout.host_page_bytes(g)
        # the host page is the offloaded roles' meaningful bytes, never the device stride
        assert page < arena.block_stride[i]
        assert page == sum(e.block_bytes for e in ctl.layout.offload_buffers(g))
    assert ctl.host_bytes == sum(8 * ctl.layout.host_page_bytes(g) for g in arena.groups)
