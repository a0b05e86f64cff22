"""The host tier's scheduler side (``kvforge.scheduler.host_tier``): demotion queues an offload
and keeps the exact check's record alive, lookups reach across held spans all or nothing,
onloads pin their pages until handed out, the least recently used page goes when the pool is
full (a shorter hit), per-request snapshots are skipped under the default ``snapshot_policy``
(``"aligned"`` is tested in ``test_state_snapshots_tier.py``), and bad inputs change nothing."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvforge._checks import ArgumentError
from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher
from kvforge.core.values import PageCopy
from kvforge.scheduler.host_tier import HostTier, check_host_tier_policy
from kvforge.scheduler.unit_records import UnitRecordStore

UNIT = 16


def chain(n_units: int, salt: str = "t") -> tuple[PrefixHasher, list[bytes]]:
    h = PrefixHasher(ExtraKeys(cache_salt=salt), unit=UNIT)
    keys = h.extend(np.arange(n_units * UNIT, dtype=np.int64))
    return h, keys


def held_chain(store: UnitRecordStore, n_units: int) -> list[bytes]:
    """Keys of ``n_units`` units whose records ``store`` holds once per unit end (as the
    device prefix cache holds them for its blocks); the request's cursor is let go."""
    h, keys = chain(n_units)
    held = store.hold(h.unit_records(), at=[UNIT * (i + 1) for i in range(n_units)])
    store.release(held.cursor)
    assert held.keys == keys
    return keys


def tier(pages: int = 5, **kw) -> tuple[HostTier, UnitRecordStore]:
    store = UnitRecordStore()
    return HostTier({"kv": pages, "swa": pages, "state": 3}, store, {"state"}, **kw), store


def snapshot(t: HostTier) -> object:
    return (
        copy.deepcopy(t._index),
        copy.deepcopy(t._pages),
        copy.deepcopy(t._offloads),
        copy.deepcopy(t._onloads),
        {g: (p.num_free, p.num_evictable, p.ref_counts.tolist()) for g, p in t._pools.items()},
        copy.deepcopy(t.stats),
    )


def records(store: UnitRecordStore) -> dict[bytes, int]:
    return {k: n.count for k, n in store._records.items()}


# ------------------------------------------------------------------ demotion, offloads


def test_demotion_queues_one_offload_per_group_and_keeps_the_record():
    t, store = tier()
    keys = held_chain(store, 3)
    pages = [t.demote("kv", k, UNIT * (i + 1), 10 + i, ref=k) for i, k in enumerate(keys)]
    assert pages == [1, 2, 3]
    assert t.demote("swa", keys[2], 3 * UNIT, 7, ref=None) == 1
    # the record references moved to the pages: nothing was released
    assert all(store.refcount(k) >= 1 for k in keys)
    assert store.confirm(chain(3)[0].unit_records()) == 3
    # pinned until handed out: nothing is evictable yet
    assert t.pool("kv").num_evictable == 0
    offloads = t.take_offloads()
    assert [c.group for c in offloads] == ["kv", "swa"]
    assert isinstance(offloads[0], PageCopy)
    assert offloads[0].device_blocks.tolist() == [10, 11, 12]
    assert offloads[0].host_pages.tolist() == [1, 2, 3]
    assert offloads[0].device_blocks.dtype == np.int32 == offloads[0].host_pages.dtype
    assert t.take_offloads() == ()
    assert t.pool("kv").num_evictable == 3
    assert t.stats.demotions == {"kv": 3, "swa": 1}
    assert t.entry("kv", keys[1]) == (2 * UNIT, keys[1], None)
    assert len(t) == 4


def test_a_repeated_key_keeps_its_page_and_lets_the_new_reference_go():
    t, store = tier()
    [k] = held_chain(store, 1)
    assert t.demote("kv", k, UNIT, 4, ref=k) == 1
    t.take_offloads()
    store.hold(chain(1)[0].unit_records(), at=[UNIT])  # a second copy's reference
    before = store.refcount(k)
    assert t.demote("kv", k, UNIT, 5, ref=k) == 1
    assert store.refcount(k) == before - 1
    assert t.take_offloads() == ()  # no copy: the page holds these bytes already
    assert t.stats.repeats == {"kv": 1}


