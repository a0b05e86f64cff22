"""The slab arena on the scheduler side: slabs move to the group that needs them, never a slab
with a block in use, and every capacity check counts as the moves then deliver.

The layout is DeepSeek-V4-tiny (four groups whose pages differ: 224,640 / 95,616 / 82,944 /
65,664 B). ``arena.check()`` asserts the module's invariants after every operation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge._checks import ArgumentError
from kvforge.core.arena import ArenaGeometry, arena_groups, plan_arena
from kvforge.core.layout import CacheLayout
from kvforge.core.values import PrefixQuery
from kvforge.errors import OutOfBlocksError
from kvforge.models import from_hf_config
from kvforge.scheduler import BlockManager
from kvforge.scheduler.arena import FREE, RESERVED, ArenaBlockPool, SlabArena

V4 = CacheLayout(from_hf_config("deepseek-v4-tiny"))


def manager(budget: int = 160 << 20, prefix: bool = True, seqs: int = 8) -> BlockManager:
    geometry = plan_arena(V4, budget)
    assert geometry is not None
    blocks = {g: geometry.num_blocks(g) for g in geometry.groups}
    return BlockManager(V4, blocks, seqs, 8192, enable_prefix_caching=prefix, arena=geometry)


def owned_by_holder(m: BlockManager) -> None:
    """Every block a request holds lies in a slab its group owns."""
    arena = m.arena
    assert arena is not None
    for p in arena.pools:
        held = m.table(p.name)
        held = held[held != 0]
        assert (arena.owner[held // p.blocks_per_slab] == p.index).all(), p.name


def keys_follow_their_blocks(m: BlockManager) -> None:
    """Every cached key names a block the cache registered under it, and a pool's evictable
    blocks are exactly its registered blocks that no request holds."""
    prefix = m._prefix
    for g in m._t.groups:
        for key, block in prefix.cached_keys(g.spec.name).items():
            assert prefix.served(g.pool, block).key == key
    for pool, _ in m._t.pools:
        known = set(prefix.registered(pool)) | prefix.waiting_blocks(pool)
        idle = {b for b in known if pool.ref_count(b) == 0}
        assert set(pool._evictable) == idle, pool.name


def two_full_swa_slabs() -> tuple[SlabArena, ArenaBlockPool, np.ndarray, np.ndarray, list]:
    """Group ``swa`` holding two whole slabs of blocks in use (the ids of the lower slab, of
    the upper), packing forced on, and the moves its pool makes heard in a list."""
    m = manager(prefix=False)  # no prefix cache: the test hears the moves itself
    arena = m.arena
    assert arena is not None
    p = arena.pool("swa")
    k = p.blocks_per_slab
    arena.prepare({p: 2 * k})
    ids = p.take(2 * k)
    s1, s2 = sorted({int(b) // k for b in ids})
    heard: list = []
    p.on_move = lambda src, dst: heard.append((src.tolist(), dst.tolist()))
    arena.packing, arena.pack_below = True, arena.geometry.num_slabs + 1
    return arena, p, ids[ids // k == s1], ids[ids // k == s2], heard


def packing_swa(settled: bool) -> tuple[SlabArena, ArenaBlockPool, int, int, list]:
    """Group ``swa`` in two slabs: slab ``s1`` with ``k - 1`` blocks in use and one cached
    block (returned), slab ``s2`` with one block in use and ``k - 1`` free slots (settled, or
    freed since the moves were last taken)."""
    arena, p, in1, in2, heard = two_full_swa_slabs()
    cached = int(in1[-1])
    p.retain(cached)
    p.release(np.concatenate([in1[-1:], in2[1:]]))
    if settled:
        assert arena.take_moves() == ()  # settles every slot
    return arena, p, int(in1[0]) // p.blocks_per_slab, cached, heard


def test_a_take_moves_a_cached_block_out_of_the_busiest_slab() -> None:
    arena, p, s1, cached, heard = packing_swa(settled=True)
    k = p.blocks_per_slab
    age = int(p.released_at[cached])
    [got] = p.take(1)
    # the take lands in the busiest slab, where the cached block was; its bytes moved to a
    # free slot of the other slab, with its age and its place in LRU order
    assert int(got) == cached and int(got) // k == s1
    [(src, [dst])] = heard
    assert src == [cached] and dst // k != s1
    assert list(p._evictable) == [dst] and int(p.released_at[dst]) == age
    assert p.live[s1] == k and p.cached[s1] == 0 and p.cached[dst // k] == 1
    [copy] = arena.take_moves()
    assert (copy.group, copy.src.tolist(), copy.dst.tolist(), copy.row) == (
        "swa",
        [cached],
        [dst],
        -1,
    )
    assert arena.moved_blocks == 1 and arena.take_moves() == ()
    arena.check()


def test_no_move_writes_a_slot_freed_since_the_moves_were_taken() -> None:
    arena, p, s1, cached, heard = packing_swa(settled=False)
    [got] = p.take(1)  # the only free slots were released in this period: no move
    assert int(got) // p.blocks_per_slab != s1 and heard == [] and arena.take_moves() == ()
    assert list(p._evictable) == [cached]
    arena.check()


def test_no_move_writes_a_slot_freed_then_evicted_since_the_moves_were_taken() -> None:
    """A block released this period (its row's clearing delta not mirrored yet) and then
    evicted by the take stays unwritable, with or without a host tier."""
    for host_tier in (False, True):
        arena, p, in1, in2, heard = two_full_swa_slabs()
        c, w, x = int(in1[-1]), int(in2[-2]), int(in2[-1])
        for b in (c, w, x):
            p.retain(b)
        if host_tier:  # a tier listens to evictions and queues offloads that read them
            p.add_eviction_listener(lambda victims: None)
        assert arena.take_moves() == ()
        for b in (x, w, c):  # least recently released first: x
            p.release([b])
        [got] = p.take(1)  # evicts x; slab s1 (k - 1 in use, c cached) is the busiest
        assert int(got) == x and heard == [] and arena.take_moves() == ()
        assert list(p._evictable) == [w, c]
        arena.check()


def test_no_move_without_pressure_or_outside_a_step() -> None:
    for packing, below in ((True, 0), (False, 10**6)):
        arena, p, s1, _cached, heard = packing_swa(settled=True)
        arena.packing, arena.pack_below = packing, below
        [got] = p.take(1)
        assert int(got) // p.blocks_per_slab != s1 and heard == []


def test_pack_below_is_one_step_of_the_hungriest_group() -> None:
    geometry = plan_arena(V4, 323_277_696)  # the prefix benchmark's quarter working set
    assert geometry is not None
    sizes = [V4.group(g).block_size for g in geometry.groups]
    arena = SlabArena(geometry, sizes)
    # c4_state: 2,048 tokens / 4 = 512 blocks, 56 per slab at this budget: 10 slabs
    assert dict(zip(geometry.groups, geometry.blocks_per_slab, strict=True))["c4_state"] == 56
    assert arena.pack_below == 10
    assert SlabArena(geometry).pack_below == 0  # without block sizes: never
    assert SlabArena(geometry, sizes, pack_tokens=4096).pack_below == 19


BAD_PACKING = [
    ({"pack_tokens": 0}, "pack_tokens must be"),
    ({"pack_tokens": "2048"}, "pack_tokens must be"),
    ({"pack_tokens": True}, "pack_tokens must be"),
    ({"block_sizes": "4"}, "block_sizes must be a sequence of ints, got str"),
    ({"block_sizes": [64, 256]}, "block_sizes has 2 sizes for the arena's 4 groups"),
    ({"block_sizes": [64, 256, 0, 8]}, "block_sizes[2] must be"),
    ({"block_sizes": [64, 256, 4.0, 8]}, "block_sizes[2] must be"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_PACKING)
def test_bad_packing_arguments_refused(kwargs, message) -> None:
    geometry = plan_arena(V4, 160 << 20)
    assert geometry is not None
    with pytest.raises(ArgumentError) as info:
        SlabArena(geometry, **kwargs)
    assert message in str(info.value), str(info.value)


def test_v4_groups_form_one_arena_and_others_do_not() -> None:
    assert arena_groups(V4) == ("swa", "compressed", "c4_state", "c128_state")
    assert arena_groups(CacheLayout(from_hf_config("gpt-oss-20b"))) == ()  # one shared pool
    assert arena_groups(CacheLayout(from_hf_config("llama-3-8b"))) == ()
    assert plan_arena(V4, 8 << 20) is None  # too few slabs to trade


def test_a_fresh_arena_owns_nothing_and_offers_every_slab() -> None:
    m = manager()
    arena = m.arena
    assert arena is not None
    g = arena.geometry
    home = arena.pools[g.home]
    assert home.name == "compressed"  # the full-history group keeps slab 0 and the tail
    assert arena.owner[0] == g.home and (arena.owner[1 : g.num_slabs] == FREE).all()
    assert arena.owner[g.num_slabs] == (g.home if g.tail_blocks else RESERVED)
    for p in arena.pools:
        pinned = g.pinned_blocks(p.name)
        assert pinned == (p.blocks_per_slab - g.home_reserved + g.tail_blocks if p is home else 0)
        assert p.own_free == pinned
        assert p.num_free == pinned + (g.num_slabs - 1) * p.blocks_per_slab
        assert m.num_free_blocks(p.name) == p.num_free
    # the home group's first ids overlap the null blocks: never handed out
    stack = home._stack[: home._num_free]
    assert stack.min() == g.home_reserved and stack.max() == home.num_blocks - 1
    arena.check()


def test_slabs_flow_from_one_group_to_another() -> None:
    m = manager(prefix=False)
    arena = m.arena
    assert arena is not None
    swa, full = arena.pool("swa"), arena.pool("compressed")
    usable = arena.geometry.num_slabs - 1
    taken = swa.take(usable * swa.blocks_per_slab)  # swa takes every slab
    pinned = arena.geometry.pinned_blocks("compressed")  # slab 0 and the tail stay
    assert swa.num_owned_slabs == usable and full.num_free == pinned
    arena.check()
    with pytest.raises(
        OutOfBlocksError, match=f"'compressed' needs {pinned + 1} free blocks but has {pinned}"
    ):
        full.take(pinned + 1)
    arena.check()
    full.release(full.take(pinned))  # its own blocks, no slab moves
    assert arena.moves == 0
    swa.release(taken[: swa.blocks_per_slab])  # one slab's blocks, wherever they lie
    arena.check()
    idle = len(arena.idle_slabs(swa))
    assert full.num_free == pinned + idle * full.blocks_per_slab
    if idle:
        got = full.take(pinned + full.blocks_per_slab)
        assert full.num_owned_slabs == 1 + 2 and arena.moves == 1  # slab 0, the tail
        assert (arena.owner[got // full.blocks_per_slab] == full.index).all()
        arena.check()


def test_a_refused_joint_need_changes_nothing() -> None:
    m = manager(prefix=False)
    arena = m.arena
    assert arena is not None
    before = arena.owner.copy()
    usable = arena.geometry.num_slabs - 1
    home = arena.pools[1]
    needs = {p: usable * p.blocks_per_slab for p in arena.pools[:2]}
    needs[home] += arena.geometry.pinned_blocks(home.name)  # every usable slab, both
    assert not arena.fits(needs)
    name, need, have = arena.shortfall(needs)
    assert (name, need) == ("swa", usable * arena.pools[0].blocks_per_slab)
    # what swa could get once compressed took its slabs: none, so need > have
    assert have == 0
    with pytest.raises(OutOfBlocksError, match="nothing was allocated"):
        arena.prepare(needs)
    assert (arena.owner == before).all()
    arena.check()


def test_cached_blocks_of_an_idle_slab_are_evicted_when_it_moves() -> None:
    m = manager(budget=64 << 20, prefix=True)
    arena = m.arena
    assert arena is not None
    tokens = list(range(1, 1 + 512))
    [match] = m.lookup([PrefixQuery(tokens)])
    step = m.schedule(["a"], [len(tokens)], [tokens], [match])
    m.end_step(step)
    m.finish(["a"])
    cached = {p.name: p.num_evictable for p in arena.pools}
    assert all(cached.values())
    # swa takes everything: the other groups' idle slabs move, their cached blocks go
    swa = arena.pool("swa")
    swa.take(swa.num_free)
    assert arena.spare_slabs(exclude=swa) == 0
    g = arena.geometry
    for p in arena.pools[1:]:
        if p.index == g.home:  # slab 0 and the tail stay, with what they cache
            assert p.num_owned_slabs == 2 and (p.cached[1 : g.num_slabs] == 0).all()
        else:
            assert p.num_evictable == 0 and p.num_owned_slabs == 0
    assert sum(m.prefix_stats.evictions.values()) > 0  # the prefix cache heard of each
    [again] = m.lookup([PrefixQuery(tokens)])
    assert again.num_tokens == 0
    arena.check()


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["new", "grow", "finish"]), st.integers(0, 7), st.integers(1, 600)
        ),
        min_size=1,
        max_size=40,
    ),
    budget=st.sampled_from([48 << 20, 96 << 20, 200 << 20]),
    pack=st.booleans(),
)
def test_random_steps_keep_the_arena_invariants(ops, budget, pack) -> None:
    m = manager(budget=budget, prefix=True)
    arena = m.arena
    assert arena is not None
    if pack:  # every step's takes move cached blocks, whatever the pressure
        arena.pack_below = arena.geometry.num_slabs + 1
    prompts = {i: [1 + (i % 3)] * 200 + list(range(i * 1000, i * 1000 + 400)) for i in range(8)}
    live: set[str] = set()
    for op, i, n in ops:
        rid = f"r{i}"
        if op == "new" and rid not in live:
            tokens = prompts[i][: 64 + n % 500]
            [match] = m.lookup([PrefixQuery(tokens)])
            step = m.schedule([rid], [len(tokens)], [tokens], [match])
            if rid in step.request_ids:
                live.add(rid)
            m.end_step(step)
        elif op == "grow" and rid in live:
            step = m.schedule([rid], [1 + n % 64], [[7] * (1 + n % 64)])
            m.end_step(step)
        elif op == "finish" and rid in live:
            m.finish([rid])
            live.discard(rid)
        arena.check()
        owned_by_holder(m)
        keys_follow_their_blocks(m)
        for copy in arena.take_moves():  # as the step's moves, drained again: none left
            raise AssertionError(f"moves outside a step: {copy}")
    m.finish(sorted(live))
    arena.check()
    assert all(p.num_used == 0 for p in arena.pools)


BAD_ARENAS = [
    ("not a geometry", TypeError, "arena must be an ArenaGeometry or None, got str"),
]


@pytest.mark.parametrize(("arena", "error", "message"), BAD_ARENAS)
def test_bad_arena_refused(arena, error, message) -> None:
    with pytest.raises(error, match=message):
        BlockManager(V4, {g.name: 9 for g in V4.groups}, 4, 8192, arena=arena)


def test_arena_counts_must_match_and_pools_must_be_shared() -> None:
    geometry = plan_arena(V4, 160 << 20)
    assert isinstance(geometry, ArenaGeometry)
    blocks = {g: geometry.num_blocks(g) for g in geometry.groups}
    with pytest.raises(ValueError, match="arena needs share_pools=True"):
        BlockManager(V4, blocks, 4, 8192, share_pools=False, arena=geometry)
    wrong = dict(blocks, swa=blocks["swa"] - 1)
    with pytest.raises(ValueError, match=r"num_blocks gives .* to arena group 'swa'; its arena"):
        BlockManager(V4, wrong, 4, 8192, arena=geometry)


def test_slab_arena_repr_and_pool_lookup() -> None:
    arena = SlabArena(plan_arena(V4, 160 << 20))
    assert arena.pool("c4_state").name == "c4_state"
    assert "slabs" in repr(arena) and "slabs of" in repr(arena.pool("swa"))
    with pytest.raises(ValueError, match="group 'kv' is not in the arena"):
        arena.pool("kv")
    assert np.all(arena.owner[1 : arena.geometry.num_slabs] == FREE)
