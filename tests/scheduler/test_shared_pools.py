"""Shared pools: groups whose pages pair up byte for byte live in the same bytes.

The layout is gpt-oss shaped but small: layers 0 and 2 slide over a 32-token window (group
``swa``), layers 1 and 3 attend to everything (group ``kv``), both GQA with 2 kv heads of dim 8
in bf16 and 16-token blocks. One buffer block is ``16 tokens * 2 heads * 8 dims * 2 B = 512 B``
and one page of either group ``2 layers * 2 roles * 512 B = 2,048 B``, so the two groups form
one pool set. With ``share_pools=True`` buffer ``k`` of ``swa`` and buffer ``k`` of ``kv`` are
one allocation, the pool's ``N`` blocks cost ``N * 2,048 B`` once, and the scheduler side
never gives one block id to both groups.
"""

from __future__ import annotations

import doctest
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvforge import CacheController, GQABackend
from kvforge.attn_backends.base import DeclaredBackend, block_buffer_view, new_block_buffer
from kvforge.core import memory_plan
from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import plan_memory, shared_pool_blocks
from kvforge.core.values import PrefixEvent, PrefixQuery, Refusal
from kvforge.scheduler import BlockManager
from kvforge.specs import CacheGroup, CacheRole, GroupKind
from kvforge.verify import token_seeds, verify_request, write_request, write_step
from kvforge.worker import CacheStorage
from kvforge.worker.overlap import PlaneExtent, PoolMember, find_overlap

PAGE = 2 * 2 * 16 * 2 * 8 * 2  # layers * roles * tokens * heads * dims * bytes = 2,048 B
BUFFER_BLOCK = 16 * 2 * 8 * 2  # 512 B
SWA_KEYS = [("key", 0), ("value", 0), ("key", 2), ("value", 2)]
KV_KEYS = [("key", 1), ("value", 1), ("key", 3), ("value", 3)]


def backends(full: type[GQABackend] = GQABackend) -> dict[int, GQABackend]:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = full(2, 8, block_size=16)
    return {0: swa, 1: kv, 2: swa, 3: kv}


def layout() -> CacheLayout:
    return CacheLayout(backends())


def test_the_small_layout_is_one_pool_set() -> None:
    lay = layout()
    assert [g.name for g in lay.groups] == ["swa", "kv"]
    assert lay.pool_sets == (("swa", "kv"),)
    assert lay.bytes_per_block("swa") == lay.bytes_per_block("kv") == PAGE == 2048
    assert lay.pool_of("kv", True) == ("swa", "kv") and lay.pool_of("kv", False) == ("kv",)


# ------------------------------------------------------------------ (a) the memory layout


def test_create_places_position_k_of_every_member_in_one_allocation() -> None:
    storage = CacheStorage(layout())
    storage.create({"swa": 10, "kv": 10}, max_num_seqs=4, max_model_len=256, share_pools=True)
    assert storage.share_pools is True
    # every member's buffers sorted by block bytes (all 512 B here), stable: layout order
    for swa_key, kv_key in zip(SWA_KEYS, KV_KEYS, strict=True):
        a, b = storage.get(*swa_key), storage.get(*kv_key)
        assert a.data_ptr() == b.data_ptr()
        assert tuple(a.shape) == tuple(b.shape) == (10, 16, 2, 8)
        assert a.dtype == b.dtype == torch.bfloat16
        assert a.is_contiguous() and a.stride() == (256, 16, 8, 1)
    bases = {storage.get(*k).data_ptr() for k in SWA_KEYS}
    assert len(bases) == 4  # the four positions are four allocations
    # 4 allocations of 10 blocks * 512 B = 20,480 B = N * page, counted once
    assert storage.device_bytes == 10 * PAGE == 20_480
    # writing block 3 of a swa buffer is writing block 3 of its kv partner (same bytes)
    storage.get("key", 0)[3].fill_(1.5)
    assert bool((storage.get("key", 1)[3] == 1.5).all())
    assert bool((storage.get("key", 1)[2] == 0).all())