def test_per_request_snapshots_are_skipped_and_release_their_record():
    t, store = tier()
    [k] = held_chain(store, 1)
    assert t.demote("state", k, UNIT, 2, ref=k) is None
    assert k not in store  # the only reference went
    assert t.stats.skipped == {"state": 1}
    assert t.take_offloads() == ()
    assert t.reach([{"kv": [], "state": [k]}]) == 0  # a span needing a snapshot: not held


# ------------------------------------------------------------------ LRU, a shorter hit


def test_a_full_pool_evicts_the_least_recently_used_page_and_its_record():
    t, store = tier(pages=3)  # 2 usable pages
    keys = held_chain(store, 3)
    t.demote("kv", keys[0], UNIT, 10, ref=keys[0])
    t.demote("kv", keys[1], 2 * UNIT, 11, ref=keys[1])
    t.take_offloads()
    spans = [{"kv": [k]} for k in keys]
    assert t.reach(spans) == 2
    # a third demotion evicts the first demoted page (the device pool's eviction order)
    assert t.demote("kv", keys[2], 3 * UNIT, 12, ref=keys[2]) == 1
    assert t.page_of("kv", keys[0]) is None and t.entry("kv", keys[0]) is None
    assert t.stats.evictions == {"kv": 1}
    assert t.reach(spans) == 0  # the first span is gone: the hit is shorter, never wrong
    assert t.reach(spans[1:]) == 2
    # the evicted page's record reference went; units 2 and 3 still hang off unit 1
    assert store.refcount(keys[0]) == 1 and store.refcount(keys[2]) == 1


def test_an_onload_touches_its_pages_so_others_go_first():
    t, store = tier(pages=3)
    keys = held_chain(store, 3)
    t.demote("kv", keys[0], UNIT, 10, ref=keys[0])
    t.demote("kv", keys[1], 2 * UNIT, 11, ref=keys[1])
    t.take_offloads()
    t.onload({"kv": ([keys[0]], [20])})
    t.take_onloads()
    t.demote("kv", keys[2], 3 * UNIT, 12, ref=keys[2])
    assert t.page_of("kv", keys[0]) == 1 and t.page_of("kv", keys[1]) is None


def test_every_page_pinned_drops_the_demotion():
    t, store = tier(pages=2)  # one usable page
    keys = held_chain(store, 2)
    assert t.demote("kv", keys[0], UNIT, 10, ref=keys[0]) == 1
    assert t.demote("kv", keys[1], 2 * UNIT, 11, ref=keys[1]) is None  # page 1 is pinned
    assert t.stats.dropped == {"kv": 1}
    assert t.page_of("kv", keys[1]) is None
    assert [c.host_pages.tolist() for c in t.take_offloads()] == [[1]]


def test_an_onload_pins_its_pages_until_handed_out():
    t, store = tier(pages=2)
    keys = held_chain(store, 2)
    t.demote("kv", keys[0], UNIT, 10, ref=keys[0])
    t.take_offloads()
    assert t.onload({"kv": ([keys[0]], np.array([30]))}) == {"kv": [1]}
    assert t.demote("kv", keys[1], 2 * UNIT, 11, ref=keys[1]) is None  # pinned: not evicted
    [c] = t.take_onloads()
    assert (c.group, c.device_blocks.tolist(), c.host_pages.tolist()) == ("kv", [30], [1])
    assert t.stats.hits == {"kv": 1}
    assert t.pool("kv").num_evictable == 1


def test_reach_is_all_or_nothing_per_span():
    t, store = tier()
    keys = held_chain(store, 4)
    for i, k in enumerate(keys):
        t.demote("kv", k, UNIT * (i + 1), 10 + i, ref=k)
    t.demote("swa", keys[1], 2 * UNIT, 3)  # the window tail at boundary 2 only
    spans = [
        {"kv": keys[0:2], "swa": [keys[1]]},  # boundary 2: full chain span + window tail
        {"kv": keys[2:4], "swa": [keys[3]]},  # boundary 4: the tail is not held
    ]
    assert t.reach(spans) == 1
    assert t.reach([]) == 0


