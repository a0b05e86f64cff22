"""The prefix cache's package (``kvforge.scheduler.prefix``): one public class composed of
parts, each module stating what it owns, the old module paths gone, and the seams the tiers
read (``cached_keys``, ``served``, ``waiting_blocks``, ``register``, ``hasher``) behaving as
documented."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import numpy as np
import pytest

import kvforge.scheduler.prefix as prefix_package
from kvforge import CacheController, GQABackend, PrefixQuery
from kvforge.scheduler.prefix import PrefixCache
from kvforge.verify import token_seeds, write_step

B = 16
PROMPT = np.random.default_rng(5).integers(0, 30_000, 64).tolist()  # 4 complete blocks


def controller() -> CacheController:
    ctl = CacheController({0: GQABackend(1, 8, B)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=40, max_num_seqs=4, max_model_len=256)
    return ctl


def compute(ctl: CacheController, rid: str, prompt: list[int]) -> list[int]:
    """One prefill step of ``prompt`` with no match; returns the request's blocks."""
    step = ctl.schedule([rid], [len(prompt)], new_token_ids=[prompt])
    assert not step.allocation.refused
    write_step(ctl, step, {rid: token_seeds(prompt)})
    ctl.end_step(step)
    return ctl.block_table(rid, "kv")


@pytest.mark.parametrize(
    "old",
    [
        "kvforge.scheduler.prefix_cache",
        "kvforge.scheduler.tier_lookup",
        "kvforge.scheduler.retention",
    ],
)
def test_the_old_module_paths_are_gone(old: str):
    assert importlib.util.find_spec(old) is None


def test_the_package_exports_its_public_names():
    for name in (
        "PrefixCache",
        "PrefixStats",
        "PromptPlan",
        "StepWork",
        "Retention",
        "DEFAULT_PREFIX_RETENTION",
        "PREFIX_RETENTIONS",
        "check_prefix_retention",
    ):
        assert name in prefix_package.__all__
        assert getattr(prefix_package, name) is not None
    assert prefix_package.PrefixCache is PrefixCache


def test_every_module_states_what_it_owns_and_the_behaviour_ones_their_invariants():
    names = [m.name for m in pkgutil.iter_modules(prefix_package.__path__)]
    assert set(names) >= {
        "adopt",
        "cache",
        "chains",
        "commit",
        "host_lookup",
        "index",
        "lookup",
        "records",
        "retention",
        "seal",
    }
    for name in names:
        doc = importlib.import_module(f"kvforge.scheduler.prefix.{name}").__doc__ or ""
        assert len(doc) > 200, name
        if name != "records":  # plain records: no behaviour to hold invariants of
            assert "Invariants" in doc, name


def test_cached_keys_is_a_live_view_of_the_served_blocks():
    ctl = controller()
    blocks = compute(ctl, "a", PROMPT)
    prefix = ctl.scheduler.prefix_cache
    pool = ctl.scheduler.pool("kv")
    view = prefix.cached_keys("kv")
    assert sorted(view.values()) == sorted(blocks)
    for key, block in view.items():
        assert prefix.block_of("kv", key) == block
        assert prefix.served(pool, block).key == key
    ctl.free_request("a")
    pool.evict(4)
    assert len(view) == 0  # the same mapping, read after the evictions
    assert prefix.served(pool, blocks[0]) is None


def test_waiting_blocks_are_the_newer_copies_of_a_served_key():
    ctl = controller()
    a_blocks = compute(ctl, "a", PROMPT)
    b_blocks = compute(ctl, "b", PROMPT)  # a holds the served copy: b's copy waits
    prefix, pool = ctl.scheduler.prefix_cache, ctl.scheduler.pool("kv")
    assert prefix.waiting_blocks(pool) == frozenset(b_blocks)
    assert set(prefix.registered(pool)) == set(a_blocks)
    ctl.free_request("a")
    pool.evict(4)  # a's copy goes: b's copy takes every key over
    assert prefix.waiting_blocks(pool) == frozenset()
    assert set(prefix.registered(pool)) == set(b_blocks)


def test_register_serves_a_block_with_a_reference_of_its_own_until_it_is_forgotten():
    ctl = controller()
    blocks = compute(ctl, "a", PROMPT)
    manager = ctl.scheduler
    prefix, pool = manager.prefix_cache, manager.pool("kv")
    [g] = manager.group_tables
    entry = prefix.served(pool, blocks[-1])
    before = prefix.records.refcount(entry.ref)
    prefix.take_events()
    [block] = pool.take(1).tolist()
    key = b"\x01" * 32
    prefix.register(0, g, key, block, entry.end, entry.ref, entry.proof)
    assert prefix.block_of("kv", key) == block
    assert prefix.records.refcount(entry.ref) == before + 1
    assert [(e.kind, e.num_tokens) for e in prefix.take_events()] == [("stored", 64)]
    prefix.forget_block(g, block)
    assert prefix.block_of("kv", key) is None
    assert prefix.records.refcount(entry.ref) == before
    assert [e.kind for e in prefix.take_events()] == ["removed"]
    pool.release([block])


def test_hasher_is_the_chain_a_lookup_extends():
    ctl = controller()
    compute(ctl, "a", PROMPT)
    prefix = ctl.scheduler.prefix_cache
    query = PrefixQuery([*PROMPT, 1])
    [match] = ctl.lookup([query])
    keys = prefix.hasher(query).extend(np.asarray(PROMPT, dtype=np.uint32))
    unit = prefix.unit
    assert list(match.keys["kv"]) == keys[B // unit - 1 :: B // unit]