def test_without_share_pools_every_buffer_has_its_own_bytes() -> None:
    storage = CacheStorage(layout())
    storage.create({"swa": 10, "kv": 10}, max_num_seqs=4, max_model_len=256, share_pools=False)
    assert storage.share_pools is False
    assert len({storage.get(*k).data_ptr() for k in SWA_KEYS + KV_KEYS}) == 8
    assert storage.device_bytes == 2 * 10 * PAGE == 40_960


class _Mixed(DeclaredBackend):
    """Two groups in one backend whose roles pair up only once sorted by device block bytes:
    ``kv`` declares (a: 384 B padded, b: 256 B), ``win`` (c: 256 B, d: 384 B padded)."""

    def __init__(self) -> None:
        kv = CacheGroup(name="kv", block_size=16, kind=GroupKind.FULL)
        win = CacheGroup(name="win", block_size=16, kind=GroupKind.SLIDING_WINDOW, window=32)
        self.declare(
            [kv, win],
            [
                # 16 tokens * 8 * 2 B = 256 B of meaningful bytes, rounded up to 384 B
                CacheRole(
                    name="a", group="kv", entry_shape=(8,), dtype="bfloat16", block_alignment=384
                ),
                CacheRole(name="b", group="kv", entry_shape=(4,), dtype="float32"),  # 256 B
                CacheRole(name="c", group="win", entry_shape=(16,), dtype="int8"),  # 256 B
                CacheRole(
                    name="d", group="win", entry_shape=(2, 4), dtype="float16", block_alignment=384
                ),
            ],
        )


def test_padded_roles_pair_by_sorted_block_bytes_and_keep_the_default_views() -> None:
    backend = _Mixed()
    lay = CacheLayout({0: backend, 1: backend})
    assert lay.pool_sets == (("kv", "win"),)
    storage = CacheStorage(lay)
    storage.create({"kv": 5, "win": 5}, max_num_seqs=2, max_model_len=128, share_pools=True)
    # sorted by device bytes: kv (b0, b1, a0, a1), win (c0, c1, d0, d1)
    for left, right in [("b", "c"), ("a", "d")]:
        for layer in (0, 1):
            assert storage.get(left, layer).data_ptr() == storage.get(right, layer).data_ptr()
    reference = backend.create_kv_cache([0, 1], {"kv": 5, "win": 5}, "cpu")
    for key, want in reference.items():
        got = storage.get(*key)
        assert (tuple(got.shape), got.stride(), got.dtype) == (
            tuple(want.shape),
            want.stride(),
            want.dtype,
        )
    # per layer: 384 + 256 B per block per position, 5 blocks, both layers, once
    assert storage.device_bytes == 5 * 2 * (384 + 256) == lay.bytes_per_block("kv") * 5


class _PaddedMeetsFull(DeclaredBackend):
    """``kv``'s role pads 256 meaningful bytes to a 384-byte stride; ``win``'s role fills a
    384-byte block: the strides pair up (one pool set), the meaningful bytes do not."""

    def __init__(self) -> None:
        self.declare(
            [
                CacheGroup(name="kv", block_size=16, kind=GroupKind.FULL),
                CacheGroup(name="win", block_size=16, kind=GroupKind.SLIDING_WINDOW, window=32),
            ],
            [
                CacheRole(
                    name="a", group="kv", entry_shape=(8,), dtype="bfloat16", block_alignment=384
                ),
                CacheRole(name="d", group="win", entry_shape=(12,), dtype="bfloat16"),
            ],
        )


def test_a_padded_role_shares_bytes_with_a_partner_that_fills_the_stride() -> None:
    backend = _PaddedMeetsFull()
    ctl = CacheController({0: backend, 1: backend}, share_pools=True)
    assert ctl.layout.pool_sets == (("kv", "win"),)
    ctl.initialize_kv_cache(num_blocks=5, max_num_seqs=2, max_model_len=64)
    for layer in (0, 1):
        a, d = ctl.get("a", layer), ctl.get("d", layer)
        assert a.data_ptr() == d.data_ptr()
        assert (a.stride(0) * a.element_size(), d.stride(0) * d.element_size()) == (384, 384)
    assert ctl.storage.device_bytes == 5 * 2 * 384  # 5 blocks, 2 layers, paid once
    ctl.free()