def test_reset_forgets_every_page_and_drops_queued_copies():
    t, store = tier()
    keys = held_chain(store, 2)
    t.demote("kv", keys[0], UNIT, 10, ref=keys[0])
    t.take_offloads()
    t.onload({"kv": ([keys[0]], [20])})
    t.demote("kv", keys[1], 2 * UNIT, 11, ref=keys[1])  # pinned: its offload is queued
    assert t.reset() == 2
    assert len(t) == 0 and not store.num_records
    # nothing to copy; the released pages ride in one copy, so the worker's record frees them
    [release] = t.take_offloads()
    assert not len(release.device_blocks) and release.released.tolist() == [1, 2]
    assert t.take_onloads() == () and t.take_offloads() == ()
    assert t.pool("kv").num_free == t.pool("kv").num_usable
    assert t.demote("kv", keys[1], 2 * UNIT, 11) is not None  # block 11 is free to queue again


# ------------------------------------------------------------------ bad inputs

K = b"k" * 32

BAD_DEMOTIONS = [
    (("nope", K, 16, 3), ArgumentError, "group 'nope' has no host tier pages"),
    ((7, K, 16, 3), ArgumentError, "group 7 has no host tier pages"),
    (("kv", "k", 16, 3), ArgumentError, "key must be non-empty bytes"),
    (("kv", b"", 16, 3), ArgumentError, "key must be non-empty bytes"),
    (("kv", K, 0, 3), ArgumentError, "end must be an int >= 1, got 0"),
    (("kv", K, True, 3), ArgumentError, "end must be an int >= 1, got True"),
    (("kv", K, 16, 0), ArgumentError, "device_block must be an int >= 1, got 0"),
    (("kv", K, 16, 2.0), ArgumentError, "device_block must be an int >= 1, got 2.0"),
    (("kv", K, 16, 9), ArgumentError, "device block 9 of group 'kv' has an offload queued"),
]


@pytest.mark.parametrize(("args", "error", "message"), BAD_DEMOTIONS)
def test_a_bad_demotion_changes_nothing(args, error, message):
    t, _ = tier()
    t.demote("kv", b"q" * 32, 16, 9)  # queued: block 9 may not be demoted again yet
    before = snapshot(t)
    with pytest.raises(error, match=message):
        t.demote(*args)
    assert snapshot(t) == before


def test_a_bad_proof_changes_nothing():
    t, _ = tier()
    before = snapshot(t)
    with pytest.raises(ArgumentError, match="proof must be None or three bytes"):
        t.demote("kv", K, 16, 3, proof=(b"a", b"b"))
    assert snapshot(t) == before


BAD_ONLOADS = [
    ({"nope": ([K], [3])}, ArgumentError, "group 'nope' has no host tier pages"),
    ({"kv": [K]}, ArgumentError, r"targets\['kv'\] must be \(keys, device blocks\)"),
    ({"kv": ([K], [3, 4])}, ArgumentError, "names 1 keys and 2 device blocks"),
    ({"kv": ([K, K], [3, 3])}, ArgumentError, "names a device block twice"),
    ({"kv": ([K], [0])}, ArgumentError, "device block ids >= 1, got 0"),
    ({"kv": ([K], [[3]])}, ArgumentError, "must be a 1-d sequence of ints"),
    ({"kv": ([K], ["3"])}, ArgumentError, "must be a 1-d sequence of ints"),
    # all or nothing: the held kv key is not onloaded when the swa key is missing
    ({"kv": ([K], [3]), "swa": ([b"x" * 32], [4])}, KeyError, "group 'swa' holds no page"),
]


@pytest.mark.parametrize(("targets", "error", "message"), BAD_ONLOADS)
def test_a_bad_onload_changes_nothing(targets, error, message):
    t, _ = tier()
    t.demote("kv", K, 16, 9)
    t.take_offloads()
    before = snapshot(t)
    with pytest.raises(error, match=message):
        t.onload(targets)
    assert snapshot(t) == before


