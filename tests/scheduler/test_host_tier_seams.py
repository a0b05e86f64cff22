"""The declared seams between the block manager, its pools and the host tier: eviction
listeners on :class:`BlockPool` (in order, before the keeper forgets the victims), and
:meth:`BlockManager.attach_host_tier` (checked in full, all or nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge import GQABackend, LinearAttentionBackend
from kvforge._checks import ArgumentError
from kvforge.core.layout import CacheLayout
from kvforge.scheduler import BlockManager, host_tier
from kvforge.scheduler.block_pool import BlockPool
from kvforge.scheduler.host_tier import HostTier
from kvforge.scheduler.unit_records import UnitRecordStore

# ------------------------------------------------------------------ eviction listeners


def retained_pool(n: int = 5) -> BlockPool:
    """A pool whose blocks 1..n are all cached and evictable (one released run: the
    deepest, n, is evicted first)."""
    pool = BlockPool(n + 1, "kv")
    ids = pool.take(n)
    for b in ids.tolist():
        pool.retain(b)
    pool.release(ids)
    return pool


def test_every_eviction_listener_runs_in_order_before_the_keeper():
    heard: list[tuple[str, list[int], bool]] = []
    pool = retained_pool()

    def listener(tag: str):
        def hear(victims: np.ndarray) -> None:
            # the victims are still cached while listeners run: nothing was freed yet
            heard.append((tag, victims.tolist(), all(pool.is_retained(b) for b in victims)))

        return hear

    pool.on_evict = listener("keeper")
    pool.add_eviction_listener(listener("first"))
    pool.add_eviction_listener(listener("second"))
    assert pool.has_eviction_listeners
    got = pool.evict(2)
    assert [t for t, _, _ in heard] == ["first", "second", "keeper"]
    assert all(v == got.tolist() and kept for _, v, kept in heard)
    heard.clear()
    pool.take(pool.num_free)  # a take that finds the free stack short evicts the rest
    assert [t for t, _, _ in heard] == ["first", "second", "keeper"]
    assert sorted(heard[0][1] + got.tolist()) == [1, 2, 3, 4, 5] and pool.num_evictable == 0


BAD_LISTENERS = [
    (None, TypeError, "listener must be callable, got NoneType"),
    ("hook", TypeError, "listener must be callable, got str"),
    (3, TypeError, "listener must be callable, got int"),
]


@pytest.mark.parametrize(("listener", "error", "message"), BAD_LISTENERS)
def test_a_bad_listener_is_refused_and_nothing_changes(listener, error, message):
    pool = retained_pool()
    with pytest.raises(error, match=message):
        pool.add_eviction_listener(listener)
    assert not pool.has_eviction_listeners
    assert pool.evict(1).tolist() == [5]  # the deepest first, as before: nothing to call


# ------------------------------------------------------------------ attach_host_tier


def manager(prefix: bool = True) -> BlockManager:
    lay = CacheLayout({0: GQABackend(2, 8, block_size=16)})
    return BlockManager(lay, {"kv": 10}, max_num_seqs=2, enable_prefix_caching=prefix)


def hybrid() -> BlockManager:
    lay = CacheLayout({0: LinearAttentionBackend(2, 2, 8, 8, 4), 1: GQABackend(1, 8, 16)})
    return BlockManager(lay, {"linear_state": 4, "kv": 8}, 2, 64, True)


def own_tier(m: BlockManager, pages: dict | None = None, **kw) -> HostTier:
    return HostTier(pages or {"kv": 4}, m.prefix_cache.records, **kw)


def _mutated_policy(m: BlockManager) -> HostTier:
    tier = own_tier(m)
    tier.policy = "lazy"  # type: ignore[assignment]
    return tier


def _mutated_snapshot_policy(m: BlockManager) -> HostTier:
    tier = own_tier(m)
    tier.snapshot_policy = "sometimes"  # type: ignore[assignment]
    return tier


def _second(m: BlockManager) -> HostTier:
    host_tier.attach(m, {"kv": 4})
    return own_tier(m)


BAD_TIERS = [
    # (manager, the tier to attach (built on the manager), error, message)
    ("gqa", _second, RuntimeError, "has a host tier already"),
    ("no prefix", own_tier, RuntimeError, "enable prefix caching"),
    ("gqa", lambda m: own_tier(m, {"nope": 4}), ArgumentError, r"names groups \['nope'\]"),
    ("gqa", _mutated_policy, ArgumentError, "host_tier_policy must be 'eviction' or"),
    ("gqa", _mutated_snapshot_policy, ArgumentError, "snapshot_policy must be 'skip' or 'aligned'"),
    ("gqa", lambda m: {"kv": 4}, ArgumentError, "tier must be a HostTier, got dict"),
    ("gqa", lambda m: None, ArgumentError, "tier must be a HostTier, got NoneType"),
    (
        "gqa",
        lambda m: HostTier({"kv": 4}, UnitRecordStore()),
        ArgumentError,
        "tier.records must be this manager's prefix_cache.records",
    ),
    (
        "hybrid",
        lambda m: own_tier(m, {"kv": 4, "linear_state": 4}),  # per_request not named
        ArgumentError,
        r"tier.per_request is \[\]; this manager's per-request groups among the tier's "
        r"are \['linear_state'\]",
    ),
    (
        "gqa",
        lambda m: own_tier(m, per_request={"kv"}),
        ArgumentError,
        r"tier.per_request is \['kv'\]",
    ),
]


def _state(m: BlockManager) -> tuple:
    pools = {g: m.pool(g) for g in m.groups}
    return (
        m.host_tier,
        {g: (p.on_evict, list(p._listeners)) for g, p in pools.items()},
        m.prefix_cache.on_store,
    )


@pytest.mark.parametrize(("kind", "make", "error", "message"), BAD_TIERS)
def test_a_bad_attach_host_tier_changes_nothing(kind, make, error, message):
    m = {"gqa": manager, "no prefix": lambda: manager(prefix=False), "hybrid": hybrid}[kind]()
    tier = make(m)
    before = _state(m)
    with pytest.raises(error, match=message):
        m.attach_host_tier(tier)
    assert _state(m) == before
    # and the manager still works as before: a step, its end, a finish
    step = m.schedule(["a"], [32], new_token_ids=[np.arange(32)])
    m.end_step(step)
    m.finish(["a"])


def test_attach_host_tier_wires_one_listener_per_pool_and_the_write_through():
    m = hybrid()
    tier = own_tier(
        m, {"kv": 8, "linear_state": 4}, per_request={"linear_state"}, policy="write_through"
    )
    m.attach_host_tier(tier)
    assert m.host_tier is tier
    assert all(len(m.pool(g)._listeners) == 1 for g in m.groups)
    assert m.prefix_cache.on_store is not None
    assert [g.spec.name for g in m.group_tables] == m.groups
    assert isinstance(m.group_tables, tuple)


def test_the_tier_seams_without_a_tier():
    m = manager()
    assert m.host_tier is None
    assert m.take_tier_offloads() == ()
    assert m.reset_host_tier() == 0


def test_reset_host_tier_forgets_the_pages_and_keeps_the_device_cache():
    m = manager()
    tier = host_tier.attach(m, {"kv": 16})
    for rid, base in (("a", 0), ("b", 1000), ("c", 2000)):
        step = m.schedule([rid], [64], new_token_ids=[np.arange(base, base + 64)])
        m.end_step(step)
        m.finish([rid])
    assert len(tier) > 0  # the later prompts evicted the earlier ones' blocks
    cached = len(m.registered_blocks("kv"))
    held = len(tier)
    assert m.reset_host_tier() == held
    assert len(tier) == 0 and len(m.registered_blocks("kv")) == cached
    assert m.reset_host_tier() == 0