def test_block_buffer_view_refuses_a_raw_buffer_of_the_wrong_width() -> None:
    backend = GQABackend(2, 8, block_size=16)
    role = backend.role("key")
    group = backend.groups_by_name()["kv"]
    view = block_buffer_view(torch.zeros((3, 512), dtype=torch.uint8), role, group)
    assert tuple(view.shape) == (3, 16, 2, 8) and view.dtype == torch.bfloat16
    fresh = new_block_buffer(role, group, 3, "cpu")
    assert (tuple(fresh.shape), fresh.stride(), fresh.dtype) == (
        (3, 16, 2, 8),
        view.stride(),
        torch.bfloat16,
    )
    assert not fresh.view(torch.uint8).any()
    with pytest.raises(
        ValueError, match=r"role 'key' needs a contiguous uint8 \[num_blocks, 512\]"
    ):
        block_buffer_view(torch.zeros((3, 500), dtype=torch.uint8), role, group)


# ------------------------------------------------------------------ find_overlap with pools


def P(name: str, base: int) -> PlaneExtent:
    return PlaneExtent(name=name, base=base, block_stride=512, block_bytes=512, num_blocks=10)


POOL = ("swa", "kv")
OVERLAP = [
    ("members of one pool coincide", [PoolMember(POOL, "swa"), PoolMember(POOL, "kv")], None),
    ("one member twice", [PoolMember(POOL, "kv"), PoolMember(POOL, "kv")], ("a", "b", 0, 0)),
    ("two pools", [PoolMember(POOL, "swa"), PoolMember(("x", "y"), "x")], ("a", "b", 0, 0)),
    ("a plane of no pool", [PoolMember(POOL, "swa"), None], ("a", "b", 0, 0)),
]


@pytest.mark.parametrize(
    ("members", "expected"), [c[1:] for c in OVERLAP], ids=[c[0] for c in OVERLAP]
)
def test_find_overlap_accepts_only_coinciding_members_of_one_pool(members, expected) -> None:
    found = find_overlap([P("a", 0), P("b", 0)], members)
    assert (None if found is None else (found[0].name, found[1].name, *found[2:])) == expected


def test_find_overlap_with_pools_still_sees_partial_overlaps() -> None:
    members = [PoolMember(POOL, "swa"), PoolMember(POOL, "kv"), PoolMember(POOL, "kv")]
    # c starts one block into the coinciding a/b: its block 0 is their block 1
    a, b, i, j = find_overlap([P("a", 0), P("b", 0), P("c", 512)], members)
    assert (a.name, b.name, i, j) == ("a", "c", 1, 0)
    # three planes: swa and kv coincide, a second kv plane on the same bytes does not
    a, b, i, j = find_overlap([P("a", 0), P("b", 0), P("c", 0)], members)
    assert (a.name, b.name, i, j) == ("b", "c", 0, 0)
    # coinciding planes of one pool that address different bytes of each block (a role padded
    # to the stride its partner fills) are one plane, the widest: a plane 128 B into the
    # wide one's blocks is still an overlap, one past them is not
    narrow = PlaneExtent(name="n", base=0, block_stride=512, block_bytes=256, num_blocks=10)
    wide = PlaneExtent(name="w", base=0, block_stride=512, block_bytes=384, num_blocks=10)
    inside = PlaneExtent(name="i", base=300, block_stride=512, block_bytes=64, num_blocks=10)
    after = PlaneExtent(name="f", base=384, block_stride=512, block_bytes=128, num_blocks=10)
    pool = [PoolMember(POOL, "swa"), PoolMember(POOL, "kv"), None]
    assert find_overlap([narrow, wide, after], pool) is None
    a, b, i, j = find_overlap([narrow, wide, inside], pool)
    assert (a.name, b.name, i, j) == ("w", "i", 0, 0)
    with pytest.raises(ValueError, match=r"members must name one pool member .* 1 for 2 planes"):
        find_overlap([P("a", 0), P("b", 0)], members[:1])
    with pytest.raises(TypeError, match=r"members\[1\] must be a PoolMember or None, got str"):
        find_overlap([P("a", 0), P("b", 0)], [None, "kv"])


