"""Lookups that read the host tier (``kvforge.scheduler.prefix.host_lookup``): a prefix the device
evicted comes back from host tier pages byte for byte, for a GQA model with a window and for
DeepSeek-V4 in its slab arena; the device blocks it lands in are held until their onloads
are handed out; a device with no room brings back nothing; a reset drops what is queued."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge import CacheController, GQABackend
from kvforge.core.values import PrefixQuery
from kvforge.models import from_hf_config
from kvforge.verify import token_seeds, verify_request, write_step


def gqa(num_blocks: int = 24, pages: int | None = 64, **kw) -> CacheController:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True, **kw)
    ctl.initialize_kv_cache(num_blocks=num_blocks, max_num_seqs=2, max_model_len=512)
    if pages is not None:
        ctl.initialize_host_tier(num_pages=pages)
    return ctl


def v4(pages: int | None = 4096) -> CacheController:
    ctl = CacheController(from_hf_config("deepseek-v4-tiny"), enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        memory_budget=64 << 20, max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=512
    )
    assert ctl.storage.arena is not None
    if pages is not None:
        ctl.initialize_host_tier(num_pages=pages)
    return ctl


def run(ctl: CacheController, rid: str, toks: np.ndarray, chunk: int, match=None) -> None:
    """Prefill ``toks`` (after ``match``'s tokens) in chunks, writing every token's bytes."""
    seeds = token_seeds(toks)
    done = match.num_tokens if match is not None else 0
    while done < len(toks):
        n = min(chunk, len(toks) - done)
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[toks[done : done + n]],
            prefix_matches=[match] if match is not None and done == match.num_tokens else None,
        )
        assert not step.allocation.refused, step.allocation.refused
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done += n


def evict_with_others(ctl: CacheController, n: int, length: int, chunk: int) -> None:
    rng = np.random.default_rng(1)
    for i in range(n):
        run(ctl, f"other{i}", rng.integers(40_000, 50_000, length), chunk)
        ctl.free_request(f"other{i}")


CASES = [
    # (controller, prompt length, chunk, evicting prompts, the longest hit: the last
    # boundary (16 tokens, 256 for V4) before the prompt's last token)
    pytest.param(gqa, 200, 64, 3, 192, id="gqa-window"),
    pytest.param(v4, 1536, 512, 6, 1280, id="deepseek-v4-tiny-arena"),
]


@pytest.mark.parametrize(("make", "length", "chunk", "others", "longest"), CASES)
@pytest.mark.slow
def test_an_evicted_prefix_comes_back_from_the_host_byte_for_byte(
    make, length, chunk, others, longest
):
    toks = np.random.default_rng(0).integers(1, 30_000, length)
    results = {}
    for tiered in (False, True):
        ctl = make() if tiered else make(pages=None)
        run(ctl, "a", toks, chunk)
        ctl.free_request("a")
        evict_with_others(ctl, others, length, chunk)
        [match] = ctl.lookup([PrefixQuery(toks)])
        results[tiered] = match.num_tokens
        if not tiered:
            continue
        tier = ctl.host_tier
        assert sum(tier.stats.hits.values()) > 0 and tier.stats.hit_tokens > 0
        # what the device held alone, plus what the host brought back
        assert match.num_tokens - tier.stats.hit_tokens == results[False]
        run(ctl, "b", toks, chunk, match)  # the step runs the onloads before its kernels
        check = verify_request(ctl, "b", token_seeds(toks))
        assert check.entries > 0 and check.mismatched == 0
        assert not tier.pending_blocks
    assert results[True] == longest > results[False]


def demoted_prompt() -> tuple[CacheController, np.ndarray]:
    """A controller whose host tier holds the blocks of a 160-token prompt that others
    evicted from the device (request ``a`` cached it, then finished)."""
    ctl = gqa()
    toks = np.arange(1, 161)
    run(ctl, "a", toks, 64)
    ctl.free_request("a")
    evict_with_others(ctl, 3, 160, 64)
    return ctl, toks


def test_brought_back_blocks_are_held_until_their_onloads_are_handed_out():
    ctl, toks = demoted_prompt()
    manager = ctl.scheduler
    [match] = ctl.lookup([PrefixQuery(toks)])
    tier = ctl.host_tier
    assert match.num_tokens == 144 and tier.pending_blocks
    for pool, blocks in tier.pending_blocks:
        assert all(pool.ref_count(int(b)) == 1 for b in blocks)  # nothing can evict them
    held = [(pool, blocks.copy()) for pool, blocks in tier.pending_blocks]
    run(ctl, "b", toks, 64, match)
    assert not tier.pending_blocks
    ctl.free_request("b")
    for pool, blocks in held:  # cached now, evictable once no request holds them
        assert all(pool.ref_count(int(b)) == 0 for b in blocks)
    assert manager.cached_block("kv", match.keys["kv"][0]) is not None


def test_a_device_with_no_room_brings_nothing_back():
    ctl = gqa(num_blocks=24)
    toks = np.arange(1, 161)
    run(ctl, "a", toks, 64)
    ctl.free_request("a")
    evict_with_others(ctl, 3, 160, 64)
    hog = np.random.default_rng(5).integers(60_000, 70_000, 512)
    seeds, done = token_seeds(hog), 0
    while True:  # grows until it holds every block the device has left
        step = ctl.schedule(["hog"], [16], new_token_ids=[hog[done : done + 16]])
        if step.allocation.refused:
            break
        write_step(ctl, step, {"hog": seeds})
        ctl.end_step(step)
        done += 16
    assert ctl.scheduler.num_free_blocks("kv") < 16 // 16 + 1
    [match] = ctl.lookup([PrefixQuery(toks)])
    tier = ctl.host_tier
    assert not tier.pending_blocks and tier.stats.hit_tokens == 0
    assert match.num_tokens == 0


def test_a_reset_drops_queued_onloads_and_their_keys():
    ctl, toks = demoted_prompt()
    [match] = ctl.lookup([PrefixQuery(toks)])
    tier = ctl.host_tier
    assert tier.pending_blocks
    free_before = ctl.scheduler.num_free_blocks("kv")
    ctl.scheduler.reset_prefix_cache()
    assert not tier.pending_blocks and len(tier) == 0
    assert ctl.scheduler.num_free_blocks("kv") > free_before
    [again] = ctl.lookup([PrefixQuery(toks)])
    assert again.num_tokens == 0
    # the stale match is refused, never served from blocks whose bytes never arrived
    step = ctl.schedule(["b"], [16], new_token_ids=[toks[144:160]], prefix_matches=[match])
    assert step.allocation.refused


def test_reset_host_tier_forgets_the_device_keys_of_the_onloads_it_drops():
    # a lookup keyed device blocks whose bytes come with its queued onloads; dropping those
    # onloads (reset_host_tier keeps the device prefix cache) must drop those keys too
    ctl, toks = demoted_prompt()
    m = ctl.scheduler
    kept = {g: dict(m.prefix_cache.cached_keys(g)) for g in m.groups}  # on the device
    [match] = ctl.lookup([PrefixQuery(toks)])
    tier = ctl.host_tier
    pending = {int(b) for _, blocks in tier.pending_blocks for b in blocks}
    assert pending and match.num_tokens == 144  # (the last token is always computed)
    free_before = m.num_free_blocks("kv")
    assert m.reset_host_tier() > 0
    assert not tier.pending_blocks and len(tier) == 0
    for g in m.groups:  # every key left names a block whose bytes are on the device
        keys = m.prefix_cache.cached_keys(g)
        assert not set(keys.values()) & pending, g
        assert all(kept[g].get(k) == b for k, b in keys.items()), g
    assert m.num_free_blocks("kv") > free_before
    [again] = ctl.lookup([PrefixQuery(toks)])
    assert again.num_tokens < match.num_tokens
    step = ctl.schedule(["b"], [16], new_token_ids=[toks[144:160]], prefix_matches=[match])
    assert step.allocation.refused  # the stale match is refused, never served


def nothing_held(m) -> None:
    """No device block and no host page is held (no request runs, no onload is queued),
    every block and page is free or cached exactly once, and every key names a block or a
    page its pool retains."""
    tier = m.host_tier
    pools = {id(m.pool(g)): m.pool(g) for g in m.groups} | {
        id(tier.pool(g)): tier.pool(g) for g in tier.groups
    }
    for pool in pools.values():
        assert not pool.ref_counts.any(), pool
        free, idle = pool._stack[: pool._num_free].tolist(), list(pool._evictable)
        if m.arena is not None and pool in m.arena.pools:  # its owned slabs' ids only
            assert len(set(free + idle)) == len(free + idle), pool
        else:
            assert sorted(free + idle) == list(range(1, pool.num_blocks)), pool
    if m.arena is not None:
        m.arena.check()  # every owned slab's ids free, cached or in use
    for g in m.groups:
        for block in m.prefix_cache.cached_keys(g).values():
            assert m.pool(g).is_retained(block), (g, block)
    for g in tier.groups:
        for page in tier._index[g].values():
            assert tier.pool(g).is_retained(page), (g, page)


def _demoted(make, length: int, chunk: int, others: int):
    """The scheduler side of a controller whose host tier holds the blocks of a prompt of
    ``length`` tokens that others evicted from the device, and the prompt."""
    ctl = make()
    toks = np.random.default_rng(0).integers(1, 30_000, length)
    run(ctl, "a", toks, chunk)
    ctl.free_request("a")
    evict_with_others(ctl, others, length, chunk)
    return ctl.scheduler, toks


@pytest.mark.slow
@pytest.mark.parametrize(("make", "length", "chunk", "others", "longest"), CASES)
def test_a_lookup_struck_at_any_line_of_the_bring_back_holds_nothing_after(
    make, length, chunk, others, longest
):
    """A lookup that brings blocks back from the host tier, cut short at any line of the
    bring-back (the device part's pins, the pages' pins, the takes, an arena's slabs, the
    queueing and the registrations): once the onloads queued are handed out, no block or
    page is held; the next lookup brings the prefix back. Before, blocks taken or pages
    pinned before the onloads were queued stayed held for good."""
    import copy
    import threading

    from _helpers import sweep_checks

    from kvforge.scheduler.prefix import host_lookup

    base, toks = _demoted(make, length, chunk, others)
    query = [PrefixQuery(toks)]
    lookup = lambda m: m.lookup(query)  # noqa: E731

    def build():
        return copy.deepcopy(base, {id(base._lock): threading.RLock()})

    def check(m, struck_at) -> None:
        m.take_effects()  # the onloads queued are handed out: their blocks released
        nothing_held(m)
        [match] = m.lookup(query)
        assert match.num_tokens == longest, struck_at
        m.take_effects()
        nothing_held(m)
        # every key and page goes, each unit record reference released once (a second
        # release raises); a reference a demotion cut short kept stays (docs/robustness.md)
        m.reset_prefix_cache()

    whole = build()
    [match] = lookup(whole)
    assert match.num_tokens == longest and whole.host_tier.pending_blocks
    check(whole, None)
    only = {
        f.__qualname__
        for f in vars(host_lookup).values()
        if callable(f) and getattr(f, "__module__", "") == host_lookup.__name__
    } | {
        "BlockPool.share",
        "BlockPool.take",
        "ArenaBlockPool.take",
        "SlabArena.prepare",
        "SlabArena._move",
        "BlockPool._release",
        "BlockPool.release",
        "BlockPool.put_back",
        "BlockPool.restore_counts",
        "ArenaBlockPool.restore_counts",
        "HostTier.pin",
        "HostTier.restore_pins",
        "HostTier.hold_for_onloads",
        "HostTier.hold_for_onloads.<locals>.hand_over",
        "PrefixCache.register",
        "PrefixIndex.store",
        "UnitRecordStore.retain",
    }
    lines: list = []
    assert sweep_checks(build, lookup, check, lines=lines, only=only) > 50
    assert {"_restore", "_pin_and_take", "_queue"} <= {q for q, _ in lines}
