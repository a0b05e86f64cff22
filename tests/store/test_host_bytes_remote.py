"""``CacheController.host_bytes`` and ``free()`` with a remote tier (Redis on loopback) behind
the host tier: the bytes are the tier's pages (no swap pages), once the store wrote every
value it copied; ``free()`` lets go of the pages, whether the controller opened the store
(closed by ``free``) or the caller did (the store forgets the pages, and stays open).

Layout (as ``tests/worker/test_host_bytes.py``): GQA, 2 KV heads of width 8, bf16, block 16,
groups ``swa`` and ``kv`` of two layers each:

    page = 16 tokens * 2 heads * 8 * 2 bytes * 2 roles * 2 layers = 2,048 bytes
    held = 32 pages * 2 groups * 2,048 = 131,072 bytes
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from _store_helpers import redis_config

from kvforge import CacheController, GQABackend, ModelIdentity, config_digest
from kvforge._checks import ArgumentError
from kvforge.remote_tier import layout_fingerprint
from kvforge.store import open_store
from kvforge.verify import token_seeds, write_step
from kvforge.worker import host_memory

PAGE = 16 * 2 * 8 * 2 * 2 * 2
TIER_PAGES = 32
HELD = TIER_PAGES * 2 * PAGE  # 131,072


def identity() -> ModelIdentity:
    return ModelIdentity(
        name="/models/gqa-host-bytes", config_digest=config_digest({"layers": 4}), dtype="bf16"
    )


@pytest.mark.parametrize("owned", [True, False], ids=["store-opened-by-controller", "callers"])
def test_remote_tier_host_bytes_are_the_tier_pages_and_free_lets_go(redis_server, owned):
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=24, max_num_seqs=2, max_model_len=512)
    ctl.initialize_host_tier(num_pages=TIER_PAGES, policy="write_through")
    config = redis_config(redis_server)
    store = None
    if owned:
        ctl.initialize_remote_tier(config, model=identity())
    else:
        store = open_store(config, layout_fingerprint(ctl.layout, identity()))
        ctl.initialize_remote_tier(store, model=identity())
    assert ctl.host_bytes == HELD
    toks = np.arange(1, 161)
    seeds, done = token_seeds(toks), 0
    while done < len(toks):  # write_through: every completed block is published
        step = ctl.schedule(["a"], [64 if done < 128 else 32], new_token_ids=[toks[done:][:64]])
        write_step(ctl, step, {"a": seeds})
        ctl.end_step(step)
        done += 64 if done < 128 else 32
    assert ctl.remote_tier.store.flush(5.0)  # every copied value written: nothing staged
    assert ctl.remote_tier.stats.published > 0
    assert ctl.host_bytes == HELD
    pages = [p.pages for p in host_memory.tier_pages_of(ctl.storage).groups.values()]
    gone = [weakref.ref(p) for p in pages]

    ctl.free()
    assert ctl.host_bytes == 0
    if store is not None:  # the caller's store forgot the pages, and is still open
        for i in range(len(pages)):  # (no loop variable left holding a page)
            with pytest.raises(ArgumentError, match="never registered"):
                store.unregister_buffer(pages[i])
        assert not store.stats().closed
        store.close()
    del pages
    gc.collect()
    assert all(ref() is None for ref in gone)
    ctl.free()
    assert ctl.host_bytes == 0