# ------------------------------------------------------------------ (b) through the facade


def run(ctl: CacheController, rid: str, toks: np.ndarray, chunk: int = 32, match=None):
    """Prefill ``toks`` in chunks through schedule / end_step, writing every step's tokens
    with token-derived seeds, as an engine's kernels would."""
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
        assert not step.allocation.refused, step.allocation.refused
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done, first = done + n, False
    return seeds


def held(ctl: CacheController, rid: str) -> dict[str, set[int]]:
    return {g: {b for b in ctl.block_table(rid, g) if b} for g in ctl.groups}


def test_prefix_reuse_and_swaps_are_byte_exact_in_a_shared_pool() -> None:
    ctl = CacheController(backends(), enable_prefix_caching=True, share_pools=True)
    ctl.initialize_kv_cache(num_blocks=40, max_num_seqs=4, max_model_len=256)
    ctl.initialize_host_cache(num_pages=32)
    assert ctl.storage.num_blocks == {"swa": 40, "kv": 40}
    assert ctl.device_bytes == 40 * PAGE  # one pool of 40 blocks, paid once
    # 39 usable blocks for both groups together: the free count is the pool's
    assert ctl.num_free_blocks("swa") == ctl.num_free_blocks("kv") == 39
    rng = np.random.default_rng(0)
    a = rng.integers(0, 50_000, 100)
    seeds_a = run(ctl, "a", a)
    assert verify_request(ctl, "a", seeds_a).mismatched == 0
    # 100 tokens: kv holds cdiv(100, 16) = 7 blocks; swa the blocks of the last step's window
    assert len(held(ctl, "a")["kv"]) == 7
    a_kv = ctl.block_table("a", "kv")
    ctl.free_request("a")
    # b shares a's first 64 tokens (4 blocks) and differs after
    b = np.concatenate([a[:64], rng.integers(0, 50_000, 36)])
    [match] = ctl.lookup([PrefixQuery(b)])
    assert match.num_tokens == 64
    seeds_b = run(ctl, "b", b, match=match)
    assert ctl.block_table("b", "kv")[:4] == a_kv[:4]  # reused, not recomputed
    check = verify_request(ctl, "b", seeds_b)
    # kv: 2 layers * 2 roles * 100 tokens; swa: 2 * 2 * the 32-token window
    assert (check.entries, check.mismatched) == (4 * 100 + 4 * 32, 0)
    # a swap round trip, with another request resident and an intruder taking blocks
    c = rng.integers(0, 50_000, 90)
    seeds_c = run(ctl, "c", c)
    before = held(ctl, "c")
    assert not before["swa"] & held(ctl, "b")["kv"]  # ids are exclusive across the groups
    ctl.swap_out("c").wait()
    for group, blocks in before.items():  # scribble over every block c gave back
        for e in ctl.layout.buffers_of(group):
            ctl.get(*e.key)[sorted(blocks)] = -7.0
    ctl.allocate("intruder", 60)
    write_request(ctl, "intruder", 123, range(60))
    ctl.swap_in("c").wait()
    for rid, seeds in (("b", seeds_b), ("c", seeds_c), ("intruder", 123)):
        assert verify_request(ctl, rid, seeds).mismatched == 0, rid
    live = [held(ctl, r) for r in ("b", "c", "intruder")]
    swa_ids = set().union(*(h["swa"] for h in live))
    kv_ids = set().union(*(h["kv"] for h in live))
    assert not swa_ids & kv_ids
    ctl.free()
    assert ctl.device_bytes == 0