BAD_TIERS = [
    ({}, {}, "num_pages must be a non-empty mapping"),
    ([("kv", 4)], {}, "num_pages must be a non-empty mapping"),
    ({"kv": 1}, {}, r"num_pages\['kv'\] must be an int >= 2"),
    ({"kv": True}, {}, r"num_pages\['kv'\] must be an int >= 2"),
    ({"": 4}, {}, "group names are non-empty str"),
    ({"kv": 4}, {"policy": "lazy"}, "host_tier_policy must be 'eviction' or 'write_through'"),
    (
        {"kv": 4},
        {"snapshot_policy": "store"},
        "snapshot_policy must be 'skip' or 'aligned', got 'store'",
    ),
    ({"kv": 4}, {"snapshot_policy": None}, "snapshot_policy must be 'skip' or 'aligned', got None"),
]


@pytest.mark.parametrize(("num_pages", "kw", "message"), BAD_TIERS)
def test_bad_settings_are_refused(num_pages, kw, message):
    with pytest.raises(ArgumentError, match=message):
        HostTier(num_pages, UnitRecordStore(), **kw)


def test_records_must_be_a_store_and_spans_mappings():
    with pytest.raises(ArgumentError, match="records must be a UnitRecordStore"):
        HostTier({"kv": 4}, {})  # type: ignore[arg-type]
    t, _ = tier()
    with pytest.raises(ArgumentError, match=r"spans\[0\] must be a mapping"):
        t.reach([[K]])  # type: ignore[list-item]
    with pytest.raises(ArgumentError, match="group 'nope' has no host tier pages"):
        t.reach([{"kv": [K]}, {"nope": [K]}])


def test_policies():
    assert check_host_tier_policy("eviction") == "eviction"
    assert tier(policy="write_through")[0].policy == "write_through"
    assert tier()[0].policy == "eviction"
    assert repr(tier()[0]).startswith("HostTier(eviction, skip")
    assert tier(snapshot_policy="aligned")[0].snapshot_policy == "aligned"


# ------------------------------------------------------------------ wired to a BlockManager


def manager(num_blocks: int = 10, prefix: bool = True):
    from kvforge import GQABackend
    from kvforge.core.layout import CacheLayout
    from kvforge.scheduler import BlockManager

    lay = CacheLayout({0: GQABackend(2, 8, block_size=16)})
    return BlockManager(lay, {"kv": num_blocks}, max_num_seqs=2, enable_prefix_caching=prefix)


def test_evictions_demote_and_the_next_step_carries_the_offloads():
    from kvforge.scheduler import host_tier

    m = manager()
    t = host_tier.attach(m, {"kv": 16})
    assert m.host_tier is t
    a = m.schedule(["a"], [64], new_token_ids=[np.arange(64)])
    assert a.offloads == ()
    m.end_step(a)
    m.finish(["a"])
    cached = {b: k for b, (k, _, _) in m.registered_blocks("kv").items()}
    assert len(cached) == 4
    b = m.schedule(["b"], [128], new_token_ids=[np.arange(100, 228)])  # 8 blocks: 3 evicted
    [off] = b.offloads
    assert off.group == "kv" and len(off.device_blocks) == 3
    for block, page in zip(off.device_blocks.tolist(), off.host_pages.tolist(), strict=True):
        assert t.page_of("kv", cached[block]) == page
    # the deepest blocks go first; the pages keep the chain's records alive
    assert t.page_of("kv", cached[min(cached)]) is None
    assert m.take_tier_offloads() == ()
    m.end_step(b)
    m.finish(["b"])
    assert m.reset_prefix_cache() > 0
    assert len(t) == 0