def test_a_memory_budget_becomes_pools_of_the_same_usable_blocks() -> None:
    budget = 64 * PAGE
    lay = layout()
    sizes = {"max_num_seqs": 4, "max_model_len": 256, "max_num_batched_tokens": 64}
    plan = plan_memory(lay, budget, **sizes)
    pool = plan.num_blocks["swa"] + plan.num_blocks["kv"]  # one null block, one more usable
    assert shared_pool_blocks(lay, plan.num_blocks) == {"swa": pool, "kv": pool}
    ctl = CacheController(backends(), share_pools=True)
    got = ctl.initialize_kv_cache(memory_budget=budget, **sizes)
    assert got.num_blocks == plan.num_blocks  # the per-group plan is what is returned
    assert ctl.storage.num_blocks == {"swa": pool, "kv": pool}
    assert ctl.scheduler.num_usable_blocks("kv") == pool - 1 == sum(plan.num_blocks.values()) - 1
    # the plan's bytes: the null block the second member no longer needs is a usable block
    assert ctl.device_bytes == pool * PAGE == plan.total_bytes


def test_shared_pool_blocks_worked_example_runs() -> None:
    finder = doctest.DocTestFinder()
    [test] = finder.find(
        memory_plan.shared_pool_blocks, "shared_pool_blocks", globs=vars(memory_plan)
    )
    result = doctest.DocTestRunner().run(test)
    assert (result.attempted, result.failed) == (4, 0)


def test_adopt_accepts_tensors_an_engine_shares_between_the_groups() -> None:
    ctl = CacheController(backends(), share_pools=True)
    raws = [torch.zeros((12, BUFFER_BLOCK), dtype=torch.uint8) for _ in range(4)]
    caches = {}
    for raw, swa_key, kv_key in zip(raws, SWA_KEYS, KV_KEYS, strict=True):
        caches[swa_key] = raw.view(torch.bfloat16).view(12, 16, 2, 8)
        caches[kv_key] = raw.view(torch.bfloat16).view(12, 16, 2, 8)
    plan = ctl.adopt_kv_cache(caches, max_num_seqs=4, max_model_len=128)
    assert plan.num_blocks == {"swa": 12, "kv": 12}
    assert ctl.storage.share_pools is True
    assert ctl.device_bytes == 12 * PAGE
    ctl.allocate("r", 40)
    write_request(ctl, "r", 5, range(40))
    assert verify_request(ctl, "r", 5).mismatched == 0


# ------------------------------------------------------------------ (c) the scheduler side


def test_one_pool_serves_both_groups() -> None:
    m = BlockManager(layout(), {"swa": 9, "kv": 9}, 4, 256, share_pools=True)
    assert m.num_free_blocks("swa") == m.num_free_blocks("kv") == 8
    # 64 tokens: kv 4 blocks; swa holds a slot for every token of the step, 4 blocks
    step = m.schedule(["r"], [64])
    assert not step.refused
    assert m.num_free_blocks("kv") == m.num_free_blocks("swa") == 8 - 4 - 4 == 0
    assert m.block_table("r", "swa") == [1, 2, 3, 4] and m.block_table("r", "kv") == [5, 6, 7, 8]
    # 16 more tokens: kv needs block 4 and swa block 4 (2 blocks, 0 free), but the step's
    # window reads from 64 + 1 - 32 = 33, so swa gives back blocks 0 and 1 (2 credits): the
    # step fits only because swa's releases count for kv's growth too, out of one free list
    step = m.schedule(["r"], [16])
    assert not step.refused
    assert m.block_table("r", "swa") == [0, 0, 3, 4, 1]
    assert m.block_table("r", "kv") == [5, 6, 7, 8, 2]  # kv got a block swa gave back
    assert m.num_free_blocks("kv") == 0
    # a new request needs one block in each group: 2 > 0, refused, nothing changes
    tables = {g: m.table(g).copy() for g in m.groups}
    step = m.schedule(["s"], [16])
    assert step.refused == (Refusal("s", "out_of_blocks", "swa", 2, 0),)
    assert m.requests == ["r"] and m.num_free_blocks("kv") == 0
    assert all(np.array_equal(m.table(g), tables[g]) for g in m.groups)


def test_eviction_in_a_shared_pool_spans_both_groups() -> None:
    m = BlockManager(
        layout(), {"swa": 13, "kv": 13}, 4, 256, enable_prefix_caching=True, share_pools=True
    )
    toks = list(range(1000, 1064))
    for i in range(0, 64, 16):
        step = m.schedule(["a"], [16], new_token_ids=[toks[i : i + 16]])
        assert not step.refused
        m.end_step(step)
    stored = m.take_events()
    assert [(e.kind, e.group, e.num_tokens) for e in stored] == [
        (kind, g, n) for n in (16, 32, 48, 64) for kind, g in (("stored", "swa"), ("stored", "kv"))
    ]
    m.finish(["a"])
    # 12 usable blocks, all free: 4 kv and 4 swa of them cached, evictable
    assert (m.num_free_blocks("kv"), m.pool("kv").num_evictable) == (12, 8)
    for i in range(0, 96, 16):  # other tokens: b needs the cached blocks of both groups
        step = m.schedule(["b"], [16], new_token_ids=[list(range(i, i + 16))])
        assert not step.refused
        m.end_step(step)
    removed = [(e.group, e.num_tokens) for e in m.take_events() if e.kind == "removed"]
    # least recently released first, across the groups: swa's first block slid out of the
    # window while a ran, then a's finish gave back swa's blocks and then kv's, deepest first
    assert removed == [
        ("swa", 16),
        ("swa", 64),
        ("swa", 48),
        ("swa", 32),
        ("kv", 64),
        ("kv", 48),
        ("kv", 32),
        ("kv", 16),
    ]
    assert all(isinstance(e, PrefixEvent) for e in stored)
    assert m.prefix_stats.evictions == {"window": 4, "history": 4}


# ------------------------------------------------------------------ (d) bad input


class _OwnLayout(GQABackend):
    """A backend that lays out its own memory (overrides create_kv_cache)."""

    def create_kv_cache(self, layer_ids, num_blocks, device):  # type: ignore[override]
        return super().create_kv_cache(layer_ids, num_blocks, device)


def _aliased(offset: int) -> dict[tuple[str, int], torch.Tensor]:
    """Caches whose swa buffer k and kv buffer k share one raw buffer, kv ``offset`` blocks in."""
    caches = {}
    for swa_key, kv_key in zip(SWA_KEYS, KV_KEYS, strict=True):
        raw = torch.zeros((12 + offset, BUFFER_BLOCK), dtype=torch.uint8)
        caches[swa_key] = raw[:12].view(torch.bfloat16).view(12, 16, 2, 8)
        caches[kv_key] = raw[offset:].view(torch.bfloat16).view(12, 16, 2, 8)
    return caches


def _separate() -> dict[tuple[str, int], torch.Tensor]:
    return {k: torch.zeros((12, 16, 2, 8), dtype=torch.bfloat16) for k in SWA_KEYS + KV_KEYS}


EQUAL = {"swa": 10, "kv": 10}
UNEQUAL = {"swa": 10, "kv": 12}