def test_evictions_outside_a_step_are_handed_out_by_take_offloads():
    from kvforge.core.values import PrefixQuery
    from kvforge.scheduler import host_tier

    m = manager(num_blocks=6)  # 5 usable blocks
    t = host_tier.attach(m, {"kv": 16})
    for rid, toks in (("z", np.arange(900, 932)), ("a", np.arange(40))):
        step = m.schedule([rid], [len(toks)], new_token_ids=[toks])
        m.end_step(step)
        m.finish([rid])  # z: 2 cached blocks; a: 2 cached, 1 free
    for rid in ("c", "d"):  # both share a's 2 cached blocks
        [match] = m.lookup([PrefixQuery(np.arange(40))])
        assert match.num_tokens == 32
        step = m.schedule([rid], [8], new_token_ids=[np.arange(32, 40)], prefix_matches=[match])
        m.end_step(step)
    # d's block evicted z's deepest: the step carried it
    assert [x.device_blocks.tolist() for x in step.offloads] == [[2]]
    # c's truncation copies its shared block on write: the fresh block evicts z's root,
    # outside any step
    m.truncate("c", 24)
    [off] = m.take_tier_offloads()
    assert off.device_blocks.tolist() == [1] and len(m.take_copies()) == 1
    assert m.take_tier_offloads() == ()
    assert len(t) == 2 == sum(t.stats.demotions.values())


BAD_ATTACH = [
    (dict(prefix=False), {"kv": 4}, {}, RuntimeError, "enable prefix caching"),
    ({}, {"nope": 4}, {}, ArgumentError, r"num_pages names groups \['nope'\]"),
    ({}, {"kv": 1}, {}, ArgumentError, r"num_pages\['kv'\] must be an int >= 2"),
    ({}, {"kv": 4}, {"policy": "lazy"}, ArgumentError, "host_tier_policy must be"),
    (
        {},
        {"kv": 4},
        {"snapshot_policy": "lazy"},
        ArgumentError,
        "snapshot_policy must be 'skip' or",
    ),
]


@pytest.mark.parametrize(("mkw", "num_pages", "kw", "error", "message"), BAD_ATTACH)
def test_a_bad_attach_changes_nothing(mkw, num_pages, kw, error, message):
    from kvforge.scheduler import host_tier

    m = manager(**mkw)
    hook = m.pool("kv").on_evict
    with pytest.raises(error, match=message):
        host_tier.attach(m, num_pages, **kw)
    assert m.host_tier is None and m.pool("kv").on_evict is hook
    assert not m.pool("kv").has_eviction_listeners and m.prefix_cache.on_store is None


def test_attach_once():
    from kvforge.scheduler import host_tier

    m = manager()
    host_tier.attach(m, {"kv": 4})
    with pytest.raises(RuntimeError, match="has a host tier already"):
        host_tier.attach(m, {"kv": 4})


def test_retain_takes_one_more_reference_on_a_held_record():
    store = UnitRecordStore()
    [k] = held_chain(store, 1)
    before = store.refcount(k)
    store.retain(k)
    assert store.refcount(k) == before + 1
    with pytest.raises(KeyError, match="retain"):
        store.retain(b"x" * 32)
    with pytest.raises(KeyError, match="retain"):
        store.retain("k")  # type: ignore[arg-type]


def test_write_through_demotes_each_block_when_it_completes_and_keeps_it_cached():
    from kvforge.core.values import PrefixQuery
    from kvforge.scheduler import host_tier

    m = manager(num_blocks=10)
    tier = host_tier.attach(m, {"kv": 8}, policy="write_through")
    tokens = list(range(1, 50))  # 3 full blocks of 16
    [match] = m.lookup([PrefixQuery(tokens)])
    m.end_step(m.schedule(["a"], [len(tokens)], [tokens], [match]))
    assert sum(tier.stats.demotions.values()) == 3 and len(tier) == 3
    [copy] = m.take_tier_offloads()  # copied now, while the device still serves them
    assert copy.group == "kv" and len(copy.device_blocks) == 3
    assert sum(m.prefix_stats.evictions.values()) == 0
    m.finish(["a"])
    [again] = m.lookup([PrefixQuery([*tokens, 9])])
    assert again.num_tokens == 48  # from the device: nothing was brought back
    assert not tier.pending_blocks and not tier.stats.hits
    # evicting them later costs no second copy: the keys are held already