# (case, call on a fresh storage of the small layout, exception, message fragment)
STORAGE: list[tuple[str, Callable[[CacheStorage], Any], type[Exception], str]] = [
    (
        "create_unequal_counts",
        lambda s: s.create(UNEQUAL, 4, 256, share_pools=True),
        ValueError,
        "create: num_blocks gives {'swa': 10, 'kv': 12} to groups ['swa', 'kv'], which share "
        "one pool (share_pools=True)",
    ),
    (
        "create_share_pools_str",
        lambda s: s.create(EQUAL, 4, 256, share_pools="yes"),
        TypeError,
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "adopt_share_pools_str",
        lambda s: s.adopt(_separate(), 4, 256, share_pools="yes"),
        TypeError,
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "adopt_aliasing_without_share_pools",
        lambda s: s.adopt(_aliased(0), 4, 256, share_pools=False),
        ValueError,
        # which of the four aliased pairs is named first depends on the addresses
        "share bytes (block 0 of the first and block 0 of the second)",
    ),
    (
        "adopt_aliasing_at_another_offset",
        lambda s: s.adopt(_aliased(1), 4, 256, share_pools=True),
        ValueError,
        # block 1 of a swa buffer is block 0 of its kv partner, one block further in
        "share bytes (block 1 of the first and block 0 of the second)",
    ),
    (
        "adopt_unequal_counts",
        lambda s: s.adopt(
            {
                k: torch.zeros((12 if k[1] % 2 else 10, 16, 2, 8), dtype=torch.bfloat16)
                for k in SWA_KEYS + KV_KEYS
            },
            4,
            256,
            share_pools=True,
        ),
        ValueError,
        "adopt: the caches hold {'swa': 10, 'kv': 12} blocks for groups ['swa', 'kv'], which "
        "share one pool (share_pools=True)",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "fragment"), [c[1:] for c in STORAGE], ids=[c[0] for c in STORAGE]
)
def test_storage_refuses_and_stays_empty(call, exc, fragment) -> None:
    storage = CacheStorage(layout())
    with pytest.raises(exc) as info:
        call(storage)
    assert fragment in str(info.value)
    assert not storage.ready and storage.device_bytes == 0 and storage.share_pools is False
    storage.create(EQUAL, 4, 256, share_pools=True)  # a valid call still goes through
    assert storage.ready and storage.device_bytes == 10 * PAGE


def test_a_group_whose_backend_lays_out_its_own_memory_keeps_its_own_pool() -> None:
    """``share_pools`` (the default) shares where the storage lays out the bytes: a group
    served by a backend that overrides ``create_kv_cache`` is a pool of its own."""
    lay = CacheLayout(backends(_OwnLayout))
    assert lay.pool_sets == (("swa",), ("kv",))
    storage = CacheStorage(lay)
    storage.create(EQUAL, 4, 256, share_pools=True)  # the backend is asked as usual
    assert storage.device_bytes == 2 * 10 * PAGE
    manager = BlockManager(lay, EQUAL, 4, 256)
    assert manager.pool("swa") is not manager.pool("kv")


FACADE: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "controller_share_pools_str",
        lambda: CacheController(backends(), share_pools="yes"),
        TypeError,
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "block_manager_share_pools_str",
        lambda: BlockManager(layout(), EQUAL, 4, 256, share_pools="yes"),
        TypeError,
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "block_manager_unequal_counts",
        lambda: BlockManager(layout(), UNEQUAL, 4, 256, share_pools=True),
        ValueError,
        "num_blocks gives {'swa': 10, 'kv': 12} to groups ['swa', 'kv'], which share one pool",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "fragment"), [c[1:] for c in FACADE], ids=[c[0] for c in FACADE]
)
def test_constructors_refuse(call, exc, fragment) -> None:
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value)


def test_controller_refusals_leave_it_uninitialised() -> None:
    ctl = CacheController(backends(), share_pools=True)
    with pytest.raises(ValueError, match=r"num_blocks gives \{'swa': 10, 'kv': 12\}"):
        ctl.initialize_kv_cache(num_blocks=UNEQUAL, max_num_seqs=4, max_model_len=256)
    with pytest.raises(ValueError, match="share bytes"):
        ctl.adopt_kv_cache(_aliased(1), max_num_seqs=4, max_model_len=256)
    with pytest.raises(ValueError, match=r"missing \[\('key', 1\)\]"):
        ctl.adopt_kv_cache({k: v for k, v in _separate().items() if k != ("key", 1)}, 4, 256)
    assert not ctl.storage.ready and ctl.device_bytes == 0
    ctl.initialize_kv_cache(num_blocks=EQUAL, max_num_seqs=4, max_model_len=256)
    assert ctl.device_bytes == 10 * PAGE
